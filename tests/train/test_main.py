"""The trainer as the README runs it: `python -m train --config ... key=value ...` in a subprocess.

One live rollout server (sync admission: max_staleness 0) serves the end-to-end test: a synchronous
run is SIGKILLed after its second checkpoint and restarted with the same command; it resumes from
the last checkpoint (step and version monotone), re-syncs the server, never trains a prompt twice,
finishes, and every trained token had lag 0.

The loop against a live server with a stand-in train step that waits until its weight push has
landed and the server has made every group its admission allows (generation faster than training,
by events rather than a sleep): async mode then really runs ahead (lag > 0, never beyond max_staleness), sync mode stays
at lag 0.
"""

from __future__ import annotations

import functools
import json
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import grpc
import jax
import numpy as np
import pytest
from flax import nnx

from rollout_api.proto import rollout_pb2, rollout_pb2_grpc
from rollout_api.records import Group, Trajectory
from sat_jax import cpu_clock, sharding
from sat_jax.experiment import load_config
from sat_jax.model import placement
from sat_jax.step import TrainState
from tests.clock import wait_until
from tests.train.conftest import JAX_CACHE
from train import checkpointing, main, metrics, setup, weight_sync
from train.local_server import LocalServer

REPO = pathlib.Path(__file__).resolve().parents[2]
CONFIG = str(REPO / "configs" / "arith_tiny.yaml")


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    env.update(
        JAX_PLATFORMS="cpu",
        JAX_COMPILATION_CACHE_DIR=str(JAX_CACHE),
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0.5",
        PYTHONPATH=str(REPO),
    )
    return env


