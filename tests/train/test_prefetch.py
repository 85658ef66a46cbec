"""The loop with prefetch (batch k+1 made on a thread while step k runs) against the serial loop,
on a scripted stream of groups (``ScriptedPool``: a fixed list served in order, leased until
acknowledged, leases returned on a restart): the same groups trained in the same order, with the
same per-token lags, the same stale drops and duplicates, the same acknowledgements, through
max_staleness edges, skipped steps, a server failure mid-Pull and a resume from the checkpoint.
No test depends on timing: the pool never blocks, and every comparison is of what was trained.
"""

from __future__ import annotations

import dataclasses
import pathlib
import threading

import jax
import numpy as np
import pytest

from rollout_api.records import Group, Trajectory
from sat_jax import sharding
from sat_jax.experiment import load_config
from sat_jax.step import TrainState
from train import checkpointing, main, prefetch, setup

REPO = pathlib.Path(__file__).resolve().parents[2]
CONFIG = str(REPO / "configs" / "arith_tiny.yaml")
BATCH = 2  # rollout.batch_groups


class ServerDied(RuntimeError):
    """What the scripted pool raises on its ``fail_at``-th pull."""


def _group(i: int, versions: tuple[int, int]) -> Group:
    """Group i: two trajectories whose completion tokens carry ``versions`` (oldest first), and
    whose tokens name the group (so a batch's tokens say which groups it holds)."""
    trajectories = tuple(
        Trajectory(
            prompt_ids=np.array([1, 3 + i % 40, 5], np.int32),
            completion_ids=np.array([7 + j, 2], np.int32),
            behavior_logprobs=np.array([-1.0, -0.5], np.float32),
            versions=np.array(versions, np.int64),
            reward=float(j),
        )
        for j in range(2)
    )
    return Group(group_id=i, prompt_id=f"p{i}", trajectories=trajectories)


