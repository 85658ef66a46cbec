"""The pool's parts alone (docs/DESIGN.md §6.5), each with fake stubs and the fake clock, without
a ``ServerPool``: the fleet (``Membership``) and the servers file, the leases, one Pull, the
rotation, the concurrent scheduler (its quota plan, the fallback past a paused server, the
hand-back) and the pushes' fence and rejoin."""

from __future__ import annotations

import logging
import threading

import grpc
import numpy as np
import pytest

from rollout_api.admission import FleetQuota
from rollout_api.client import DRAINING
from rollout_api.records import Group, Trajectory
from tests.clock import FakeClock, wait_until
from tests.train.test_fleet import FakeChannel, FakeStub
from train.fleet_weights import FleetWeights
from train.leases import Leases
from train.membership import FleetHooks, Membership
from train.pull_scheduler import PullScheduler
from train.pulls import Pulls
from train.rotation import Rotation
from train.senders import Push
from train.servers_file import POLL_S, ServersFile

GRACE, WAIT, RETRY_MAX = 5.0, 60.0, 4.0


class Failing(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str = ""):
        self._code, self._details = code, details

    def code(self):
        return self._code

    def details(self):
        return self._details


def raising(error: grpc.RpcError):
    """A stub method that fails with ``error``."""

    def call(*args, **kw):
        raise error

    return call


class Parts:
    """A fleet over FakeStubs and the parts built on it, as ``ServerPool`` wires them."""

    def __init__(self, addresses, *, batch_groups=0, max_staleness=None, servers_file=""):
        self.clock = FakeClock()
        self.stubs: dict[str, FakeStub] = {}

        def connect(address, max_message_bytes, root_certificates=None):
            self.stubs[address] = FakeStub(address, self.clock)
            return FakeChannel(), self.stubs[address]

        self.fleet = Membership(
            addresses, token="", root_certificates=None, max_message_bytes=1 << 20,
            retry_max_s=RETRY_MAX, server_wait_s=WAIT, grace_s=GRACE, servers_file=servers_file,
            on_retry=None, clock=self.clock, sleep=self.clock.sleep, connect=connect,
        )  # fmt: skip
        self.quota = FleetQuota(batch_groups, min_fallback_s=1.0) if batch_groups else None
        seats = 0 if max_staleness is None else (max_staleness + 1) * batch_groups
        self.leases = Leases(self.fleet, run_id="r", quota=self.quota, batch_groups=batch_groups)
        self.weights = FleetWeights(
            self.fleet, self.leases, token="", run_id="r", max_staleness=max_staleness,
            seats=seats, quota=self.quota,
        )  # fmt: skip
        self.pulls = Pulls(self.fleet, self.leases, self.weights, run_id="r", quota=self.quota)

    def server(self, address):
        return next(s for s in self.fleet.servers if s.address == address)


def group(server_id: str, group_id: int, version: int = 0) -> Group:
    traj = Trajectory(
        prompt_ids=np.array([1], np.int32),
        completion_ids=np.array([2], np.int32),
        behavior_logprobs=np.zeros(1, np.float32),
        versions=np.array([version], np.int64),
    )
    return Group(group_id=group_id, prompt_id=f"p{group_id}", server_id=server_id,
                 trajectories=(traj,))  # fmt: skip


# The fleet.


def test_the_fleet_alone_a_failing_server_leaves_after_the_grace_and_joins_once_it_answers():
    parts = Parts(["a:1", "b:1"])
    down, upkeep = [], []
    parts.fleet.start(False, FleetHooks(went_down=down.append, upkeep=lambda: upkeep.append(1)))
    a, clock = parts.server("a:1"), parts.clock
    parts.fleet.failed(a, "Pull: UNAVAILABLE", clock())
    assert a.up and not down  # within the grace
    clock.advance(GRACE)
    parts.fleet.failed(a, "Pull: UNAVAILABLE", clock())
    assert not a.up and down == [a] and a.reason == "Pull: UNAVAILABLE"
    parts.fleet.maintain()  # its probe is one backoff away
    assert not parts.stubs["a:1"].rpcs("Health") and upkeep == [1]
    clock.advance(a.backoff)
    parts.fleet.maintain()  # it answers: without a rejoin hook it joins as it is
    assert a.up and len(parts.stubs["a:1"].rpcs("Health")) == 1
    assert parts.fleet.metrics() == {"servers_up": 2, "pulled_0": 0, "pulled_1": 0}