@pytest.mark.parametrize(
    "override, key",
    [
        ("train.bogus=1", "train.bogus"),
        ("train.stale_policy=sometimes", "stale_policy"),
        ("train.loss.sat.quantile=1.5", "train.loss.sat"),
        ("train.steps=many", "train.steps"),
        ("train.weight_sync_interval=4", "train.weight_sync_interval"),
        ("train.run_dir=gs://bucket/run", "run_dir"),
        ("train.length_bucket=-1", "length_bucket"),
    ],
)
def test_bad_config_exits_2_naming_the_key(override, key, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main.cli(["--config", CONFIG, override])
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and key in lines[0], lines


@pytest.mark.slow  # the trainer command in a process
def test_python_m_train_rejects_an_unknown_key():
    proc = subprocess.run(
        [sys.executable, "-m", "train", "--config", CONFIG, "train.bogus=1"],
        cwd=REPO,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and proc.stderr.strip() == (
        "sat-train: config error: train.bogus: unknown key"
    ), proc.stderr


@pytest.mark.parametrize(
    "overrides, child",
    [
        ([], ["server.checkpoint_root=RUN", "server.state_dir=RUN/server"]),
        (["server.checkpoint_root=/ck", "server.state_dir=/st"], []),
    ],
)
def test_the_local_server_loads_weights_from_the_run_dir_unless_configured(
    overrides, child, monkeypatch, tmp_path
):
    started = []
    monkeypatch.setattr(main, "LocalServer", lambda *args: started.append(args))
    run_dir = str(tmp_path / "run")
    cfg = load_config(None, overrides)
    main.start_local_server(cfg, "c.yaml", overrides, run_dir)
    child = [c.replace("RUN", run_dir) for c in child]
    assert started == [("c.yaml", [*overrides, *child], os.path.join(run_dir, "server.log"))]
    assert os.path.isdir(run_dir)


def test_a_run_dir_outside_the_local_servers_checkpoint_root_is_refused_before_start(
    tmp_path, capsys, monkeypatch
):
    started = []
    monkeypatch.setattr(main, "LocalServer", lambda *args: started.append(args))
    root, run = tmp_path / "root", tmp_path / "elsewhere"
    with pytest.raises(SystemExit) as exit_info:
        main.cli(["--config", CONFIG, f"server.checkpoint_root={root}", f"train.run_dir={run}"])
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("sat-train: config error: train.run_dir: ") and str(root) in lines[0]
    assert "server.checkpoint_root=" in lines[0] and not started and not run.exists()
    # Inside the root, with remote servers, or with the root unset, the same run is accepted.
    for overrides in (
        [f"server.checkpoint_root={tmp_path}", f"train.run_dir={run}"],
        [f"server.checkpoint_root={root}", f"train.run_dir={run}", "train.client.servers=[h:1]"],
        ["server.checkpoint_root=", f"train.run_dir={run}"],
    ):
        setup.check_run(load_config(CONFIG, overrides))


def _records(run_dir: pathlib.Path) -> list[dict]:
    path = run_dir / "logs" / "metrics.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass  # a line torn by SIGKILL
    return out


@pytest.mark.slow
def test_sync_run_survives_sigkill_and_resumes(tmp_path):
    overrides = [
        "rollout.max_staleness=0",
        "rollout.batch_groups=4",
        "rollout.group_size=4",
        "server.slots=8",
        f"server.checkpoint_root={tmp_path}",
        f"server.state_dir={tmp_path / 'server'}",
    ]
    server = LocalServer(CONFIG, overrides, str(tmp_path / "server.log"))
    run_dir = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "train",
        "--config",
        CONFIG,
        *overrides,
        f"train.client.servers=[{server.address}]",
        "train.mode=sync",
        "train.steps=6",
        "train.checkpoint.every=2",
        "train.warmup.steps=20",
        "train.eval.problems=16",
        "train.eval.every=0",
        "train.loss.kl_coef=0.01",  # exercises the reference-policy KL path
        f"train.run_dir={run_dir}",
    ]
    # cwd = tmp_path: the warm-up cache (runs/sft_cache) stays inside the test's directory.
    first = second = None
    try:
        server.wait_ready(timeout_s=150)
        with open(tmp_path / "first.log", "w") as log:
            first = subprocess.Popen(cmd, cwd=tmp_path, env=_env(), stdout=log, stderr=log)
        # Generous: the warm-up and first compiles take minutes on a loaded 2-core machine (the
        # test's own limit is SLOW_TEST_TIMEOUT_S).
        # The kill lands past step 3 and once a checkpoint has finished: checkpoints are written
        # in the background, so step 3 may come before step 2's save is complete, and how far
        # the save has got by then is the machine's pace, not the test's to assume.
        deadline = time.monotonic() + 400
        reached = False
        while time.monotonic() < deadline and first.poll() is None:
            stepped = any(r.get("step", 0) >= 3 and "lag_max" in r for r in _records(run_dir))
            reached = stepped and bool(_finished_checkpoints(run_dir))
            if reached:
                break
            time.sleep(0.2)
        assert first.poll() is None, (tmp_path / "first.log").read_text()
        assert reached, (
            "no step 3 and checkpoint within 400 s:\n" + (tmp_path / "first.log").read_text()
        )
        first.send_signal(signal.SIGKILL)
        first.wait(30)
        killed_at = max(r["step"] for r in _records(run_dir) if "lag_max" in r)
        # The newest finished checkpoint at the kill (2, or 4 if the trainer got that far first).
        latest = max(_finished_checkpoints(run_dir))
        with open(tmp_path / "second.log", "w") as log:
            second = subprocess.run(
                cmd, cwd=tmp_path, env=_env(), stdout=log, stderr=log, timeout=300
            )
        out = (tmp_path / "second.log").read_text()
        assert second.returncode == 0, out
    finally:
        for proc in (first,):
            if proc is not None and proc.poll() is None:
                proc.kill()
        server.stop()

    assert 2 <= latest < 6 and f"resumed from checkpoint {latest}" in out, (latest, out)
    assert "done: 6 steps" in out, out
    steps = [r for r in _records(run_dir) if "lag_max" in r]
    resumed = steps[[r["step"] for r in steps].index(killed_at) + 1 :]
    assert [r["step"] for r in resumed] == list(range(latest + 1, 7))
    versions = [r["version"] for r in resumed]
    assert versions == sorted(versions) and len(set(versions)) == len(versions)
    # Synchronous mode: generation waited for every new version, so no trained token is stale.
    assert all(r["lag_max"] == 0 and r["lag_mean"] == 0 for r in steps)
    # Same weights on both sides and the trainer renormalizes over the ids the server samples
    # from: the mismatch is float32 rounding (engine cache path vs full forward), ~1e-6.
    assert all(r["mismatch_abs_mean"] < 1e-4 for r in steps), [
        r["mismatch_abs_mean"] for r in steps
    ]
    assert (run_dir / "curves.png").exists()
    assert sorted(os.listdir(run_dir / "checkpoints"))[-1] == "6"
    progress = json.loads((run_dir / "checkpoints" / "6" / "progress" / "metadata").read_text())
    trained = progress["recent_prompt_ids"]
    assert len(trained) == len(set(trained)) == progress["groups_trained"] == 6 * 4


def _finished_checkpoints(run_dir) -> list[int]:
    """Steps of the checkpoints whose save has finished (orbax names a checkpoint by its step once
    it is complete; one still being written has a temporary name)."""
    path = run_dir / "checkpoints"
    return [int(d) for d in os.listdir(path) if d.isdigit()] if path.is_dir() else []


def _random_params(cfg) -> dict:
    """Params of the model's structure, without compiling an init."""
    abstract = nnx.to_pure_dict(placement.abstract_model(cfg.model)[1])
    rng = np.random.default_rng(0)
    return jax.tree.map(
        lambda x: jax.device_put((0.1 * rng.standard_normal(x.shape)).astype(x.dtype)), abstract
    )


def _push_to(pool, version, params, *, weights_dir):
    weight_sync.push_weights(pool, params, version, weights_dir)


class PacedStep:
    """A stand-in train step that changes nothing (the params, and so the pushed weights, stay
    put) and paces the loop by events, not sleeps: before step k (1-based) it runs ``hooks[k]``,
    then waits until the weights pushed after the step before have landed (``pusher``, set once
    the test's pusher exists) and until ``servers`` have caught up (``_caught_up``). Generation
    and weight pushes are then faster than training however loaded the machine is."""

    def __init__(self, servers: list[LocalServer], hooks: dict[int, Callable] | None = None):
        self.servers, self.hooks = servers, hooks or {}
        self.pusher: weight_sync.WeightPusher | None = None
        self.calls = 0

    def __call__(self, state: TrainState, batch):
        self.calls += 1
        if self.calls in self.hooks:
            self.hooks[self.calls]()
        if self.pusher is not None:
            self.pusher.wait()
        _caught_up(self.servers)
        return state.replace(step=state.step + 1), {"step_skipped": np.bool_(False)}


def _caught_up(servers: list[LocalServer], timeout_s: float = 300.0) -> None:
    """Waits until every answering server has made every group its admission allows for the
    weights it holds: admission closed and no group running. A server that does not answer
    (killed, stopped or restarting) is not waited for.

    Raises:
      AssertionError: a server answers but has not caught up within ``timeout_s`` (a safety
        limit: only a broken server takes that long).
    """
    for server in servers:
        channel = grpc.insecure_channel(server.address)
        try:
            stub = rollout_pb2_grpc.RolloutStub(channel)

            def done(stub=stub) -> bool:
                try:
                    stats = stub.Stats(rollout_pb2.StatsRequest(), timeout=2)
                except grpc.RpcError:
                    return True
                return stats.groups_running == 0 and not stats.admission_open

            wait_until(done, timeout_s=timeout_s, interval_s=0.05)
        finally:
            channel.close()


def _loop_parts(cfg, pool, pusher, writer, step_fn, *, ckpt=None) -> main.LoopParts:
    """What ``train_loop`` needs around a test's pool and step, on one device, without eval."""
    return main.LoopParts(
        pool=pool,
        pusher=pusher,
        ckpt=ckpt,
        writer=writer,
        graphdef=None,
        step_fn=step_fn,
        mesh=sharding.make_mesh(cfg.train.mesh, jax.devices()[:1]),
        spec=setup.batch_spec(cfg),
    )


@pytest.mark.slow
@pytest.mark.parametrize("mode, staleness", [("async", 1), ("sync", 0)])
def test_async_runs_ahead_and_sync_stays_at_lag_0(mode, staleness, tmp_path, monkeypatch):
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(JAX_CACHE))
    monkeypatch.setenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")
    overrides = [
        f"rollout.max_staleness={staleness}",
        "rollout.batch_groups=2",
        "rollout.group_size=2",
        "rollout.max_new_tokens=6",
        "server.slots=4",
        f"server.checkpoint_root={tmp_path}",
        f"train.mode={mode}",
        "train.steps=5",
        "train.checkpoint.every=100",
        "train.eval.problems=0",
        "train.client.wait_s=120",
        f"train.run_dir={tmp_path / 'run'}",
    ]
    cfg = load_config(CONFIG, overrides)
    _, _, weights_dir = setup.run_paths(cfg)
    push = functools.partial(_push_to, weights_dir=weights_dir)
    state = TrainState(params=_random_params(cfg), opt_state=(), step=np.int32(0))
    progress = checkpointing.Progress(version=1, min_version=1, rng_key=(0, 0))
    with (
        LocalServer(CONFIG, overrides, str(tmp_path / "server.log")) as server,
        checkpointing.Checkpointer(str(tmp_path / "ckpt"), keep=1) as ckpt,
        metrics.MetricsWriter(str(tmp_path / "logs"), total_steps=5, console=None) as writer,
    ):
        server.wait_ready(timeout_s=150)
        with (
            setup.connect(cfg, server) as pool,  # the pool `make run` builds from the config
            weight_sync.WeightPusher(functools.partial(push, pool)) as pusher,
        ):
            progress = main.sync_weights(pool, state, progress, weights_dir)
            step = PacedStep([server])
            step.pusher = pusher
            parts = _loop_parts(cfg, pool, pusher, writer, step, ckpt=ckpt)
            state, progress = main.train_loop(cfg, parts, state, progress)
        path = writer.jsonl_path
    lags = [r["lag_max"] for r in metrics.read_jsonl(path)]
    assert len(lags) == 5 and progress.version == 6
    assert progress.stale_dropped == 0  # admission never ran past max_staleness
    if mode == "async":
        # The server starts (max_staleness + 1) batches of the first weights: from the second
        # step on, the trainer trains a batch one version old.
        assert max(lags) == 1 and lags[0] == 0, lags
    else:
        assert lags == [0] * 5


