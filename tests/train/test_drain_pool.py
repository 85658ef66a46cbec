"""The trainer's side of a preemption notice (docs/DESIGN.md §6.5), against in-process fake
Rollout services: a server that answers "draining" gets no more weights nor share, is pulled
until it has nothing left and then leaves at once (one log line, no grace, no backoff), every
acknowledgement it was owed delivered; its probes stay quiet while it is out, and restarted it
rejoins at the current weights."""

from __future__ import annotations

import logging

import grpc

from rollout_api.client import DRAINING
from rollout_api.proto import rollout_pb2
from tests.clock import FakeClock
from tests.train.test_remote import FakeRollout, pool, serve


class DrainingRollout(FakeRollout):
    """Hands out groups; once ``draining`` is set, only ``left`` more, then a Pull and every
    UpdateWeights answer as a draining server does, and Health answers not live."""

    def __init__(self):
        super().__init__()
        self.draining = False
        self.left = 0
        self.acked: list[int] = []
        self.pull_acks: list[int] = []

    def Pull(self, request, context):
        self.pull_acks.extend(request.ack_group_ids)
        if self.draining:
            if not self.left:
                context.abort(grpc.StatusCode.UNAVAILABLE, f"{DRAINING} nothing left")
            self.left -= 1
            request = rollout_pb2.PullRequest(max_groups=1)
        return super().Pull(request, context)

    def Ack(self, request, context):
        self.acked.extend(request.group_ids)
        return rollout_pb2.AckResponse(acked=len(request.group_ids))

    def UpdateWeights(self, request, context):
        if self.draining:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"{DRAINING} no more weights")
        return super().UpdateWeights(request, context)

    def Health(self, request, context):
        return rollout_pb2.HealthResponse(live=not self.draining, version=self.version)


def test_a_draining_server_is_pulled_empty_then_leaves_at_once_with_one_log_line(caplog):
    a, b = DrainingRollout(), FakeRollout()
    clock = FakeClock()
    for addr_a in serve(a):
        for addr_b in serve(b):
            with pool([addr_a, addr_b], grace_s=3600, clock=clock, sleep=clock.sleep) as p:
                first = p.pull(2, timeout_s=0.0)  # from a (round robin starts there)
                assert [g.group_id for g in first] == [0, 1]
                p.ack(first)  # trained: the acknowledgement waits for a's next Pull
                a.draining, a.left = True, 1
                with caplog.at_level(logging.INFO, logger="train"):
                    # The push tells the pool: a gets no more weights, and b's share is 1.
                    p.update_weights(2, "/w/v2")
                    p.settle()
                    assert p.metrics()["servers_up"] == 2  # still pulled: it has a group left
                    p.pull(2, timeout_s=0.0)  # from b
                    [last] = p.pull(2, timeout_s=0.0)  # a's last group
                    p.ack([last])
                    p.pull(2, timeout_s=0.0)  # from b
                    groups = p.pull(2, timeout_s=0.0)  # a has nothing left: straight on to b
                    p.update_weights(3, "/w/v3")
                    p.settle()
                    for _ in range(3):  # probes of a, due at once on the fake clock
                        clock.advance(3600)
                        p.maintain()
                        p.settle()
                assert last.group_id == 2 and len(groups) == 2
                assert all(g.key.startswith("/") for g in groups)  # b's (no server id here)
                assert p.metrics()["servers_up"] == 1
                # It answered: no grace (3600 s here), no backoff sleep, no failure streak.
                assert clock.sleeps == []
                # What it was owed reached it with its Pulls (the one it refused too).
                assert sorted(set(a.pull_acks) | set(a.acked)) == [0, 1, 2]
                assert a.updates == [] and [u[0] for u in b.updates] == [2, 3]
                assert [u for u in b.updates if u[0] == 2] == [(2, "/w/v2", False)]
                lines = [r.getMessage() for r in caplog.records if addr_a in r.getMessage()]
                assert len(lines) == 1 and "is draining" in lines[0], lines
                # Nothing is pending for it: the acknowledgements were delivered.
                p.flush_acks()
                assert "not sent" not in caplog.text


def test_a_drained_server_restarted_rejoins_at_the_current_weights(caplog):
    a, b = DrainingRollout(), FakeRollout()
    clock = FakeClock()
    for addr_a in serve(a):
        for addr_b in serve(b):
            with pool([addr_a, addr_b], clock=clock, sleep=clock.sleep) as p:
                a.draining = True
                p.update_weights(3, "/w/v3")
                p.settle()
                p.pull(1, timeout_s=0.0)  # a: nothing left, so it leaves; b's group
                assert p.metrics()["servers_up"] == 1 and [u[0] for u in b.updates] == [3]
                a.draining = False  # restarted on its state_dir
                clock.advance(3600)
                with caplog.at_level(logging.INFO, logger="train"):
                    p.maintain()
                    p.settle()
                assert p.metrics()["servers_up"] == 2
                assert a.updates == [(3, "/w/v3", True)]  # the current weights, a new epoch
                assert f"rollout server {addr_a} joined" in caplog.text
