"""The frontier's mechanism and cost tables: what each correction did to the batch where runs
collapsed, and what a step of each method costs relative to GRPO.

Used by ``benchmarks/frontier_report.py`` (the mechanism tables) and ``benchmarks/frontier.py``
(its ``--cost`` mode); the summaries are pure functions of a run's records (unit-tested on
synthetic records).

Mechanism, per run: the mean over the ``window`` steps before its collapse (or its last
``window`` steps when it did not collapse) of the lag of its batches, the 0.99 quantile of |d| (``d_abs_q99``), the ESS
fraction (``ess``), the clip's share of tokens (``clip_frac_low + clip_frac_high``), the share
the method's own correction removes (``MASKED``: IcePop's tokens outside its band, sequence
masking's responses, M2PO's tokens, DPPO-TV's tokens, SAT's gated tokens) and, for VCPO, its step
multiplier sqrt(ess) and its baseline's shift from the group means.

The sampler row set (``sampler_table``): per (method, lag, rate) that ran with another sampler,
that row beside the default sampler's: |d| at step 1 (lag 0: the trainer holds the sampler's own
weights, so |d| is the sampler's mismatch alone), |d| over the run, and how often SAT could act.

The 8-bit rollouts (``quant_table``): per (method, lag, rate), the 8-bit sampler's cells beside
the same cells sampled in bfloat16, paired by seed: stability, final accuracy, the per-seed
difference, and the mismatch each saw (``sampler_kl`` and mean |d| at step 1, lag 0, and over
the run).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable

import numpy as np
from frontier_methods import DEFAULT_SAT, NOT_QUANTIZED, QUANT_BASELINE, row_order

# method -> (metric, transform to "fraction removed"): what the method's own correction masks.
MASKED: dict[str, tuple[str, Callable[[float], float]]] = {
    "GRPO+IcePop": ("icepop_kept_frac", lambda kept: 1.0 - kept),
    "GRPO+SeqMask": ("seq_masked_frac", lambda x: x),
    "GRPO+M2PO": ("m2po_masked_frac", lambda x: x),
    "GRPO+DPPO-TV": ("dppo_tv_masked_frac", lambda x: x),
}
SAT_GATE = ("sat_gate_rate", lambda x: x)


def masked_metric(method: str) -> tuple[str, Callable[[float], float]] | None:
    """The metric of what ``method``'s own correction removes, or None (GRPO, R3, TIS, VCPO)."""
    if method in MASKED:
        return MASKED[method]
    return SAT_GATE if "SAT" in method else None


def _window(records: list[dict], end: int, window: int) -> list[dict]:
    return [r for r in records if "mismatch_abs_mean" in r and end - window < r["step"] <= end]


def _mean(xs: list[float]) -> float:
    xs = [x for x in xs if math.isfinite(x)]
    return float(np.mean(xs)) if xs else math.nan


def run_mechanism(method: str, records: list[dict], end: int, window: int) -> dict:
    """One run's mechanism figures over the ``window`` steps ending at ``end`` (its collapse step,
    or its last step)."""
    rows = _window(records, end, window)
    masked = masked_metric(method)
    get = lambda key, f=lambda x: x: _mean([f(r[key]) for r in rows if key in r])
    return {
        "lag": get("lag"),
        "q99": get("d_abs_q99"),
        "ess": get("ess"),
        "clip": _mean([r.get("clip_frac_low", 0.0) + r.get("clip_frac_high", 0.0) for r in rows]),
        "masked": get(*masked) if masked else math.nan,
        "ess_scale": get("ess_step_scale"),
        "opob_shift": get("opob_shift"),
    }


