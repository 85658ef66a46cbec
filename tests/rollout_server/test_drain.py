"""The preemption notice (docs/DESIGN.md §6.5) without a server process: `RolloutLoop.drain`
closes admission for good, a Pull hands out what is left and stops waiting once nothing runs, and
the loop is drained once every group made is acknowledged; `process.drain` ends at that moment,
at `server.drain_s`, or when something else stops the server first."""

from __future__ import annotations

import asyncio

import grain
import pytest

from rollout_api.proto import rollout_pb2
from rollout_server import process
from rollout_server.persistence import StateStore
from rollout_server.service import RolloutService
from sat_jax.config import RolloutConfig
from sat_jax.experiment import ConfigError, load_config
from sat_jax.tasks import Prompt
from tests.rollout_server.test_rollout import (
    B,
    FakeEngine,
    RecordingDriver,
    ShortPromptEngine,
    _loop,
)


def _prompts(n: int) -> grain.IterDataset:
    items = [Prompt(id=f"p{i}", text="1=", answer="1") for i in range(n)]
    return grain.MapDataset.source(items).to_iter_dataset()


def test_a_drained_loop_admits_nothing_hands_out_what_is_left_and_persists_the_rest(tmp_path):
    store = StateStore(str(tmp_path))
    driver = RecordingDriver()
    loop = _loop(store, ShortPromptEngine(), wait=True, driver=driver, prompts=_prompts(8))
    loop.install_weights(1, "/ckpt/v1", params=None)
    loop._dispatch_next()  # group 0 runs
    loop.queue.put(rollout_pb2.Group(group_id=7))  # a finished group waits to be pulled
    assert loop.stats()["admission_open"] and not loop.draining
    loop.drain()
    assert loop.draining and not loop.stats()["admission_open"]
    assert not loop._may_dispatch()  # the flag is what the loop's dispatch decision reads
    # The finished group is still handed out, and the running one keeps the drain open.
    [group] = loop.pull(4, timeout_s=0.0)
    assert group.group_id == 7 and not loop.drained()
    # Nothing queued but a group still running: a Pull waits for it (here up to its timeout).
    assert loop.pull(4, timeout_s=0.1) == [] and not loop.drained()
    # The running group is handed back: it stays in the saved state for a restart to re-issue.
    assert [r["group_id"] for r in store.load().unfinished] == [0]
    loop._core.generation.running.clear()  # as if generation of group 0 failed for good
    # Nothing runs: a Pull returns at once however long it may wait (a wait would hang here).
    assert loop.pull(4, timeout_s=600.0) == []
    assert not loop.drained()  # group 7 is leased, not acknowledged yet
    assert loop.ack([7]) == 1 and loop.drained()


def test_the_drain_ends_when_drained_at_its_time_or_when_stopped_otherwise():
    class Loop:
        """What `process.drain` calls, drained once `drained_after` checks have passed."""

        def __init__(self, drained_after: int | None):
            self.drained_after, self.checks, self.drains = drained_after, 0, 0

        def drain(self):
            self.drains += 1

        def drained(self):
            self.checks += 1
            return self.drained_after is not None and self.checks > self.drained_after

    async def run(rollout, drain_s, preset=False, told=lambda: True):
        done = asyncio.Event()
        if preset:
            done.set()
        await asyncio.wait_for(process.drain(rollout, drain_s, done, told), 60)
        return done.is_set()

    drained = Loop(drained_after=3)
    assert asyncio.run(run(drained, drain_s=3600)) and drained.drains == 1
    assert drained.checks == 4  # it stopped at the first check that found it drained
    # Drained at once, but it stays until its trainer was told so (a Pull found nothing left).
    asks = []
    untold = Loop(drained_after=0)
    assert asyncio.run(run(untold, drain_s=3600, told=lambda: asks.append(1) or len(asks) > 2))
    assert untold.checks == 3
    never = Loop(drained_after=None)
    assert asyncio.run(run(never, drain_s=0.0)) and never.checks == 1  # time over at once
    stopped = Loop(drained_after=None)
    assert asyncio.run(run(stopped, drain_s=3600, preset=True)) and stopped.checks == 0


def test_a_draining_loop_stays_closed_whatever_the_budget(tmp_path):
    cfg = RolloutConfig(batch_groups=B, max_staleness=4)
    loop = _loop(StateStore(str(tmp_path)), FakeEngine(), wait=False, cfg=cfg)
    loop.drain()
    for version in (1, 2, 3):
        loop.install_weights(version, f"/ckpt/v{version}", params=None, new_epoch=True)
        assert not loop.stats()["admission_open"]


@pytest.mark.parametrize("value", ["-1", "nan", "3601"])
def test_a_bad_drain_time_is_refused_naming_the_key(value):
    with pytest.raises(ConfigError, match=r"server\.drain_s|drain_s must be in \[0, 3600\]"):
        load_config(None, [f"server.drain_s={value}"])
    assert load_config(None, ["server.drain_s=0"]).server.drain_s == 0


def test_a_pull_reply_carries_the_measured_capacity():
    """The capacity the loop measures rides on every Pull reply (docs/DESIGN.md §6.3): the
    trainer's shares follow it."""

    class Loop:
        draining = False
        capacity_tokens_per_s = 123.5

        def pull(self, max_groups, timeout_s, **kw):
            return [rollout_pb2.Group(group_id=7)]

    class Context:
        def cancelled(self):
            return False

        def done(self):
            return False

    service = RolloutService(
        loop=Loop(), engine=None, driver=None, checkpoint_root="", token="",
        max_version_jump=1, pull_threads=1,
    )  # fmt: skip
    try:
        request = rollout_pb2.PullRequest(max_groups=1, timeout_s=0)
        reply = asyncio.run(service.Pull(request, Context()))
    finally:
        service.close()
    assert reply.capacity_tokens_per_s == 123.5 and [g.group_id for g in reply.groups] == [7]
