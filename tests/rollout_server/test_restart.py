"""Killing the server (SIGKILL) loses no prompt: the restart re-issues every prompt whose group was
not acknowledged (pulled or not), and no acknowledged group comes back, also when the kill lands in
a burst of acknowledgements and dispatches (docs/DESIGN.md §6.4)."""

from __future__ import annotations

import json
import os
import threading

import grpc
import pytest

from rollout_api.proto import rollout_pb2
from tests.rollout_server.conftest import stats, wait_for

pytestmark = pytest.mark.slow  # starts server processes

BATCH = 4


def test_sigkill_then_restart_reissues_unacknowledged_prompts(server_factory, tmp_path):
    overrides = [
        f"server.state_dir={tmp_path / 'state'}",
        "server.checkpoint_root=",
        "server.wait_for_weights=false",
        f"rollout.batch_groups={BATCH}",
        "rollout.max_staleness=1",
    ]
    budget = 2 * BATCH
    first = server_factory(overrides)
    stub = first.rollout_stub()
    # Kill while some groups are still running and some are queued.
    wait_for(lambda: stats(stub).groups_produced >= 3, interval_s=0.05)
    pulled = stub.Pull(rollout_pb2.PullRequest(max_groups=2, timeout_s=10)).groups
    assert len(pulled) == 2
    pulled_ids = {g.prompt_id for g in pulled}
    stub.Ack(rollout_pb2.AckRequest(group_ids=[g.group_id for g in pulled]))
    [leased] = stub.Pull(rollout_pb2.PullRequest(max_groups=1, timeout_s=10)).groups  # no ack
    first.kill()
    state = json.loads((tmp_path / "state" / "rollout_state.json").read_text())
    assert state["consumed"] == 2
    drawn = {f"arith-0-{i}" for i in range(state["next_group_id"])}
    unfinished = {r["id"] for r in state["unfinished"]}
    assert unfinished == drawn - pulled_ids and leased.prompt_id in unfinished

    second = server_factory(overrides)
    stub = second.rollout_stub()
    groups = []
    wait_for(
        lambda: (
            groups.extend(stub.Pull(rollout_pb2.PullRequest(max_groups=budget, timeout_s=2)).groups)
            or len(groups) >= budget - 2
        ),
        timeout_s=120,
    )
    ids = [g.prompt_id for g in groups]
    assert len(ids) == len(set(ids)) == budget - 2
    assert not set(ids) & pulled_ids
    # The re-issued prompts come back (same ids and group ids), then new ones continue.
    assert unfinished <= set(ids)
    assert set(ids) - unfinished == {f"arith-0-{i}" for i in range(state["next_group_id"], budget)}
    assert second.stop() == 0


class _Trainer:
    """What trainer-like clients learned from the server's replies: the groups delivered, and the
    acknowledgements a reply confirmed (the rest are still owed: sent to a server that died before
    replying, or not sent yet)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.delivered: list[rollout_pb2.Group] = []
        self.confirmed: set[int] = set()
        self.owed: set[int] = set()
        self.replies_with_acks = 0

    def client(self, stub, stop: threading.Event, kill_after: int, kill: threading.Event) -> None:
        """Pulls two groups at a time, acknowledging each reply's groups with the next Pull."""
        mine: list[int] = []
        while not stop.is_set():
            request = rollout_pb2.PullRequest(max_groups=2, timeout_s=5, ack_group_ids=mine)
            try:
                reply = stub.Pull(request, timeout=60)
            except grpc.RpcError:  # the server was killed mid-call
                break
            with self.lock:
                self.confirmed |= set(mine)
                self.delivered += reply.groups
                if mine:
                    self.replies_with_acks += 1
                    if self.replies_with_acks == kill_after:
                        kill.set()
            mine = [g.group_id for g in reply.groups]
        with self.lock:
            self.owed |= set(mine)


# Loaded by the first server through PYTHONPATH: once the file HOLD names exists, a state write
# starts (creating "held" beside it) and never ends, as one in flight when the kill lands.
_HOLD_WRITES = """
import os, pathlib, threading
from rollout_server import persistence

_hold = pathlib.Path(os.environ["SATJAX_TEST_HOLD_WRITES"])
_save = persistence.StateStore.save

def save(self, state):
    if _hold.exists():
        (_hold.parent / "held").touch()
        threading.Event().wait()
    _save(self, state)

persistence.StateStore.save = save
"""


