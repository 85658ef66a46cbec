"""``sat-train --config configs/NAME.yaml [dotted.key=value ...]``: the async SAT-GRPO trainer.

The job and its command line: build (mesh, base policy, optimizer; the builders are
``train.setup``'s) → restore the latest checkpoint or start at version 1 → connect to the servers
(a local child when ``train.client.servers`` is empty) and push the weights, opening an admission
epoch → loop: step k on batch k while batch k+1 is made (``train.prefetch``), acknowledge,
publish every n updates and after every skipped step (``train.weight_sync``), checkpoint every k,
evaluate, log → final checkpoint and evaluation. A run stuck on skipped steps stops with exit
status 1 and one line (``train.skips``). Every JAX process runs the same job; only process 0
talks to the servers and writes metrics.

Why it is so, and what it guarantees (versions and lag, delivery, sync mode, LoRA pushes,
multi-host, resume): docs/DESIGN.md §7 (and §6.2, §6.3 for delivery and admission).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.experimental import multihost_utils

from sat_jax import cli as sat_cli
from sat_jax import params_io, sharding
from sat_jax.config import ServerConfig
from sat_jax.cpu_clock import CpuWindow
from sat_jax.experiment import ConfigError, ExperimentConfig
from sat_jax.step import (
    Step,
    TrainBatch,
    TrainState,
    create_train_state,
    make_train_step,
    step_config,
)
from train import (
    batching,
    checkpointing,
    curves,
    held_out,
    metrics,
    peers,
    prefetch,
    pulling,
    setup,
    skips,
    weight_sync,
)
from train.local_server import LocalServer
from train.remote import ServerPool

log = logging.getLogger("train")

# The longest a push waits for the servers' installs where it must (the first push of a run; every
# push in sync mode); a server that has not installed by then is left to its sender.
INSTALL_WAIT_S = 120.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunResult:
    """What a finished run reports (also printed)."""

    steps: int
    version: int
    accuracy_before: float | None
    accuracy_after: float | None
    run_dir: str
    no_progress: str = ""  # the one line of a run stopped by train.max_skipped_steps


def start_or_resume(
    cfg: ExperimentConfig,
    ckpt: checkpointing.Checkpointer,
    optimizer: optax.GradientTransformation,
    mesh: jax.sharding.Mesh,
    params: Any,
) -> tuple[TrainState, checkpointing.Progress]:
    """The latest checkpoint restored into its shardings, or a fresh state at version 1.

    ``params`` is the base policy (``setup.base_policy``). With LoRA it is also the frozen base of
    a resumed run (a checkpoint holds only the adapters; ``checkpointing.restore_train_state``
    refuses a base other than the checkpoint's), and a fresh run records its fingerprint."""
    latest = ckpt.latest_step()
    if latest is None:
        key = jax.random.key_data(jax.random.key(cfg.train.seed))
        state = create_train_state(cfg.model, optimizer, mesh, params)
        fingerprint = {}
        if state.frozen is not None:
            fingerprint = checkpointing.base_fingerprint(state.frozen)
        progress = checkpointing.Progress(
            version=1,
            min_version=1,
            rng_key=tuple(int(x) for x in np.asarray(key)),
            base_fingerprint=fingerprint,
        )
        return state, progress
    state, progress = checkpointing.restore_train_state(
        ckpt, latest, cfg.model, optimizer, mesh, params
    )
    log.info(
        "resumed from checkpoint %d: step %d, version %d", latest, int(state.step), progress.version
    )
    return state, progress


def sync_weights(
    pool: ServerPool | None,
    state: TrainState,
    progress: checkpointing.Progress,
    weights_dir: str,
    dtype: Any = None,
    weight_dtype: str = "bfloat16",
) -> checkpointing.Progress:
    """Pushes the current params to every server as ``progress.version`` (or, if a server is past
    it, as a fresh higher version, and from then on tokens of older versions are dropped), opening
    a new admission epoch. Every process calls it and writes its own shards (in ``dtype``, the
    serving dtype, if given; pre-quantized to ``weight_dtype`` if 8-bit, ``pushed_weight_dtype``);
    process 0 (the one with ``pool``) picks the version and calls ``UpdateWeights``, and every
    process gets its version back. Under LoRA it also writes the
    frozen base (``weight_sync.base_dir(weights_dir, version)``), which every later push of this
    trainer names as its ``base_path``."""
    if pool is not None:
        ahead = max(pool.versions())
        if ahead >= progress.version and ahead > 0:
            progress = dataclasses.replace(progress, version=ahead + 1, min_version=ahead + 1)
    if jax.process_count() > 1:
        versions = np.array([progress.version, progress.min_version], np.int32)
        version, min_version = multihost_utils.broadcast_one_to_all(versions).tolist()
        progress = dataclasses.replace(progress, version=version, min_version=min_version)
    os.makedirs(weights_dir, exist_ok=True)
    base_path = ""
    if state.frozen is not None:  # LoRA: the base once, then only adapters (weight_sync)
        base = weight_sync.host_copy(state.frozen, dtype)
        base_path = weight_sync.save_base(
            base, progress.version, weights_dir, lead=pool is not None
        )
        log.info(
            "LoRA base written to %s (%.1f MiB)", base_path, weight_sync.tree_bytes(base) / 2**20
        )
    params = weight_sync.host_copy(state.params, dtype, weight_dtype)
    weight_sync.push_weights(
        pool,
        params,
        progress.version,
        weights_dir,
        new_admission_epoch=True,
        base_path=base_path,
        wait_s=INSTALL_WAIT_S,
    )
    if pool is not None:
        log.info("servers synced to weights version %d", progress.version)
    return progress


def advance(
    progress: checkpointing.Progress,
    stats: batching.BatchStats,
    skipped: bool,
    rng: jax.Array,
) -> checkpointing.Progress:
    """The progress after one consumed batch."""
    recent = (progress.recent_prompt_ids + stats.prompt_ids)[-checkpointing.RECENT_PROMPTS :]
    keys = (progress.recent_group_keys + stats.group_keys)[-checkpointing.RECENT_PROMPTS :]
    return dataclasses.replace(
        progress,
        # One version per consumed batch, skipped or not: the servers' admission budget grows by
        # a batch per version, so a skipped step that kept the version would shrink their lead
        # for good (and stall sync mode, whose server waits for the next version).
        version=progress.version + 1,
        rng_key=tuple(int(x) for x in np.asarray(jax.random.key_data(rng))),
        groups_trained=progress.groups_trained + stats.groups,
        tokens_trained=progress.tokens_trained + stats.tokens,
        stale_dropped=progress.stale_dropped + stats.stale_dropped,
        steps_skipped=progress.steps_skipped + int(skipped),
        recent_prompt_ids=recent,
        recent_group_keys=keys,
    )


def run(cfg: ExperimentConfig, config_path: str | None, overrides: list[str]) -> RunResult:
    """The whole job: build → restore → sync → loop → final checkpoint and evaluation (see the
    module docstring)."""
    setup.check_run(cfg)
    t = cfg.train
    lead = jax.process_index() == 0  # talks to the servers, writes metrics and weights
    run_dir, _, weights_dir = setup.run_paths(cfg)
    with contextlib.ExitStack() as stack:
        # With several processes, a lost one stops this one at once, naming it (train.peers).
        stack.enter_context(peers.watch())
        # A local server starts first: its start-up overlaps the warm-up and the first evaluation.
        server = None
        if lead and t.client.local_server:
            server = stack.enter_context(start_local_server(cfg, config_path, overrides, run_dir))
        mesh = sharding.make_mesh(t.mesh)
        optimizer = t.optimizer.make(t.steps)
        graphdef, params = setup.base_policy(cfg, mesh)
        # The KL penalty's reference is the base policy. The step donates the train state, whose
        # params may share these buffers (device_put to the same sharding does not copy), so the
        # reference keeps its own copy.
        ref_params = jax.tree.map(jnp.copy, params) if step_config(cfg).uses_reference else None
        ckpt = stack.enter_context(checkpointing.Checkpointer.from_config(t.checkpoint, run_dir))
        state, progress = start_or_resume(cfg, ckpt, optimizer, mesh, params)
        writer = stack.enter_context(open_writer(cfg, run_dir)) if lead else None
        acc_before = evaluate_and_log(cfg, graphdef, state, writer, "before")
        pool = None
        if lead:
            pool = stack.enter_context(setup.connect(cfg, server, run=setup.run_id(run_dir)))
        progress = sync_weights(
            pool, state, progress, weights_dir, serving_dtype(cfg.server), pushed_weight_dtype(cfg)
        )
        base = (
            weight_sync.base_dir(weights_dir, progress.version) if state.frozen is not None else ""
        )
        pusher = stack.enter_context(make_pusher(t.mode, pool, weights_dir, base))
        parts = LoopParts(
            pool=pool,
            pusher=pusher,
            ckpt=ckpt,
            writer=writer,
            graphdef=graphdef,
            step_fn=make_step_fn(cfg, optimizer, mesh, ref_params),
            mesh=mesh,
            spec=setup.batch_spec(cfg),
        )
        state, progress, no_progress = loop_or_stuck(cfg, parts, state, progress)
        ckpt.save(int(state.step), state, progress)  # a stuck run's loop has saved it already
        acc_after = None
        if not no_progress:
            acc_after = evaluate_and_log(cfg, graphdef, state, writer, "after")
        if writer is not None:
            writer.flush()
            records = metrics.read_jsonl(writer.jsonl_path)
            curves.plot_curves(records, os.path.join(run_dir, "curves.png"), title=cfg.name)
    return RunResult(
        steps=int(state.step),
        version=progress.version,
        accuracy_before=acc_before,
        accuracy_after=acc_after,
        run_dir=run_dir,
        no_progress=no_progress,
    )


def make_pusher(
    mode: str, pool: ServerPool | None, weights_dir: str, base: str
) -> weight_sync.WeightPusher:
    """The loop's background pusher: saves each version under ``weights_dir`` (LoRA adapters
    against the base weights at ``base``; "" = full weights) and announces it to ``pool``; with
    several processes one ``PushGroup`` so that process 0 announces only complete versions. In
    ``train.mode`` "sync" each push waits for the servers' installs: the next batch is generated
    by these weights."""
    wait_s = INSTALL_WAIT_S if mode == "sync" else 0.0
    several = jax.process_count() > 1
    group = weight_sync.PushGroup.of_job() if several else None
    push = lambda version, p: weight_sync.push_weights(
        pool, p, version, weights_dir, base_path=base, group=group, wait_s=wait_s
    )
    barriers = several and params_io.weights_format(weights_dir) == "orbax"
    return weight_sync.WeightPusher(push, group=group, orbax_barriers=barriers)


def start_local_server(
    cfg: ExperimentConfig, config_path: str | None, overrides: list[str], run_dir: str
) -> LocalServer:
    """A rollout server child with the trainer's own config, logging to ``<run_dir>/server.log``.

    Unless the config names them, the child's checkpoint root is the run directory (the weights
    are pushed under it) and its state persists in ``<run_dir>/server`` (a restarted child resumes).
    """
    os.makedirs(run_dir, exist_ok=True)
    child = []
    if not cfg.server.checkpoint_root:
        child.append(f"server.checkpoint_root={run_dir}")
    if not cfg.server.state_dir:
        child.append(f"server.state_dir={os.path.join(run_dir, 'server')}")
    return LocalServer(config_path, [*overrides, *child], os.path.join(run_dir, "server.log"))


def open_writer(cfg: ExperimentConfig, run_dir: str) -> metrics.MetricsWriter:
    """TensorBoard, ``metrics.jsonl`` (under ``<run_dir>/logs``) and, when asked, W&B."""
    return metrics.MetricsWriter(
        os.path.join(run_dir, "logs"),
        total_steps=cfg.train.steps,
        wandb_project=cfg.name if cfg.train.wandb else "",
    )


def make_step_fn(
    cfg: ExperimentConfig,
    optimizer: optax.GradientTransformation,
    mesh: jax.sharding.Mesh,
    ref_params: Any = None,
) -> Callable[[TrainState, TrainBatch], tuple[TrainState, dict[str, jax.Array]]]:
    """The jitted train step, ``step(state, batch)``: advantages from the batch's rewards and
    group ids, and, with ``ref_params`` (the KL penalty's reference policy), their log-probs, all
    inside the step; log-probs renormalize over the ids the servers sample from."""
    step_fn = make_train_step(
        cfg.model, optimizer, step_config(cfg), mesh, vocab_mask=setup.sampleable_mask(cfg)
    )
    if ref_params is None:
        return step_fn
    return functools.partial(step_fn, ref_params=ref_params)


def evaluate_and_log(
    cfg: ExperimentConfig,
    graphdef: nnx.GraphDef,
    state: TrainState,
    writer: metrics.MetricsWriter | None,
    when: str,
) -> float | None:
    """Held-out greedy accuracy, printed and logged at the current step (by the process with the
    ``writer``; every process evaluates)."""
    accuracy = held_out.held_out_accuracy(cfg, graphdef, state.model_params)
    if writer is not None:
        print(f"held-out greedy accuracy {when}: {_fmt(accuracy)}", flush=True)
        writer.write(int(state.step), {"accuracy": accuracy}, console=False)
    return accuracy


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoopParts:
    """What the loop uses, built once by ``run`` (a record, not a framework).

    ``pool`` and ``writer`` exist on process 0 only (None on the others); ``pusher`` on every
    process (each writes its own shards). ``prefetch``: make batch k+1 while step k runs (async
    mode; synchronous mode never does, see ``train_loop``); False gives the serial loop.
    """

    pool: ServerPool | None
    pusher: weight_sync.WeightPusher | None
    ckpt: checkpointing.Checkpointer
    writer: metrics.MetricsWriter | None
    graphdef: nnx.GraphDef
    step_fn: Callable[[TrainState, TrainBatch], tuple[TrainState, dict[str, jax.Array]]]
    mesh: jax.sharding.Mesh
    spec: batching.BatchSpec
    prefetch: bool = True


def train_loop(
    cfg: ExperimentConfig,
    parts: LoopParts,
    state: TrainState,
    progress: checkpointing.Progress,
) -> tuple[TrainState, checkpointing.Progress]:
    """Take the ready batch → dispatch the step → start the next batch → finish the step (ack,
    push every n, checkpoint every k, eval) → log it once the next step is dispatched; until
    ``train.steps`` (docs/DESIGN.md §7.1 has the timeline of one step).

    Prefetch (``parts.prefetch``, async mode): right after step k is dispatched, a background
    thread (``prefetch.BatchSource``) pulls, selects and assembles batch k+1 and puts it on the
    devices, against the progress after batch k: the version batch k+1 will be trained with (one
    more per consumed batch, skipped or not, so it is known before step k ends: lags and the
    stale-drop decision are exact) and batch k's group keys among the trained ones (the duplicate
    check). It is started only when the run needs another batch whatever step k does (a skipped
    step k needs one more), so no batch is pulled for nothing. Synchronous mode never prefetches:
    the server generates batch k+1 only from the weights of step k, which the loop pushes and waits
    for after step k, so there is nothing to pull before then; the batch is made on the loop's
    thread after the push, as in the serial loop.

    Step k is finished (its metrics read, its groups acknowledged, its push, checkpoint and
    evaluation) once it is done and before step k+1 is dispatched: all of them depend on whether it
    was skipped, and the push and the checkpoint read its state, whose buffers step k+1 donates.
    Its record is written to the metrics after step k+1 is dispatched. The checkpoint holds the
    progress after step k; batch k+1, pulled and not acknowledged, is not in it (its groups stay
    leased and come back after a restart).

    Pushes run in the background (``weight_sync.WeightPusher``), except in sync mode, which waits
    for each; the loop returns once the last one has landed. Every process runs the loop; see the
    module docstring for what only process 0 does.

    A run stuck on skipped steps stops: after ``train.max_skipped_steps`` consecutive ones the
    loop writes its last record, lands its pushes, checkpoints and raises ``skips.NoProgress``.

    Raises:
      skips.NoProgress: ``train.max_skipped_steps`` consecutive steps were skipped (checkpointed).
      RuntimeError: a weight push failed (raised at the next step), or no groups arrive.
      Whatever stopped the batch being made (raised as is, e.g. the pool's ``ServersDownError``).
    """
    t = cfg.train
    rng = jax.random.wrap_key_data(np.asarray(progress.rng_key, np.uint32))
    step = int(state.step)
    ahead = parts.prefetch and t.mode != "sync"
    record = None  # the finished step's log record, written once the next step is dispatched
    streak = skips.SkipStreak()  # consecutive skipped steps (a resume starts a new count)
    source = prefetch.BatchSource(
        parts.pool,
        parts.spec,
        parts.mesh,
        timeout_s=t.client.pull_timeout_s,
        stall_s=t.client.wait_s,
        background=ahead,
    )
    cpu = CpuWindow()  # the process's CPU and the machine's steal seconds, per step
    with source:
        while step < t.steps:
            if parts.pusher is not None:
                parts.pusher.check()
            start = time.monotonic()
            if not source.pending:
                source.start(progress)
            ready = source.take()
            got_batch = time.monotonic()
            # The step is deterministic; the key is split per step and checkpointed so that a
            # stochastic phase (e.g. subsampling a batch) would resume reproducibly.
            rng, _ = jax.random.split(rng)
            state, step_metrics = parts.step_fn(state, ready.batch)
            if ahead and step + 1 < t.steps:
                source.start(advance(progress, ready.pulled.stats, False, rng))
            if record is not None:
                write_record(parts, *record)
            step, progress, streak, record = finish_step(
                cfg, parts, state, progress, ready.pulled, step_metrics, rng, streak
            )
            cpu_s, steal_s = cpu.lap()
            record[1].update(
                tokens_per_s=ready.pulled.stats.tokens / max(time.monotonic() - start, 1e-9),
                pull_wait_s=got_batch - start,
                batch_host_s=ready.host_s,
                step_s=time.monotonic() - got_batch,
                cpu_s=cpu_s,
                steal_s=steal_s,
            )
            if streak.exhausted(t.max_skipped_steps):
                break
        if record is not None:
            write_record(parts, *record)
    if parts.pusher is not None:
        parts.pusher.wait()
    if parts.pool is not None:
        parts.pool.flush_acks()
    if streak.exhausted(t.max_skipped_steps):
        stop_stuck(parts, state, progress, streak)
    return state, progress


def loop_or_stuck(
    cfg: ExperimentConfig,
    parts: LoopParts,
    state: TrainState,
    progress: checkpointing.Progress,
) -> tuple[TrainState, checkpointing.Progress, str]:
    """``train_loop``'s state and progress, and "" or, for a run stopped by
    ``train.max_skipped_steps`` (checkpointed by the loop), its one line."""
    try:
        state, progress = train_loop(cfg, parts, state, progress)
    except skips.NoProgress as e:
        return e.state, e.progress, str(e)
    return state, progress, ""


def stop_stuck(
    parts: LoopParts,
    state: TrainState,
    progress: checkpointing.Progress,
    streak: skips.SkipStreak,
) -> None:
    """Checkpoints a run stuck on skipped steps (and waits for the write), then raises
    ``skips.NoProgress`` with the one line: the count, the likely cause, the checkpoint."""
    step, saved = int(state.step), ""
    if parts.ckpt is not None:
        failures = parts.ckpt.failures
        parts.ckpt.save(step, state, progress)
        parts.ckpt.wait()  # committed (or failed, logged) before the run ends
        if parts.ckpt.failures == failures:
            saved = f"; checkpoint {step} in {parts.ckpt.directory}"
    raise skips.NoProgress(streak.message() + saved, state=state, progress=progress)


def finish_step(
    cfg: ExperimentConfig,
    parts: LoopParts,
    state: TrainState,
    progress: checkpointing.Progress,
    pulled: pulling.PulledBatch,
    step_metrics: dict[str, jax.Array],
    rng: jax.Array,
    streak: skips.SkipStreak,
) -> tuple[
    int,
    checkpointing.Progress,
    skips.SkipStreak,
    tuple[int, dict[str, Any], batching.BatchStats],
]:
    """Waits for the dispatched step (its metrics), then acknowledges its groups, pushes,
    checkpoints and evaluates as due. Returns the step count, the progress after the batch, the
    skip streak after it and the step's log record (step, scalars, stats) for ``write_record``."""
    t = cfg.train
    step_metrics = jax.device_get(step_metrics)
    skipped = bool(step_metrics["step_skipped"])
    progress = advance(progress, pulled.stats, skipped, rng)
    if skipped:
        cause = skips.skip_cause(step_metrics, pulled.batch, pulled.stats, t.overlong)
        streak = streak.after(True, cause)
    else:
        streak = streak.after(False)
    if parts.pool is not None:  # trained (or dropped): the servers may forget them
        parts.pool.ack(pulled.pulled)
    step = int(state.step)
    publish_if_due(cfg, parts, state, progress, skipped)
    if not skipped and step % t.checkpoint.every == 0:
        if parts.pusher is not None and parts.pusher.orbax_barriers:
            parts.pusher.wait()  # one order of orbax barriers on every process
        parts.ckpt.save(step, state, progress)
    accuracy = None
    if t.eval.every and step % t.eval.every == 0 and not skipped:
        accuracy = held_out.held_out_accuracy(cfg, parts.graphdef, state.model_params)
    scalars = {}
    if parts.writer is not None:
        scalars = {**step_metrics, **loop_scalars(pulled.stats, progress)}
        step_obj = getattr(parts.step_fn, "func", parts.step_fn)  # a partial binds ref_params
        if isinstance(step_obj, Step):
            scalars["compiled_programs"] = step_obj.compiled_programs
        scalars.update(parts.pusher.metrics() if parts.pusher else {}, accuracy=accuracy)
        scalars.update(parts.pool.metrics() if parts.pool else {})
    return step, progress, streak, (step, scalars, pulled.stats)


def write_record(
    parts: LoopParts, step: int, scalars: dict[str, Any], stats: batching.BatchStats
) -> None:
    """Writes one finished step's record (process 0, which has the writer)."""
    if parts.writer is not None:
        parts.writer.write(step, scalars, stats)


def publish_if_due(
    cfg: ExperimentConfig,
    parts: LoopParts,
    state: TrainState,
    progress: checkpointing.Progress,
    skipped: bool,
) -> None:
    """Hands the params to the pusher as ``progress.version`` every ``weight_sync_interval``
    updates, and after every skipped step (sync mode: after every step, and waits for the push).

    A skipped step republishes the unchanged params under the new version: the step consumed a
    batch, so the version moved on, and a server whose weights fall more than ``max_staleness``
    versions behind the trainer's admits nothing (docs/DESIGN.md §6.3); without the push a run of
    skipped steps (nothing active, a non-finite loss) would close admission for good and die of
    ``train.client.wait_s``. A skipped step does not advance ``state.step``, so the interval alone
    would not push either.
    """
    t = cfg.train
    step = int(state.step)
    if not (skipped or t.mode == "sync" or step % t.weight_sync_interval == 0):
        return
    # The host copy is taken now: the next step donates these device buffers.
    params = weight_sync.host_copy(
        state.params, serving_dtype(cfg.server), pushed_weight_dtype(cfg)
    )
    if parts.pusher is not None:
        parts.pusher.submit(progress.version, params)
        if t.mode == "sync":
            parts.pusher.wait()


def serving_dtype(server: ServerConfig) -> str | None:
    """The dtype the servers serve in (``server.dtype``), the weights are pushed in; None (each
    param's own dtype, ``model.param_dtype``) when it is unset."""
    return server.dtype or None


def pushed_weight_dtype(cfg: ExperimentConfig) -> str:
    """The format whole-params pushes carry (``weight_sync.push_format``): the servers'
    ``server.weight_dtype`` when 8-bit (the trainer quantizes), else full precision."""
    lora = cfg.model.lora.rank > 0
    return weight_sync.push_format(cfg.server.weight_dtype, setup.run_paths(cfg)[2], lora=lora)


def loop_scalars(stats: batching.BatchStats, progress: checkpointing.Progress) -> dict[str, float]:
    """The trainer-side metrics of docs/DESIGN.md §4 for one step (the step's own come from
    train_step)."""
    return {
        "reward_mean": stats.reward_mean,
        "response_length": stats.response_len_mean,
        "pad_frac": stats.pad_frac,
        "lag_mean": stats.lag_mean,
        "lag_max": stats.lag_max,
        "stale_dropped": progress.stale_dropped,
        "stale_kept": stats.stale_kept,
        "steps_skipped": progress.steps_skipped,
        "duplicates_skipped": stats.duplicates,
        "groups_invalid": stats.invalid,
        "groups_filtered": stats.filtered,
        "overlong_frac": stats.overlong_frac,
        "groups": stats.groups,
        "version": progress.version,
    }


def cli(argv: list[str] | None = None) -> None:
    """``sat-train --config FILE [key=value ...]``; a bad config exits with code 2 and one line,
    a run stopped by ``train.max_skipped_steps`` with code 1 and one line (after its checkpoint)."""
    command = sat_cli.Command("sat-train", __doc__)
    args = command.parse(sys.argv[1:] if argv is None else argv)
    cfg = command.load_config(args)
    with command.exit_on(ConfigError, prefix="config error: "):
        setup.check_run(cfg)
    sat_cli.log_to_stderr("train")
    result = run(cfg, args.config, args.overrides)
    if result.no_progress:
        log.error("%s", sat_cli.one_line(result.no_progress))
        sys.exit(1)
    print(
        f"done: {result.steps} steps, weights version {result.version}, "
        f"accuracy {_fmt(result.accuracy_before)} -> {_fmt(result.accuracy_after)}, "
        f"logs in {result.run_dir}",
        flush=True,
    )


def _fmt(accuracy: float | None) -> str:
    return "n/a" if accuracy is None else f"{accuracy:.3f}"
