"""The corrected large-lag study's tables (issue 44): realized lags and paired comparisons.

    python benchmarks/lag_report.py OUT [OUT ...] [--baseline GRPO] [--pool-min-lag 32]
        [--json PATH]

Reads the finished cells of ``benchmarks/frontier.py`` runs (``OUT/cells/*.jsonl``, any lag mode)
and prints four Markdown tables:

1. per cell (method, lag mode, lag, rate): its seeds, the realized lag of its trained tokens
   (each update's ``lag`` weighted by its ``active_tokens``: mean, 10th/50th/90th percentile, max
   and the share at exactly the configured lag), the updates per run at exactly that lag (mean
   over seeds), the final held-out accuracy per seed, how many seeds are "stable" (final ≥ 0.8 ×
   the run's best, ``frontier_report.STABLE_FRACTION``: the run did not lose 20% of its best) and
   how many "collapsed" (final < 0.5 × best, or a storm of skipped steps), with the step of each
   collapse;
2. per cell beside ``--baseline`` at the same (lag mode, lag, rate): the seeds both ran (the
   pairs: one seed is one prompt stream and one sampling key), the mean per-seed difference in
   final accuracy with its standard error, the sign count (wins-ties-losses) and the two-sided
   sign-test p (exact binomial over the non-tied pairs; 3 pairs cannot go below 0.25);
3. the same pairs pooled per (method, rate) over the lags ≥ ``--pool-min-lag``;
4. per cell, means over its updates at exactly the configured lag (every update where none is):
   the ESS at both levels (``ess_sequence``, ``ess_token``), the step multiplier sqrt(ess) of
   ESS-scaled rows (``ess_step_scale``), the clip's share of tokens, M2PO's masked share,
   IcePop's kept share, sequence masking's masked share of responses, the share of updates whose
   gradient is exactly 0 (the optimizer's momentum and weight decay still move the weights) and
   the 0.99 quantile of |logp − behavior_logp|.

``--json`` also writes the rows as JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from frontier_report import load_runs


def realized_lags(records: list[dict]) -> dict[str, float]:
    """Token-weighted distribution of the ``lag`` of a run's updates."""
    steps = [r for r in records if "lag" in r]
    if not steps:
        return {}
    lag = np.array([r["lag"] for r in steps], float)
    w = np.array([r.get("active_tokens", 1.0) for r in steps], float)
    order = np.argsort(lag, kind="stable")
    cum = np.cumsum(w[order]) / max(w.sum(), 1e-12)
    pct = lambda p: float(lag[order][min(np.searchsorted(cum, p), len(cum) - 1)])
    return {
        "mean": float(np.average(lag, weights=w)) if w.sum() > 0 else float(lag.mean()),
        "p10": pct(0.1),
        "p50": pct(0.5),
        "p90": pct(0.9),
        "max": float(lag.max()),
        "lag": lag,
        "w": w,
    }


def cells(outs: list[pathlib.Path]) -> dict[tuple, dict[int, dict]]:
    """(method, lag mode, lag, lr) -> seed -> the run's summary (``load_runs``)."""
    found: dict[tuple, dict[int, dict]] = {}
    for out in outs:
        for c, got in load_runs(out).items():
            found.setdefault((c.method, c.lag_mode, c.lag, c.lr), {})[c.seed] = got
    return found


def cell_rows(table: dict[tuple, dict[int, dict]]) -> list[str]:
    lines = [
        "| method | mode | lag | lr | seeds | realized lag: mean (p10/p50/p90, max) | at lag | "
        "updates at lag | final per seed | mean final | stable | collapsed (step) |",
        "| --- | --- | ---: | ---: | ---: | --- | ---: | ---: | --- | ---: | ---: | --- |",
    ]
    for (method, mode, lag, lr), seeds in sorted(
        table.items(), key=lambda kv: kv[0][1:] + kv[0][:1]
    ):
        runs = [seeds[s] for s in sorted(seeds)]
        lags = [realized_lags(r["records"]) for r in runs]
        all_lag = np.concatenate([x["lag"] for x in lags if x])
        all_w = np.concatenate([x["w"] for x in lags if x])
        merged = realized_lags(
            [{"lag": a, "active_tokens": b} for a, b in zip(all_lag, all_w, strict=True)]
        )
        at = float(all_w[all_lag == lag].sum() / max(all_w.sum(), 1e-12))
        n_at = np.mean([int((x["lag"] == lag).sum()) if x else 0 for x in lags])
        finals = " ".join(f"{r['final']:.3f}" for r in runs)
        steps = [str(r["collapse_step"]) for r in runs if r["collapsed"]]
        lines.append(
            f"| {method} | {mode} | {lag} | {lr:g} | {len(runs)} | {merged['mean']:.1f} "
            f"({merged['p10']:g}/{merged['p50']:g}/{merged['p90']:g}, {merged['max']:g}) | "
            f"{at:.0%} | {n_at:.0f} | {finals} | {np.mean([r['final'] for r in runs]):.3f} | "
            f"{sum(r['stable'] for r in runs)}/{len(runs)} | "
            f"{sum(r['collapsed'] for r in runs)}/{len(runs)}"
            f"{' (' + ', '.join(steps) + ')' if steps else ''} |"
        )
    return lines