def cell_mechanism(runs: list[tuple[str, list[dict], int, bool]], window: int) -> dict:
    """Seed means of ``run_mechanism`` for one cell, split by whether the seed collapsed.

    ``runs``: (method, records, end step, collapsed) per seed. Returns ``{"collapsed": {...},
    "stable": {...}}``, each the mean over that group's seeds (NaN where the group is empty)."""
    out = {}
    for key, want in (("collapsed", True), ("stable", False)):
        got = [run_mechanism(m, recs, end, window) for m, recs, end, c in runs if c == want]
        fields = ("lag", "q99", "ess", "clip", "masked", "ess_scale", "opob_shift")
        out[key] = {f: _mean([g[f] for g in got]) for f in fields}
        out[key]["seeds"] = len(got)
    return out


def sampler_figures(records: list[dict]) -> dict:
    """One run's sampler figures: step 1's (lag 0) mean and q99 of |d|, and their run means."""
    steps = [r for r in records if "mismatch_abs_mean" in r]
    first = steps[0] if steps else {}
    return {
        "lag0_mean": first.get("mismatch_abs_mean", math.nan),
        "lag0_q99": first.get("d_abs_q99", math.nan),
        "mean": _mean([r["mismatch_abs_mean"] for r in steps]),
        "q99": _mean([r["d_abs_q99"] for r in steps if "d_abs_q99" in r]),
    }


def sampler_table(runs: dict) -> list[str]:
    """The sampler row set beside the default sampler at the same method, lag and rate, from
    ``frontier_report.load_runs``'s runs (cell -> summary with ``records``); [] when none ran."""
    by: dict[tuple, list[dict]] = {}
    for c, g in runs.items():
        if c.knobs == DEFAULT_SAT:
            by.setdefault((c.method, c.lag, c.lr, c.row), []).append(g)
    other = {(m, lag, lr) for (m, lag, lr, row) in by if row != m}
    if not other:
        return []
    lines = [
        "",
        "**The sampler row set** beside the default sampler (float32, no truncation) at the same "
        "method, lag and rate: |d| = |logp − behavior_logp| at step 1 (lag 0, the sampler's "
        "mismatch alone), its mean and q99 over the run, the fraction of steps SAT could act, "
        "and the final accuracy (seed means)",
        "",
        "| row | lag | lr | seeds | mean \\|d\\| at lag 0 | q99 \\|d\\| at lag 0 | mean \\|d\\| | "
        "q99 \\|d\\| | SAT can act | final |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    order = lambda k: (row_order(k[3]), k[1], k[2])
    for m, lag, lr, row in sorted((k for k in by if k[:3] in other), key=order):
        seeds = by[(m, lag, lr, row)]
        fig = [sampler_figures(g["records"]) for g in seeds]
        col = lambda f, fig=fig: _mean([x[f] for x in fig])
        live = f"{_mean([g['sat_live'] for g in seeds]):.0%}" if "SAT" in m else "—"
        lines.append(
            f"| {row} | {lag} | {lr:g} | {len(seeds)} | {col('lag0_mean'):.4f} | "
            f"{col('lag0_q99'):.3f} | {col('mean'):.4f} | {col('q99'):.2f} | {live} | "
            f"{_mean([g['final'] for g in seeds]):.3f} |"
        )
    return lines


def time_steps(
    steps: dict[str, Callable[[], None]], *, repeats: int, warmup: int = 2
) -> dict[str, float]:
    """Median wall seconds of each named callable (one train step, its extra passes included),
    after ``warmup`` calls each; calls interleave over the names so load hits all alike."""
    for fn in steps.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(repeats):
        for name, fn in steps.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts) for name, ts in times.items()}


def _quant_figures(g: dict) -> dict:
    """One run's mismatch: ``sampler_kl`` and mean |d| at step 1 (lag 0) and over the run."""
    steps = [r for r in g["records"] if "mismatch_abs_mean" in r]
    first = steps[0] if steps else {}
    run_mean = lambda k: _mean([r[k] for r in steps if k in r])
    return {
        "kl0": first.get("sampler_kl", math.nan),
        "d0": first.get("mismatch_abs_mean", math.nan),
        "kl": run_mean("sampler_kl"),
        "d": run_mean("mismatch_abs_mean"),
    }


