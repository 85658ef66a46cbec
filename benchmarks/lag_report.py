"""The corrected large-lag study's tables (issue 44): realized lags and paired comparisons.

    python benchmarks/lag_report.py OUT [OUT ...] [--baseline GRPO]

Reads the finished cells of ``benchmarks/frontier.py`` runs (``OUT/cells/*.jsonl``, any lag mode)
and prints two Markdown tables:

1. per cell (method, lag mode, lag, rate): its seeds, the realized lag of its trained tokens
   (each update's ``lag`` weighted by its ``active_tokens``: mean, 10th/50th/90th percentile, max
   and the share at exactly the configured lag), the final held-out accuracy per seed, how many
   seeds are "stable" (final ≥ 0.8 × the run's best, ``frontier_report.STABLE_FRACTION``: the run
   did not lose 20% of its best) and how many "collapsed" (final < 0.5 × best, or a storm of
   skipped steps);
2. per cell beside ``--baseline`` at the same (lag mode, lag, rate): the seeds both ran (the
   pairs: one seed is one prompt stream and one sampling key), the mean per-seed difference in
   final accuracy with its standard error, and the sign count (wins-ties-losses).
"""

from __future__ import annotations

import argparse
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
        "final per seed | stable | collapsed |",
        "| --- | --- | ---: | ---: | ---: | --- | ---: | --- | ---: | ---: |",
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
        finals = " ".join(f"{r['final']:.3f}" for r in runs)
        lines.append(
            f"| {method} | {mode} | {lag} | {lr:g} | {len(runs)} | {merged['mean']:.1f} "
            f"({merged['p10']:g}/{merged['p50']:g}/{merged['p90']:g}, {merged['max']:g}) | "
            f"{at:.0%} | {finals} | {sum(r['stable'] for r in runs)}/{len(runs)} | "
            f"{sum(r['collapsed'] for r in runs)}/{len(runs)} |"
        )
    return lines


def paired_rows(table: dict[tuple, dict[int, dict]], baseline: str) -> list[str]:
    lines = [
        f"| method | mode | lag | lr | pairs | mean Δ final vs {baseline} (± s.e.) | W-T-L |",
        "| --- | --- | ---: | ---: | ---: | --- | --- |",
    ]
    for (method, mode, lag, lr), seeds in sorted(
        table.items(), key=lambda kv: kv[0][1:] + kv[0][:1]
    ):
        base = table.get((baseline, mode, lag, lr))
        if method == baseline or base is None:
            continue
        common = sorted(set(seeds) & set(base))
        if not common:
            continue
        diff = np.array([seeds[s]["final"] - base[s]["final"] for s in common])
        se = float(diff.std(ddof=1) / math.sqrt(len(diff))) if len(diff) > 1 else math.nan
        wins, losses = int((diff > 0).sum()), int((diff < 0).sum())
        lines.append(
            f"| {method} | {mode} | {lag} | {lr:g} | {len(common)} | {diff.mean():+.3f} "
            f"(± {se:.3f}) | {wins}-{len(diff) - wins - losses}-{losses} |"
        )
    return lines


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("outs", type=pathlib.Path, nargs="+", help="frontier.py --out directories")
    p.add_argument("--baseline", default="GRPO", help="the method every pair is against")
    args = p.parse_args(argv)
    table = cells(args.outs)
    if not table:
        raise SystemExit(f"lag_report: no finished cells under {', '.join(map(str, args.outs))}")
    print("\n".join(cell_rows(table)))
    print()
    print("\n".join(paired_rows(table, args.baseline)))


if __name__ == "__main__":
    main()
