"""Delivery and healing of the rollout loop without a server (docs/DESIGN.md §6.2, §10): leases
that expire or are given back, acknowledgements, failed state saves (ENOSPC), the state_dir lock,
and which trainer run may start an admission epoch."""

from __future__ import annotations

import dataclasses
import errno
import json
import types

import numpy as np
import pytest

from rollout_api import records
from rollout_api.proto import rollout_pb2
from rollout_server.driver import FinishedSample
from rollout_server.persistence import StateDirLockedError, StateStore
from rollout_server.trainer_link import RunNotAttachedError
from sat_jax.config import RolloutConfig
from tests.clock import FakeClock
from tests.rollout_server.test_rollout import FakeEngine, RecordingDriver, ShortPromptEngine, _loop


def _groups(loop, ids):
    for i in ids:
        loop.queue.put(rollout_pb2.Group(group_id=i, prompt_id=f"p{i}"))


def test_an_unacknowledged_lease_expires_back_to_the_front():
    clock = FakeClock()
    loop = _loop(StateStore(""), FakeEngine(), wait=False, lease_s=5.0, clock=clock)
    _groups(loop, range(4))
    assert [g.group_id for g in loop.pull(2, 0)] == [0, 1]
    clock.advance(4.5)
    loop.trainer.expire_leases()  # too early: still leased
    assert loop.stats()["groups_leased"] == 2 and len(loop.queue) == 2
    clock.advance(0.5)
    loop.trainer.expire_leases()
    assert loop.stats()["groups_leased"] == 0
    assert [g.group_id for g in loop.pull(4, 0)] == [0, 1, 2, 3]  # pulled again, in order
    assert loop.persisted.consumed == 0


def test_a_lease_that_ends_unacknowledged_counts_for_admission_again():
    """A group leased to an earlier batch than the trainer's version holds no place in the
    budget (`ServerAdmission.in_earlier_batch`); once its lease expires or its reply is never
    sent it is queued again, will be handed out to a later batch, and counts again."""
    clock = FakeClock()
    loop = _loop(StateStore(""), FakeEngine(), wait=False, lease_s=5.0, clock=clock)
    _groups(loop, range(4))
    pulled = loop.pull(3, 0, trainer_version=1)  # the batch of version 1
    loop.pull(1, 0, trainer_version=2)  # the trainer pulls for version 2 while 1 trains
    adm = loop.admission
    assert [adm.in_earlier_batch(i) for i in range(4)] == [True, True, True, False]
    loop.release(pulled[2:])
    assert not adm.in_earlier_batch(2)
    clock.advance(5.0)
    loop.trainer.expire_leases()
    assert not any(adm.in_earlier_batch(i) for i in range(4))


def test_groups_handed_back_are_leased_again_for_the_batch_the_next_pull_names():
    """A trainer that pulled more than its batch (or got a reply after its batch was made)
    hands groups back unleased, on a Pull or an Ack: they are queued again at the front and the
    next Pull leases them for the batch it names, where admission counts them; none is
    consumed, and an id not leased is ignored."""
    loop = _loop(StateStore(""), FakeEngine(), wait=False, lease_s=600)
    _groups(loop, range(4))
    pulled = loop.pull(4, 0, trainer_version=1)
    adm = loop.admission
    again = loop.pull(2, 0, give_back=[2, 3, 9], trainer_version=2)
    assert [g.group_id for g in again] == [2, 3] and loop.stats()["groups_leased"] == 4
    assert [adm.in_earlier_batch(i) for i in range(4)] == [True, True, False, False]
    assert loop.ack([], give_back=[g.group_id for g in pulled[:2]]) == 0
    assert len(loop.queue) == 2 and loop.stats()["groups_leased"] == 2
    assert loop.persisted.consumed == 0