def test_the_fleet_calls_its_hooks_for_a_server_that_joins_and_one_whose_line_goes(tmp_path):
    path = tmp_path / "servers"
    path.write_text("a:1\n")
    parts = Parts([], servers_file=str(path))
    rejoined, removed = [], []
    hooks = FleetHooks(rejoin=lambda s, v: rejoined.append((s.address, v)), removed=removed.append)
    parts.fleet.start(False, hooks)
    (a,) = parts.fleet.servers
    assert not a.up  # listed: probed first
    parts.fleet.maintain()
    assert rejoined == [("a:1", 0)] and not a.up  # the hook decides when it joins
    path.write_text("")
    parts.clock.advance(POLL_S)
    parts.fleet.maintain()
    assert removed == [a] and parts.fleet.servers == []


def test_the_servers_file_skips_bad_lines_and_an_unreadable_one_keeps_its_servers(tmp_path, caplog):
    clock = FakeClock()
    path = tmp_path / "servers"
    path.write_text("a:1  # comment\nnot-an-address\n\nb:2\n")
    servers_file = ServersFile(str(path), clock)
    assert servers_file.due()
    with caplog.at_level(logging.WARNING, logger="train"):
        assert servers_file.read() == ["a:1", "b:2"]
        assert not servers_file.due()
        clock.advance(POLL_S)
        assert servers_file.due()
        path.unlink()
        assert servers_file.read() is None and servers_file.read() is None
    assert sum("not host:port" in r.getMessage() for r in caplog.records) == 1
    assert sum("cannot read" in r.getMessage() for r in caplog.records) == 1  # once


# The leases.


def test_leases_queue_acks_for_the_next_pull_and_a_reject_gives_back_its_place():
    parts = Parts(["a:1"], batch_groups=2)
    leases, a = parts.leases, parts.server("a:1")
    parts.quota.start(3, {"a:1": 1.0}, parts.clock())
    leases.begin(3)
    pulled = [group("a-1", 0), group("a-1", 1)]
    leases.delivered(a, pulled, 3)
    parts.quota.took("a:1", 2)
    assert leases.next_batch_version() == 4  # its batch is whole
    leases.ack(pulled[:1])
    leases.ack(pulled[1:], rejected=True)
    leases.ack([group("x-1", 9)])  # not pulled here: ignored
    assert a.acks == [("a-1", 0)] and a.rejects == [("a-1", 1)]
    assert leases.next_batch_version() == 3 and parts.quota.quota("a:1") == 1
    a.acks.append(("a-0", 7))  # for an earlier incarnation: dropped once a-1 answered
    assert leases.pending(a, a.acks) == [("a-1", 0)]
    leases.sent(a, [("a-1", 0)], [("a-1", 1)])
    assert a.acks == [] and a.rejects == []


# One Pull.


def test_one_pull_carries_the_pending_acks_and_books_its_reply():
    parts = Parts(["a:1"], batch_groups=4)
    parts.fleet.start(False)
    a, stub = parts.server("a:1"), parts.stubs["a:1"]
    stub.capacity = 50.0
    a.acks.append(("", 3))
    a.returns.append(("", 5))
    got = parts.pulls.call(a, 2, 1.0, None, trainer_version=1)
    (request,) = stub.rpcs("Pull")
    assert list(request.ack_group_ids) == [3] and list(request.return_group_ids) == [5]
    assert request.trainer_version == 1 and request.run_id == "r"
    assert [g.group_id for g in got] == [0, 1] and a.acks == [] and a.returns == []
    assert a.pulled == 2 and a.rate == 50.0 and a.pull_overhead_s == 0.0
    assert a.server_id == "a:1-1"


