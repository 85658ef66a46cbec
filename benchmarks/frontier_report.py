"""The frontier's report: reads the finished cells under ``--out`` and writes the tables (accuracy,
frontier, collapse, within-noise, mechanism, cost, SAT's knobs), the summary and the heat maps.

Used by ``benchmarks/frontier.py`` (``--report-only`` and the end of a study; its ``--cost`` mode
prints ``cost_table``). The summaries are pure functions of a run's records (unit-tested on
synthetic records).

Definitions (docs/DESIGN.md §4 metrics). A run is *stable* when its final accuracy is at least
``STABLE_FRACTION`` × its best (step 0 included) and fewer than ``STORM_FRACTION`` of its steps
were skipped for a non-finite loss or gradient; it has *collapsed* when its final accuracy is
below ``COLLAPSE_FRACTION`` × its best or it had such a storm. Its *steps to collapse* are the first
evaluation after its best that lies below ``COLLAPSE_FRACTION`` × best (or the step the storm
reached ``STORM_FRACTION``). A cell (method, lag, learning rate) is stable when at least
``STABLE_SEEDS`` of its seeds (2 of 3) are; the *largest stable learning rate* is the largest one
of the sweep at which the cell and every smaller rate are stable. A run can be stable without
learning (a rate too large to improve on the base policy but not large enough to lose it), so the
report also gives the largest rate whose seed-mean final accuracy *keeps* ``STABLE_FRACTION`` of the
best seed-mean final accuracy of any method and rate at that lag.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib

import frontier_mechanism as mech
import grid
import numpy as np
from frontier_methods import DEFAULT_SAT, Cell, row_method, row_order

STABLE_FRACTION = 0.8
COLLAPSE_FRACTION = grid.COLLAPSE_FRACTION
STORM_FRACTION = 0.05
STABLE_SEEDS = 2 / 3  # the fraction of a cell's seeds
TAIL_WINDOW = 20  # steps of |d| q99 averaged "just before collapse"


# ----------------------------------------------------------------------------------------------
# Summaries: pure functions of a run's records (unit-tested on synthetic records).


def summarize_run(records: list[dict], reach: float) -> dict:
    """One run's accuracy, stability, steps to collapse, mismatch tail and SAT reach."""
    acc = [(r["step"], r["accuracy"]) for r in records if "accuracy" in r]
    steps = [r for r in records if "mismatch_abs_mean" in r]
    best_step, best = max(acc, key=lambda sa: (sa[1], -sa[0]))  # the first best
    final = acc[-1][1]
    bad = np.cumsum(
        [r.get("step_skipped", 0.0) > 0 or not math.isfinite(r.get("loss", 0.0)) for r in steps]
    )
    storm_at = max(math.ceil(STORM_FRACTION * len(steps)), 1)
    storm_step = next((r["step"] for r, b in zip(steps, bad, strict=True) if b >= storm_at), None)
    collapsed = storm_step is not None or final < COLLAPSE_FRACTION * best
    collapse_step = None
    if collapsed:
        drops = [s for s, a in acc if s > best_step and a < COLLAPSE_FRACTION * best]
        collapse_step = min([s for s in ([*drops[:1], storm_step]) if s is not None], default=None)
    end = collapse_step if collapse_step is not None else steps[-1]["step"] if steps else 0
    tail = [
        r["d_abs_q99"] for r in steps if "d_abs_q99" in r and end - TAIL_WINDOW < r["step"] <= end
    ]
    return {
        "base": acc[0][1],
        "best": best,
        "final": final,
        "steps": steps[-1]["step"] if steps else 0,
        "skipped": int(bad[-1]) if len(bad) else 0,
        "stable": storm_step is None and final >= STABLE_FRACTION * best,
        "collapsed": collapsed,
        "collapse_step": collapse_step,
        "tail_q99": float(np.mean(tail)) if tail else math.nan,
        "sat_live": float(np.mean([r.get("sat_q", 0.0) < reach for r in steps])) if steps else 0.0,
    }