class FakePool:
    """Serves groups whose tokens carry the version last pushed. When ``gate`` is given a push
    first waits for it to be set; with ``gate_each_push`` it clears it again, so the next push
    waits for the next set."""

    def __init__(self, gate: threading.Event | None = None, *, gate_each_push: bool = False):
        self.gate = gate
        self.gate_each_push = gate_each_push
        self.version = 1
        self.events: list[tuple[str, int]] = []
        self.next_id = 0
        self.acked: list[int] = []

    def pull(
        self, max_groups: int, timeout_s: float, *, limits=None, trainer_version=0
    ) -> list[Group]:
        self.events.append(("pull", self.version))
        groups = []
        for _ in range(max_groups):
            trajectories = tuple(
                Trajectory(
                    prompt_ids=np.array([1, 5, 6], np.int32),
                    completion_ids=np.array([7, 2], np.int32),
                    behavior_logprobs=np.array([-1.0, -0.5], np.float32),
                    versions=np.full(2, self.version, np.int64),
                    reward=float(i),
                )
                for i in range(2)
            )
            groups.append(
                Group(
                    group_id=self.next_id, prompt_id=f"p{self.next_id}", trajectories=trajectories
                )
            )
            self.next_id += 1
        return groups

    def ack(self, groups, *, rejected: bool = False) -> None:
        self.acked.extend(g.group_id for g in groups)

    def flush_acks(self) -> None:
        pass

    def metrics(self) -> dict[str, float]:
        return {"servers_up": 1}

    def update_weights(
        self,
        version: int,
        path: str,
        *,
        new_admission_epoch: bool = False,
        base_path: str = "",
        wait_s: float = 0.0,
    ):
        if self.gate is not None:
            assert self.gate.wait(120), "the push was never released (by the step, or the wait)"
            if self.gate_each_push:
                self.gate.clear()
        self.version = version
        self.events.append(("push", version))


