"""The stability frontier: where fixed-clip GRPO collapses as learning rate and lag grow, and how
far SAT, R3 and the field's large-lag corrections push it.

    python benchmarks/frontier.py --out runs/frontier [--steps 160] [--seeds 3] [--first-seed 0]
        [--lags 8 32 128 64 1] [--lag-mode sync|constant] [--lrs 1e-3 1.5e-3 2e-3] [--workers 2]
        [--knob-lr auto] [--set key=value ...]
        [--sampler-methods GRPO GRPO+SAT ...] [--sampler-lags 8] [--sampler-dtype bfloat16] [--top-p 0.9]
        [--quant-methods GRPO GRPO+SAT ...] [--quant-lags 1 32] [--quant-weights fp8] [--quant-cache fp8]
    python benchmarks/frontier.py --out runs/frontier --report-only
    python benchmarks/frontier.py --smoke            (a few tiny cells into a temporary directory)
    python benchmarks/frontier.py --out runs/frontier --cost --methods GRPO GRPO+VCPO ...

Every run is a cell of `benchmarks/grid.py` — the same task, base policy and in-process sampler
(its ``Runner``) — with more axes: the learning rate, SAT's quantile and exponent, the sampler's
dtype and top-p, and the lag mode (``--lag-mode``): ``sync`` publishes the weights every n
updates, so the realized lag cycles through 1..n; ``constant`` trains update u on the weights of
version u − n, so after the first n updates every batch is exactly n versions old. Every record
logs its realized ``lag``; the report gives each cell's distribution. A cell's sampling key folds
in its lag and mode, so one seed's runs at different lags share no completions. Five phases run in order, each spread over the worker
processes, so a cut-off keeps the most important cells:

1. the GRPO family (GRPO, + SAT, + R3, + SAT + R3) and the large-lag corrections (``FIELD``: SAT
   with each microbatch's own threshold, TIS, IcePop, sequence masking, DPPO-TV, M2PO, VCPO) ×
   ``--lags`` (1 to 128) × ``--lrs`` × seeds;
2. SAT's knobs: GRPO + SAT at ``--knob-lag`` and ``--knob-lr`` (``auto``: the smallest learning
   rate at which plain GRPO is unstable there, from phase 1), quantile × exponent;
3. GSPO and GSPO + SAT with a window wide enough that SAT's threshold can fall inside it
   (``GSPO_WIDE_CLIP``; GSPO's own 3e-4/4e-4 never lets SAT act, see RESULTS.md);
4. the sampler row set, when ``--sampler-methods`` are given (``SAMPLER_METHODS``: the issue's):
   ``--sampler-methods`` × ``--sampler-lags`` × ``--lrs`` × seeds sampled in
   ``--sampler-dtype`` (the sampling weights cast to it and its matmuls in it; the trainer stays in
   the config's dtype) with top-p ``--top-p``. Tokens are drawn by the rollout server's own
   sampling code, which records each token's log-prob under the truncated distribution and the
   kept set's size; the batch carries the kept counts and the train step replays the truncation
   (``rollout.logprob_replay``, "truncated" by default), as the trainer does with the server's.
5. the 8-bit rollouts, when ``--quant-methods`` are given (``QUANT_METHODS``: the issue's):
   ``--quant-methods`` × ``--quant-lags`` × ``--lrs`` × seeds (in ``--lag-mode``), each sampled by
   a bfloat16 model serving ``--quant-weights`` weights and a ``--quant-cache`` KV cache as the
   rollout server does (the weights quantized by ``quant.quantize_params`` from the bfloat16 cast,
   attention reading keys and values as the 8-bit cache holds them; the recorded log-probs and
   routing are that model's own), and beside it the same cell sampled in bfloat16 unquantized, for
   a per-seed pairing (``frontier_mechanism.quant_table``). The trainer stays float32.

Per step a run logs the grid's metrics plus the 0.99 quantile of |d| = |logp − behavior_logp| over
the batch's completion tokens (``--tail-every``; log-probs as the loss sees them, replayed routing
for R3), and held-out greedy accuracy every ``--eval-every`` steps. A run stops early once
``--stop-after`` consecutive evaluations lie below ``COLLAPSE_FRACTION`` × its best.

This script owns the command line, the phases and the running of cells; ``frontier_methods``
the methods and a cell's coordinates; ``frontier_report`` reading finished cells, the
definitions of stable and collapsed, the tables and the heat maps.

Output in ``--out``: ``cells/<cell>.jsonl`` (one finished run each; a rerun skips finished cells),
``frontier.md`` (the tables, with the mechanism table of ``frontier_mechanism`` and, once
``--cost`` has run, each method's step time relative to GRPO), ``frontier_summary.json`` (one
row per cell), ``cost.json``, ``frontier_heatmap.png`` (a panel per method),
``frontier_heatmap_lag<n>.png`` (one per lag: methods × rates) and ``frontier_q_reach.png``.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import math
import os
import pathlib
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

# benchmarks/ scripts run by path and import each other so, never as a package (JetStream
# installs a top-level `benchmarks` package).
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import frontier_mechanism as mech
import frontier_methods
import grid
import worker_group
from frontier_methods import (
    DEFAULT_SAMPLER,
    DEFAULT_SAT,
    GRPO_FAMILY,
    GSPO_WIDE,
    LAGS,
    LARGE_LAG,
    NOT_QUANTIZED,
    QUANT_BASELINE,
    QUANT_METHODS,
    QUANT_ROW_SET,
    SAMPLER_METHODS,
    SAMPLER_ROW_SET,
    Cell,
    loss_config,
    microbatches,
    needs_proximal,
    sat_reach,
)
from frontier_report import (
    COLLAPSE_FRACTION,
    cell_table,
    cost_table,
    load_runs,
    report,
    summarize_run,
)

from sat_jax import objectives, quant
from sat_jax.model import placement
from sat_jax.step import create_train_state, make_train_step, shard_batch


class Runner(grid.Runner):
    """``grid.Runner`` with the learning rate and SAT knobs per cell, and the |d| tail logged."""

    def __init__(self, overrides: list[str], *, eval_problems: int):
        super().__init__(overrides, eval_problems=eval_problems)
        self.base_accuracy = self.accuracy(self.base_params)  # step 0 of every cell
        self._samplers: dict[str, object] = {}

    def replays_truncation(self, cell: Cell) -> bool:
        """Whether the cell's batches carry kept counts the step replays (top-p < 1 and
        ``rollout.logprob_replay`` "truncated")."""
        return cell.top_p < 1.0 and self.cfg.rollout.logprob_replay == "truncated"

    def sampler_graphdef(self, dtype: str):
        """The model the cell samples with: the trainer's own for ``DEFAULT_SAMPLER``'s dtype,
        else the config's model with its weights and matmuls in ``dtype`` (norms, softmaxes, the
        router and the logits stay float32, as the model keeps them)."""
        if dtype == DEFAULT_SAMPLER[0]:
            return self.graphdef
        if dtype not in self._samplers:
            model = self.cfg.model.replace(dtype=jnp.dtype(dtype), param_dtype=jnp.dtype(dtype))
            self._samplers[dtype] = placement.abstract_model(model)[0]
        return self._samplers[dtype]

    def optimizer(self, lr: float):
        return dataclasses.replace(self.cfg.train.optimizer, learning_rate=lr).make(
            self.cfg.train.steps
        )

    def cell_step_fn(self, cell: Cell):
        key = (cell.method, cell.lr, cell.knobs, self.replays_truncation(cell))
        if key not in self._steps:
            options = dataclasses.replace(
                self.step_options(*loss_config(cell.method, *cell.knobs)),
                microbatches=microbatches(cell.method),
                kept_counts=self.replays_truncation(cell),
            )
            self._steps[key] = make_train_step(
                self.cfg.model,
                self.optimizer(cell.lr),
                options,
                self.mesh,
                vocab_mask=self.vocab_mask,
            )
        return self._steps[key]

    def run(
        self,
        cell: Cell,
        *,
        steps: int,
        eval_every: int,
        log_every: int,
        tail_every: int,
        stop_after: int,
    ) -> list[dict]:
        """Trains one cell (``grid.Runner.run``'s loop); returns its records."""
        loss_cfg, replay = loss_config(cell.method, *cell.knobs)
        step_fn = self.cell_step_fn(cell)
        state = create_train_state(
            self.cfg.model, self.optimizer(cell.lr), self.mesh, grid._copy(self.base_params)
        )
        key = frontier_methods.sample_key(cell)
        graphdef = self.sampler_graphdef(cell.sampler_dtype)
        # Every version a later update may still sample from: version v = the params after v
        # updates (the oldest is dropped once no update can want it).
        versions = collections.deque([(0, grid._copy(state.params))])
        sampling, version, below = None, -1, 0
        records = [{"step": 0, "accuracy": self.base_accuracy}]
        best = self.base_accuracy
        start = time.monotonic()
        for u in range(steps):
            want = frontier_methods.behavior_version(u, cell.lag, cell.lag_mode)
            while versions[0][0] < want:
                versions.popleft()
            if versions[0][0] != version:
                version = versions[0][0]
                sampling = sampling_params(versions[0][1], cell.sampler_dtype, cell.weight_dtype)
            key, sample_key = jax.random.split(key)
            batch, reward, length = self.batch(
                sampling,
                u,
                cell.seed,
                sample_key,
                graphdef=graphdef,
                top_p=cell.top_p,
                kv_cache_dtype=cell.kv_cache_dtype,
            )
            if not self.replays_truncation(cell):
                batch = batch.replace(kept_counts=None)  # logprob_replay "full": no replay
            tail = {}
            if tail_every and u % tail_every == 0:
                logp = self.proximal_logp(state.params, batch, replay)
                d = np.abs(logp - batch.behavior_logp)[batch.loss_mask > 0]
                tail = {"d_abs_q99": float(np.quantile(d, 0.99)), "d_abs_max": float(d.max())}
            if needs_proximal(loss_cfg):
                batch = batch.replace(old_logp=self.proximal_logp(state.params, batch, replay))
            state, metrics = step_fn(state, shard_batch(batch, self.mesh))
            versions.append((u + 1, grid._copy(state.params)))
            record = {k: float(v) for k, v in jax.device_get(metrics).items()}
            record.update(step=u + 1, lag=u - version, reward_mean=reward, **tail)
            record["response_length"] = length
            if (u + 1) % eval_every == 0 or u + 1 == steps:
                record["accuracy"] = acc = self.accuracy(state.params)
                best = max(best, acc)
                below = below + 1 if acc < COLLAPSE_FRACTION * best else 0
            records.append(record)
            if log_every and (u + 1) % log_every == 0:
                print(
                    f"  {cell.name}: step {u + 1}/{steps} reward {reward:.3f} mismatch "
                    f"{record['mismatch_abs_mean']:.2e} acc {record.get('accuracy', math.nan):.3f}"
                    f" ({time.monotonic() - start:.0f}s)",
                    flush=True,
                )
            if stop_after and below >= stop_after:
                break  # collapsed and not recovering: the rest of the budget goes elsewhere
        return records


def sampling_params(params, dtype: str, weight_dtype: str = "bfloat16"):
    """``params`` as the sampler holds them: floating leaves cast to ``dtype`` (what the
    rollout server's ``server.dtype`` does to pushed weights), then quantized to
    ``weight_dtype`` by the server's own function (``quant.quantize_params``, as the engine does
    to what it installs); the same arrays for the default."""
    if dtype == DEFAULT_SAMPLER[0] and not quant.is_quantized(weight_dtype):
        return params
    cast = lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x
    return _QUANTIZE(jax.tree.map(cast, params), weight_dtype)


_QUANTIZE = jax.jit(quant.quantize_params, static_argnums=1)


# ----------------------------------------------------------------------------------------------
# Phases, workers, resumption.


def phase_cells(args: argparse.Namespace, phase: str, knob_lr: float | None) -> list[Cell]:
    """The cells of one phase, most important first; every seed of a cell before the next."""
    seeds = range(args.first_seed, args.first_seed + args.seeds)
    if phase == "main":
        return [
            Cell(m, lag, lr, s, lag_mode=args.lag_mode)
            for lag in args.lags  # in the order given: the lag that matters most first
            for lr in sorted(args.lrs)
            for m in args.methods
            for s in seeds
        ]
    if phase == "knobs":
        return [
            Cell("GRPO+SAT", args.knob_lag, knob_lr, s, q, p)
            for q in args.knob_quantiles
            for p in args.knob_exponents
            for s in seeds
        ]
    if phase == "gspo":
        return [
            Cell(m, lag, lr, s)
            for lag in args.gspo_lags
            for lr in sorted(args.lrs)
            for m in args.gspo_methods
            for s in seeds
        ]
    if phase == "quant":  # each 8-bit cell beside its bfloat16 pair, seed by seed
        return [
            Cell(
                m,
                lag,
                lr,
                s,
                lag_mode=args.lag_mode,
                weight_dtype=w,
                kv_cache_dtype=kv,
                sampler_dtype=QUANT_BASELINE[0],
                top_p=QUANT_BASELINE[1],
            )
            for lag in args.quant_lags
            for lr in sorted(args.lrs)
            for m in args.quant_methods
            for s in seeds
            for w, kv in ((args.quant_weights, args.quant_cache), NOT_QUANTIZED)
        ]
    return [
        Cell(m, lag, lr, s, sampler_dtype=args.sampler_dtype, top_p=args.top_p)
        for lag in args.sampler_lags
        for lr in sorted(args.lrs)
        for m in args.sampler_methods
        for s in seeds
    ]


def cell_path(out: pathlib.Path, cell: Cell) -> pathlib.Path:
    return out / "cells" / f"{cell.name}.jsonl"


_RUNNERS: dict[tuple, Runner] = {}


def shared_runner(overrides: list[str], eval_problems: int) -> Runner:
    """One ``Runner`` per (overrides, eval problems) in this process, so ``--smoke``'s timing
    reuses the step functions its cells compiled."""
    key = (tuple(overrides), eval_problems)
    if key not in _RUNNERS:
        _RUNNERS[key] = Runner(list(overrides), eval_problems=eval_problems)
    return _RUNNERS[key]


def run_worker(args: argparse.Namespace, cells: list[Cell]) -> None:
    """Claims unfinished cells one at a time (a claim file per cell), so workers stay balanced."""
    runner = None
    for cell in cells:
        path = cell_path(args.out, cell)
        claim = path.with_suffix(".claim")
        if path.exists():
            continue
        try:
            os.close(os.open(claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            continue
        runner = runner or shared_runner(args.set, args.eval_problems)
        start = time.monotonic()
        records = runner.run(
            cell,
            steps=args.steps,
            eval_every=args.eval_every,
            log_every=args.log_every,
            tail_every=args.tail_every,
            stop_after=args.stop_after,
        )
        cfg, _ = loss_config(cell.method, *cell.knobs)
        head = {
            "cell": dataclasses.asdict(cell),
            "seconds": round(time.monotonic() - start, 1),
            "reach": sat_reach(cfg),
            "clip": [cfg.clip_low, cfg.clip_high],
        }
        tmp = path.with_suffix(".tmp")
        tmp.write_text("\n".join(json.dumps(x) for x in [head, *records]) + "\n")
        os.replace(tmp, path)  # a finished cell appears atomically
        claim.unlink()
        got = summarize_run(records, head["reach"])
        print(
            f"[worker {args.worker}] {cell.name}: best {got['best']:.3f} final {got['final']:.3f}"
            f"{' COLLAPSED at ' + str(got['collapse_step']) if got['collapsed'] else ''}, "
            f"{head['seconds']:.0f}s",
            flush=True,
        )


def run_phase(args: argparse.Namespace, phase: str, knob_lr: float | None) -> None:
    cells = phase_cells(args, phase, knob_lr)
    todo = [c for c in cells if not cell_path(args.out, c).exists()]
    print(f"frontier: phase {phase}: {len(cells)} runs, {len(todo)} to do", flush=True)
    if not todo:
        return
    (args.out / "cells").mkdir(parents=True, exist_ok=True)
    for stale in (args.out / "cells").glob("*.claim"):  # left by a run that was cut off
        stale.unlink()
    if args.workers <= 1:
        run_worker(args, cells)
        return
    env = worker_group.single_core_env()
    cmd = [sys.executable, __file__, *sys.argv[1:], "--phase", phase, "--knob-lr", repr(knob_lr)]
    with worker_group.WorkerGroup() as group:
        for w in range(args.workers):
            group.start([*cmd, "--worker", f"{w}/{args.workers}"], env=env, cwd=grid.REPO)
        codes = group.wait()
    if any(codes):
        raise SystemExit(f"frontier: a worker failed (exit codes {codes}); finished cells are kept")


def pick_knob_lr(args: argparse.Namespace) -> float:
    """``--knob-lr`` or, for ``auto``, the smallest rate at which plain GRPO is unstable at the
    knob lag (the frontier), else the largest rate of the sweep."""
    if args.knob_lr != "auto":
        return float(args.knob_lr)
    stable = cell_table(load_runs(args.out))
    for lr in sorted(args.lrs):
        got = stable.get(("GRPO", args.knob_lag, lr, DEFAULT_SAT))
        if got is not None and not got["stable"]:
            return lr
    return max(args.lrs)


def measure_cost(args: argparse.Namespace) -> dict[str, float]:
    """Median seconds of one train step per method (``args.methods``) at the first ``--lrs``
    rate, on one sampled batch, interleaved (``frontier_mechanism.time_steps``); the proximal
    forward counts for the methods that need it. Written to ``cost.json`` in ``--out``."""
    runner = shared_runner(args.set, args.eval_problems)
    batch = runner.batch(runner.base_params, 0, 0, jax.random.key(0))[0]
    steps = {}
    for method in args.methods:
        cfg, replay = loss_config(method)
        step_fn = runner.cell_step_fn(Cell(method, 1, min(args.lrs), 0))
        opt = runner.optimizer(min(args.lrs))
        holder = [
            create_train_state(runner.cfg.model, opt, runner.mesh, grid._copy(runner.base_params))
        ]

        def one(cfg=cfg, replay=replay, step_fn=step_fn, holder=holder) -> None:
            b = batch
            if needs_proximal(cfg):
                b = batch.replace(old_logp=runner.proximal_logp(holder[0].params, batch, replay))
            holder[0], metrics = step_fn(holder[0], shard_batch(b, runner.mesh))
            jax.block_until_ready(metrics)

        steps[method] = one
    got = mech.time_steps(steps, repeats=args.cost_repeats)
    (args.out / "cost.json").write_text(json.dumps(got, indent=1) + "\n")
    return got


# ----------------------------------------------------------------------------------------------
# Entry point.

SMOKE = [
    "--steps", "4", "--seeds", "1", "--lags", "2", "128", "--lrs", "1e-3",
    "--methods", "GRPO+SAT", *LARGE_LAG,
    "--knob-lag", "2", "--knob-quantiles", "0.8", "--knob-exponents", "1", "--gspo-lags", "2",
    "--gspo-methods", "GSPOwide+SAT", "--sampler-methods", "GRPO+SAT", "GRPO+TIS",
    "--sampler-lags", "2", "--workers", "1", "--eval-every", "2", "--cost-repeats", "1",
    "--eval-problems", "16", "--stop-after", "0", "--tail-every", "1",
    "--set", "train.warmup.steps=0", "rollout.batch_groups=4", "rollout.group_size=4",
]  # fmt: skip


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=pathlib.Path, help="output directory (required unless --smoke)")
    p.add_argument("--smoke", action="store_true", help="a few tiny cells (a test of the script)")
    p.add_argument("--steps", type=int, default=160, help="RL updates per run (at most)")
    p.add_argument("--seeds", type=int, default=3, help="seeds per cell (0..n-1)")
    p.add_argument("--first-seed", type=int, default=0, help="seeds first..first+n-1 instead")
    p.add_argument("--lags", type=int, nargs="+", default=list(LAGS), help="configured lags n")
    p.add_argument(
        "--lag-mode",
        choices=frontier_methods.LAG_MODES,
        default="sync",
        help="phase 1: publish every n updates (sync) or train update u on version u - n (constant)",
    )
    p.add_argument("--lrs", type=float, nargs="+", default=[1e-3, 1.5e-3, 2e-3])
    p.add_argument(
        "--methods", nargs="*", default=list(GRPO_FAMILY + LARGE_LAG), help="phase 1 methods"
    )
    p.add_argument("--knob-lag", type=int, default=8)
    p.add_argument("--knob-lr", default="auto", help="a rate, or auto (GRPO's frontier)")
    p.add_argument("--knob-quantiles", type=float, nargs="*", default=[0.8, 0.9, 0.95])
    p.add_argument("--knob-exponents", type=float, nargs="*", default=[1.0, 2.0, 4.0])
    p.add_argument("--gspo-methods", nargs="*", default=list(GSPO_WIDE), help="phase 3 methods")
    p.add_argument("--gspo-lags", type=int, nargs="*", default=[8])
    p.add_argument(
        "--sampler-methods",
        nargs="*",
        default=[],
        help=f"phase 4 methods (none by default; the issue's row set: {' '.join(SAMPLER_METHODS)})",
    )
    p.add_argument("--sampler-lags", type=int, nargs="*", default=[8], help="phase 4 lags")
    p.add_argument(
        "--sampler-dtype", default=SAMPLER_ROW_SET[0], help="phase 4: the sampler's dtype"
    )
    p.add_argument(
        "--top-p", type=float, default=SAMPLER_ROW_SET[1], help="phase 4: the sampler's top-p"
    )
    p.add_argument(
        "--quant-methods",
        nargs="*",
        default=[],
        help=f"phase 5, 8-bit rollouts (none by default; the issue's: {' '.join(QUANT_METHODS)})",
    )
    p.add_argument("--quant-lags", type=int, nargs="*", default=[1, 32], help="phase 5 lags")
    p.add_argument(
        "--quant-weights", default=QUANT_ROW_SET[0], help="phase 5: server.weight_dtype (8-bit)"
    )
    p.add_argument(
        "--quant-cache", default=QUANT_ROW_SET[1], help="phase 5: server.kv_cache_dtype (8-bit)"
    )
    p.add_argument("--workers", type=int, default=2, help="parallel worker processes")
    p.add_argument("--eval-every", type=int, default=20, help="held-out accuracy period")
    p.add_argument("--eval-problems", type=int, default=300, help="held-out problems")
    p.add_argument("--tail-every", type=int, default=2, help="|d| q99 period (0 = off)")
    p.add_argument("--stop-after", type=int, default=2, help="evaluations below the collapse line")
    p.add_argument("--log-every", type=int, default=50, help="progress line period (steps)")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="config overrides")
    p.add_argument("--report-only", action="store_true", help="only rebuild the report")
    p.add_argument("--cost", action="store_true", help="only time one step per --methods")
    p.add_argument("--cost-repeats", type=int, default=20, help="timed steps per method")
    p.add_argument("--phase", default="", help=argparse.SUPPRESS)
    p.add_argument("--worker", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.smoke:
        given = sys.argv[1:] if argv is None else argv
        args = p.parse_args([*SMOKE, *given])  # flags given with --smoke still win
        args.out = args.out or pathlib.Path(tempfile.mkdtemp(prefix="frontier_smoke_"))
    if args.out is None:
        p.error("--out is required (or --smoke)")
    for name in ("steps", "seeds", "workers", "eval_every", "eval_problems"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.first_seed < 0:
        p.error(f"--first-seed must be >= 0, got {args.first_seed}")
    lags = [*args.lags, *args.gspo_lags, *args.sampler_lags, *args.quant_lags, args.knob_lag]
    if any(lag < 1 for lag in lags):
        p.error("lags must be >= 1")
    if any(not lr > 0 for lr in args.lrs):
        p.error(f"--lrs must be > 0, got {args.lrs}")
    if not 0 < args.top_p <= 1:
        p.error(f"--top-p must be in (0, 1], got {args.top_p}")
    try:
        if not jnp.issubdtype(jnp.dtype(args.sampler_dtype), jnp.floating):
            raise TypeError
    except TypeError:
        p.error(f"--sampler-dtype must be a floating dtype, got {args.sampler_dtype!r}")
    for flag, fmt in (("--quant-weights", args.quant_weights), ("--quant-cache", args.quant_cache)):
        if fmt not in quant.FORMATS or (args.quant_methods and not quant.is_quantized(fmt)):
            p.error(f"{flag} must be int8 or fp8, got {fmt!r}")
    try:
        for m in [*args.methods, *args.gspo_methods, *args.sampler_methods, *args.quant_methods]:
            loss_config(m)
        for q in args.knob_quantiles:
            for e in args.knob_exponents:
                objectives.SATConfig(quantile=q, exponent=e)
    except ValueError as e:
        p.error(str(e))
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.worker:
        knob_lr = None if args.knob_lr == "None" else float(args.knob_lr)
        run_worker(args, phase_cells(args, args.phase, knob_lr))
        return
    if args.cost:
        got = measure_cost(args)
        print("\n".join(cost_table(args.out)))
        print(f"frontier: step times of {len(got)} methods in {args.out / 'cost.json'}")
        return
    wall = None
    if not args.report_only:
        start = time.monotonic()
        run_phase(args, "main", None)
        knob_lr = pick_knob_lr(args)
        print(f"frontier: SAT's knobs at lr {knob_lr:g}", flush=True)
        if args.knob_quantiles and args.knob_exponents:
            run_phase(args, "knobs", knob_lr)
        if args.gspo_methods and args.gspo_lags:
            run_phase(args, "gspo", None)
        if args.sampler_methods and args.sampler_lags:
            run_phase(args, "sampler", None)
        if args.quant_methods and args.quant_lags:
            run_phase(args, "quant", None)
        wall = time.monotonic() - start
        if args.smoke:  # the --cost path too, on the step functions the cells compiled
            measure_cost(args)
        if (args.out / "wall_seconds.json").exists():  # a resumed study adds to its first part
            wall += json.loads((args.out / "wall_seconds.json").read_text())
    print(report(args, wall))
    print(f"frontier: output in {args.out}")


if __name__ == "__main__":
    main()