def summarize_cell(runs: list[dict]) -> dict:
    """Seeds of one (method, lag, lr, knobs) cell: means, stds and counts."""
    col = lambda k: [r[k] for r in runs]
    std = lambda xs: float(np.std(xs, ddof=1)) if len(xs) > 1 else 0.0
    n_stable = sum(col("stable"))
    return {
        "seeds": len(runs),
        "stable_seeds": n_stable,
        "collapsed_seeds": sum(col("collapsed")),
        "stable": n_stable >= STABLE_SEEDS * len(runs) - 1e-9,
        "final_mean": float(np.mean(col("final"))),
        "final_std": std(col("final")),
        "best_mean": float(np.mean(col("best"))),
        "best_std": std(col("best")),
        "collapse_steps": [r["collapse_step"] for r in runs if r["collapse_step"] is not None],
        "tail_q99_collapsed": _nanmean([r["tail_q99"] for r in runs if r["collapsed"]]),
        "tail_q99_stable": _nanmean([r["tail_q99"] for r in runs if not r["collapsed"]]),
        "sat_live": float(np.mean(col("sat_live"))),
    }


def largest_stable_lr(stable_by_lr: dict[float, bool]) -> float | None:
    """The largest rate at which the cell and every smaller rate of the sweep are stable."""
    found = None
    for lr in sorted(stable_by_lr):
        if not stable_by_lr[lr]:
            break
        found = lr
    return found


def edge_text(stable_by_lr: dict[float, bool]) -> str:
    """``largest_stable_lr`` as the sweep bounds it: "< r" when the smallest rate r that ran is
    unstable, "≥ r" when r is the largest that ran (the edge lies above it), else r."""
    best = largest_stable_lr(stable_by_lr)
    if best is None:
        return f"< {min(stable_by_lr):g}"
    return f"≥ {best:g}" if best == max(stable_by_lr) else f"{best:g}"


def keeping_lrs(table: dict[tuple, dict]) -> dict:
    """Per (method, lag): the largest rate keeping ``STABLE_FRACTION`` of the lag's best seed-mean
    final accuracy (there and below); and that best per lag. Default SAT knobs only."""
    rows = {k: g for k, g in table.items() if k[3] == DEFAULT_SAT}
    best: dict[int, float] = {}
    for (_, lag, _, _), g in rows.items():
        best[lag] = max(best.get(lag, 0.0), g["final_mean"])
    by: dict[tuple, dict[float, bool]] = {}
    for (m, lag, lr, _), g in rows.items():
        by.setdefault((m, lag), {})[lr] = g["final_mean"] >= STABLE_FRACTION * best[lag]
    return {"best": best, "lr": {k: largest_stable_lr(v) for k, v in by.items()}}


def _nanmean(xs: list[float]) -> float:
    xs = [x for x in xs if math.isfinite(x)]
    return float(np.mean(xs)) if xs else math.nan


# ----------------------------------------------------------------------------------------------
# The report.


def load_runs(out: pathlib.Path) -> dict[Cell, dict]:
    """Finished runs under ``out/cells``: cell -> ``summarize_run`` (+ the records, the head)."""
    found = {}
    for path in sorted((out / "cells").glob("*.jsonl")):
        lines = [json.loads(x) for x in path.read_text().splitlines() if x]
        head, records = lines[0], lines[1:]
        found[Cell(**head["cell"])] = {
            **summarize_run(records, head["reach"]),
            "records": records,
            "head": head,
        }
    return found


def cell_table(runs: dict[Cell, dict]) -> dict[tuple, dict]:
    """(row, lag, lr, knobs) -> ``summarize_cell`` of its seeds; the row is the method, with
    the sampler where it is not the default (``Cell.row``)."""
    by_cell: dict[tuple, list[dict]] = {}
    for c, got in runs.items():
        by_cell.setdefault((c.row, c.lag, c.lr, c.knobs), []).append(got)
    return {k: summarize_cell(v) for k, v in sorted(by_cell.items())}