def test_ack_removes_groups_whether_leased_or_queued_again():
    loop = _loop(StateStore(""), FakeEngine(), wait=False, lease_s=600)
    _groups(loop, range(3))
    pulled = loop.pull(3, 0)
    loop.release(pulled[1:])  # their reply was never sent: back in the queue
    assert len(loop.queue) == 2 and loop.stats()["groups_leased"] == 1
    assert loop.ack([0, 1, 2]) == 3  # a late ack of a re-queued group still counts once
    assert loop.ack([0, 1, 2]) == 0
    assert len(loop.queue) == 0 and loop.persisted.consumed == 3


def test_rejected_groups_leave_the_admission_count_so_they_are_replaced(tmp_path):
    # Sync-mode shape: the batch of v1 is all dispatched, so admission is closed.
    B = 4
    cfg = RolloutConfig(batch_groups=B, max_staleness=0)
    loop = _loop(StateStore(str(tmp_path)), FakeEngine(), wait=True, cfg=cfg)
    loop.install_weights(1, "/ckpt/v1", params=None)
    _groups(loop, range(B))
    assert len(loop.pull(B, 0, trainer_version=1)) == B and not loop.stats()["admission_open"]
    # Rejected (filtered, invalid) while the trainer still fills its batch of v1, with the next
    # Pull (one of them twice: counted once) or through Ack: replaced at once.
    assert loop.pull(1, 0, reject=[1, 2, 2], trainer_version=1) == []
    assert loop.ack([], reject=[3, 1]) == 1
    stats = loop.stats()
    assert stats["groups_rejected"] == 3 and stats["admission_open"]
    assert loop.admission_budget() == 3  # one replacement per rejected group
    # Trained: the trainer is past v1 (it pulled group 0 at v1), so a group of v1 weights would
    # be stale; its place waits for v2's.
    assert loop.ack([0]) == 1
    assert loop.stats()["groups_consumed"] == B and loop.admission_budget() <= 0
    loop.install_weights(2, "/ckpt/v2", params=None)
    assert loop.admission_budget() == B
    saved = json.loads((tmp_path / "rollout_state.json").read_text())
    assert saved["consumed"] == B


class FullDisk(StateStore):
    """A state store whose disk is full (ENOSPC) while `full` is set."""

    full = True

    def save(self, state):
        if self.full:
            raise OSError(errno.ENOSPC, "No space left on device")
        super().save(state)


class LongPromptEngine(ShortPromptEngine):
    core = types.SimpleNamespace(max_prefill_length=64)


def _sample() -> FinishedSample:
    return FinishedSample(
        prompt_ids=np.array([1, 5, 6], np.int32),
        completion_ids=np.array([7, 2], np.int32),
        logprobs=np.zeros(2, np.float32),
        versions=np.ones(2, np.int64),
        routing=np.zeros((5, 1, 2), np.uint8),
        finish_reason="stop",
    )


def test_a_full_disk_loses_and_strands_no_group(tmp_path):
    store = FullDisk(str(tmp_path))
    cfg = RolloutConfig(batch_groups=1, max_staleness=0, group_size=2)
    driver = RecordingDriver()
    loop = _loop(store, LongPromptEngine(), wait=False, cfg=cfg, driver=driver)
    loop._dispatch_next()  # its save fails: the group still runs
    assert loop.stats()["groups_running"] == 1 and len(driver.requests) == 2
    for request in driver.requests:
        request.on_done(request, _sample())
    loop._collect(timeout_s=1.0)
    assert loop.stats()["groups_running"] == 0 and len(loop.queue) == 1
    [group] = loop.pull(1, 0)
    assert loop.ack([group.group_id]) == 1  # its save fails too: counted in memory
    assert loop.persisted.consumed == 1 and not (tmp_path / "rollout_state.json").exists()
    store.full = False
    loop._core.retry_failed_save()  # the loop's next turn
    saved = json.loads((tmp_path / "rollout_state.json").read_text())
    assert saved["consumed"] == 1 and saved["unfinished"] == []
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []


def test_a_finished_group_is_queued_as_the_proto_of_its_records():
    """The engine's arrays reach the queue through one conversion (``records.to_proto``) and
    come back out of it unchanged."""
    cfg = RolloutConfig(batch_groups=1, max_staleness=0, group_size=2)
    driver = RecordingDriver()
    loop = _loop(StateStore(""), LongPromptEngine(), wait=False, cfg=cfg, driver=driver)
    loop._dispatch_next()
    for request in driver.requests:
        request.on_done(request, _sample())
    loop._collect(timeout_s=1.0)
    [message] = loop.pull(1, 0)
    assert isinstance(message, rollout_pb2.Group)
    group = records.decode_group(message)
    assert group.key == f"{loop.persisted.server_id}/0" and len(group.trajectories) == 2
    want = _sample()
    for t in group.trajectories:
        np.testing.assert_array_equal(t.prompt_ids, want.prompt_ids)
        np.testing.assert_array_equal(t.completion_ids, want.completion_ids)
        np.testing.assert_array_equal(t.behavior_logprobs, want.logprobs)
        np.testing.assert_array_equal(t.versions, want.versions)
        np.testing.assert_array_equal(t.routing, want.routing)
        assert t.finish_reason == "stop" and t.completion_text == "4"  # id 7 of the tokenizer


def test_samples_that_make_no_valid_group_drop_it_and_count_it_failed():
    cfg = RolloutConfig(batch_groups=1, max_staleness=0, group_size=2)
    driver = RecordingDriver()
    loop = _loop(StateStore(""), LongPromptEngine(), wait=False, cfg=cfg, driver=driver)
    loop._dispatch_next()
    bad = dataclasses.replace(_sample(), routing=np.zeros((4, 1, 2), np.uint8))  # 3 + 2 rows due
    for request in driver.requests:
        request.on_done(request, bad)
    loop._collect(timeout_s=1.0)  # logged, not raised: the loop goes on
    stats = loop.stats()
    assert (stats["groups_running"], stats["groups_queued"], loop.groups_failed) == (0, 0, 1)
    assert loop.persisted.unfinished == []  # not re-issued after a restart either


def test_a_second_store_on_a_directory_is_refused(tmp_path):
    first = StateStore(str(tmp_path))
    with pytest.raises(StateDirLockedError, match="in use by another server"):
        StateStore(str(tmp_path))
    first.close()
    StateStore(str(tmp_path)).close()


def test_only_the_attached_run_starts_an_admission_epoch():
    engine = FakeEngine()
    clock = FakeClock()
    loop = _loop(StateStore(""), engine, wait=True, lease_s=5.0, clock=clock)
    loop.install_weights(1, "/ckpt/v1", None, new_epoch=True, run_id="run-a")
    loop.install_weights(2, "/ckpt/v2", None, new_epoch=True, run_id="run-a")  # its restart
    before = (
        loop.persisted.epoch_version,
        list(loop.persisted.admission["excluded"]),
        engine.swaps,
    )
    with pytest.raises(RunNotAttachedError, match="run-a"):
        loop.install_weights(3, "/ckpt/v3", None, new_epoch=True, run_id="intruder")
    with pytest.raises(RunNotAttachedError):
        loop.check_attached(True, "")
    assert (
        loop.persisted.epoch_version,
        loop.persisted.admission["excluded"],
        engine.swaps,
    ) == before
    loop.install_weights(3, "/ckpt/v3", None, run_id="other")  # no new epoch: a plain update
    clock.advance(4.5)  # run-a silent for less than the lease time: still attached
    with pytest.raises(RunNotAttachedError):
        loop.check_attached(True, "run-b")
    clock.advance(0.5)  # silent for the lease time: another run may attach
    loop.install_weights(4, "/ckpt/v4", None, new_epoch=True, run_id="run-b")
    assert (loop.persisted.run_id, loop.persisted.epoch_version) == ("run-b", 4)