def test_sigkill_in_a_burst_of_acks_and_dispatches_keeps_exactly_once(
    server_factory, tmp_path, monkeypatch
):
    """Three clients pull and acknowledge while the server dispatches replacements. After the 10th
    reply that confirmed acknowledgements, the test pulls two groups, holds the server's state
    writes, and acknowledges them: no reply may come while the write is held. Then the server is
    killed (the clients mid-call, groups mid-generation, a write in flight). After the restart no
    acknowledged group comes back, every group up to the last one delivered is delivered and
    acknowledged, each prompt under one name, and the server counts each acknowledged group
    once."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(_HOLD_WRITES)
    hold = hook / "hold"
    monkeypatch.setenv("SATJAX_TEST_HOLD_WRITES", str(hold))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(hook), os.environ.get("PYTHONPATH", "")]))
    overrides = [
        f"server.state_dir={tmp_path / 'state'}",
        "server.checkpoint_root=",
        "server.wait_for_weights=false",
        f"rollout.batch_groups={BATCH}",
        # Admission bounded by the queue alone: each acknowledged group is replaced at once.
        "rollout.max_staleness=100000",
        f"rollout.queue_groups={2 * BATCH}",
    ]
    first = server_factory(overrides)
    server_id = first.rollout_stub().Health(rollout_pb2.HealthRequest(), timeout=30).server_id
    trainer, stop, kill = _Trainer(), threading.Event(), threading.Event()
    clients = [
        threading.Thread(target=trainer.client, args=(first.rollout_stub(), stop, 10, kill))
        for _ in range(3)
    ]
    for c in clients:
        c.start()
    assert kill.wait(timeout=300), "10 acknowledging replies never came"
    stub = first.rollout_stub()
    mine = stub.Pull(rollout_pb2.PullRequest(max_groups=2, timeout_s=30), timeout=60).groups
    assert mine
    trainer.delivered += mine
    trainer.owed |= {g.group_id for g in mine}
    hold.touch()
    with pytest.raises(grpc.RpcError) as unanswered:
        stub.Ack(rollout_pb2.AckRequest(group_ids=[g.group_id for g in mine]), timeout=5)
    assert unanswered.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_for(lambda: (hook / "held").exists())
    first.kill()
    stop.set()
    for c in clients:
        c.join(timeout=120)
        assert not c.is_alive()
    hold.unlink()
    before = {g.group_id for g in trainer.delivered}
    acked_before = set(trainer.confirmed)
    assert len(acked_before) >= 10

    second = server_factory(overrides)
    stub = second.rollout_stub()
    assert stub.Health(rollout_pb2.HealthRequest(), timeout=30).server_id == server_id
    owed, after = set(trainer.owed) | (before - acked_before), []

    def pull_and_ack() -> bool:
        nonlocal owed
        request = rollout_pb2.PullRequest(max_groups=8, timeout_s=2, ack_group_ids=sorted(owed))
        reply = stub.Pull(request, timeout=60)
        trainer.confirmed |= owed
        after.extend(reply.groups)
        owed = {g.group_id for g in reply.groups}
        return set(range(max(before) + 1)) <= trainer.confirmed

    wait_for(pull_and_ack, timeout_s=300, interval_s=0)
    stub.Ack(rollout_pb2.AckRequest(group_ids=sorted(owed)), timeout=30)
    trainer.confirmed |= owed
    # No group acknowledged before the kill is delivered again ...
    assert not {g.group_id for g in after} & acked_before
    # ... every prompt is delivered under one name (a group delivered again keeps its name) ...
    groups = trainer.delivered + after
    assert all(g.server_id == server_id for g in groups)
    assert all(g.prompt_id == f"arith-0-{g.group_id}" for g in groups)
    # ... and each acknowledged group is counted once (none lost, none counted twice).
    assert stats(stub).groups_consumed == len(trainer.confirmed)
    assert second.stop() == 0