class AnnouncingPusher(weight_sync.WeightPusher):
    """A WeightPusher that sets ``waiting`` whenever the loop waits for its pushes."""

    def __init__(self, push, waiting: threading.Event):
        super().__init__(push)
        self.waiting = waiting

    def wait(self) -> None:
        self.waiting.set()
        super().wait()


def _step_opening(gate: threading.Event, at_call: int):
    """A no-op train step that sets ``gate`` on its ``at_call``-th call."""
    calls = []

    def step(state: TrainState, batch):
        calls.append(len(calls))
        if len(calls) == at_call:
            gate.set()
        return state.replace(step=state.step + 1), {"step_skipped": np.bool_(False)}

    return step


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_weight_pushes_run_beside_the_loop_and_sync_waits_for_them(mode, tmp_path):
    steps = 6
    cfg = load_config(
        CONFIG,
        [
            f"train.mode={mode}",
            f"rollout.max_staleness={0 if mode == 'sync' else 8}",
            "rollout.batch_groups=2",
            "rollout.group_size=2",
            "train.routing_replay=false",
            f"train.steps={steps}",
            "train.checkpoint.every=100",
        ],
    )
    # Async: the first push is held until the loop runs its last step, which it reaches only if
    # it never waits for a push. Sync: each push is held until the loop waits for it, so a loop
    # that did not wait would pull before the push landed.
    gate, waiting = threading.Event(), threading.Event()
    pool = FakePool(gate) if mode == "async" else FakePool(waiting, gate_each_push=True)
    state = TrainState(params={"w": jax.numpy.zeros(3)}, opt_state=(), step=np.int32(0))
    progress = checkpointing.Progress(version=1, min_version=1, rng_key=(0, 0))
    pushed = []

    def push(version, params):
        pushed.append(version)
        pool.update_weights(version, "unused")

    pusher = weight_sync.WeightPusher(push) if mode == "async" else AnnouncingPusher(push, waiting)
    with (
        pusher,
        metrics.MetricsWriter(str(tmp_path), total_steps=steps, console=None) as writer,
    ):
        parts = _loop_parts(cfg, pool, pusher, writer, _step_opening(gate, steps))
        cpu_before = cpu_clock.cpu_seconds()
        state, progress = main.train_loop(cfg, parts, state, progress)
        cpu_during = cpu_clock.cpu_seconds() - cpu_before
    records = metrics.read_jsonl(writer.jsonl_path)
    # Every step logs the process's CPU seconds of its window: they add up to at most what the
    # process spent over the loop.
    assert all(r["cpu_s"] >= 0 for r in records) and len(records) == steps
    assert sum(r["cpu_s"] for r in records) <= cpu_during + 1e-6
    assert progress.version == steps + 1 and pushed[-1] == steps + 1  # flushed on return
    assert pushed == sorted(set(pushed))
    assert all(0 < r["pad_frac"] < 1 for r in records)  # logged every step
    if mode == "sync":
        # Every push lands before the next pull: pulls alternate with pushes, all at lag 0, and
        # each step's record carries the push it waited for.
        assert pool.events == [
            e for v in range(1, steps + 1) for e in (("pull", v), ("push", v + 1))
        ]
        assert [r["lag_max"] for r in records] == [0] * steps
        assert [r["pushed_version"] for r in records] == [r["version"] for r in records]
    else:
        # Every pull ran while the first push was held: the loop never waited for a push. The
        # pushes queued behind it were superseded by the newest.
        assert [e for e in pool.events if e[0] == "pull"] == [("pull", 1)] * steps
        assert pushed[0] == 2 and len(pushed) < steps
        assert records[-1]["pushes_superseded"] == steps - len(pushed)
        assert [r["lag_max"] for r in records] == list(range(steps))