def _ms(mean: float, std: float, fmt: str = ".3f") -> str:
    return f"{format(mean, fmt)} ± {format(std, fmt)}"


def _lr_cell(got: dict | None, seeds: int = 3) -> str:
    if got is None:
        return "—"
    mark = f" † {got['collapsed_seeds']}/{got['seeds']}" if got["collapsed_seeds"] else ""
    few = f" (n = {got['seeds']})" if got["seeds"] != seeds else ""
    return f"{_ms(got['final_mean'], got['final_std'])}{mark}{few}"


def report(args: argparse.Namespace, wall_s: float | None) -> str:
    """Writes ``frontier.md``, ``frontier_summary.json`` and the pictures; returns the tables."""
    runs = load_runs(args.out)
    if not runs:
        raise SystemExit(f"frontier: no finished runs under {args.out / 'cells'}")
    table = cell_table(runs)
    wall_path = args.out / "wall_seconds.json"
    if wall_s is not None:
        wall_path.write_text(json.dumps(wall_s))
    elif wall_path.exists():  # a report-only rerun keeps the study's own wall time
        wall_s = json.loads(wall_path.read_text())
    lines = _header_lines(args, runs, wall_s)
    frontier = {}
    lines += _accuracy_table(args, table, frontier)
    lines += _frontier_tables(table, frontier)
    lines += _collapse_table(table)
    lines += _noise_table(table)
    lines += _mechanism_table(runs)
    lines += mech.sampler_table(runs)
    lines += mech.quant_table(runs)
    lines += cost_table(args.out)
    lines += _knob_tables(args, table)
    text = "\n".join(lines) + "\n"
    (args.out / "frontier.md").write_text(text)
    rows = [
        dict(method=row_method(row), row=row, lag=lag, lr=lr, quantile=q, exponent=p, **g)
        for (row, lag, lr, (q, p)), g in table.items()
    ]
    (args.out / "frontier_summary.json").write_text(json.dumps(rows, indent=1) + "\n")
    plot_heatmap(rows, args.out / "frontier_heatmap.png")
    plot_lag_heatmaps(rows, args.out)
    plot_q_reach(runs, args.out / "frontier_q_reach.png")
    return text


def _axes(table: dict[tuple, dict]) -> tuple[list[str], list[int], list[float]]:
    """The rows (methods in ``METHODS`` order, ``row_order``), lags and rates that ran."""
    methods = sorted({k[0] for k in table}, key=row_order)
    return methods, sorted({k[1] for k in table}), sorted({k[2] for k in table})


def _header_lines(args: argparse.Namespace, runs: dict[Cell, dict], wall_s) -> list[str]:
    run_s = sum(g["head"]["seconds"] for g in runs.values())
    steps = sum(g["steps"] for g in runs.values())
    base = runs[next(iter(runs))]["base"]
    return [
        f"{len(runs)} runs ({steps} RL steps in all, at most {args.steps} per run; seeds "
        f"{sorted({c.seed for c in runs})}); held-out accuracy of the base policy {base:.3f}; run "
        f"time summed over runs {run_s / 60:.0f} min"
        + (f", wall {wall_s / 60:.0f} min" if wall_s else "")
        + ".",
        "",
    ]