def test_a_deaf_pull_fences_its_server_a_failed_one_starts_its_streak_a_drained_one_leaves():
    parts = Parts(["a:1", "b:1", "c:1"])
    parts.fleet.start(False)
    a, b, c = (parts.server(x) for x in ("a:1", "b:1", "c:1"))
    deadline = Failing(grpc.StatusCode.DEADLINE_EXCEEDED)
    a.pull_overhead_s = 0.1  # measured: past its deadline it is deaf
    parts.stubs["a:1"].Pull = raising(deadline)
    assert parts.pulls.call(a, 1, 0.5, None, 0) == "deaf" and a.lagging and a.up
    parts.stubs["b:1"].down = True
    assert parts.pulls.call(b, 1, 0.5, None, 0) == "failed" and b.failing_since is not None
    draining = Failing(grpc.StatusCode.UNAVAILABLE, f"{DRAINING} SIGTERM")
    parts.stubs["c:1"].Pull = raising(draining)
    c.acks.append(("", 4))  # the Pull carried it (it answered): no Ack left to send
    c.rejects.append(("c-0", 6))  # another incarnation's: dropped
    c.server_id = "c-1"
    assert parts.pulls.call(c, 1, 0.5, None, 0) == "drained"
    assert not c.up and c.draining and c.failing_since is None and c.acks == []
    assert not parts.stubs["c:1"].rpcs("Ack")


def test_a_launched_pull_ends_with_its_groups_in_carried_under_one_lock():
    """Whoever sees the Pull ended sees its groups: ``pulling`` goes False under the same lock
    as the groups go into ``carried``."""
    parts = Parts(["a:1"], batch_groups=2)
    parts.fleet.start(False)
    a, stub = parts.server("a:1"), parts.stubs["a:1"]
    release = threading.Event()
    pull = stub.Pull

    def slow_pull(request, timeout, metadata):
        release.wait(60)
        return pull(request, timeout, metadata)

    stub.Pull = slow_pull
    assert parts.pulls.launch(a, 2, 0.5, None, trainer_version=1)
    assert not parts.pulls.launch(a, 2, 0.5, None, trainer_version=1)  # one in flight at most
    assert a.pulling and a.pull_asked == 2 and a.pull_for == 1
    with parts.fleet.lock:
        release.set()
        wait_until(lambda: len(stub.rpcs("Pull")) == 1)
        assert a.pulling and parts.pulls.carried == []  # it waits for the lock
    wait_until(lambda: not a.pulling)
    assert [g.group_id for g in parts.pulls.carried] == [0, 1] and a.pull_result == "ok"


# Which servers a pull asks.


def test_the_rotation_pulls_the_current_servers_in_turn():
    parts = Parts(["a:1", "b:1", "c:1"])
    parts.fleet.start(False)
    rotation = Rotation(parts.fleet, parts.leases, parts.pulls)
    got = [rotation.pull(1, 1.0, None, 0)[0].server_id for _ in range(4)]
    assert got == ["a:1-1", "b:1-1", "c:1-1", "a:1-1"]
    assert all(r.timeout_s == 1.0 for s in parts.stubs.values() for r in s.rpcs("Pull"))


def scheduler(parts: Parts) -> PullScheduler:
    return PullScheduler(parts.fleet, parts.leases, parts.pulls, parts.quota, parts.weights.shares)


def test_the_plan_asks_each_server_for_its_quota_and_not_one_with_a_pull_in_flight():
    parts = Parts(["a:1", "b:1"], batch_groups=4)
    parts.fleet.start(False)
    sched, (a, b) = scheduler(parts), parts.fleet.servers
    assert sched.plan([a, b], 1) == [(a, 2), (b, 2)]
    assert parts.leases.trainer_version == 1
    b.pulling = True
    assert sched.plan([a, b], 1) == [(a, 2)]