def test_a_skipped_step_still_advances_the_version_so_sync_mode_goes_on(tmp_path):
    # A non-finite or empty step consumes its batch; the server (max_staleness 0) only generates
    # the next one for the next version, so the trainer must publish one even without an update.
    steps = 3
    cfg = load_config(
        CONFIG,
        [
            "train.mode=sync",
            "rollout.max_staleness=0",
            "rollout.batch_groups=2",
            "rollout.group_size=2",
            "train.routing_replay=false",
            f"train.steps={steps}",
            "train.checkpoint.every=100",
        ],
    )
    waiting = threading.Event()
    pool = FakePool(waiting, gate_each_push=True)  # a push lands once the loop waits for it
    calls = []

    def step_fn(state, batch):  # the second call is skipped (as train_step does on a NaN)
        calls.append(len(calls))
        skipped = len(calls) == 2
        return state.replace(step=state.step + (0 if skipped else 1)), {
            "step_skipped": np.bool_(skipped)
        }

    state = TrainState(params={"w": jax.numpy.zeros(3)}, opt_state=(), step=np.int32(0))
    progress = checkpointing.Progress(version=1, min_version=1, rng_key=(0, 0))
    with (
        AnnouncingPusher(lambda v, p: pool.update_weights(v, "unused"), waiting) as pusher,
        metrics.MetricsWriter(str(tmp_path), total_steps=steps, console=None) as writer,
    ):
        parts = _loop_parts(cfg, pool, pusher, writer, step_fn)
        state, progress = main.train_loop(cfg, parts, state, progress)
    assert len(calls) == steps + 1 and progress.steps_skipped == 1
    assert progress.version == steps + 2  # one per consumed batch
    # Pulls alternate with pushes through the skipped step: every batch is at lag 0.
    assert pool.events == [e for v in range(1, steps + 2) for e in (("pull", v), ("push", v + 1))]
    assert [r["lag_max"] for r in metrics.read_jsonl(writer.jsonl_path)] == [0] * (steps + 1)
    assert pool.acked == list(range(pool.next_id))  # every pulled group, once, after its step