def sign_p(wins: int, losses: int) -> float:
    """Two-sided exact sign-test p of ``wins`` against ``losses`` (ties dropped; 1 when none)."""
    n = wins + losses
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, k) for k in range(min(wins, losses) + 1)) / 2**n
    return min(1.0, 2 * tail)


def pairs(table: dict[tuple, dict[int, dict]], baseline: str) -> dict[tuple, np.ndarray]:
    """(method, mode, lag, lr) -> per-seed final differences against ``baseline`` (the seeds
    both ran, in seed order)."""
    found = {}
    for (method, mode, lag, lr), seeds in sorted(
        table.items(), key=lambda kv: kv[0][1:] + kv[0][:1]
    ):
        base = table.get((baseline, mode, lag, lr))
        if method == baseline or base is None:
            continue
        common = sorted(set(seeds) & set(base))
        if common:
            found[(method, mode, lag, lr)] = np.array(
                [seeds[s]["final"] - base[s]["final"] for s in common]
            )
    return found


def diff_stats(diff: np.ndarray) -> dict:
    """Mean, standard error, sign count and sign-test p of paired differences."""
    se = float(diff.std(ddof=1) / math.sqrt(len(diff))) if len(diff) > 1 else math.nan
    wins, losses = int((diff > 0).sum()), int((diff < 0).sum())
    return {
        "pairs": len(diff),
        "mean": float(diff.mean()),
        "se": se,
        "wins": wins,
        "ties": len(diff) - wins - losses,
        "losses": losses,
        "sign_p": sign_p(wins, losses),
    }


def stats_cells(d: dict) -> str:
    return (
        f"{d['pairs']} | {d['mean']:+.3f} (± {d['se']:.3f}) | "
        f"{d['wins']}-{d['ties']}-{d['losses']} | {d['sign_p']:.2g} |"
    )


def paired_rows(table: dict[tuple, dict[int, dict]], baseline: str) -> list[str]:
    lines = [
        f"| method | mode | lag | lr | pairs | mean Δ final vs {baseline} (± s.e.) | W-T-L | "
        "sign p |",
        "| --- | --- | ---: | ---: | ---: | --- | --- | ---: |",
    ]
    for (method, mode, lag, lr), diff in pairs(table, baseline).items():
        lines.append(f"| {method} | {mode} | {lag} | {lr:g} | {stats_cells(diff_stats(diff))}")
    return lines


def pooled_rows(table: dict[tuple, dict[int, dict]], baseline: str, min_lag: int) -> list[str]:
    pooled: dict[tuple, list] = {}
    for (method, mode, lag, lr), diff in pairs(table, baseline).items():
        if lag >= min_lag:
            pooled.setdefault((method, mode, lr), []).append((lag, diff))
    lines = [
        f"| method | mode | lr | lags (≥ {min_lag}) | pairs | mean Δ final vs {baseline} "
        "(± s.e.) | W-T-L | sign p |",
        "| --- | --- | ---: | --- | ---: | --- | --- | ---: |",
    ]
    for (method, mode, lr), got in sorted(pooled.items()):
        diff = np.concatenate([d for _, d in got])
        lags = " ".join(str(lag) for lag, _ in got)
        lines.append(f"| {method} | {mode} | {lr:g} | {lags} | {stats_cells(diff_stats(diff))}")
    return lines