def script(n: int, lags: tuple[int, ...]) -> list[Group]:
    """``n`` groups; group i's newest token is of version i // (2 · BATCH) + 1 less
    ``lags[i % len(lags)]`` (never below 0), an odd group's first token one older: as drops shift
    groups into later batches, the lags (some negative: a script, not a server) and the drops at
    the max_staleness edge vary. The first even group of lag 0 (trained whatever the bound) comes
    again after group 9 (a
    re-delivery: a duplicate)."""
    fresh = next(i for i in range(0, 9, 2) if lags[i % len(lags)] == 0)
    groups = []
    for i in range(n):
        v = max(i // (2 * BATCH) + 1 - lags[i % len(lags)], 0)
        groups.append(_group(i, (max(v - i % 2, 0), v)))
        if i == 9:
            groups.append(groups[fresh])
    return groups


class ScriptedPool:
    """Serves ``groups`` in order, at most ``per_pull`` per pull; a pulled group is leased until
    acknowledged (or rejected); ``restart`` puts the leased ones back first, in pull order (what a
    server does for a trainer that comes back). The ``fail_at``-th pull raises ``ServerDied``."""

    def __init__(self, groups: list[Group], *, per_pull: int = 3, fail_at: int | None = None):
        self.queue = list(groups)
        self.per_pull, self.fail_at = per_pull, fail_at
        self.pulls = 0
        self.leased: dict[str, Group] = {}
        self.acked: list[str] = []
        self.rejected: list[str] = []
        self.error = ServerDied("server gone mid-Pull")
        self._lock = threading.Lock()

    def pull(
        self, max_groups: int, timeout_s: float, *, limits=None, trainer_version=0
    ) -> list[Group]:
        with self._lock:
            self.pulls += 1
            if self.pulls == self.fail_at:
                raise self.error
            n = min(max_groups, self.per_pull)
            out, self.queue = self.queue[:n], self.queue[n:]
            self.leased.update((g.key, g) for g in out)
            return out

    def ack(self, groups, *, rejected: bool = False) -> None:
        with self._lock:
            for g in groups:
                self.leased.pop(g.key, None)
                (self.rejected if rejected else self.acked).append(g.key)

    def restart(self) -> None:
        with self._lock:
            self.queue = list(self.leased.values()) + self.queue
            self.leased.clear()
            self.fail_at = None

    def flush_acks(self) -> None:
        pass

    def metrics(self) -> dict[str, float]:
        return {}


class Recorder:
    """The metrics writer: keeps every step's record and stats."""

    def __init__(self):
        self.steps: list[tuple[int, dict, tuple[str, ...], list[int]]] = []

    def write(self, step, scalars, stats=None) -> None:
        self.steps.append((step, scalars, stats.group_keys, stats.lags.tolist()))


class MemoryCheckpoints:
    """``Checkpointer.save`` in memory: the last saved (state, progress)."""

    def __init__(self):
        self.saved: list[tuple[int, TrainState, checkpointing.Progress]] = []

    def save(self, step, state, progress) -> None:
        self.saved.append((step, state, progress))


def _step_fn(trained: list, skip_calls: set[int]):
    """A no-op train step recording the tokens it trains; its calls in ``skip_calls`` (counted
    from 1 over the whole test, resumes included) are skipped."""

    def step(state: TrainState, batch):
        trained.append(np.asarray(batch.tokens))
        skipped = len(trained) in skip_calls
        return state.replace(step=state.step + (0 if skipped else 1)), {
            "step_skipped": np.float32(skipped)
        }

    return step


def _cfg(staleness: int, policy: str, steps: int, *, every: int = 100):
    return load_config(
        CONFIG,
        [
            f"rollout.max_staleness={staleness}",
            f"train.stale_policy={policy}",
            f"rollout.batch_groups={BATCH}",
            "rollout.group_size=2",
            "train.routing_replay=false",
            "train.length_bucket=0",
            f"train.steps={steps}",
            f"train.checkpoint.every={every}",
            "train.eval.every=0",
        ],
    )


def _run(cfg, pool, ckpt, trained, skip_calls, *, prefetch_on, state=None, progress=None):
    """Runs ``train_loop``; returns (state, progress, records) or raises what the loop raised."""
    if state is None:
        state = TrainState(params={"w": jax.numpy.zeros(3)}, opt_state=(), step=np.int32(0))
        progress = checkpointing.Progress(version=1, min_version=1, rng_key=(0, 0))
    writer = Recorder()
    parts = main.LoopParts(
        pool=pool,
        pusher=None,
        ckpt=ckpt,
        writer=writer,
        graphdef=None,
        step_fn=_step_fn(trained, skip_calls),
        mesh=sharding.make_mesh(cfg.train.mesh, jax.devices()[:1]),
        spec=setup.batch_spec(cfg),
        prefetch=prefetch_on,
    )
    state, progress = main.train_loop(cfg, parts, state, progress)
    return state, progress, writer.steps


def _summary(pool, trained, records, progress) -> dict:
    """What must not depend on prefetch."""
    return {
        "trained": [t.tolist() for t in trained],
        "records": [(step, keys, lags) for step, _, keys, lags in records],
        "lag_max": [r[1]["lag_max"] for r in records],
        "stale_dropped": [r[1]["stale_dropped"] for r in records],
        "duplicates": [r[1]["duplicates_skipped"] for r in records],
        "version": [r[1]["version"] for r in records],
        "progress": dataclasses.replace(progress, rng_key=()),
        "acked": pool.acked,
        "rejected": pool.rejected,
        "leased": sorted(pool.leased),
    }


@pytest.mark.parametrize(
    "staleness, policy, lags, skips",
    [
        (0, "drop", (0, 0, 1, 0, 2), {2}),  # lag 0 kept, 1 dropped
        (2, "drop", (2, 3, 0, 1, 2, 4), {3, 4}),  # the edge: lag 2 kept, 3 dropped; two skips
        (1, "keep", (1, 2, 0, 5), set()),  # stale groups kept and counted
    ],
)
def test_prefetch_trains_what_the_serial_loop_trains(staleness, policy, lags, skips):
    cfg = _cfg(staleness, policy, steps=6)
    out = {}
    for on in (False, True):
        pool, trained = ScriptedPool(script(40, lags)), []
        _, progress, records = _run(cfg, pool, MemoryCheckpoints(), trained, skips, prefetch_on=on)
        out[on] = _summary(pool, trained, records, progress)
        assert len(trained) == 6 + len(skips) and progress.steps_skipped == len(skips)
    assert out[True] == out[False]
    summary = out[True]
    # The script does reach the edges: some groups dropped, some tokens at the bound.
    assert summary["progress"].stale_dropped > 0 or policy == "keep"
    if policy == "drop":
        assert max(summary["lag_max"]) == staleness
    else:
        assert max(summary["lag_max"]) > staleness
    assert sum(summary["duplicates"]) == 1 and summary["leased"] == []  # nothing pulled for nothing


def test_a_failure_mid_pull_and_the_resume_train_what_the_serial_loop_trains():
    # Checkpoint at step 2 (the second batch is skipped); the 22nd pull (the fifth batch's second
    # group, prefetched while step 3 runs, its first leased) fails: the loop raises the pool's own error; the restart resumes from checkpoint 2 with the
    # leased groups delivered again. Prefetch or not, the same groups are trained, once each
    # after the checkpoint, at the same lags.
    cfg = _cfg(1, "drop", steps=6, every=2)
    out = {}
    for on in (False, True):
        pool = ScriptedPool(script(40, (0, 1, 2, 0)), per_pull=1, fail_at=22)
        ckpt, trained = MemoryCheckpoints(), []
        with pytest.raises(ServerDied) as raised:
            _run(cfg, pool, ckpt, trained, {2}, prefetch_on=on)
        assert raised.value is pool.error  # the original error, not a wrapper
        first = len(trained)
        assert first == 4 and pool.leased  # steps 1-3 (one skipped) ran; batch 5 was in the making
        (step, state, progress) = ckpt.saved[-1]
        assert step == 2 and progress.version == 4  # 3 batches consumed (one step skipped)
        pool.restart()
        _, progress, records = _run(
            cfg, pool, ckpt, trained, {2}, prefetch_on=on, state=state, progress=progress
        )
        out[on] = _summary(pool, trained, records, progress) | {"first": first}
    assert out[True] == out[False]
    assert out[True]["progress"].version == 8 and out[True]["leased"] == []


def test_an_error_making_the_batch_surfaces_in_take_as_raised():
    pool = ScriptedPool([], fail_at=1)
    cfg = _cfg(1, "drop", steps=2)
    mesh = sharding.make_mesh(cfg.train.mesh, jax.devices()[:1])
    progress = checkpointing.Progress(version=1, min_version=1, rng_key=(0, 0))
    with prefetch.BatchSource(
        pool, setup.batch_spec(cfg), mesh, timeout_s=0.1, stall_s=5, background=True
    ) as source:
        source.start(progress)
        with pytest.raises(ServerDied) as raised:
            source.take()
        assert raised.value is pool.error
        with pytest.raises(RuntimeError, match="no batch started"):
            source.take()
        source.start(progress)
        with pytest.raises(RuntimeError, match="not taken"):
            source.start(progress)


def test_the_next_batch_is_pulled_while_the_step_runs():
    """Prefetch overlaps the step: the step's result (read by the loop after it dispatched the
    step, as a device computation's would be) is ready only once the pool has been asked for the
    next batch's groups, which a loop that pulls the next batch only after the step never does
    (each step would wait until its hang guard and the test fail)."""
    cfg = _cfg(1, "drop", steps=4)
    pool = ScriptedPool(script(40, (0,)))
    asked: dict[int, threading.Event] = {v: threading.Event() for v in range(1, 8)}
    plain = pool.pull

    def pull(max_groups, timeout_s, *, limits=None, trainer_version=0):
        asked[trainer_version].set()
        return plain(max_groups, timeout_s, limits=limits, trainer_version=trainer_version)

    pool.pull = pull
    trained: list = []
    overlapped: list[bool] = []

    class Pending:
        """A step's result that is ready once batch ``version + 1`` has been asked for."""

        def __init__(self, version: int):
            self.version = version

        def __array__(self, dtype=None, copy=None):
            if self.version < 4:
                overlapped.append(asked[self.version + 1].wait(60))
            return np.asarray(0.0, np.float32)

    def step(state, batch):
        trained.append(np.asarray(batch.tokens))
        return state.replace(step=state.step + 1), {"step_skipped": Pending(len(trained))}

    state = TrainState(params={"w": jax.numpy.zeros(3)}, opt_state=(), step=np.int32(0))
    progress = checkpointing.Progress(version=1, min_version=1, rng_key=(0, 0))
    parts = main.LoopParts(
        pool=pool, pusher=None, ckpt=MemoryCheckpoints(), writer=Recorder(), graphdef=None,
        step_fn=step, mesh=sharding.make_mesh(cfg.train.mesh, jax.devices()[:1]),
        spec=setup.batch_spec(cfg), prefetch=True,
    )  # fmt: skip
    main.train_loop(cfg, parts, state, progress)
    assert overlapped == [True, True, True] and len(trained) == 4


def test_batch_host_seconds_count_assembly_and_transfer_not_the_wait(monkeypatch):
    """``ReadyBatch.host_s`` (the trainer's ``batch_host_s``) is the host work on a batch after
    its groups are in: assembly (0.25 s on a fake clock) and the host→device transfer (0.125 s),
    not the pulls' wait for groups (5 s each)."""
    now = [0.0]
    clock = lambda: now[0]
    pool = ScriptedPool(script(40, (0,)), per_pull=1)
    plain_pull, plain_assemble = pool.pull, prefetch.batching.assemble_batch
    plain_shard = prefetch.shard_batch

    def pull(*args, **kwargs):
        now[0] += 5.0
        return plain_pull(*args, **kwargs)

    def assemble(*args, **kwargs):
        now[0] += 0.25
        return plain_assemble(*args, **kwargs)

    def shard(*args, **kwargs):
        now[0] += 0.125
        return plain_shard(*args, **kwargs)

    pool.pull = pull
    monkeypatch.setattr(prefetch.batching, "assemble_batch", assemble)
    monkeypatch.setattr(prefetch, "shard_batch", shard)
    cfg = _cfg(1, "drop", steps=2)
    mesh = sharding.make_mesh(cfg.train.mesh, jax.devices()[:1])
    progress = checkpointing.Progress(version=1, min_version=1, rng_key=(0, 0))
    with prefetch.BatchSource(
        pool, setup.batch_spec(cfg), mesh, timeout_s=0.1, stall_s=50, background=False, clock=clock
    ) as source:
        source.start(progress)
        ready = source.take()
    assert pool.pulls >= BATCH and now[0] == pytest.approx(pool.pulls * 5.0 + 0.375)
    assert ready.pulled.host_s == pytest.approx(0.25)
    assert ready.host_s == pytest.approx(0.375)


def test_the_loop_logs_each_batch_host_seconds():
    cfg = _cfg(1, "drop", steps=3)
    pool, trained = ScriptedPool(script(40, (0,))), []
    _, _, records = _run(cfg, pool, MemoryCheckpoints(), trained, set(), prefetch_on=True)
    assert len(records) == 3
    assert all(r[1]["batch_host_s"] >= 0.0 for r in records)