@pytest.mark.parametrize("wait", [0.5, 2.0])
def test_a_paused_server_owed_part_of_the_batch_holds_nothing_past_the_fallback(wait):
    """Past the fallback every server may be asked for any number, also while a server owed part
    of the batch has a Pull in flight past its wait (paused) and before its deadline: the paused
    server's part is not waited for beyond the fallback, as for any slow server."""
    parts = Parts(["a:1", "b:1"], batch_groups=4)
    parts.fleet.start(False)
    sched, (a, b), clock = scheduler(parts), parts.fleet.servers, parts.clock
    sched.plan([a, b], 1)
    b.pulling, b.pull_started, b.pull_wait, b.pull_deadline = True, clock(), wait, 2.5
    clock.advance(0.5)  # before the fallback (1 s): a is asked for its quota only
    assert sched.plan([a, b], 1) == [(a, 2)]
    clock.advance(1.0)  # the fallback is open; b's Pull is past its wait when wait = 0.5
    assert sched.plan([a, b], 1) == [(a, None)]


def test_take_carried_hands_out_the_oldest_and_hands_back_the_late_and_the_overflow():
    parts = Parts(["a:1", "b:1"], batch_groups=2)
    parts.fleet.start(False)
    sched, (a, b) = scheduler(parts), parts.fleet.servers
    late, young, old, over = group("a", 1, 5), group("b", 2, 7), group("b", 3, 6), group("a", 4, 8)
    parts.leases.delivered(a, [late], 1)  # its batch was made before it came
    parts.leases.delivered(b, [young, old], 2)
    parts.leases.delivered(a, [over], 2)
    parts.pulls.carried = [late, young, over, old]
    assert sched.take_carried(2, 2) == [old, young]
    assert a.returns == [("a", 1), ("a", 4)] and b.returns == [] and parts.pulls.carried == []


def test_concurrent_pulls_make_the_batch_from_every_server_at_once():
    parts = Parts(["a:1", "b:1"], batch_groups=4)
    parts.fleet.start(False)
    sched, got = scheduler(parts), []
    while len(got) < 4:  # the replies may come in two calls
        got += sched.pull(4 - len(got), 1.0, None, trainer_version=1)
    assert sorted(g.server_id for g in got) == ["a:1-1"] * 2 + ["b:1-1"] * 2
    for stub in parts.stubs.values():
        (request,) = stub.rpcs("Pull")
        assert request.max_groups == 2 and request.timeout_s == 0.5


# The pushes.


def test_a_fenced_server_gets_an_ended_lease_and_its_part_of_the_batch_goes_to_the_others():
    parts = Parts(["a:1", "b:1"], batch_groups=4, max_staleness=1)
    parts.fleet.start(False)
    a, b = parts.fleet.servers
    sched = scheduler(parts)
    sched.plan([a, b], 3)
    parts.weights.fence(b, "a Pull is overdue")
    assert b.lagging and parts.quota.quota("a:1") == 4 and parts.quota.quota("b:1") == 0
    with parts.fleet.lock:
        to_b = parts.weights._request(b, Push(3, "/w/v3"))
        to_a = parts.weights._request(a, Push(3, "/w/v3"))
    assert to_b.share_until == 2 and to_b.admission_share == 0.5  # ended: it admits nothing
    assert to_a.share_until == 4 and to_a.admission_share == 1.0 and a.grants == [(1.0, 4)]


def test_a_server_that_answers_a_probe_joins_as_it_is_before_a_push_and_after_one_once_loaded():
    parts = Parts(["a:1"])
    weights = parts.weights
    parts.fleet.start(False, FleetHooks(rejoin=weights.rejoin, went_down=weights.senders.reset))
    (a,) = parts.fleet.servers
    with parts.fleet.lock:
        parts.fleet.take_out(a)
    weights.rejoin(a, 0)
    assert a.up  # no push yet
    weights.update(Push(2, "/w/v2"))
    assert weights.settle(30.0) and weights.senders.state(a).installed == 2
    with parts.fleet.lock:
        parts.fleet.take_out(a)
    with parts.fleet.lock:  # its sender waits for the lock
        weights.rejoin(a, 1)
        assert a.joining and not a.up
    assert weights.settle(30.0) and a.up and not a.joining
    last = parts.stubs["a:1"].rpcs("UpdateWeights")[-1]
    assert last.version == 2 and last.new_admission_epoch
    weights.close(1.0)