MECHANISM = (
    ("ess_sequence", "ESS seq"),
    ("ess_token", "ESS tok"),
    ("ess_step_scale", "sqrt(ess) step"),
    ("clip_frac", "clipped"),
    ("m2po_masked_frac", "M2PO masked"),
    ("icepop_kept_frac", "IcePop kept"),
    ("seq_masked_frac", "SeqMask masked"),
    ("zero_grad", "zero-gradient updates"),
    ("d_abs_q99", "q99 abs d"),
)


def mechanism(records: list[dict], lag: int) -> dict[str, float]:
    """Means of ``MECHANISM``'s metrics over a run's updates at exactly ``lag`` (or every update
    where none is); NaN for a metric the run did not log."""
    steps = [r for r in records if "lag" in r]
    at = [r for r in steps if r["lag"] == lag] or steps
    got = {}
    for key, _ in MECHANISM:
        if key == "clip_frac":
            xs = [r["clip_frac_low"] + r["clip_frac_high"] for r in at if "clip_frac_low" in r]
        elif key == "zero_grad":  # every token masked or weighted 0: the optimizer alone moves
            xs = [float(r["grad_norm"] == 0.0) for r in at if "grad_norm" in r]
        else:
            xs = [r[key] for r in at if key in r]
        got[key] = float(np.mean(xs)) if xs else math.nan
    return got


def mechanism_rows(table: dict[tuple, dict[int, dict]]) -> list[str]:
    lines = [
        "| method | mode | lag | lr | " + " | ".join(name for _, name in MECHANISM) + " |",
        "| --- | --- | ---: | ---: |" + " ---: |" * len(MECHANISM),
    ]
    for (method, mode, lag, lr), seeds in sorted(
        table.items(), key=lambda kv: kv[0][1:] + kv[0][:1]
    ):
        per = [mechanism(seeds[s]["records"], lag) for s in sorted(seeds)]
        means = [
            np.nanmean([m[k] for m in per]) if any(np.isfinite([m[k] for m in per])) else math.nan
            for k, _ in MECHANISM
        ]
        cells = " | ".join("" if math.isnan(x) else f"{x:.3g}" for x in means)
        lines.append(f"| {method} | {mode} | {lag} | {lr:g} | {cells} |")
    return lines


def as_json(table: dict[tuple, dict[int, dict]], baseline: str) -> dict:
    """The cells (finals, stability, collapse steps, realized lag, mechanism) and the pairs."""
    cells_out = []
    for (method, mode, lag, lr), seeds in sorted(table.items()):
        runs = {s: seeds[s] for s in sorted(seeds)}
        cells_out.append(
            {
                "method": method,
                "mode": mode,
                "lag": lag,
                "lr": lr,
                "seeds": {
                    str(s): {
                        "final": r["final"],
                        "best": r["best"],
                        "stable": bool(r["stable"]),
                        "collapsed": bool(r["collapsed"]),
                        "collapse_step": r["collapse_step"],
                        "steps": r["steps"],
                        "updates_at_lag": sum(x.get("lag") == lag for x in r["records"]),
                        "mean_lag": realized_lags(r["records"]).get("mean"),
                        "mechanism": mechanism(r["records"], lag),
                    }
                    for s, r in runs.items()
                },
            }
        )
    paired = [
        {"method": m, "mode": mode, "lag": lag, "lr": lr, **diff_stats(d)}
        for (m, mode, lag, lr), d in pairs(table, baseline).items()
    ]
    return {"baseline": baseline, "cells": cells_out, "pairs": paired}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("outs", type=pathlib.Path, nargs="+", help="frontier.py --out directories")
    p.add_argument("--baseline", default="GRPO", help="the method every pair is against")
    p.add_argument("--pool-min-lag", type=int, default=32, help="table 3: the lags pooled")
    p.add_argument("--json", type=pathlib.Path, help="also write the rows here as JSON")
    args = p.parse_args(argv)
    table = cells(args.outs)
    if not table:
        raise SystemExit(f"lag_report: no finished cells under {', '.join(map(str, args.outs))}")
    print("\n".join(cell_rows(table)))
    print()
    print("\n".join(paired_rows(table, args.baseline)))
    print()
    print("\n".join(pooled_rows(table, args.baseline, args.pool_min_lag)))
    print()
    print("\n".join(mechanism_rows(table)))
    if args.json:
        args.json.write_text(json.dumps(as_json(table, args.baseline), indent=1) + "\n")


if __name__ == "__main__":
    main()