def _accuracy_table(args: argparse.Namespace, table: dict, frontier: dict) -> list[str]:
    """Final accuracy per (method, lag) over the rates; fills ``frontier`` with the largest
    stable rate of each (method, lag)."""
    methods, lags, lrs = _axes(table)
    lines = [
        f"**Final held-out accuracy** (mean ± std over seeds; † k/n: k of n seeds collapsed, i.e. "
        f"final < {COLLAPSE_FRACTION:g} × best or a skipped-step storm; **bold**: the cell is stable, "
        f"≥ 2/3 of its seeds with final ≥ {STABLE_FRACTION:g} × best) and the **largest stable "
        "learning rate** (stable there and at every smaller rate that ran; ≥: the largest rate that ran, "
        "the edge lies above it; <: unstable at the smallest rate that ran)",
        "",
        "| method | lag | " + " | ".join(f"lr {lr:g}" for lr in lrs) + " | largest stable lr |",
        "| --- | ---: | " + " | ".join("---:" for _ in lrs) + " | ---: |",
    ]
    for m in methods:
        for lag in lags:
            row = {lr: table.get((m, lag, lr, DEFAULT_SAT)) for lr in lrs}
            if not any(row.values()):
                continue
            ran = {lr: g["stable"] for lr, g in row.items() if g is not None}
            frontier[(m, lag)] = edge_text(ran)
            cells = [
                f"**{_lr_cell(g, args.seeds)}**" if g and g["stable"] else _lr_cell(g, args.seeds)
                for g in row.values()
            ]
            lines.append(f"| {m} | {lag} | " + " | ".join(cells) + f" | {frontier[(m, lag)]} |")
    return lines


def _rate_row(m: str, got: list) -> str:
    text = ["—" if x is None else x if isinstance(x, str) else f"{x:g}" for x in got]
    return f"| {m} | " + " | ".join(text) + " |"


def _frontier_tables(table: dict, frontier: dict) -> list[str]:
    """The largest stable rate, and the largest rate that keeps the lag's best, per method × lag."""
    methods, lags, lrs = _axes(table)
    lines = [
        "",
        "**Largest stable learning rate** per method and lag (of the sweep "
        + ", ".join(f"{lr:g}" for lr in lrs)
        + "; ≥ r: stable at r, the largest rate that ran there; < r: unstable at r, the smallest "
        "that ran; n/a: nothing ran)",
        "",
        "| method | " + " | ".join(f"lag {lag}" for lag in lags) + " |",
        "| --- | " + " | ".join("---:" for _ in lags) + " |",
    ]
    lines += [_rate_row(m, [frontier.get((m, lag), "n/a") for lag in lags]) for m in methods]
    keeps = keeping_lrs(table)
    lines += [
        "",
        f"**Largest learning rate that keeps {STABLE_FRACTION:g} of the lag's best** seed-mean final "
        "accuracy (the best over every method and rate at that lag, in the column's head), at that "
        "rate and every smaller one; it separates the rates that still learn from those that only "
        "hold the base policy",
        "",
        "| method | "
        + " | ".join(f"lag {lag} (best {keeps['best'].get(lag, math.nan):.3f})" for lag in lags)
        + " |",
        "| --- | " + " | ".join("---:" for _ in lags) + " |",
    ]
    lines += [_rate_row(m, [keeps["lr"].get((m, lag), "n/a") for lag in lags]) for m in methods]
    return lines


def _collapse_table(table: dict) -> list[str]:
    """Steps to collapse, the mismatch tail and how often SAT could act, per cell."""
    lines = [
        "",
        "**Steps to collapse** of the collapsed seeds (the first evaluation after the best below "
        f"{COLLAPSE_FRACTION:g} × best) and the **mismatch tail**: the 0.99 quantile of "
        f"|logp − behavior_logp| over completion tokens, mean over the {TAIL_WINDOW} steps before "
        "collapse (collapsed seeds) or over the last "
        f"{TAIL_WINDOW} steps (the others); for SAT methods the fraction of steps on which SAT could "
        "act (q below max(log(1 + ε_high), −log(1 − ε_low)))",
        "",
        "| method | lag | lr | steps to collapse | q99 \\|d\\| before collapse | q99 \\|d\\| (not "
        "collapsed) | SAT can act |",
        "| --- | ---: | ---: | --- | ---: | ---: | ---: |",
    ]
    order = lambda kv: (row_order(kv[0][0]), kv[0][1], kv[0][2])
    for (m, lag, lr, knobs), g in sorted(table.items(), key=order):
        if knobs != DEFAULT_SAT:
            continue
        live = f"{g['sat_live']:.0%}" if "SAT" in m else "—"
        lines.append(
            f"| {m} | {lag} | {lr:g} | {', '.join(map(str, sorted(g['collapse_steps']))) or '—'} | "
            f"{_fmt(g['tail_q99_collapsed'])} | {_fmt(g['tail_q99_stable'])} | {live} |"
        )
    return lines


