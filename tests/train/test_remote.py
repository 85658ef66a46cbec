"""ServerPool against an in-process fake Rollout service: round robin, retries while a server is
down (with a log line), weight pushes to every server, giving up after server_wait_s, and the
message size limit (server.max_message_bytes) reaching the trainer's channel."""

from __future__ import annotations

import dataclasses
import logging
from concurrent import futures

import grpc
import portpicker
import pytest

from rollout_api import records
from rollout_api.proto import rollout_pb2, rollout_pb2_grpc
from tests.clock import FakeClock
from train.membership import MessageTooLargeError, ServersDownError
from train.remote import ServerPool

MiB = 1024 * 1024


def pool(addresses, **kw) -> ServerPool:
    """A ServerPool with the test's settings, overridable per test."""
    base = dict(token="", max_message_bytes=8 * MiB, retry_max_s=0.1, server_wait_s=30.0)
    return ServerPool(addresses, **(base | kw))


class FakeRollout(rollout_pb2_grpc.RolloutServicer):
    def __init__(self, payload_bytes: int = 0):
        self.payload_bytes = payload_bytes
        self.next_id = 0
        self.updates: list[tuple[int, str, bool]] = []
        self.version = 0

    def Pull(self, request, context):
        groups = []
        for _ in range(request.max_groups):
            # One prompt token whose routing is `payload_bytes` expert ids ([1, 1, payload]).
            n = self.payload_bytes
            routing = rollout_pb2.Routing(data=b"\x01" * n, shape=[1, 1, n], dtype="uint8")
            traj = rollout_pb2.Trajectory(prompt_ids=[1], routing=routing if n else None)
            groups.append(
                rollout_pb2.Group(
                    group_id=self.next_id, prompt_id=f"p{self.next_id}", trajectories=[traj]
                )
            )
            self.next_id += 1
        return rollout_pb2.PullResponse(groups=groups)

    def UpdateWeights(self, request, context):
        if request.version < self.version:  # the real server's refusal
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"version {request.version} is older than the current version {self.version}",
            )
        if "outside" in request.checkpoint_path:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "not under the checkpoint root")
        self.version = request.version
        self.updates.append((request.version, request.checkpoint_path, request.new_admission_epoch))
        return rollout_pb2.UpdateWeightsResponse(version=request.version)

    def Health(self, request, context):
        return rollout_pb2.HealthResponse(live=True, version=self.version)


def serve(servicer: FakeRollout):
    """Starts ``servicer`` on a free loopback port (sending up to 64 MiB); yields its address."""
    options = [("grpc.max_send_message_length", 64 * MiB)]
    server = grpc.server(futures.ThreadPoolExecutor(2), options=options)
    rollout_pb2_grpc.add_RolloutServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(0)


@pytest.fixture
def fake():
    servicer = FakeRollout()
    for address in serve(servicer):
        yield servicer, address


@pytest.fixture
def large():
    """A server whose groups are ~2 MiB each."""
    yield from serve(FakeRollout(payload_bytes=2 * MiB))


def test_pull_skips_a_down_server_with_a_log_line(fake, caplog):
    servicer, address = fake
    dead = f"127.0.0.1:{portpicker.pick_unused_port()}"
    with pool([dead, address]) as p:
        with caplog.at_level(logging.WARNING, logger="train"):
            groups = p.pull(3, timeout_s=0.1)
        assert [g.prompt_id for g in groups] == ["p0", "p1", "p2"]
        assert all(isinstance(g, records.Group) for g in groups)  # decoded where pulled
        assert f"rollout server {dead} is down" in caplog.text


def test_pull_decodes_and_validates_against_the_limits(fake):
    servicer, address = fake
    limits = records.GroupLimits(vocab_size=1, num_experts=1, routing_lk=None)
    with pool([address]) as p:
        [bad] = p.pull(1, timeout_s=0.1, limits=limits)  # its prompt id 1 is past the vocab
        [good] = p.pull(1, timeout_s=0.1, limits=dataclasses.replace(limits, vocab_size=2))
    assert isinstance(bad, records.InvalidGroup) and bad.key == "/0"
    assert "trajectory 0: prompt token id 1 outside [0, 1)" in bad.problem
    assert isinstance(good, records.Group) and good.trajectories[0].prompt_ids.tolist() == [1]


def test_update_weights_reaches_every_server_and_refusals_raise(fake):
    """Every server gets each push; one refused because the server holds a newer version counts
    as current; any other refusal is raised in the caller's next call."""
    servicer, address = fake
    with pool([address, address]) as p:
        p.update_weights(3, "/ckpt/v3", new_admission_epoch=True, wait_s=30)
        p.update_weights(4, "/ckpt/v4", wait_s=30)
        assert servicer.updates == [
            (3, "/ckpt/v3", True),
            (3, "/ckpt/v3", True),
            (4, "/ckpt/v4", False),
            (4, "/ckpt/v4", False),
        ]
        assert p.versions() == [4, 4]
        p.update_weights(2, "/ckpt/v2", wait_s=30)  # older than the servers': counted current
        assert p.installed(address) == 4 and p.versions() == [4, 4]
        p.update_weights(5, "/ckpt/outside/v5")
        p.settle()
        with pytest.raises(grpc.RpcError) as info:
            p.pull(1, timeout_s=0.0)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "checkpoint root" in info.value.details()


def test_gives_up_when_every_server_stays_down():
    dead = f"127.0.0.1:{portpicker.pick_unused_port()}"
    clock = FakeClock()
    kw = dict(server_wait_s=1.0, retry_max_s=0.25, clock=clock, sleep=clock.sleep)
    with pool([dead], **kw) as p:
        with pytest.raises(ServersDownError, match="no rollout server answered"):
            p.pull(1, timeout_s=0.1)
    # Retried (waits capped at retry_max_s) until just past server_wait_s, then no longer.
    assert max(clock.sleeps) == 0.25 and sum(clock.sleeps[:-1]) <= 1.0 < sum(clock.sleeps)


def test_server_wait_counts_from_the_first_failure_not_the_last_answer():
    """A pool idle for longer than server_wait_s still retries a server that just went down."""
    dead = f"127.0.0.1:{portpicker.pick_unused_port()}"
    retries = []
    clock = FakeClock()
    kw = dict(server_wait_s=0.5, on_retry=lambda: retries.append(1), clock=clock)
    with pool([dead], sleep=clock.sleep, **kw) as p:
        clock.advance(0.6)  # idle: no call in flight, so nothing has failed yet
        with pytest.raises(ServersDownError):
            p.pull(1, timeout_s=0.1)
    assert len(retries) >= 2


def test_on_retry_can_stop_the_wait():
    dead = f"127.0.0.1:{portpicker.pick_unused_port()}"

    def local_server_exited():
        raise RuntimeError("the rollout server exited with -9")

    with pool([dead], server_wait_s=600, on_retry=local_server_exited) as p:
        with pytest.raises(RuntimeError, match="exited with -9"):
            p.pull(1, timeout_s=0.1)


def test_a_reply_over_the_message_limit_fails_at_once_naming_the_setting(large, caplog):
    with pool([large], max_message_bytes=1 * MiB, server_wait_s=600) as p:
        with caplog.at_level(logging.WARNING, logger="train"):
            with pytest.raises(MessageTooLargeError, match="server.max_message_bytes") as info:
                p.pull(1, timeout_s=0.1)
    assert "larger than max" in str(info.value) and "is down" not in caplog.text
    with pool([large], max_message_bytes=8 * MiB) as p:
        [group] = p.pull(1, timeout_s=0.1)
    assert group.trajectories[0].routing.nbytes == 2 * MiB
