"""The trainer's side of a preemption notice (docs/DESIGN.md §6.5), against in-process fake
Rollout services: a server that answers "draining" leaves the rotation at once (one log line, no
grace, no backoff), gets the acknowledgements it waits for right away, is pushed no more weights,
and its probes stay quiet while it is out."""

from __future__ import annotations

import logging

import grpc

from rollout_api.client import DRAINING
from rollout_api.proto import rollout_pb2
from tests.clock import FakeClock
from tests.train.test_remote import FakeRollout, pool, serve


class DrainingRollout(FakeRollout):
    """Hands out groups until ``draining`` is set; then a Pull with nothing left and every
    UpdateWeights answer as a draining server does, and Health answers not live."""

    def __init__(self):
        super().__init__()
        self.draining = False
        self.acked: list[int] = []
        self.pull_acks: list[int] = []

    def Pull(self, request, context):
        self.pull_acks.extend(request.ack_group_ids)
        if self.draining:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"{DRAINING} shutting down")
        return super().Pull(request, context)

    def Ack(self, request, context):
        self.acked.extend(request.group_ids)
        return rollout_pb2.AckResponse(acked=len(request.group_ids))

    def UpdateWeights(self, request, context):
        if self.draining:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"{DRAINING} shutting down")
        return super().UpdateWeights(request, context)

    def Health(self, request, context):
        return rollout_pb2.HealthResponse(live=not self.draining, version=self.version)


def test_a_draining_server_leaves_at_once_and_gets_its_acknowledgements(caplog):
    a, b = DrainingRollout(), FakeRollout()
    clock = FakeClock()
    for addr_a in serve(a):
        for addr_b in serve(b):
            with pool([addr_a, addr_b], grace_s=3600, clock=clock, sleep=clock.sleep) as p:
                first = p.pull(2, timeout_s=0.0)  # from a (round robin starts there)
                assert [g.group_id for g in first] == [0, 1]
                p.ack(first)  # trained: the acknowledgement waits for a's next Pull
                a.draining = True
                with caplog.at_level(logging.INFO, logger="train"):
                    p.pull(2, timeout_s=0.0)  # from b
                    groups = p.pull(2, timeout_s=0.0)  # a drains: straight on to b
                    p.update_weights(2, "/w/v2")
                    for _ in range(3):  # probes of a, due at once on the fake clock
                        clock.advance(3600)
                        p.maintain()
                assert all(g.server_id == "" for g in groups) and len(groups) == 2
                assert p.metrics()["servers_up"] == 1
                # It answered: no grace (3600 s here), no backoff sleep, no failure streak.
                assert clock.sleeps == []
                # What it was owed reached it, with the Pull it refused (or the Ack after).
                assert sorted(set(a.pull_acks) | set(a.acked)) == [0, 1]
                assert [u[0] for u in b.updates] == [2] and a.updates == []
                lines = [r.getMessage() for r in caplog.records if addr_a in r.getMessage()]
                assert len(lines) == 1 and "draining" in lines[0], lines
                assert "left the rotation" in lines[0]


def test_a_drained_server_restarted_rejoins_at_the_current_weights(caplog):
    a, b = DrainingRollout(), FakeRollout()
    clock = FakeClock()
    for addr_a in serve(a):
        for addr_b in serve(b):
            with pool([addr_a, addr_b], clock=clock, sleep=clock.sleep) as p:
                a.draining = True
                p.update_weights(3, "/w/v3")
                assert p.metrics()["servers_up"] == 1 and [u[0] for u in b.updates] == [3]
                a.draining = False  # restarted on its state_dir
                clock.advance(3600)
                with caplog.at_level(logging.INFO, logger="train"):
                    p.maintain()
                assert p.metrics()["servers_up"] == 2
                assert a.updates == [(3, "/w/v3", True)]  # the current weights, a new epoch
                assert f"rollout server {addr_a} joined" in caplog.text
