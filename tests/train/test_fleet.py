"""The pool's per-server health (docs/DESIGN.md §6.5) against fake stubs and a fake clock: a
failing server leaves after the grace and the run goes on with the others; pushes skip it and a
failed push makes it leave at once; it is probed with backoff and rejoins with the current weights
first; acknowledgements wait for it (and are dropped if another server answers at its address);
servers_file entries join and leave; the run stops only when no server has answered for
server_wait_s."""

from __future__ import annotations

import itertools
import logging
import threading

import grpc
import pytest

from rollout_api.proto import rollout_pb2
from tests.clock import FakeClock, wait_until
from train.membership import ServersDownError
from train.remote import ServerPool

GRACE, WAIT, RETRY_MAX = 5.0, 60.0, 4.0


class Unavailable(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.UNAVAILABLE

    def details(self):
        return "connection refused"


class FakeStub:
    """A server's Rollout stub: records each call (name, request); raises UNAVAILABLE while
    ``down``."""

    def __init__(self, name: str, clock: FakeClock):
        self.name, self.clock = name, clock
        self.down = False
        self.calls: list[tuple[str, object, float]] = []
        self.version = 0
        self.server_id = f"{name}-1"
        self.next_id = 0
        self.capacity = 0.0  # what its Pull replies report (0 = not measured)

    def _call(self, rpc, request):
        self.calls.append((rpc, request, self.clock()))
        if self.down:
            raise Unavailable()

    def rpcs(self, rpc: str) -> list:
        return [request for name, request, _ in self.calls if name == rpc]

    def Pull(self, request, timeout, metadata):
        self._call("Pull", request)
        groups = []
        for _ in range(request.max_groups):
            traj = rollout_pb2.Trajectory(prompt_ids=[1])
            groups.append(
                rollout_pb2.Group(
                    group_id=self.next_id,
                    prompt_id=f"{self.name}{self.next_id}",
                    server_id=self.server_id,
                    trajectories=[traj],
                )
            )
            self.next_id += 1
        return rollout_pb2.PullResponse(groups=groups, capacity_tokens_per_s=self.capacity)

    def Ack(self, request, timeout, metadata):
        self._call("Ack", request)
        return rollout_pb2.AckResponse(acked=len(request.group_ids))

    def UpdateWeights(self, request, timeout, metadata):
        self._call("UpdateWeights", request)
        self.version = request.version
        return rollout_pb2.UpdateWeightsResponse(version=request.version)

    def Health(self, request, timeout, metadata):
        self._call("Health", request)
        return rollout_pb2.HealthResponse(live=True, version=self.version, server_id=self.server_id)


class FakeChannel:
    def close(self):
        pass


@pytest.fixture
def fleet():
    """(pool factory, stubs by address, clock): every address gets a FakeStub."""
    clock = FakeClock()
    stubs: dict[str, FakeStub] = {}

    def connect(address, max_message_bytes, root_certificates=None):
        stubs[address] = FakeStub(address, clock)
        return FakeChannel(), stubs[address]

    def make(addresses, **kw):
        base = dict(
            token="", max_message_bytes=1 << 20, retry_max_s=RETRY_MAX, server_wait_s=WAIT,
            grace_s=GRACE, clock=clock, sleep=clock.sleep, connect=connect,
        )  # fmt: skip
        return ServerPool(addresses, **(base | kw))

    return make, stubs, clock


def test_a_failing_server_leaves_after_the_grace_and_the_run_goes_on(fleet, caplog):
    make, stubs, clock = fleet
    with make(["a:1", "b:1"]) as pool, caplog.at_level(logging.INFO, logger="train"):
        stubs["a:1"].down = True
        assert {g.server_id for g in pool.pull(2, 1.0)} == {"b:1-1"}  # a failed: b answered
        assert pool.metrics()["servers_up"] == 2  # within the grace
        clock.advance(GRACE)
        pool.pull(2, 1.0)  # b's turn
        pool.pull(2, 1.0)  # a fails again, past the grace: it leaves; b serves
        assert pool.metrics() == {"servers_up": 1, "pulled_0": 0, "pulled_1": 6}
        tries = len(stubs["a:1"].rpcs("Pull"))
        for _ in range(5):
            pool.pull(2, 1.0)
        assert len(stubs["a:1"].rpcs("Pull")) == tries  # out of the rotation: no more Pulls
    left = [r for r in caplog.records if "left the rotation" in r.getMessage()]
    assert (
        len(left) == 1
        and "a:1" in left[0].getMessage()
        and "Pull: UNAVAILABLE" in (left[0].getMessage())
    )
    assert sum("is down" in r.getMessage() for r in caplog.records) == 1  # not one per retry


def test_pushes_skip_a_down_server_and_a_failing_one_is_retried_by_its_sender_alone(fleet):
    """Each server has its own sender: one whose UpdateWeights fails holds up neither the others'
    installs nor the caller (no sleep, no retry on the caller's thread); its sender retries with
    backoff and the server leaves once its calls have failed for the grace."""
    make, stubs, clock = fleet
    with make(["a:1", "b:1", "c:1"]) as pool:
        pool.update_weights(1, "/w/v1", new_admission_epoch=True)
        pool.settle()
        assert [r.admission_share for r in stubs["b:1"].rpcs("UpdateWeights")] == [
            pytest.approx(1 / 3)
        ]
        stubs["a:1"].down = True
        pool.update_weights(2, "/w/v2")  # a fails v2; b and c install it
        pool.settle()
        assert stubs["b:1"].version == stubs["c:1"].version == 2 and clock.sleeps == []
        assert pool.metrics()["servers_up"] == 3  # within the grace
        clock.advance(GRACE)
        pool.maintain()  # a's backoff has passed: its sender retries, past the grace: it leaves
        pool.settle()
        assert pool.metrics()["servers_up"] == 2 and clock.sleeps == []
        pool.update_weights(3, "/w/v3")
        pool.settle()
        assert [r.version for r in stubs["a:1"].rpcs("UpdateWeights")] == [1, 2, 2]
        # The two left share the fleet's budget.
        assert [r.admission_share for r in stubs["c:1"].rpcs("UpdateWeights")] == pytest.approx(
            [1 / 3, 1 / 3, 1 / 2]
        )


def test_shares_follow_the_capacities_the_pull_replies_report(fleet):
    """A server half as fast gets half the work (docs/DESIGN.md §6.3): shares ∝ the capacity
    each server reports, an unreported one counting as the mean, whole seats of the fleet's
    (max_staleness + 1) · batch_groups budget; a server that comes back as another one is
    measured again."""
    make, stubs, clock = fleet
    with make(["a:1", "b:1", "c:1"], batch_groups=8, max_staleness=2) as pool:
        pool.update_weights(1, "/w/v1", new_admission_epoch=True)
        pool.settle()
        stubs["a:1"].capacity, stubs["b:1"].capacity = 500.0, 1000.0
        for _ in range(3):
            pool.pull(1, 1.0)  # one Pull each (plain rotation: no trainer version)
        pool.update_weights(2, "/w/v2")
        pool.settle()
        shares = [stubs[n].rpcs("UpdateWeights")[-1].admission_share for n in ("a:1", "b:1", "c:1")]
        # Rates 500, 1000 and c's unknown = their mean, 750: 24 seats as 5.3, 10.7, 8 -> 5, 11, 8.
        assert shares == pytest.approx([5 / 24, 11 / 24, 8 / 24])
        stubs["b:1"].down = True
        pool.update_weights(3, "/w/v3")  # b fails the push ...
        pool.settle()
        clock.advance(GRACE)
        pool.maintain()  # ... and its sender's retry past the grace: it leaves
        pool.settle()
        assert pool.metrics()["servers_up"] == 2
        stubs["b:1"].down, stubs["b:1"].server_id = False, "b:1-2"  # back as another server
        clock.advance(RETRY_MAX)
        pool.maintain()
        pool.settle()
        push = stubs["b:1"].rpcs("UpdateWeights")[-1]  # the rejoin's (the failed one before)
        assert push.version == 3 and push.new_admission_epoch
        # b measured again (the mean of a's 500 and c's unknown: 500): equal with a; c the same.
        assert push.admission_share == pytest.approx(8 / 24)


def test_a_down_server_is_probed_with_backoff_and_rejoins_with_the_current_weights(fleet, caplog):
    make, stubs, clock = fleet
    a, b = "a:1", "b:1"
    with make([a, b], grace_s=0.0) as pool, caplog.at_level(logging.INFO, logger="train"):
        pool.update_weights(4, "/w/v4", new_admission_epoch=True)
        pool.settle()
        stubs[a].down = True
        pool.pull(1, 1.0)  # a fails (no grace): it leaves
        for _ in range(40):
            clock.advance(0.25)
            pool.maintain()
            pool.settle()
        probes = [t for rpc, _, t in stubs[a].calls if rpc == "Health"]
        gaps = [round(y - x, 2) for x, y in itertools.pairwise(probes)]
        assert gaps[:4] == [0.5, 1.0, 2.0, 4.0] and max(gaps) == RETRY_MAX  # doubling, capped
        pool.update_weights(5, "/w/v5")  # while a is down: only b
        pool.settle()
        stubs[a].down = False
        clock.advance(RETRY_MAX)
        pool.maintain()  # a answers: first the current weights, with a new admission epoch
        pool.settle()
        [push] = [r for r in stubs[a].rpcs("UpdateWeights") if r.version == 5]
        assert push.checkpoint_path == "/w/v5" and push.new_admission_epoch
        assert push.admission_share == pytest.approx(0.5)
        assert pool.metrics()["servers_up"] == 2
        for _ in range(2):
            pool.pull(1, 1.0)
        calls = [rpc for rpc, _, _ in stubs[a].calls]
        assert calls.index("UpdateWeights", 2) < len(calls) - 1 and calls[-1] == "Pull"
    joined = [r.getMessage() for r in caplog.records if "joined" in r.getMessage()]
    assert joined == [f"rollout server {a} joined at weights version 5 (2 up)"]


def test_every_server_down_stops_after_server_wait_s(fleet):
    make, stubs, clock = fleet
    with make(["a:1", "b:1"]) as pool:
        for stub in stubs.values():
            stub.down = True
        start = clock()
        with pytest.raises(ServersDownError, match=r"no rollout server answered for 60s"):
            pool.pull(1, 1.0)
        assert WAIT < clock() - start <= WAIT + RETRY_MAX
        assert pool.metrics()["servers_up"] == 0
        # Probed with backoff meanwhile, not hammered.
        assert len(stubs["a:1"].rpcs("Health")) < 30


def test_a_server_answering_again_in_time_stays_without_a_log_line(fleet, caplog):
    make, stubs, clock = fleet
    with make(["a:1"]) as pool, caplog.at_level(logging.INFO, logger="train"):
        stubs["a:1"].down = True
        pool.update_weights(1, "/w/v1")  # a push fails: a stays, within the grace ...
        pool.settle()
        stubs["a:1"].down = False
        assert len(pool.pull(1, 1.0)) == 1  # ... answers the pull ...
        clock.advance(RETRY_MAX)
        pool.maintain()
        pool.settle()  # ... and its sender's retry brings it v1
        assert stubs["a:1"].version == 1 and pool.metrics()["servers_up"] == 1
    assert not [r for r in caplog.records if "left the rotation" in r.getMessage()]


def test_acknowledgements_wait_for_their_server_and_not_for_another(fleet):
    make, stubs, clock = fleet
    a, b = "a:1", "b:1"
    with make([a, b], grace_s=0.0) as pool:
        pool.update_weights(1, "/w/v1")
        pool.settle()
        from_a = pool.pull(2, 1.0)
        from_b = pool.pull(2, 1.0)
        stubs[a].down = True
        pool.ack(from_a + from_b)  # trained
        pool.pull(1, 1.0)  # a fails and leaves; b gets its acks
        assert stubs[b].rpcs("Pull")[-1].ack_group_ids == [0, 1]
        # a comes back with its state (same server id): its acks ride on its next Pull.
        stubs[a].down = False
        clock.advance(1)
        pool.maintain()
        pool.settle()
        pool.pull(1, 1.0)
        pool.pull(1, 1.0)
        assert [list(r.ack_group_ids) for r in stubs[a].rpcs("Pull")][-1] == [0, 1]
        # Acks for a server whose state is gone (a new server id) are dropped.
        more = [g for g in (pool.pull(1, 1.0) + pool.pull(1, 1.0)) if g.server_id == "a:1-1"]
        stubs[a].down = True
        pool.ack(more)
        pool.pull(1, 1.0)
        stubs[a].down, stubs[a].server_id = False, "a:1-2"
        clock.advance(1)
        pool.maintain()
        pool.settle()
        pool.pull(1, 1.0)
        pool.pull(1, 1.0)
        assert stubs[a].calls[-1][0] == "Pull" and not stubs[a].rpcs("Pull")[-1].ack_group_ids


def test_servers_file_entries_join_and_leave(fleet, tmp_path, caplog):
    make, stubs, clock = fleet
    listing = tmp_path / "servers"
    listing.write_text("b:1\n")
    with make([], servers_file=str(listing)) as pool, caplog.at_level(logging.INFO, "train"):
        assert pool.versions() == [0]  # b probed at once: it joins
        pool.update_weights(3, "/w/v3", new_admission_epoch=True)
        pool.settle()
        listing.write_text("b:1\n# a comment\nc:1\n")
        clock.advance(3)
        pool.maintain()  # c listed and probed: the current weights, then it joins
        pool.settle()
        assert stubs["c:1"].rpcs("UpdateWeights")[0].version == 3
        assert pool.metrics()["servers_up"] == 2
        assert {g.server_id for g in pool.pull(1, 1.0) + pool.pull(1, 1.0)} == {"b:1-1", "c:1-1"}
        listing.write_text("c:1\n")
        clock.advance(3)
        pool.maintain()
        pool.settle()
        assert pool.addresses == ("c:1",) and pool.metrics()["servers_up"] == 1
    text = caplog.text
    assert "b:1 left the rotation: removed from" in text and "c:1 joined" in text


def test_a_server_ahead_of_the_trainer_stays_out_until_the_trainer_passes_it(fleet):
    make, stubs, clock = fleet
    with make(["a:1", "b:1"], grace_s=0.0) as pool:
        pool.update_weights(3, "/w/v3")
        pool.settle()
        stubs["a:1"].down = True
        pool.pull(1, 1.0)
        stubs["a:1"].down, stubs["a:1"].version = False, 9  # another trainer's weights
        clock.advance(1)
        pool.maintain()
        pool.settle()
        assert pool.metrics()["servers_up"] == 1
        assert [r.version for r in stubs["a:1"].rpcs("UpdateWeights")] == [3]
        pool.update_weights(10, "/w/v10")
        pool.settle()
        clock.advance(RETRY_MAX)
        pool.maintain()
        pool.settle()
        assert pool.metrics()["servers_up"] == 2 and stubs["a:1"].version == 10


def test_a_push_sends_no_ack_first_each_servers_next_pull_carries_them(fleet):
    """A push is one UpdateWeights per server: an Ack in front of it would put a round trip and
    the server's write of it between a step and the install that opens admission for the batch
    after next. The trained groups hold no place in the server's budget meanwhile (they went out
    on Pulls for an earlier batch: `ServerAdmission.in_earlier_batch`); their acknowledgements go
    with each server's next Pull."""
    make, stubs, _ = fleet
    a, b = "a:1", "b:1"
    with make([a, b]) as pool:
        pool.update_weights(1, "/w/v1")
        pool.settle()
        trained = pool.pull(2, 1.0) + pool.pull(2, 1.0)
        pool.ack(trained)
        pool.update_weights(2, "/w/v2")
        pool.settle()
        for address in (a, b):
            names = [name for name, _, _ in stubs[address].calls]
            assert names[-1] == "UpdateWeights" and "Ack" not in names, names
        for _ in range(8):  # the pool takes turns; each server is pulled within a few
            if all(stubs[x].rpcs("Pull")[-1].ack_group_ids for x in (a, b)):
                break
            pool.pull(1, 1.0)
        for address in (a, b):
            assert list(stubs[address].rpcs("Pull")[-1].ack_group_ids) == [0, 1]


def test_a_rejected_group_gives_its_place_in_the_batch_back_to_its_server(fleet):
    """A group rejected (stale, filtered, ...) from the batch being pulled returns its place to
    its server's quota: the batch takes that server's next group, older than the others', and a
    server that was one group behind its share does not stay behind (each of its groups trained
    a version late, a stale drop per step, seen live after a drained server rejoined)."""
    make, stubs, clock = fleet
    with make(["a:1", "b:1"], batch_groups=2, max_staleness=1) as pool:
        pool.update_weights(1, "/w/v1", new_admission_epoch=True)
        pool.settle()
        first = pool.pull(1, 1.0, trainer_version=5) + pool.pull(1, 1.0, trainer_version=5)
        assert sorted(g.prompt_id[0] for g in first) == ["a", "b"]  # one each: its share
        stale = next(g for g in first if g.prompt_id.startswith("b"))
        pool.ack([stale], rejected=True)
        # b's place came back: the next Pull of this batch goes to b, not to a (whose quota is
        # spent and whose fallback is three step periods away).
        again = pool.pull(1, 1.0, trainer_version=5)
        assert [g.prompt_id for g in again] == ["b:11"]
        # A rejected group of an earlier batch gives nothing to the batch being pulled.
        pool.pull(1, 1.0, trainer_version=6)
        pool.pull(1, 1.0, trainer_version=6)
        quota = dict(pool._quota.credit)
        pool.ack([g for g in first if g is not stale], rejected=True)
        assert pool._quota.credit == quota


def test_a_push_names_the_version_the_next_pulled_groups_are_trained_at(fleet):
    """A rejoining server's admission counts how far the trainer is past the weights it gets:
    the push names the version of the batch being pulled, or the next one once that batch has
    all its groups (a server told the version whose batch is already complete admits groups
    that batch will never take, and they go stale)."""
    make, stubs, _ = fleet
    with make(["a:1"], batch_groups=2, max_staleness=1) as pool:
        assert pool.next_batch_version() == 0
        pool.update_weights(3, "/w/v3", new_admission_epoch=True)
        pool.settle()
        assert stubs["a:1"].rpcs("UpdateWeights")[-1].trainer_version == 3
        got = pool.pull(1, 1.0, trainer_version=4)
        assert pool.next_batch_version() == 4  # batch 4 still needs a group
        got += pool.pull(1, 1.0, trainer_version=4)
        assert pool.next_batch_version() == 5  # batch 4 complete
        pool.ack(got[:1], rejected=True)
        assert pool.next_batch_version() == 4  # a rejected group: batch 4 needs one again
        pool.pull(1, 1.0, trainer_version=4)
        pool.update_weights(4, "/w/v4")
        pool.settle()
        assert stubs["a:1"].rpcs("UpdateWeights")[-1].trainer_version == 5


def test_an_empty_pull_reply_for_the_batch_being_pulled_is_no_error(fleet):
    """A Pull that names the batch being pulled and gets no group (its server had none ready)
    returns nothing and changes no count; the server's identity stays the one its groups gave."""
    make, stubs, _ = fleet
    with make(["a:1"], batch_groups=2, max_staleness=1) as pool:
        pool.update_weights(1, "/w/v1", new_admission_epoch=True)
        pool.settle()
        assert len(pool.pull(1, 1.0, trainer_version=2)) == 1
        assert pool.pull(0, 1.0, trainer_version=2) == []
        assert pool.next_batch_version() == 2
        assert pool.pull(1, 1.0, trainer_version=2)[0].server_id == "a:1-1"
        assert pool.next_batch_version() == 3


class Blocked(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.DEADLINE_EXCEEDED

    def details(self):
        return "deadline exceeded"


def hold_updates(stub: FakeStub, *, fail: bool = True) -> threading.Event:
    """Makes ``stub``'s UpdateWeights hang until the returned event is set; then it fails as a
    call past its deadline would (``fail``) or installs."""
    release = threading.Event()
    plain = stub.UpdateWeights

    def update(request, timeout, metadata):
        stub._call("UpdateWeights", request)
        release.wait(30)
        if fail:
            raise Blocked()
        stub.version = request.version
        return rollout_pb2.UpdateWeightsResponse(version=request.version)

    stub.UpdateWeights = update
    stub.plain_update = plain
    return release


class Refused(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.INVALID_ARGUMENT

    def details(self):
        return "checkpoint_path is outside the checkpoint root"


def test_a_refused_push_is_not_sent_again(fleet):
    """A server refusing a push for good (not transient, not "older than the current") gets it
    once: its sender forgets it (before, it sent it again at once, in a loop, and ``close``
    waited its 30 s for an install that could not come); the refusal is raised in the caller's
    next call."""
    make, stubs, clock = fleet
    with make(["a:1"], batch_groups=2, max_staleness=1) as pool:
        stub = pool._fleet.servers[0].stub

        def refuse(request, timeout, metadata):
            stub._call("UpdateWeights", request)
            raise Refused()

        stub.UpdateWeights = refuse
        pool.update_weights(1, "/outside/v1", new_admission_epoch=True)
        assert pool.settle(timeout_s=10)
        assert len(stub.rpcs("UpdateWeights")) == 1
        with pytest.raises(Refused):
            pool.pull(1, 0.0)
        assert len(stub.rpcs("UpdateWeights")) == 1


def test_a_server_whose_update_never_returns_delays_no_other_install_nor_the_next_push(fleet):
    """One sender per server, newest version wins: a push returns at once; a server stuck in its
    load delays neither the other's installs nor the caller's next push; once its call ends it
    gets the newest version, skipping those pushed meanwhile."""
    make, stubs, clock = fleet
    with make(["a:1", "b:1"], batch_groups=4, max_staleness=2) as pool:
        pool.update_weights(1, "/w/v1", new_admission_epoch=True)
        pool.settle()
        release = hold_updates(stubs["a:1"], fail=False)
        for version in range(2, 6):
            pool.update_weights(version, f"/w/v{version}")  # returns while a's load hangs
            assert wait_until(lambda v=version: stubs["b:1"].version == v)
        assert [r.version for r in stubs["a:1"].rpcs("UpdateWeights")] == [1, 2]
        assert {1, 2, 5} <= pool.pinned_versions()  # held, loading, wanted: not removed
        stubs["a:1"].UpdateWeights = stubs["a:1"].plain_update
        release.set()  # its load of v2 ends
        pool.settle()
        # v3 and v4 skipped: the newest, with the lease of a server that keeps up.
        assert [r.version for r in stubs["a:1"].rpcs("UpdateWeights")] == [1, 2, 5]
        assert stubs["a:1"].rpcs("UpdateWeights")[-1].share_until == 5 + 2
        assert clock.sleeps == []


def test_an_overdue_server_is_fenced_then_current_again(fleet, caplog):
    """A server whose UpdateWeights is overdue is lagging: its share goes to the others at the
    next push, its own lease has ended (it admits nothing), it is still pulled; once it installs
    weights within S of the trainer it is current again and its share comes back."""
    make, stubs, clock = fleet
    a, b = "a:1", "b:1"
    with make([a, b], batch_groups=4, max_staleness=1) as pool:
        pool.update_weights(1, "/w/v1", new_admission_epoch=True)
        pool.settle()
        release = hold_updates(stubs[b])
        pool.update_weights(2, "/w/v2")
        assert wait_until(lambda: len(stubs[b].rpcs("UpdateWeights")) == 2)
        pool.settle(timeout_s=0.5)  # b's call hangs: settle gives up
        with caplog.at_level(logging.WARNING, logger="train"):
            clock.advance(60)
            pool.maintain()  # b's call is overdue: fenced
        assert pool.metrics()["servers_lagging"] == 1 and "is lagging" in caplog.text
        pool.update_weights(3, "/w/v3")
        pool.settle(timeout_s=0.5)
        assert stubs[a].rpcs("UpdateWeights")[-1].admission_share == pytest.approx(1.0)
        # Still pulled (in the background: a deaf server holds no Pull of the loop's).
        got = []
        for _ in range(20):  # the batch's pulls (it needs 4, B)
            got += pool.pull(4, 1.0, trainer_version=3)
            if any(g.server_id == "b:1-1" for g in got):
                break
            wait_until(lambda: not pool._fleet.servers[1].pulling)
        assert any(g.server_id == "b:1-1" for g in got)
        # b's load ends (past its deadline): its sender sends the newest, with an ended lease.
        stubs[b].UpdateWeights = stubs[b].plain_update
        release.set()
        pool.settle()  # its call ends (failed past its deadline): a retry after a backoff
        clock.advance(RETRY_MAX)
        pool.maintain()
        pool.settle()
        fenced = stubs[b].rpcs("UpdateWeights")[-1]
        assert fenced.version == 3 and 0 < fenced.share_until < fenced.trainer_version
        # It holds v3, within S = 1 of the trainer: current again; the next push shares.
        assert "servers_lagging" not in pool.metrics()
        pool.update_weights(4, "/w/v4")
        pool.settle()
        back = stubs[b].rpcs("UpdateWeights")[-1]
        assert back.admission_share == pytest.approx(0.5) and back.share_until >= 4 + 1


def test_a_rejoining_server_joins_after_at_most_two_loads_while_pushes_go_on(fleet):
    """A rejoining server joins once the weights it installed are within S of the trainer: its
    sender sends the newest next, so a load that took several pushes is followed by one more, not
    one per push (before: a load per push, and it joined only once pushing stopped)."""
    make, stubs, clock = fleet
    a, b = "a:1", "b:1"
    with make([a, b], batch_groups=4, max_staleness=1, grace_s=0.0) as pool:
        pool.update_weights(1, "/w/v1", new_admission_epoch=True)
        pool.settle()
        stubs[a].down = True
        pool.pull(1, 1.0)  # a fails (no grace): it leaves
        stubs[a].down = False
        loading = threading.Event()
        finish = threading.Event()
        plain = stubs[a].UpdateWeights

        def slow(request, timeout, metadata):  # a load that lasts several pushes
            loading.set()
            finish.wait(30)
            return plain(request, timeout, metadata)

        stubs[a].UpdateWeights = slow
        clock.advance(RETRY_MAX)
        pool.maintain()  # a answers a probe: its sender starts the rejoin's load
        assert loading.wait(30)
        for version in range(2, 8):  # pushes go on meanwhile
            pool.update_weights(version, f"/w/v{version}")
            pool.pull(1, 1.0, trainer_version=version + 1)
        stubs[a].UpdateWeights = plain
        finish.set()
        pool.settle()
        loads = stubs[a].rpcs("UpdateWeights")
        assert [r.version for r in loads] == [1, 1, 7] and loads[1].new_admission_epoch
        assert loads[2].new_admission_epoch is False
        assert pool.metrics()["servers_up"] == 2


def test_the_server_refusing_an_epoch_it_was_owed_gets_it_with_the_newer_push(fleet):
    """A new admission epoch stays owed until an install confirms it: a push that fails carries
    it on to the next one sent."""
    make, stubs, clock = fleet
    with make(["a:1"]) as pool:
        stubs["a:1"].down = True
        pool.update_weights(1, "/w/v1", new_admission_epoch=True)
        pool.settle()
        pool.update_weights(2, "/w/v2")
        stubs["a:1"].down = False
        clock.advance(RETRY_MAX)
        pool.maintain()
        pool.settle()
        sent = stubs["a:1"].rpcs("UpdateWeights")
        assert [(r.version, r.new_admission_epoch) for r in sent] == [(1, True), (2, True)]


def test_pulls_go_to_every_server_at_once_and_a_deaf_one_holds_no_batch(fleet, caplog):
    """With quotas, each server has one Pull in flight at most, all at once: a batch is made of
    whichever replies come; a server whose Pull hangs (paused, deaf) holds nothing up, and one
    past its deadline is fenced (lagging), not failed; groups beyond the batch wait for the next
    one, still leased."""
    make, stubs, clock = fleet
    a, b = "a:1", "b:1"
    with make([a, b], batch_groups=4, max_staleness=1) as pool:
        pool.update_weights(1, "/w/v1", new_admission_epoch=True)
        pool.settle()
        first = pool.pull(4, 1.0, trainer_version=2)
        first += pool.pull(4 - len(first), 1.0, trainer_version=2)
        assert sorted(g.server_id for g in first) == ["a:1-1"] * 2 + ["b:1-1"] * 2  # shares
        release = threading.Event()
        plain = stubs[b].Pull

        def deaf(request, timeout, metadata):
            stubs[b]._call("Pull", request)
            release.wait(30)
            raise Blocked()

        stubs[b].Pull = deaf
        got: list = []
        for _ in range(50):  # b's quota waits for the fallback, then a fills the batch
            got += pool.pull(4 - len(got), 1.0, trainer_version=3)
            if len(got) >= 4:
                break
            clock.advance(1.0)
        assert [g.server_id for g in got] == ["a:1-1"] * 4
        assert len(stubs[b].rpcs("Pull")) == 2  # one Pull in flight: not one per call
        with caplog.at_level(logging.WARNING, logger="train"):
            release.set()  # b's Pull ends past its deadline: fenced, no failure streak
            wait_until(lambda: pool.metrics().get("servers_lagging") == 1)
        assert "is lagging" in caplog.text and "is down" not in caplog.text
        assert pool.metrics()["servers_up"] == 2
        stubs[b].Pull = plain
        pool.update_weights(2, "/w/v2")
        pool.settle()
        assert stubs[a].rpcs("UpdateWeights")[-1].admission_share == pytest.approx(1.0)
        later = []
        for _ in range(50):  # still pulled, in the background: what it finished is trained
            later += pool.pull(4, 1.0, trainer_version=4)
            if any(g.server_id == "b:1-1" for g in later):
                break
        assert any(g.server_id == "b:1-1" for g in later)


def test_a_reply_after_its_batch_was_made_is_handed_back_unleased(fleet):
    """A Pull's reply that comes after its batch was made from the other servers' replies is
    not kept for the next batch: its groups go back unleased on that server's next Pull, which
    leases them for the batch it names (kept, they would count in no batch's budget)."""
    make, stubs, clock = fleet
    a, b = "a:1", "b:1"
    with make([a, b], batch_groups=2, max_staleness=1) as pool:
        pool.update_weights(1, "/w/v1", new_admission_epoch=True)
        pool.settle()
        release = threading.Event()
        plain = stubs[b].Pull

        def slow(request, timeout, metadata):
            release.wait(30)
            return plain(request, timeout, metadata)

        stubs[b].Pull = slow
        got = pool.pull(2, 1.0, trainer_version=2)  # a's part comes; b's waits
        for _ in range(50):
            if len(got) >= 2:
                break
            clock.advance(1.0)  # the fallback: a fills the batch
            got += pool.pull(2 - len(got), 1.0, trainer_version=2)
        assert [g.server_id for g in got] == ["a:1-1", "a:1-1"]
        stubs[b].Pull = plain
        release.set()  # b's reply, for the batch of version 2, comes now
        wait_until(lambda: not pool._fleet.servers[1].pulling)
        late = {g.group_id for g in pool._pulls.carried}
        assert late and pool._fleet.servers[1].pull_for == 2
        nxt = pool.pull(2, 1.0, trainer_version=3)  # hands them back; b's next Pull carries them
        pool.pull(2 - len(nxt), 1.0, trainer_version=3)
        returned = {i for r in stubs[b].rpcs("Pull") for i in r.return_group_ids}
        assert returned == late and not pool._fleet.servers[1].returns