def within_noise(table: dict[tuple, dict]) -> dict[tuple, tuple[str, list[str]]]:
    """Per (lag, lr): the method of best seed-mean final accuracy, and every method (the best
    included) whose mean lies within two standard errors of the difference from it,
    2·sqrt(s_a²/n_a + s_b²/n_b). Default SAT knobs only."""
    by: dict[tuple, dict[str, dict]] = {}
    for (m, lag, lr, knobs), g in table.items():
        if knobs == DEFAULT_SAT:
            by.setdefault((lag, lr), {})[m] = g
    out = {}
    for key, cells in by.items():
        best = max(cells, key=lambda m: cells[m]["final_mean"])
        b = cells[best]
        close = [
            m
            for m in sorted(cells, key=row_order)
            if b["final_mean"] - cells[m]["final_mean"]
            <= 2.0
            * math.sqrt(
                b["final_std"] ** 2 / b["seeds"] + cells[m]["final_std"] ** 2 / cells[m]["seeds"]
            )
        ]
        out[key] = (best, close)
    return out


def _noise_table(table: dict[tuple, dict]) -> list[str]:
    lines = [
        "",
        "**Within noise of the best** per lag and rate: the best seed-mean final accuracy, and the "
        "methods within two standard errors of the difference from it",
        "",
        "| lag | lr | best | within noise | the others |",
        "| ---: | ---: | --- | --- | --- |",
    ]
    for (lag, lr), (best, close) in sorted(within_noise(table).items()):
        g = table[(best, lag, lr, DEFAULT_SAT)]
        here = sorted({k[0] for k in table if k[1:] == (lag, lr, DEFAULT_SAT)}, key=row_order)
        others = [m for m in here if m not in close]
        lines.append(
            f"| {lag} | {lr:g} | {best} ({g['final_mean']:.3f}) | {', '.join(close)} | "
            f"{', '.join(others) or '—'} |"
        )
    return lines


def _mechanism_table(runs: dict[Cell, dict]) -> list[str]:
    """Per cell, what the batch looked like where seeds collapsed (and where they did not)."""
    by: dict[tuple, list] = {}
    for c, g in runs.items():
        if c.knobs == DEFAULT_SAT:
            end = g["collapse_step"] if g["collapse_step"] is not None else g["steps"]
            by.setdefault((c.row, c.lag, c.lr), []).append(
                (c.method, g["records"], end, g["collapsed"])
            )
    lines = [
        "",
        f"**Mechanism**: means over the {TAIL_WINDOW} steps before collapse (collapsed seeds; "
        f"in brackets the last {TAIL_WINDOW} steps of the others) of the batches' lag, the q99 "
        "of |d|, the ESS "
        "fraction, the clip's share of tokens, the share the method's own correction removes "
        "(IcePop: outside its band; SeqMask: responses; M2PO, DPPO-TV: tokens; SAT: gated "
        "tokens) and VCPO's step multiplier sqrt(ess)",
        "",
        "| method | lag | lr | collapsed | lag seen | q99 \\|d\\| | ESS | clipped | own mask | "
        "VCPO scale |",
        "| --- | ---: | ---: | ---: | --- | --- | --- | --- | --- | --- |",
    ]
    order = lambda kv: (row_order(kv[0][0]), kv[0][1], kv[0][2])
    for (m, lag, lr), seeds in sorted(by.items(), key=order):
        got = mech.cell_mechanism(seeds, TAIL_WINDOW)
        col, ok = got["collapsed"], got["stable"]
        pair = lambda f, fmt, col=col, ok=ok: f"{_fmt(col[f], fmt)} ({_fmt(ok[f], fmt)})"
        lines.append(
            f"| {m} | {lag} | {lr:g} | {col['seeds']}/{col['seeds'] + ok['seeds']} | "
            f"{pair('lag', '.0f')} | {pair('q99', '.2f')} | {pair('ess', '.2f')} | {pair('clip', '.1%')} | "
            f"{pair('masked', '.1%')} | {pair('ess_scale', '.2f')} |"
        )
    return lines + _peak_table(runs)