def quant_table(runs: dict) -> list[str]:
    """The 8-bit rollouts beside their bfloat16 pairs (same method, lag, rate and seed), from
    ``frontier_report.load_runs``'s runs; [] when no 8-bit cell ran."""
    by: dict[tuple, dict[tuple, dict[int, dict]]] = {}
    for c, g in runs.items():
        if c.knobs == DEFAULT_SAT and c.sampler == QUANT_BASELINE:
            key = (c.method, c.lag, c.lr, c.lag_mode)
            by.setdefault(key, {}).setdefault(c.quantized, {})[c.seed] = g
    keys = [k for k in by if any(q != NOT_QUANTIZED for q in by[k])]
    if not keys:
        return []
    lines = [
        "",
        "**8-bit rollouts** beside bfloat16 rollouts (the same method, lag, rate and seeds; "
        "bfloat16 sampler, no truncation, trainer float32): seeds stable (final ≥ 0.8 × best) "
        "and collapsed, final accuracy (mean ± std, and per seed), the paired difference 8-bit − "
        "bfloat16 (mean ± s.e., wins-ties-losses of 8-bit), and the mismatch each sampler's runs "
        "saw: sampler_kl (k3) and mean |d| = |logp − behavior_logp| at step 1 (lag 0: the "
        "sampler's mismatch alone) and over the run (mismatch and staleness); seed means",
        "",
        "| method | lag | lr | rollouts | seeds | stable | collapsed | final | per seed | Δ vs bf16 | "
        "W-T-L | sampler_kl lag 0 | \\|d\\| lag 0 | sampler_kl run | \\|d\\| run |",
        "| --- | ---: | ---: | --- | ---: | ---: | ---: | --- | --- | --- | --- | ---: | ---: | ---: "
        "| ---: |",
    ]
    for key in sorted(keys, key=lambda k: (k[1], row_order(k[0]), k[2])):
        m, lag, lr, _ = key
        base = by[key].get(NOT_QUANTIZED, {})
        for q in sorted(by[key], key=lambda q: q == NOT_QUANTIZED):
            seeds = by[key][q]
            finals = [seeds[s]["final"] for s in sorted(seeds)]
            fig = [_quant_figures(seeds[s]) for s in sorted(seeds)]
            col = lambda f, fig=fig: _mean([x[f] for x in fig])
            std = float(np.std(finals, ddof=1)) if len(finals) > 1 else 0.0
            delta, wtl = "—", "—"
            pairs = [seeds[s]["final"] - base[s]["final"] for s in sorted(seeds) if s in base]
            if q != NOT_QUANTIZED and pairs:
                se = float(np.std(pairs, ddof=1) / math.sqrt(len(pairs))) if len(pairs) > 1 else 0
                delta = f"{np.mean(pairs):+.3f} ± {se:.3f} (n = {len(pairs)})"
                wtl = "-".join(
                    str(sum(f(d) for d in pairs))
                    for f in (lambda d: d > 1e-9, lambda d: abs(d) <= 1e-9, lambda d: d < -1e-9)
                )
            name = "bfloat16" if q == NOT_QUANTIZED else "{} weights, {} cache".format(*q)
            lines.append(
                f"| {m} | {lag} | {lr:g} | {name} | {len(seeds)} | "
                f"{sum(seeds[s]['stable'] for s in seeds)}/{len(seeds)} | "
                f"{sum(seeds[s]['collapsed'] for s in seeds)}/{len(seeds)} | "
                f"{np.mean(finals):.3f} ± {std:.3f} | {' '.join(f'{f:.3f}' for f in finals)} | "
                f"{delta} | {wtl} | {col('kl0'):.2e} | {col('d0'):.4f} | {col('kl'):.2e} | "
                f"{col('d'):.4f} |"
            )
    return lines
