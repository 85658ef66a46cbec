"""The elastic fleet and the fleet's staleness budget, live (docs/DESIGN.md §6.3, §6.5): the
trainer's loop in this process with a stand-in train step that waits until the servers have
caught up (generation faster than training, by an event rather than a sleep, so admission is what
bounds staleness) against rollout server processes.

- After a SIGKILL of the server and a resume of the trainer from an earlier checkpoint, stale drops
  per step return to the rate before the kill within a few steps.
- Two servers: one SIGKILLed while the trainer's Pull to it is in flight, and later while its
  weight push is in flight, leaves each time and the run goes on; restarted (same state_dir and
  port), it rejoins at the current weights version, its new groups are trained, and no group is
  trained twice.
- A server listed in train.client.servers_file mid-run joins; with every server killed the run stops
  after train.client.wait_s with a clear error.
- A server that gets SIGTERM mid-run (a preemption notice) drains: the trainer pulls what it has
  left and counts it as gone; it exits with status 0, nothing it made lost or trained twice.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import pathlib
import signal
import threading
import time

import grpc
import numpy as np
import pytest

from rollout_api.client import connect
from sat_jax.experiment import load_config
from sat_jax.step import TrainState
from tests.clock import wait_until
from tests.train.conftest import JAX_CACHE
from tests.train.test_main import CONFIG, PacedStep, _loop_parts, _push_to, _random_params
from train import checkpointing, main, metrics, setup, weight_sync
from train.local_server import LocalServer
from train.membership import ServersDownError
from train.remote import ServerPool

pytestmark = pytest.mark.slow

B = 2  # groups per batch


@pytest.fixture(autouse=True)
def _jax_env(monkeypatch):
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(JAX_CACHE))
    monkeypatch.setenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")


def _overrides(tmp_path: pathlib.Path, *extra: str) -> list[str]:
    return [
        "rollout.max_staleness=1",
        f"rollout.batch_groups={B}",
        "rollout.group_size=2",
        "rollout.max_new_tokens=6",
        "server.slots=4",
        "server.lease_s=600",
        f"server.checkpoint_root={tmp_path}",
        "train.checkpoint.every=1000",
        "train.eval.problems=0",
        f"train.run_dir={tmp_path / 'run'}",
        *extra,
    ]


def _server(tmp_path: pathlib.Path, name: str, overrides: list[str]) -> LocalServer:
    state = f"server.state_dir={tmp_path / f'state-{name}'}"
    return LocalServer(CONFIG, [*overrides, state], str(tmp_path / f"server-{name}.log"))


class _SkippingClock:
    """The monotonic clock plus every wait a ``ServerPool`` was asked to make once ``skip`` is
    set, which then returns at once: from then on its grace, backoff and
    ``train.client.wait_s`` pass on this clock without the test waiting for them. (Before, its
    waits are real: a pool waiting for its first server to join must not spin its clock on.)"""

    def __init__(self):
        self.skipped = 0.0
        self.skip = False

    def __call__(self) -> float:
        return time.monotonic() + self.skipped

    def sleep(self, seconds: float) -> None:
        if self.skip:
            self.skipped += seconds
        else:
            time.sleep(seconds)


def _train(cfg, pool, state, progress, writer, step_fn: PacedStep):
    """``sync_weights`` then ``train_loop`` to ``cfg.train.steps`` over ``pool``, paced by
    ``step_fn`` (which waits for this run's pushes)."""
    _, _, weights_dir = setup.run_paths(cfg)
    push = functools.partial(_push_to, pool, weights_dir=weights_dir)
    with weight_sync.WeightPusher(push) as pusher:
        step_fn.pusher = pusher
        progress = main.sync_weights(pool, state, progress, weights_dir)
        parts = _loop_parts(cfg, pool, pusher, writer, step_fn)
        return main.train_loop(cfg, parts, state, progress)


def _start(cfg) -> tuple[TrainState, checkpointing.Progress]:
    state = TrainState(params=_random_params(cfg), opt_state=(), step=np.int32(0))
    return state, checkpointing.Progress(version=1, min_version=1, rng_key=(0, 0))


def _server_id(tmp_path: pathlib.Path, name: str) -> str:
    return json.loads((tmp_path / f"state-{name}" / "rollout_state.json").read_text())["server_id"]


def _trained_from(server_id: str, progress: checkpointing.Progress, *, after: int) -> bool:
    """Whether a group of ``server_id`` is among the trained groups past the first ``after``."""
    return any(k.startswith(f"{server_id}/") for k in progress.recent_group_keys[after:])


def test_stale_drops_return_to_the_pre_kill_rate_after_a_resume(tmp_path):
    """Before the fix every resume left the server (max_staleness + 1) batches further ahead for
    good (the groups it had made for the lost weights, rejected, each bought a replacement): a
    steady stream of stale drops to the end of the run (2.8 per step of 16 groups in `make run`)."""
    overrides = _overrides(tmp_path, "train.client.wait_s=240")
    before_steps, after_steps, settle = 6, 12, 3
    server = _server(tmp_path, "a", overrides)
    with server, metrics.MetricsWriter(str(tmp_path / "logs"), total_steps=99, console=None) as w:
        server.wait_ready(timeout_s=240)
        cfg = load_config(CONFIG, [*overrides, f"train.steps={before_steps}"])
        state, progress = _start(cfg)
        with setup.connect(cfg, server) as pool:
            state, before = _train(cfg, pool, state, progress, w, PacedStep([server], {}))
        # SIGKILL the server with groups queued for versions ahead, then resume the trainer from
        # a checkpoint of step 2 (version 3): the restarted server is past it, so the trainer
        # jumps ahead and drops everything made before.
        server.proc.kill()
        server.proc.wait()
        server.restart_if_exited()
        server.wait_ready(timeout_s=240)
        resumed = checkpointing.Progress(version=3, min_version=1, rng_key=(0, 0))
        state = state.replace(step=np.int32(2))
        cfg = load_config(CONFIG, [*overrides, f"train.steps={2 + after_steps}"])
        with setup.connect(cfg, server) as pool:
            _, after = _train(cfg, pool, state, resumed, w, PacedStep([server], {}))
        path = w.jsonl_path
    records = metrics.read_jsonl(path)
    assert len(records) == before_steps + after_steps
    drops = [r["stale_dropped"] for r in records]  # cumulative over each run
    per_step_before = before.stale_dropped / before_steps
    late = drops[-1] - drops[before_steps + settle - 1]  # after the first `settle` resumed steps
    assert after.version > before.version
    assert per_step_before == 0, drops
    assert late / (after_steps - settle) <= per_step_before, drops


def test_a_listed_server_joins_and_all_down_stops_after_server_wait(tmp_path):
    listing = tmp_path / "servers.txt"
    overrides = _overrides(
        tmp_path,
        "train.client.wait_s=20",
        "train.client.grace_s=1",
        f"train.client.servers_file={listing}",
    )
    a, c = _server(tmp_path, "a", overrides), _server(tmp_path, "c", overrides)
    pool_ref, seen = [], {}
    clock = _SkippingClock()  # the pool's: its 20 s of silence pass without the test waiting

    def add_c():
        listing.write_text(f"{a.address}\n{c.address}\n")

    def wait_for_c():
        pool = pool_ref[0]
        wait_until(lambda: pool.metrics()["servers_up"] == 2, timeout_s=300, interval_s=0.2)
        seen["up"] = 2

    def kill_all():
        seen["pulled_c"] = pool_ref[0].metrics()["pulled_1"]
        # Before the kills: a push's sender may see the first of them fail at once.
        seen["killed"] = clock()
        for s in (a, c):
            s.proc.kill()
            s.proc.wait()
        clock.skip = True

    hooks = {2: add_c, 4: wait_for_c, 7: kill_all}
    with a, c, metrics.MetricsWriter(str(tmp_path / "logs"), total_steps=99, console=None) as w:
        listing.write_text(f"{a.address}\n")
        a.wait_ready(timeout_s=240)
        c.wait_ready(timeout_s=240)
        cfg = load_config(CONFIG, [*overrides, "train.steps=99"])
        assert cfg.train.client.servers == ()
        state, progress = _start(cfg)
        args = vars(setup.connection(cfg))  # ServerPool's keyword arguments
        with ServerPool((), background=True, clock=clock, sleep=clock.sleep, **args) as pool:
            pool_ref.append(pool)
            with pytest.raises(ServersDownError, match=r"no rollout server answered for 20s"):
                _train(cfg, pool, state, progress, w, PacedStep([a, c], hooks))
            # It gave up only once 20 s had passed, on its own clock, since the kill.
            assert clock() - seen["killed"] >= 20
    assert seen["up"] == 2 and seen["pulled_c"] > 0  # c joined and was pulled from


class _KillDuringCall:
    """A Rollout stub that SIGKILLs its server while an armed call to it is in flight.

    ``arm(method, delay_s, stop_first)``: the next call of ``method`` still waiting ``delay_s``
    after it started is the one: the server is stopped (SIGSTOP, so it can no longer answer) and
    killed if that call has not returned by then; a call that returned first leaves the stub armed
    for the next one. ``stop_first``: stop the server as the call starts, so that call waits
    (a Pull that waits for groups) whatever the server had ready. ``landed`` is set once a killed
    call has raised in the caller, and ``errors`` says how each one ended."""

    def __init__(self, stub, server: LocalServer):
        self._stub, self._server = stub, server
        self._armed: str | None = None
        self._delay_s, self._stop_first = 0.0, False
        self.landed = threading.Event()
        self.errors: list[str] = []

    def arm(self, method: str, delay_s: float, *, stop_first: bool = False) -> None:
        self.landed.clear()
        self._armed, self._delay_s, self._stop_first = method, delay_s, stop_first

    def __getattr__(self, name: str):
        real = getattr(self._stub, name)
        if name != self._armed:
            return real

        def call(*args, **kwargs):
            done, killed = threading.Event(), threading.Event()
            proc = self._server.proc
            if self._stop_first:
                os.kill(proc.pid, signal.SIGSTOP)

            def kill_if_in_flight():
                if done.wait(self._delay_s):
                    return
                os.kill(proc.pid, signal.SIGSTOP)
                if done.is_set():  # it answered just before: try the next call
                    os.kill(proc.pid, signal.SIGCONT)
                    return
                self._armed = None
                killed.set()
                proc.kill()
                proc.wait()

            killer = threading.Thread(target=kill_if_in_flight, daemon=True)
            killer.start()
            try:
                return real(*args, **kwargs)
            except grpc.RpcError as e:
                if killed.is_set():
                    self.errors.append(f"{name}: {e.code().name}")
                    self.landed.set()
                raise
            finally:
                done.set()
                killer.join()

        return call


def test_a_server_killed_during_a_pull_and_during_a_push_rejoins_and_loses_nothing(tmp_path):
    """Issue 21's "kill one during a push and during a long Pull": the kill lands while the
    trainer waits on that server (its Pull, then its UpdateWeights), on a stopped server, so it
    is mid-call by construction. Each time the run goes on with the other server, and the killed
    one, restarted on its port and state_dir, rejoins at the trainer's current weights."""
    # grace_s=0: the killed call itself makes b leave, whatever the pace of the steps (a grace
    # would need the steps to take longer than it while b is down).
    overrides = _overrides(tmp_path, "train.client.wait_s=240", "train.client.grace_s=0")
    a, b = _server(tmp_path, "a", overrides), _server(tmp_path, "b", overrides)
    steps = 22
    killer: list[_KillDuringCall] = []
    pool_ref: list[ServerPool] = []
    seen: dict[str, object] = {}

    def connect_through_killer(address, max_message_bytes, *, root_certificates=None):
        channel, stub = connect(address, max_message_bytes, root_certificates=root_certificates)
        if address == b.address:
            killer.append(_KillDuringCall(stub, b))
            stub = killer[0]
        return channel, stub

    def arm(method, delay_s, stop_first=False):
        return lambda: killer[0].arm(method, delay_s, stop_first=stop_first)

    def restart_b_once_killed():
        if killer[0].landed.is_set() and b.proc.poll() is not None:
            b.restart_if_exited()  # same port, same state_dir

    def wait_for_b(name, method):
        def hook():
            assert killer[0].landed.is_set(), f"no {method} to b was in flight to kill"
            restart_b_once_killed()
            pool = pool_ref[0]
            wait_until(lambda: pool.metrics()["servers_up"] == 2, timeout_s=300, interval_s=0.2)
            seen[name] = pool.metrics()["pulled_1"]

        return hook

    # Pulls run between steps and pushes on the pusher's thread (one per step), so a hook arms a
    # kill, the next steps' hooks restart b once it landed, and a later one waits for b to rejoin.
    # Each call: b stopped as it starts and killed 0.3 s into it, so the call is in flight when the
    # kill lands whatever the machine's pace (a push now installs in about 10 ms here: a kill timed
    # to land inside the server's load would miss it on a fast machine and fire on a slow one).
    hooks = {k: restart_b_once_killed for k in range(7, steps)}
    hooks.update({
        3: arm("Pull", 0.3, stop_first=True),
        9: wait_for_b("rejoined_1", "Pull"),
        10: arm("UpdateWeights", 0.3, stop_first=True),
        16: wait_for_b("rejoined_2", "UpdateWeights"),
    })  # fmt: skip
    with a, b, metrics.MetricsWriter(str(tmp_path / "logs"), total_steps=steps, console=None) as w:
        a.wait_ready(timeout_s=240)
        b.wait_ready(timeout_s=240)
        cfg = load_config(
            CONFIG,
            [*overrides, f"train.client.servers=[{a.address},{b.address}]", f"train.steps={steps}"],
        )
        args = vars(setup.connection(cfg))  # ServerPool's keyword arguments
        with ServerPool(
            cfg.train.client.servers, background=True, connect=connect_through_killer, **args
        ) as pool:
            pool_ref.append(pool)
            state, progress = _start(cfg)
            step = PacedStep([a, b], hooks)
            state, progress = _train(cfg, pool, state, progress, w, step)
            final = pool.metrics()
            # b's first groups after a restart come from the weights it restarted with and go
            # stale; on a loaded machine its fresh ones may miss the last steps too, so the run
            # goes on a few steps at a time (at most 24) until one of b's is trained.
            b_id, extra = _server_id(tmp_path, "b"), 0
            while extra < 24 and not _trained_from(b_id, progress, after=16 * B):
                extra += 4
                more = load_config(CONFIG, [*overrides, f"train.client.servers=[{a.address},{b.address}]",
                                            f"train.steps={steps + extra}"])  # fmt: skip
                step = PacedStep([a, b], {})
                state, progress = _train(more, pool, state, progress, w, step)
        path = w.jsonl_path
    records = metrics.read_jsonl(path)
    assert [r["step"] for r in records] == list(range(1, steps + extra + 1))  # the run finished
    assert killer[0].errors == ["Pull: UNAVAILABLE", "UpdateWeights: UNAVAILABLE"], killer[0].errors
    up = [r["servers_up"] for r in records]
    assert 1 in up[3:9] and 1 in up[10:16] and up[-1] == 2, up  # left after each kill, back
    # b came back at the trainer's current weights, and served groups that were trained.
    log_b = (tmp_path / "server-b.log").read_text()
    swaps = [int(line.split("-> ")[1].split()[0]) for line in log_b.splitlines()
             if "weights swapped" in line]  # fmt: skip
    assert swaps[-1] == progress.version, (swaps, progress.version)
    assert final["pulled_1"] > seen["rejoined_2"] >= seen["rejoined_1"]
    assert _trained_from(b_id, progress, after=16 * B), progress.recent_group_keys
    # Exactly once: every step trained B groups, none of them twice.
    keys = progress.recent_group_keys
    assert len(keys) == (steps + extra) * B and len(set(keys)) == len(keys), keys
    # At most what b held at each kill, through the end of the run: a replacement for a stale
    # group waits for weights that can still make the bound (docs/DESIGN.md §6.3), so no cycle
    # of stale replacements follows a rejoin.
    assert records[-1]["stale_dropped"] <= 4 * B
    # No trained token older than max_staleness (1).
    assert max(r["lag_max"] for r in records) <= 1, [r["lag_max"] for r in records]


def test_a_server_sigtermed_mid_run_drains_exits_0_and_the_run_loses_nothing(tmp_path, caplog):
    """A preemption notice (docs/DESIGN.md §6.5): b gets SIGTERM mid-run. It admits nothing more,
    the trainer pulls what it has left, gives it no more weights, and counts it as gone once a
    Pull finds nothing left (one log line; a grace of 600 s shows no failure made it leave); b,
    drained, exits with status 0 (its drain time, 600 s, is not what ends it), every group it made
    acknowledged. Restarted, it rejoins, and the run finishes with every group trained once."""
    overrides = _overrides(
        tmp_path, "train.client.wait_s=240", "train.client.grace_s=600", "server.drain_s=600"
    )
    a, b = _server(tmp_path, "a", overrides), _server(tmp_path, "b", overrides)
    steps, seen = 24, {}
    pool_ref: list[ServerPool] = []

    def sigterm_b():
        b.proc.send_signal(signal.SIGTERM)

    def restart_b_once_drained():
        # Between the SIGTERM and here b was pulled from at every other step at least: far more
        # than the at most (max_staleness + 1) batches it held. Told it has nothing left, it
        # exits whatever the trainer does, so this wait is only a safety limit.
        seen["returncode"] = b.proc.wait(timeout=300)
        seen["state"] = json.loads((tmp_path / "state-b" / "rollout_state.json").read_text())
        b.restart_if_exited()  # same port, same state_dir
        pool = pool_ref[0]
        wait_until(lambda: pool.metrics()["servers_up"] == 2, timeout_s=300, interval_s=0.2)

    hooks = {4: sigterm_b, 16: restart_b_once_drained}
    with (
        a,
        b,
        metrics.MetricsWriter(str(tmp_path / "logs"), total_steps=steps, console=None) as w,
        caplog.at_level(logging.INFO, logger="train"),
    ):
        a.wait_ready(timeout_s=240)
        b.wait_ready(timeout_s=240)
        servers = f"train.client.servers=[{a.address},{b.address}]"
        cfg = load_config(CONFIG, [*overrides, servers, f"train.steps={steps}"])
        with setup.connect(cfg, None) as pool:
            pool_ref.append(pool)
            state, progress = _start(cfg)
            state, progress = _train(cfg, pool, state, progress, w, PacedStep([a, b], hooks))
        path = w.jsonl_path
    records = metrics.read_jsonl(path)
    assert [r["step"] for r in records] == list(range(1, steps + 1))  # the run finished
    assert seen["returncode"] == 0
    log_b = (tmp_path / "server-b.log").read_text()
    assert "SIGTERM: draining" in log_b and "drained: every group made was acknowledged" in log_b
    # Nothing b made was lost: every group it dispatched was acknowledged (trained or rejected).
    state_b = seen["state"]
    assert state_b["unfinished"] == [] and state_b["consumed"] == state_b["next_group_id"]
    # The trainer counted b as gone after the SIGTERM and before its restart, and back at the end.
    up = [r["servers_up"] for r in records]
    assert 1 in up[4:15] and up[-1] == 2, up
    lines = [r.getMessage() for r in caplog.records if b.address in r.getMessage()]
    assert len(lines) == 2 and "is draining" in lines[0] and "joined" in lines[1], lines
    # Exactly once: every step trained B groups, none of them twice.
    keys = progress.recent_group_keys
    assert len(keys) == steps * B and len(set(keys)) == len(keys), keys
    # No trained token older than max_staleness (1).
    assert max(r["lag_max"] for r in records) <= 1, [r["lag_max"] for r in records]
    # Waste (docs/DESIGN.md §6.3): at most 2% of the groups trained go stale in steady state,
    # after the first 3 steps (the servers' compilations) and before b's rejoin (during step 16),
    # and again once the rejoin's share change has passed (S + 1 = 2 versions, and a step for
    # the batch in flight); in between, only the groups a made under its share of 1 that its
    # share of 1/2 no longer takes in time, at most (S + 1) * (1 - 1/2) * B.
    dropped = [r["stale_dropped"] for r in records]
    assert dropped[15] - dropped[2] <= 0.02 * 13 * B, dropped
    assert dropped[18] - dropped[15] <= 2 * (1 - 1 / 2) * B, dropped
    assert dropped[-1] - dropped[18] <= 0.02 * (steps - 19) * B, dropped