def _peak_table(runs: dict[Cell, dict]) -> list[str]:
    """The same figures at one lag for every seed: the ``TAIL_WINDOW`` steps just before the
    first publish (steps lag − 19 … lag, batches lag − 20 … lag − 1 old) where a run reached
    it; lags below 2 × ``TAIL_WINDOW`` and runs shorter than their lag are left out."""
    by: dict[tuple, list] = {}
    for c, g in runs.items():
        if c.knobs == DEFAULT_SAT and 2 * TAIL_WINDOW <= c.lag <= g["steps"]:
            by.setdefault((c.row, c.lag, c.lr), []).append((c.method, g["records"], c.lag, True))
    if not by:
        return []
    lines = [
        "",
        f"**At the lag's peak**: the same means over the {TAIL_WINDOW} steps just before the "
        "first weight publish (every seed that reached it; lags ≥ "
        f"{2 * TAIL_WINDOW})",
        "",
        "| method | lag | lr | seeds | lag seen | q99 \\|d\\| | ESS | clipped | own mask | VCPO scale |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    order = lambda kv: (row_order(kv[0][0]), kv[0][1], kv[0][2])
    for (m, lag, lr), seeds in sorted(by.items(), key=order):
        got = mech.cell_mechanism(seeds, TAIL_WINDOW)["collapsed"]
        lines.append(
            f"| {m} | {lag} | {lr:g} | {got['seeds']} | {_fmt(got['lag'], '.0f')} | "
            f"{_fmt(got['q99'])} | {_fmt(got['ess'])} | {_fmt(got['clip'], '.1%')} | "
            f"{_fmt(got['masked'], '.1%')} | {_fmt(got['ess_scale'])} |"
        )
    return lines


def cost_table(out: pathlib.Path) -> list[str]:
    """Step time per method relative to GRPO, from ``--cost`` (``cost.json``), if measured."""
    path = out / "cost.json"
    if not path.exists():
        return []
    cost = json.loads(path.read_text())
    base = cost.get("GRPO")
    lines = [
        "",
        "**Cost**: median seconds of one train step (the proximal forward included where the "
        "method needs it), interleaved over methods on one batch (`--cost`), and the ratio to GRPO",
        "",
        "| method | step (ms) | × GRPO |",
        "| --- | ---: | ---: |",
    ]
    for m in sorted(cost, key=row_order):
        ratio = f"{cost[m] / base:.2f}" if base else "—"
        lines.append(f"| {m} | {1e3 * cost[m]:.0f} | {ratio} |")
    return lines


def _knob_tables(args: argparse.Namespace, table: dict) -> list[str]:
    """GRPO + SAT's final accuracy over quantile × exponent at the knob lag, one table per rate."""
    knob_rows = {k: g for k, g in table.items() if k[0] == "GRPO+SAT" and k[1] == args.knob_lag}
    knob_lrs = sorted({k[2] for k in knob_rows if k[3] != DEFAULT_SAT})
    lines = []
    for lr in knob_lrs:
        qs = sorted({k[3][0] for k in knob_rows if k[2] == lr})
        ps = sorted({k[3][1] for k in knob_rows if k[2] == lr})
        plain = table.get(("GRPO", args.knob_lag, lr, DEFAULT_SAT))
        lines += [
            "",
            f"**SAT's knobs**: GRPO + SAT at lag {args.knob_lag}, lr {lr:g}; final accuracy (mean ± "
            "std, † collapsed seeds, **bold** stable) and the fraction of steps SAT could act; "
            f"plain GRPO there: {_lr_cell(plain, args.seeds)}",
            "",
            "| quantile \\ exponent | " + " | ".join(f"p = {p:g}" for p in ps) + " |",
            "| --- | " + " | ".join("---:" for _ in ps) + " |",
        ]
        for q in qs:
            cells = []
            for p in ps:
                g = knob_rows.get(("GRPO+SAT", args.knob_lag, lr, (q, p)))
                text = _lr_cell(g, args.seeds) + (f" (acts {g['sat_live']:.0%})" if g else "")
                cells.append(f"**{text}**" if g and g["stable"] else text)
            lines.append(f"| q = {q:g} | " + " | ".join(cells) + " |")
    return lines


def _fmt(x: float, fmt: str = ".2f") -> str:
    return "—" if not math.isfinite(x) else format(x, fmt)


def plot_heatmap(rows: list[dict], path: pathlib.Path) -> None:
    """Final accuracy over learning rate × lag, one panel per method: the seed mean, the stable
    seeds (bold: a stable cell) and † the collapsed seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if (r["quantile"], r["exponent"]) == DEFAULT_SAT]
    methods = sorted({r["row"] for r in rows}, key=row_order)
    lrs = sorted({r["lr"] for r in rows})
    lags = sorted({r["lag"] for r in rows})
    top = max(r["final_mean"] for r in rows)
    ncols = min(len(methods), 3)
    nrows = -(-len(methods) // ncols)
    fig, axes = plt.subplots(
        nrows,
        ncols,
        figsize=(0.9 + 0.75 * len(lrs) * ncols, 0.5 + (0.5 + 0.55 * len(lags)) * nrows),
        squeeze=False,
    )
    for k, ax in enumerate(axes.flat):
        if k >= len(methods):
            ax.axis("off")
            continue
        acc = np.full((len(lags), len(lrs)), np.nan)
        for r in rows:
            if r["row"] == methods[k]:
                i, j = lags.index(r["lag"]), lrs.index(r["lr"])
                acc[i, j] = r["final_mean"]
                label = f"{r['final_mean']:.2f}\n{r['stable_seeds']}/{r['seeds']}"
                label += f" †{r['collapsed_seeds']}" if r["collapsed_seeds"] else ""
                weight = "bold" if r["stable"] else "normal"
                ax.text(j, i, label, ha="center", va="center", fontsize=6.5, fontweight=weight)
        ax.imshow(acc, cmap="RdYlGn", vmin=0.0, vmax=top, origin="lower", aspect="auto")
        ax.set_xticks(range(len(lrs)), [f"{lr * 1e3:g}" for lr in lrs], fontsize=7)
        ax.set_yticks(range(len(lags)), [str(x) for x in lags], fontsize=7)
        ax.set_title(methods[k], fontsize=9)
        ax.set_xlabel("learning rate (× 1e-3)", fontsize=7)
        ax.set_ylabel("lag", fontsize=7)
    fig.suptitle(
        "final held-out accuracy (seed mean); k/n seeds stable (bold: stable cell); † collapsed",
        fontsize=8,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def plot_lag_heatmaps(rows: list[dict], out: pathlib.Path) -> list[pathlib.Path]:
    """One picture per lag, ``frontier_heatmap_lag<n>.png``: methods × learning rates, colour the
    seed-mean final accuracy, text the mean, k/n stable seeds (bold: a stable cell) and †
    collapsed seeds; blank where the cell did not run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if (r["quantile"], r["exponent"]) == DEFAULT_SAT]
    top = max(r["final_mean"] for r in rows)
    paths = []
    for lag in sorted({r["lag"] for r in rows}):
        here = [r for r in rows if r["lag"] == lag]
        methods = sorted({r["row"] for r in here}, key=row_order)
        lrs = sorted({r["lr"] for r in here})
        acc = np.full((len(methods), len(lrs)), np.nan)
        fig, ax = plt.subplots(figsize=(max(5.0, 1.6 + 1.1 * len(lrs)), 1.0 + 0.42 * len(methods)))
        for r in here:
            i, j = methods.index(r["row"]), lrs.index(r["lr"])
            acc[i, j] = r["final_mean"]
            label = f"{r['final_mean']:.3f}  {r['stable_seeds']}/{r['seeds']}"
            label += f" †{r['collapsed_seeds']}" if r["collapsed_seeds"] else ""
            weight = "bold" if r["stable"] else "normal"
            ax.text(j, i, label, ha="center", va="center", fontsize=7, fontweight=weight)
        ax.imshow(acc, cmap="RdYlGn", vmin=0.0, vmax=top, aspect="auto")
        ax.set_xticks(range(len(lrs)), [f"{lr:g}" for lr in lrs], fontsize=7)
        ax.set_yticks(range(len(methods)), methods, fontsize=7)
        ax.set_xlabel("learning rate", fontsize=7)
        ax.set_title(
            f"lag {lag}: final held-out accuracy (seed mean)\n"
            "k/n seeds stable (bold: stable cell), † seeds collapsed",
            fontsize=8,
        )
        fig.tight_layout()
        path = out / f"frontier_heatmap_lag{lag}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)
    return paths


