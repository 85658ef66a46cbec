"""A small-scale replication of the paper's comparison grid (Results 3.4.1 and 3.4.2).

    python benchmarks/grid.py --out benchmarks/grid [--steps 200] [--seeds 3] [--lags 1 8]
        [--workers 2] [--methods GRPO GRPO+SAT ...] [--set key=value ...]
    python benchmarks/grid.py --out benchmarks/grid --report-only

Every cell — an objective (GRPO: token ratio; GSPO: sequence ratio) × a variant (plain, + SAT,
+ R3, + SAT + R3, + TIS, + DPPO-TV) × a configured lag n × a seed — trains the arithmetic task's
`make run` base policy (the cached supervised warm-up of `configs/arith_main.yaml`) with the
library's own jitted, sharded train step, and logs the docs/DESIGN.md §4 metrics per step and held-out
greedy accuracy every `--eval-every` steps.

Configured lag, exactly: the trainer publishes its weights every n updates, and a batch is generated
by the weights published last before its generation starts, one batch ahead of the trainer (as a
pipelined async server does). Update u ≥ 1 therefore trains on tokens of version n·⌊(u − 1)/n⌋: lag
1 at n = 1 (one-step off-policy), lags 1…8 (mean 4.5) at n = 8. Rollouts are sampled in-process
by `benchmarks/sampler.py` (temperature 1 over the tokenizer's ids, full recompute) with behavior
log-probs and expert ids recorded from the behavior weights — the same quantities the rollout
server records — so the lag is exact and seeds are reproducible (see benchmarks/RESULTS.md for the
grid's run time). (The real
server + trainer pipeline, whose lag depends on timing, is what `make run` and
`benchmarks/async_vs_sync.py` exercise.)

Output in ``--out``: ``cells/<cell>.jsonl`` (one finished run each; a rerun skips finished cells),
``grid.md`` (the two tables), ``grid_accuracy.png`` and ``grid_mismatch.png``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import pathlib
import sys
import time
from typing import Any

import jax
import numpy as np
from flax import nnx

# benchmarks/ scripts run by path and import each other so, never as a package (JetStream
# installs a top-level package named `benchmarks`).
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import sampler
import worker_group

from sat_jax import objectives, sharding
from sat_jax.experiment import load_config
from sat_jax.step import (
    StepConfig,
    TrainBatch,
    create_train_state,
    make_train_step,
    shard_batch,
    step_config,
)
from sat_jax.tasks import CharTokenizer, arithmetic_task
from sat_jax.tasks.rewards import exact_match_reward
from train import held_out, setup

REPO = pathlib.Path(__file__).resolve().parents[1]

# name -> (PolicyLossConfig overrides, routing replay). TIS needs the proximal log-probs
# (old_logp = the trainer's own, before the update); DPPO-TV masks against the behavior policy.
GRPO_CLIP = {"clip_low": 0.2, "clip_high": 0.2}
# GSPO's sequence ratio is a per-token geometric mean: its paper's clip range is ~1000× narrower.
GSPO_CLIP = {"clip_low": 3e-4, "clip_high": 4e-4}
TIS_CAP = 2.0
DPPO_TV_DELTA = 0.1
VARIANTS = {
    "": ({}, False),
    "+SAT": ({"sat": True}, False),
    "+R3": ({}, True),
    "+SAT+R3": ({"sat": True}, True),
    "+TIS": ({"tis_cap": TIS_CAP}, False),
    "+DPPO-TV": ({"dppo_tv_delta": DPPO_TV_DELTA}, False),
}
METHODS = tuple(f"{base}{v}" for base in ("GRPO", "GSPO") for v in VARIANTS)
# The main job's config (`make run`), shared by every cell.
CONFIG = REPO / "configs" / "arith_main.yaml"
PROMPT_SEED_OFFSET = 3_000_017  # the RL prompt stream of seed s: task.seed + offset + s
# A run has collapsed when its final held-out accuracy fell below half of its best.
COLLAPSE_FRACTION = 0.5


@dataclasses.dataclass(frozen=True)
class Cell:
    method: str
    lag: int
    seed: int

    @property
    def name(self) -> str:
        return f"{self.method}_lag{self.lag}_seed{self.seed}"


def loss_config(method: str):
    """The ``PolicyLossConfig`` and routing-replay switch of a grid method name."""

    if method not in METHODS:
        raise ValueError(f"unknown grid method {method!r}; choose from {', '.join(METHODS)}")
    base, _, variant = method.partition("+")
    extra, replay = VARIANTS[f"+{variant}" if variant else ""]
    kwargs = dict(GRPO_CLIP if base == "GRPO" else GSPO_CLIP)
    kwargs["ratio_level"] = "token" if base == "GRPO" else "sequence"
    kwargs["sat"] = objectives.SATConfig(enabled=bool(extra.get("sat")))
    kwargs.update({k: v for k, v in extra.items() if k != "sat"})
    return objectives.PolicyLossConfig(**kwargs), replay


# ----------------------------------------------------------------------------------------------
# One run.


class Runner:
    """Shared per process: the config, the base policy, jitted samplers and steps per method."""

    def __init__(self, overrides: list[str], *, eval_problems: int):

        self.cfg = load_config(str(CONFIG), overrides)
        self.mesh = sharding.make_mesh(self.cfg.train.mesh)
        self.graphdef, self.base_params = setup.base_policy(self.cfg, self.mesh)
        self.tokenizer = CharTokenizer(self.cfg.task.alphabet)
        self.vocab_mask = setup.sampleable_mask(self.cfg)
        self.eval_set = held_out.held_out_problems(self.cfg.task, eval_problems)
        self._steps: dict[str, Any] = {}
        self._logprobs: dict[bool, Any] = {}
        prompt_len = 1 + 2 * self.cfg.task.max_digits + 2  # BOS a op b =
        self.seq_len = prompt_len + self.cfg.rollout.max_new_tokens

    def accuracy(self, params) -> float:

        return held_out.greedy_accuracy(
            self.graphdef,
            params,
            self.eval_set,
            self.tokenizer,
            max_new_tokens=self.cfg.rollout.max_new_tokens,
        )

    def step_options(self, loss_cfg: objectives.PolicyLossConfig, replay: bool) -> StepConfig:
        """The configured step (``step_config``) with a method's loss and routing replay. The
        benchmark samples without truncation and computes the proximal log-probs itself
        (``proximal_logp``), so its batches carry no kept counts and the step recomputes
        nothing."""
        return dataclasses.replace(
            step_config(self.cfg),
            loss=loss_cfg,
            routing_replay=replay,
            recompute_old_logp=False,
            kept_counts=False,
        )

    def step_fn(self, method: str):
        if method not in self._steps:
            options = self.step_options(*loss_config(method))
            self._steps[method] = make_train_step(
                self.cfg.model,
                self.cfg.train.optimizer.make(self.cfg.train.steps),
                options,
                self.mesh,
                vocab_mask=self.vocab_mask,
            )
        return self._steps[method]

    def batch(
        self,
        params,
        step: int,
        seed: int,
        key,
        *,
        graphdef=None,
        top_p: float = 1.0,
        kv_cache_dtype: str = "bfloat16",
    ):
        """One batch of ``batch_groups`` prompts × ``group_size`` samples from ``params``.

        ``graphdef`` samples with another build of the model (default the base policy's; the
        frontier's bfloat16 sampler); with ``top_p < 1`` the batch carries the sampler's kept
        counts (``TrainBatch.kept_counts``) for the step's truncation replay. ``params`` may be
        8-bit (``quant.quantize_params``) and ``kv_cache_dtype`` an 8-bit cache format: the
        frontier's 8-bit rollouts (``sampler.sample``).
        """

        r = self.cfg.rollout
        stream = arithmetic_task(self.cfg.task, seed_offset=PROMPT_SEED_OFFSET + seed)
        problems = [stream.problem(step * r.batch_groups + i) for i in range(r.batch_groups)]
        rows = [p for p in problems for _ in range(r.group_size)]
        prompts = [self.tokenizer.encode(p.text, bos=True) for p in rows]
        tokens, lengths = sampler.pad_prompts(prompts, self.seq_len)
        out = jax.device_get(
            sampler.sample(
                self.graphdef if graphdef is None else graphdef,
                params,
                tokens,
                lengths,
                key,
                max_new_tokens=r.max_new_tokens,
                temperature=r.temperature,
                vocab_mask=self.vocab_mask,
                eos_id=self.tokenizer.eos_id,
                return_logp=True,
                return_routing=True,
                top_p=top_p,
                kv_cache_dtype=kv_cache_dtype,
            )
        )
        tokens, loss_mask, logp, routing = out.tokens_bt, out.mask_bt, out.logp_bt, out.routing_btlk
        rewards = np.asarray(
            [
                exact_match_reward(self.tokenizer.decode(tokens[b, lengths[b] :]), p.answer)
                for b, p in enumerate(rows)
            ],
            np.float32,
        )
        batch = TrainBatch(  # the step computes the group advantages from rewards and groups
            tokens=tokens,
            loss_mask=loss_mask,
            behavior_logp=logp,
            rewards=rewards,
            group_ids=np.repeat(np.arange(r.batch_groups, dtype=np.int32), r.group_size),
            routing=routing,
            kept_counts=out.kept_bt,
        )
        return batch, float(rewards.mean()), float(loss_mask.sum(-1).mean())

    def proximal_logp(self, params, batch, replay: bool):
        """The trainer's log-probs of the batch under ``params`` (``Transformer.logprobs``),
        replaying the sampler's truncation where the batch carries kept counts, as the step does."""
        if replay not in self._logprobs:
            self._logprobs[replay] = jax.jit(
                lambda p, tokens, routing, kept: nnx.merge(self.graphdef, p).logprobs(
                    tokens,
                    temperature=self.cfg.rollout.temperature,
                    vocab_mask=self.vocab_mask,
                    replay_routing=routing,
                    kept_bt=kept,
                )[0]
            )
        routing = batch.routing if replay else None
        return np.asarray(self._logprobs[replay](params, batch.tokens, routing, batch.kept_counts))

    def run(self, cell: Cell, *, steps: int, eval_every: int, log_every: int) -> list[dict]:
        """Trains one cell; returns its records (per step, accuracy on eval steps)."""

        loss_cfg, replay = loss_config(cell.method)
        step_fn = self.step_fn(cell.method)
        state = create_train_state(
            self.cfg.model,
            self.cfg.train.optimizer.make(self.cfg.train.steps),
            self.mesh,
            _copy(self.base_params),
        )
        key = jax.random.key(cell.seed)
        published = prev = _copy(state.params)  # version 0 = the base policy
        version = 0
        records = [{"step": 0, "accuracy": self.accuracy(state.params)}]
        start = time.monotonic()
        for u in range(steps):
            if behavior_version(u, cell.lag) != version:  # = u - 1: the last update's weights
                published, version = prev, u - 1
            key, sample_key = jax.random.split(key)
            batch, reward, length = self.batch(published, u, cell.seed, sample_key)
            if loss_cfg.tis_cap is not None:
                batch = batch.replace(old_logp=self.proximal_logp(state.params, batch, replay))
            prev = _copy(state.params)  # version u, before the donated step
            state, metrics = step_fn(state, shard_batch(batch, self.mesh))
            record = {k: float(v) for k, v in jax.device_get(metrics).items()}
            record.update(step=u + 1, lag=u - version, reward_mean=reward, response_length=length)
            if (u + 1) % eval_every == 0 or u + 1 == steps:
                record["accuracy"] = self.accuracy(state.params)
            records.append(record)
            if log_every and (u + 1) % log_every == 0:
                print(
                    f"  {cell.name}: step {u + 1}/{steps} reward {reward:.3f} mismatch "
                    f"{record['mismatch_abs_mean']:.2e} acc {record.get('accuracy', float('nan')):.3f}"
                    f" ({time.monotonic() - start:.0f}s)",
                    flush=True,
                )
        return records


def behavior_version(update: int, lag: int) -> int:
    """The weights version that generated the batch of update ``update`` (0-based) at configured
    lag ``lag``: published every ``lag`` updates, generation one batch ahead of the trainer."""
    return 0 if update == 0 else lag * ((update - 1) // lag)


def _copy(tree):

    return jax.tree.map(lambda x: x.copy(), tree)


# ----------------------------------------------------------------------------------------------
# The grid: cells, workers, resumption.


def all_cells(methods: list[str], lags: list[int], seeds: int) -> list[Cell]:
    for m in methods:
        loss_config(m)  # validates the name
    return [Cell(m, lag, s) for m in methods for lag in lags for s in range(seeds)]


def cell_path(out: pathlib.Path, cell: Cell) -> pathlib.Path:
    return out / "cells" / f"{cell.name}.jsonl"


def run_worker(args: argparse.Namespace, cells: list[Cell]) -> None:
    todo = [c for c in cells if not cell_path(args.out, c).exists()]
    if not todo:
        return
    runner = Runner(args.set, eval_problems=args.eval_problems)
    for i, cell in enumerate(todo):
        start = time.monotonic()
        records = runner.run(
            cell, steps=args.steps, eval_every=args.eval_every, log_every=args.log_every
        )
        path = cell_path(args.out, cell)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        with open(tmp, "w") as f:
            f.write(json.dumps({"cell": dataclasses.asdict(cell), "seconds": 0.0}) + "\n")
            for r in records:
                f.write(json.dumps(r) + "\n")
        _set_seconds(tmp, time.monotonic() - start)
        os.replace(tmp, path)  # a finished cell appears atomically
        best = max(r["accuracy"] for r in records if "accuracy" in r)
        print(
            f"[worker {args.worker}] {i + 1}/{len(todo)} {cell.name}: best accuracy {best:.3f}, "
            f"{time.monotonic() - start:.0f}s",
            flush=True,
        )


def _set_seconds(path: pathlib.Path, seconds: float) -> None:
    lines = path.read_text().splitlines()
    head = json.loads(lines[0])
    head["seconds"] = round(seconds, 1)
    path.write_text("\n".join([json.dumps(head), *lines[1:]]) + "\n")


def run_grid(args: argparse.Namespace, cells: list[Cell]) -> float:
    """Runs the unfinished cells over ``args.workers`` processes; returns wall seconds."""
    start = time.monotonic()
    if args.workers <= 1:
        run_worker(args, cells)
        return time.monotonic() - start
    env = worker_group.single_core_env()
    cmd = [sys.executable, __file__, *sys.argv[1:]]
    with worker_group.WorkerGroup() as group:
        for w in range(args.workers):
            group.start([*cmd, "--worker", f"{w}/{args.workers}"], env=env, cwd=REPO)
        codes = group.wait()
    if any(codes):
        raise SystemExit(f"grid: a worker failed (exit codes {codes}); finished cells are kept")
    return time.monotonic() - start


# ----------------------------------------------------------------------------------------------
# The report.


def load_cells(out: pathlib.Path) -> dict[Cell, tuple[dict, list[dict]]]:
    found = {}
    for path in sorted((out / "cells").glob("*.jsonl")):
        lines = [json.loads(x) for x in path.read_text().splitlines() if x]
        head, records = lines[0], lines[1:]
        found[Cell(**head["cell"])] = (head, records)
    return found


def sat_reach(method: str) -> float:
    """The largest SAT threshold q at which SAT can still change a gradient: beyond it every gated
    token (|d| > q) already lies outside PPO's window, where both clips are flat."""
    cfg, _ = loss_config(method)
    return max(math.log1p(cfg.clip_high), -math.log1p(-cfg.clip_low))


def summarize(records: list[dict], reach: float) -> dict[str, float]:

    acc = [(r["step"], r["accuracy"]) for r in records if "accuracy" in r]
    steps = [r for r in records if "mismatch_abs_mean" in r]
    last_quarter = steps[len(steps) - max(len(steps) // 4, 1) :]
    best = max(a for _, a in acc)
    final = acc[-1][1]
    nonfinite = any(not math.isfinite(r.get("loss", 0.0)) for r in steps)
    return {
        "base": acc[0][1],
        "best": best,
        "final": final,
        "collapsed": float(nonfinite or final < COLLAPSE_FRACTION * best),
        "mismatch_lq": float(np.mean([r["mismatch_abs_mean"] for r in last_quarter])),
        "sat_live": float(np.mean([r.get("sat_q", 0.0) < reach for r in steps])),
    }


def _mean_std(xs: list[float], fmt: str) -> str:

    if len(xs) == 1:
        return format(xs[0], fmt)
    return f"{format(float(np.mean(xs)), fmt)} ± {format(float(np.std(xs, ddof=1)), fmt)}"


def report(out: pathlib.Path, methods: list[str], lags: list[int], wall_s: float | None) -> str:
    cells = load_cells(out)
    if not cells:
        raise SystemExit(f"grid: no finished cells under {out / 'cells'}")
    summary = {c: summarize(recs, sat_reach(c.method)) for c, (_, recs) in cells.items()}
    by_cell: dict[tuple[str, int], list[dict[str, float]]] = {}
    for c, got in summary.items():
        by_cell.setdefault((c.method, c.lag), []).append(got)
    wall_path = out / "wall_seconds.json"
    if wall_s is not None:
        wall_path.write_text(json.dumps(wall_s))
    elif wall_path.exists():  # a report-only rerun keeps the grid's own wall time
        wall_s = json.loads(wall_path.read_text())
    seeds = sorted({c.seed for c in cells})
    steps = max(len(recs) - 1 for _, recs in cells.values())
    cpu_s = sum(head["seconds"] for head, _ in cells.values())
    base = sorted({s["base"] for s in summary.values()})
    lines = [
        f"{len(cells)} runs: {steps} RL steps each, seeds {seeds}; held-out accuracy of the base "
        f"policy {base[0]:.3f}; run time summed over runs {cpu_s / 60:.0f} min"
        + (f", wall {wall_s / 60:.0f} min" if wall_s else "")
        + ".",
        "",
        "**Best held-out greedy accuracy** (mean ± std over seeds; final accuracy in brackets; "
        f"† k/n: k of n seeds collapsed, i.e. final < {COLLAPSE_FRACTION:g} × best)",
        "",
        "| method | " + " | ".join(f"lag {lag}" for lag in lags) + " |",
        "| --- | " + " | ".join("---:" for _ in lags) + " |",
    ]
    for m in methods:
        row = [m]
        for lag in lags:
            got = by_cell.get((m, lag), [])
            if not got:
                row.append("—")
                continue
            collapsed = int(sum(s["collapsed"] for s in got))
            mark = f" † {collapsed}/{len(got)}" if collapsed else ""
            row.append(
                f"{_mean_std([s['best'] for s in got], '.3f')} "
                f"[{_mean_std([s['final'] for s in got], '.3f')}]{mark}"
            )
        lines.append("| " + " | ".join(row) + " |")
    lines += [
        "",
        "**Last-quarter mean of `mismatch_abs_mean`** (|logp − behavior_logp| over completion "
        "tokens; mean ± std over seeds); for SAT methods also the fraction of steps on which SAT "
        "could act at all (its threshold q below max(log(1 + ε_high), −log(1 − ε_low)); above it "
        "every token SAT gates is already outside PPO's window, where the contracted window gives "
        "the same value and gradient)",
        "",
        "| method | "
        + " | ".join(f"lag {lag} mismatch | lag {lag} SAT can act" for lag in lags)
        + " |",
        "| --- | " + " | ".join("---: | ---:" for _ in lags) + " |",
    ]
    for m in methods:
        row = [m]
        for lag in lags:
            got = by_cell.get((m, lag), [])
            row.append(_mean_std([s["mismatch_lq"] for s in got], ".2e") if got else "—")
            live = got and loss_config(m)[0].sat.enabled
            row.append(_mean_std([s["sat_live"] for s in got], ".0%") if live else "—")
        lines.append("| " + " | ".join(row) + " |")
    text = "\n".join(lines) + "\n"
    (out / "grid.md").write_text(text)
    plot(cells, methods, lags, out)
    return text


def plot(cells, methods: list[str], lags: list[int], out: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bases = [b for b in ("GRPO", "GSPO") if any(m.startswith(b) for m in methods)]

    def curves(method: str, lag: int, key: str):
        runs = [recs for c, (_, recs) in cells.items() if c.method == method and c.lag == lag]
        if not runs:
            return None
        series = [[(r["step"], r[key]) for r in recs if key in r] for recs in runs]
        n = min(len(s) for s in series)
        xs = np.asarray([p[0] for p in series[0][:n]], float)
        ys = np.asarray([[p[1] for p in s[:n]] for s in series], float)
        return xs, ys.mean(0), ys.std(0)

    def smooth(ys: np.ndarray, window: int) -> np.ndarray:
        sums = np.cumsum(np.concatenate([[0.0], ys]))
        lo = np.maximum(np.arange(1, len(ys) + 1) - window, 0)
        return (sums[1:] - sums[lo]) / (np.arange(1, len(ys) + 1) - lo)

    # Mismatch vs step at the largest lag, one panel per base objective.
    lag = max(lags)
    fig, axes = plt.subplots(1, len(bases), figsize=(6 * len(bases), 4), squeeze=False)
    for ax, b in zip(axes[0], bases, strict=True):
        for i, m in enumerate(x for x in methods if x.startswith(b)):
            got = curves(m, lag, "mismatch_abs_mean")
            if got:
                xs, ys, _ = got  # from step 2: step 1 trains on the base policy's own batch
                style = "--" if "SAT" in m else "-"  # identical runs stay visible
                ax.plot(xs[1:], smooth(ys[1:], 10), style, label=m, color=f"C{i}")
        ax.set_ylim(bottom=0)
        ax.set_title(
            f"{b}: mismatch |logp − behavior_logp|, lag {lag} (seed mean, moving average)",
            fontsize=9,
        )
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "grid_mismatch.png", dpi=100)
    plt.close(fig)

    # Held-out accuracy vs step: rows = objectives, columns = lags.
    fig, axes = plt.subplots(
        len(bases), len(lags), figsize=(5.5 * len(lags), 3.8 * len(bases)), squeeze=False
    )
    for row, b in zip(axes, bases, strict=True):
        for ax, lag in zip(row, lags, strict=True):
            for i, m in enumerate(x for x in methods if x.startswith(b)):
                got = curves(m, lag, "accuracy")
                if got:
                    xs, ys, sd = got
                    style = "--" if "SAT" in m else "-"
                    ax.plot(xs, ys, style, label=m, color=f"C{i}", marker="o", markersize=2)
                    ax.fill_between(xs, ys - sd, ys + sd, color=f"C{i}", alpha=0.1)
            ax.set_title(f"{b}, lag {lag}: held-out greedy accuracy (mean ± std)", fontsize=9)
            ax.set_xlabel("step")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "grid_accuracy.png", dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, required=True, help="output directory")
    parser.add_argument("--steps", type=int, default=200, help="RL updates per run")
    parser.add_argument("--seeds", type=int, default=3, help="seeds per cell (0..n-1)")
    parser.add_argument("--lags", type=int, nargs="+", default=[1, 8], help="configured lags n")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), help="grid methods")
    parser.add_argument("--workers", type=int, default=2, help="parallel worker processes")
    parser.add_argument("--eval-every", type=int, default=20, help="held-out accuracy period")
    parser.add_argument("--eval-problems", type=int, default=300, help="held-out problems")
    parser.add_argument("--log-every", type=int, default=50, help="progress line period (steps)")
    parser.add_argument(
        "--set", nargs="*", default=[], metavar="KEY=VALUE", help="config overrides for every run"
    )
    parser.add_argument("--report-only", action="store_true", help="only rebuild the report")
    parser.add_argument("--worker", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for name in ("steps", "seeds", "workers", "eval_every", "eval_problems"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if any(lag < 1 for lag in args.lags):
        parser.error(f"--lags must be >= 1, got {args.lags}")
    try:
        cells = all_cells(args.methods, args.lags, args.seeds)
    except ValueError as e:
        parser.error(str(e))
    args.out.mkdir(parents=True, exist_ok=True)
    if args.worker:
        w, n = (int(x) for x in args.worker.split("/"))
        run_worker(args, cells[w::n])
        return
    wall = None
    if not args.report_only:
        done = sum(cell_path(args.out, c).exists() for c in cells)
        print(
            f"grid: {len(cells)} runs of {args.steps} steps ({done} finished before) over "
            f"{args.workers} worker processes",
            flush=True,
        )
        wall = run_grid(args, cells)
    print(report(args.out, args.methods, args.lags, wall))


if __name__ == "__main__":
    main()
