"""ServerPool against an in-process fake Rollout service: round robin, retries while a server is
down (with a log line), weight pushes to every server, and giving up after server_wait_s."""

from __future__ import annotations

import logging
from concurrent import futures

import grpc
import portpicker
import pytest

from rollout_server.proto import rollout_pb2, rollout_pb2_grpc
from train.remote import ServerPool, ServersDownError


class FakeRollout(rollout_pb2_grpc.RolloutServicer):
    def __init__(self):
        self.next_id = 0
        self.updates: list[tuple[int, str, bool]] = []
        self.version = 0

    def Pull(self, request, context):
        groups = []
        for _ in range(request.max_groups):
            groups.append(rollout_pb2.Group(group_id=self.next_id, prompt_id=f"p{self.next_id}"))
            self.next_id += 1
        return rollout_pb2.PullResponse(groups=groups)

    def UpdateWeights(self, request, context):
        if request.version < self.version:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "older version")
        self.version = request.version
        self.updates.append((request.version, request.checkpoint_path, request.new_admission_epoch))
        return rollout_pb2.UpdateWeightsResponse(version=request.version)

    def Health(self, request, context):
        return rollout_pb2.HealthResponse(live=True, version=self.version)


@pytest.fixture
def fake():
    servicer = FakeRollout()
    server = grpc.server(futures.ThreadPoolExecutor(2))
    rollout_pb2_grpc.add_RolloutServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield servicer, f"127.0.0.1:{port}"
    finally:
        server.stop(0)


def test_pull_skips_a_down_server_with_a_log_line(fake, caplog):
    servicer, address = fake
    dead = f"127.0.0.1:{portpicker.pick_unused_port()}"
    with ServerPool([dead, address], retry_max_s=0.1, server_wait_s=30) as pool:
        with caplog.at_level(logging.WARNING, logger="train"):
            groups = pool.pull(3, timeout_s=0.1)
        assert [g.prompt_id for g in groups] == ["p0", "p1", "p2"]
        assert f"rollout server {dead} is down" in caplog.text


def test_update_weights_reaches_every_server_and_refusals_raise(fake):
    servicer, address = fake
    with ServerPool([address, address]) as pool:
        pool.update_weights(3, "/ckpt/v3", new_admission_epoch=True)
        pool.update_weights(4, "/ckpt/v4")
        assert servicer.updates == [
            (3, "/ckpt/v3", True),
            (3, "/ckpt/v3", True),
            (4, "/ckpt/v4", False),
            (4, "/ckpt/v4", False),
        ]
        assert pool.versions() == [4, 4]
        with pytest.raises(grpc.RpcError) as info:
            pool.update_weights(2, "/ckpt/v2")
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_gives_up_when_every_server_stays_down():
    dead = f"127.0.0.1:{portpicker.pick_unused_port()}"
    with ServerPool([dead], retry_max_s=0.1, server_wait_s=1.0) as pool:
        with pytest.raises(ServersDownError, match="no rollout server answered"):
            pool.pull(1, timeout_s=0.1)


def test_on_retry_can_stop_the_wait():
    dead = f"127.0.0.1:{portpicker.pick_unused_port()}"

    def local_server_exited():
        raise RuntimeError("the rollout server exited with -9")

    with ServerPool([dead], server_wait_s=600, on_retry=local_server_exited) as pool:
        with pytest.raises(RuntimeError, match="exited with -9"):
            pool.pull(1, timeout_s=0.1)