def plot_q_reach(runs: dict[Cell, dict], path: pathlib.Path) -> None:
    """SAT's threshold q against the clip's reach over training: rows SAT methods, columns rates,
    a line per lag (the mean over the seeds still running at each step)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sat = {c: g for c, g in runs.items() if "SAT" in c.method and c.knobs == DEFAULT_SAT}
    methods = sorted({c.row for c in sat}, key=row_order)
    if not methods:
        return
    lrs = sorted({c.lr for c in sat})
    lrs = sorted({lrs[0], lrs[len(lrs) // 2], lrs[-1]})  # the ends and the middle of the sweep
    fig, axes = plt.subplots(
        len(methods), len(lrs), figsize=(3.6 * len(lrs), 2.5 * len(methods)), squeeze=False
    )
    for row, m in zip(axes, methods, strict=True):
        for ax, lr in zip(row, lrs, strict=True):
            reach = None
            for i, lag in enumerate(sorted({c.lag for c in sat if c.row == m})):
                by_step: dict[int, list[float]] = {}
                for c, g in sat.items():
                    if (c.row, c.lag, c.lr) == (m, lag, lr):
                        reach = g["head"]["reach"]
                        for r in g["records"]:
                            if "sat_q" in r and r["step"] > 1:  # step 1 is on-policy: q = 0
                                by_step.setdefault(r["step"], []).append(r["sat_q"])
                if by_step:
                    xs = sorted(by_step)
                    ys = [np.mean(by_step[x]) for x in xs]
                    ax.plot(xs, ys, color=f"C{i}", lw=0.8, label=f"q, lag {lag}")
            if reach is not None:
                ax.axhline(reach, color="k", ls="--", lw=1, label="reach of ε")
            ax.set_yscale("log")
            ax.set_title(f"{m}, lr {lr:g}", fontsize=8)
            ax.set_xlabel("step", fontsize=7)
            ax.tick_params(labelsize=7)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=6)
    fig.suptitle("SAT's threshold q (seed mean) against the clip's reach: SAT acts below the line")
    fig.tight_layout()
    fig.savefig(path, dpi=60)
    plt.close(fig)
