"""Evidence for the recipe options on the arithmetic task, through the real server + trainer.

    python benchmarks/recipe.py --out benchmarks/recipe [--steps 300] [--seeds 0 1 2]
        [--experiments replay filter] [--eval-every 50] [--set key=value ...]
    python benchmarks/recipe.py --out benchmarks/recipe --report-only

Every cell is `python -m train --config configs/arith_main.yaml` (`make run`'s job: the cached
supervised warm-up of its seed, a local rollout server child, async SAT-GRPO with R3) with
`train.steps`, `train.eval.every`, `train.seed` and `server.seed` set, and one experiment's
variant:

- ``replay``: the server samples with top_p = 0.9; the trainer scores the tokens under the same
  truncation (`rollout.logprob_replay=truncated`, the default) or over the whole vocabulary
  (`full`). Reported per variant: the mean over steps of `mismatch_abs_mean`, `sampler_kl`
  (lag-0 tokens only), `kl_k3`, SAT's threshold `sat_q` and `sat_gate_rate` (about
  1 − `train.loss.sat.quantile` by construction: what the truncation bias moves is q, the scale
  SAT contracts against), and held-out greedy accuracy after.
- ``filter``: DAPO's dynamic sampling off (`train.filter_groups=none`) or on (`all_equal`), at
  top_p = 1: accuracy after, the run's wall-clock seconds, accuracy against wall-clock
  (``recipe_filter.png``), and the groups filtered.
- ``lora``: full fine-tuning against LoRA rank 8 (alpha 16, attention and experts, learning rate
  1e-3 against the full run's 1e-4) from the same warmed-up base: held-out accuracy at equal
  wall clock (the latest evaluation at or before the shortest run's last one, counted from each
  run's first evaluation), the steps reached by then, and accuracy against wall-clock
  (``recipe_lora.png``).

A finished cell is kept in ``cells/<cell>.json`` (a rerun skips it); ``recipe.md`` holds the
tables (mean ± sample std over seeds).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import subprocess
import sys
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "arith_main.yaml"
EXPERIMENTS = {
    "replay": {
        "top_p0.9-truncated": ["rollout.top_p=0.9", "rollout.logprob_replay=truncated"],
        "top_p0.9-full": ["rollout.top_p=0.9", "rollout.logprob_replay=full"],
    },
    "filter": {
        "filter-none": ["train.filter_groups=none"],
        "filter-all_equal": ["train.filter_groups=all_equal"],
    },
    # LoRA at 10x the full run's learning rate (the usual rule for LoRA's rate).
    "lora": {
        "lora-full": [],
        "lora-r8": [
            "model.lora.rank=8",
            "model.lora.alpha=16",
            "train.optimizer.learning_rate=1e-3",
        ],
    },
}
MEANS = ("mismatch_abs_mean", "sampler_kl", "kl_k3", "sat_q", "sat_gate_rate", "overlong_frac")
SUMS = ("groups_filtered",)  # per batch
LASTS = ("stale_dropped",)  # the run's running count


def run_cell(out: pathlib.Path, variant: str, extra: list[str], seed: int, args) -> dict:
    """Trains one cell (or reads its finished summary)."""
    name = f"{variant}-s{seed}"
    done = out / "cells" / f"{name}.json"
    run_dir = out / "runs" / name
    if done.exists():  # re-read from the run's log, so a new statistic needs no rerun
        summary = json.loads(done.read_text())
        return summary | summarize(run_dir / "logs" / "metrics.jsonl", summary["wall_s"])
    cmd = [
        sys.executable, "-m", "train", "--config", str(CONFIG),
        f"train.run_dir={run_dir}", f"train.steps={args.steps}",
        f"train.eval.every={args.eval_every}", f"train.checkpoint.every={args.steps}",
        f"train.seed={seed}", f"server.seed={seed}", *extra, *args.set,
    ]  # fmt: skip
    print(f"# {name}: {' '.join(cmd[3:])}", file=sys.stderr, flush=True)
    start = time.monotonic()
    with open(out / "runs" / f"{name}.log", "w") as log:
        subprocess.run(cmd, cwd=REPO, check=True, stdout=log, stderr=subprocess.STDOUT)
    wall = time.monotonic() - start
    summary = summarize(run_dir / "logs" / "metrics.jsonl", wall)
    summary.update(variant=variant, seed=seed, command=" ".join(cmd[1:]))
    done.parent.mkdir(parents=True, exist_ok=True)
    done.write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def summarize(path: pathlib.Path, wall_s: float) -> dict:
    """Step means and sums, the accuracy curve (seconds since the first record) and the ends."""
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    steps = [r for r in records if "active_tokens" in r]
    t0 = records[0]["time"]
    curve = [(r["time"] - t0, r["step"], r["accuracy"]) for r in records if "accuracy" in r]
    out = {
        "wall_s": wall_s,
        "steps": len(steps),
        "accuracy_before": curve[0][2] if curve else None,
        "accuracy_after": curve[-1][2] if curve else None,
        "curve": curve,
    }
    for key in MEANS:
        values = [r[key] for r in steps if key in r]
        out[key] = statistics.fmean(values) if values else None
    for key in SUMS:
        out[key] = sum(r.get(key, 0.0) for r in steps)
    for key in LASTS:
        out[key] = steps[-1].get(key, 0.0) if steps else 0.0
    return out


def _stat(cells: list[dict], key: str, fmt: str = "{:.4f}") -> str:
    values = [c[key] for c in cells if c.get(key) is not None]
    if not values:
        return "–"
    mean = statistics.fmean(values)
    if len(values) < 2:
        return fmt.format(mean)
    return f"{fmt.format(mean)} ± {fmt.format(statistics.stdev(values))}"


def report(out: pathlib.Path, cells: list[dict]) -> str:
    by = {}
    for c in cells:
        by.setdefault(c["variant"], []).append(c)
    lines = []
    replay = [v for v in EXPERIMENTS["replay"] if v in by]
    if replay:
        lines += [
            "| top_p = 0.9, trainer log-probs | seeds | mismatch_abs_mean | sampler_kl | kl_k3 "
            "| sat_q | sat_gate_rate | accuracy before → after |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for v in replay:
            c = by[v]
            lines.append(
                f"| {v.split('-', 1)[1]} | {len(c)} | {_stat(c, 'mismatch_abs_mean')} | "
                f"{_stat(c, 'sampler_kl', '{:.2e}')} | {_stat(c, 'kl_k3', '{:.2e}')} | "
                f"{_stat(c, 'sat_q')} | {_stat(c, 'sat_gate_rate')} | {_stat(c, 'accuracy_before', '{:.3f}')} → "
                f"{_stat(c, 'accuracy_after', '{:.3f}')} |"
            )
        lines.append("")
    filt = [v for v in EXPERIMENTS["filter"] if v in by]
    if filt:
        lines += [
            "| dynamic sampling | seeds | accuracy before → after | wall s | groups filtered "
            "| stale dropped |",
            "|---|---|---|---|---|---|",
        ]
        for v in filt:
            c = by[v]
            lines.append(
                f"| {v.split('-', 1)[1]} | {len(c)} | {_stat(c, 'accuracy_before', '{:.3f}')} → "
                f"{_stat(c, 'accuracy_after', '{:.3f}')} | {_stat(c, 'wall_s', '{:.0f}')} | "
                f"{_stat(c, 'groups_filtered', '{:.0f}')} | {_stat(c, 'stale_dropped', '{:.0f}')} |"
            )
        plot_curves(out / "recipe_filter.png", {v: by[v] for v in filt})
    lora = [v for v in EXPERIMENTS["lora"] if v in by]
    if lora:
        cells = [c for v in lora for c in by[v]]
        horizon = min(c["curve"][-1][0] for c in cells)
        for c in cells:
            before = [p for p in c["curve"] if p[0] <= horizon]
            c["equal_wall_s"], c["steps_by_then"], c["accuracy_at_equal_wall"] = before[-1]
        lines += [
            "",
            f"| fine-tuning | seeds | accuracy before | accuracy at {horizon:.0f} s "
            "| steps by then | accuracy after | wall s |",
            "|---|---|---|---|---|---|---|",
        ]
        for v in lora:
            c = by[v]
            lines.append(
                f"| {v.split('-', 1)[1]} | {len(c)} | {_stat(c, 'accuracy_before', '{:.3f}')} | "
                f"{_stat(c, 'accuracy_at_equal_wall', '{:.3f}')} | "
                f"{_stat(c, 'steps_by_then', '{:.0f}')} | {_stat(c, 'accuracy_after', '{:.3f}')} | "
                f"{_stat(c, 'wall_s', '{:.0f}')} |"
            )
        plot_curves(out / "recipe_lora.png", {v: by[v] for v in lora})
    text = "\n".join(lines) + "\n"
    (out / "recipe.md").write_text(text)
    return text


def plot_curves(path: pathlib.Path, by: dict[str, list[dict]]) -> None:
    """Held-out accuracy against wall-clock seconds, one line per seed, a colour per variant."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(5.5, 3.6))
    ax = fig.subplots()
    for i, (variant, cells) in enumerate(by.items()):
        for j, c in enumerate(cells):
            t, _, acc = zip(*c["curve"], strict=True)
            ax.plot(t, acc, color=f"C{i}", alpha=0.8, label=variant if j == 0 else None)
    ax.set_xlabel("wall-clock s (from the first evaluation)")
    ax.set_ylabel("held-out greedy accuracy")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=pathlib.Path, default=REPO / "benchmarks" / "recipe")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument(
        "--experiments", nargs="+", choices=sorted(EXPERIMENTS), default=["replay", "filter"]
    )
    p.add_argument("--set", nargs="*", default=[], help="extra key=value overrides for every cell")
    p.add_argument("--report-only", action="store_true")
    args = p.parse_args()
    (args.out / "runs").mkdir(parents=True, exist_ok=True)
    cells = []
    if args.report_only:
        for f in sorted((args.out / "cells").glob("*.json")):
            cell = json.loads(f.read_text())
            cells.append(run_cell(args.out, cell["variant"], [], cell["seed"], args))
    else:
        # Seeds outermost: a seed's warm-up is trained once (cached), then its cells run.
        for seed in args.seeds:
            for name in args.experiments:
                for variant, extra in EXPERIMENTS[name].items():
                    cells.append(run_cell(args.out, variant, extra, seed, args))
                    print(report(args.out, cells), flush=True)
    print(report(args.out, cells))


if __name__ == "__main__":
    main()
