"""The hardened server live (docs/DESIGN.md §6.2, §10): the token on every RPC but health checks,
version jumps and foreign admission epochs refused, no group lost to an abandoned Pull or a killed
client, a 64 MB request refused without stalling Health, long Pulls that block neither Health,
Stats nor UpdateWeights, and one server per state_dir."""

from __future__ import annotations

import concurrent.futures
import fcntl
import json
import subprocess
import sys
import urllib.request

import grpc
import portpicker
import pytest

from rollout_server import jetstream_compat  # noqa: F401  (must precede jetstream imports)

# isort: split
from jetstream.core.proto import jetstream_pb2, jetstream_pb2_grpc

from rollout_api.proto import rollout_pb2, rollout_pb2_grpc
from sat_jax.params_io import save_params
from tests.rollout_server.conftest import (
    REPO,
    pull_all,
    random_params,
    stats,
    wait_for,
)

pytestmark = pytest.mark.slow  # starts server processes

TOKEN = "s3cret"
BATCH, STALENESS = 2, 1
AHEAD = (STALENESS + 1) * BATCH  # groups of the first weights


def _server(server_factory, tmp, *overrides):
    (tmp / "ckpt").mkdir(exist_ok=True)
    return server_factory(
        [
            f"server.token={TOKEN}",
            f"server.checkpoint_root={tmp / 'ckpt'}",
            f"server.state_dir={tmp / 'state'}",
            f"rollout.batch_groups={BATCH}",
            f"rollout.max_staleness={STALENESS}",
            *overrides,
        ]
    )


def _push(stub, tmp, version):
    path = tmp / "ckpt" / f"v{version}"
    if not path.exists():
        save_params(path, random_params("tiny", seed=version))
    request = rollout_pb2.UpdateWeightsRequest(version=version, checkpoint_path=str(path))
    return stub.UpdateWeights(request, timeout=120)


def _code(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as e:
        call()
    return e.value.code()


def test_every_rpc_but_health_needs_the_token(server_factory, tmp_path):
    server = _server(
        server_factory, tmp_path, "server.wait_for_weights=false", "server.max_version_jump=5"
    )
    stub = server.rollout_stub()
    wait_for(lambda: stats(stub).groups_queued == AHEAD)  # the initial weights' groups
    before = stats(stub)
    raw = rollout_pb2_grpc.RolloutStub(server.raw_channel())
    wrong = [("authorization", "Bearer nope")]
    decode = jetstream_pb2.DecodeRequest(
        text_content=jetstream_pb2.DecodeRequest.TextContent(text="1+1="), max_tokens=2
    )
    raw_decode = jetstream_pb2_grpc.OrchestratorStub(server.raw_channel())
    pull = rollout_pb2.PullRequest(max_groups=AHEAD, timeout_s=1)
    update = rollout_pb2.UpdateWeightsRequest(version=1, checkpoint_path="x", token="nope")
    for md in (None, wrong):
        for call in [
            lambda md=md: raw.Pull(pull, timeout=30, metadata=md),
            lambda md=md: raw.Ack(rollout_pb2.AckRequest(group_ids=[0]), metadata=md),
            lambda md=md: raw.Stats(rollout_pb2.StatsRequest(), timeout=30, metadata=md),
            lambda md=md: raw.UpdateWeights(update, timeout=30, metadata=md),
            lambda md=md: list(raw_decode.Decode(decode, timeout=30, metadata=md)),
        ]:
            assert _code(call) == grpc.StatusCode.UNAUTHENTICATED
    assert raw.Health(rollout_pb2.HealthRequest(), timeout=30).live
    assert raw_decode.HealthCheck(jetstream_pb2.HealthCheckRequest(), timeout=30).is_live
    after = stats(stub)
    assert (after.groups_queued, after.groups_leased, after.groups_consumed) == (
        before.groups_queued, 0, 0)  # fmt: skip
    # The token in UpdateWeights' own field is still accepted (metadata or field).
    path = tmp_path / "ckpt" / "v1"
    save_params(path, random_params("tiny", seed=1))
    field = rollout_pb2.UpdateWeightsRequest(
        version=1, checkpoint_path=str(path), token=TOKEN, new_admission_epoch=True, run_id="run-a"
    )
    assert raw.UpdateWeights(field, timeout=120).version == 1
    # Beyond server.max_version_jump, or a new epoch from a run other than the attached one:
    # refused, and the version stays.
    for request, code in [
        (rollout_pb2.UpdateWeightsRequest(version=1 + 6, checkpoint_path=str(path)),
         grpc.StatusCode.INVALID_ARGUMENT),
        (rollout_pb2.UpdateWeightsRequest(version=2, checkpoint_path=str(path),
                                          new_admission_epoch=True, run_id="run-b"),
         grpc.StatusCode.FAILED_PRECONDITION),
    ]:  # fmt: skip
        assert _code(lambda r=request: stub.UpdateWeights(r, timeout=120)) == code
    assert stats(stub).version == 1
    # A 64 MB request is refused by the receive limit, and Health answers meanwhile.
    huge = jetstream_pb2.DecodeRequest(
        text_content=jetstream_pb2.DecodeRequest.TextContent(text="1" * (64 << 20)), max_tokens=2
    )
    decoder = jetstream_pb2_grpc.OrchestratorStub(server.channel())
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        refused = pool.submit(lambda: _code(lambda: list(decoder.Decode(huge, timeout=120))))
        assert stub.Health(rollout_pb2.HealthRequest(), timeout=30).live
        assert refused.result() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert stub.Health(rollout_pb2.HealthRequest(), timeout=30).live


_CLIENT = """
import sys, grpc
from rollout_api.proto import rollout_pb2, rollout_pb2_grpc
stub = rollout_pb2_grpc.RolloutStub(grpc.insecure_channel(sys.argv[1]))
got = stub.Pull(rollout_pb2.PullRequest(max_groups=2, timeout_s=120), timeout=300,
                metadata=[("authorization", "Bearer " + sys.argv[2])]).groups
print(" ".join(str(g.group_id) for g in got), flush=True)
sys.stdin.read()  # holds the groups, never acknowledging them, until killed
"""


def _client(address: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", _CLIENT, address, TOKEN],
        cwd=REPO,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


def test_no_group_is_lost_to_abandoned_pulls_or_killed_clients(server_factory, tmp_path):
    server = _server(server_factory, tmp_path, "server.lease_s=5")
    stub = server.rollout_stub()
    # Before any weights no group exists: these Pulls wait, and are abandoned while waiting ...
    waiting = _client(server.address)
    pull = rollout_pb2.PullRequest(max_groups=AHEAD, timeout_s=60)
    for _ in range(2):  # ... by their deadline
        assert _code(lambda: stub.Pull(pull, timeout=1)) == grpc.StatusCode.DEADLINE_EXCEEDED
    waiting.kill()  # ... and by a killed client
    waiting.wait()
    _push(stub, tmp_path, 1)
    wait_for(lambda: stats(stub).groups_produced == AHEAD, timeout_s=240)
    # A client that got groups dies before acknowledging them.
    holder = _client(server.address)
    held = [int(i) for i in holder.stdout.readline().split()]
    assert held
    holder.kill()
    holder.wait()
    groups = pull_all(stub, AHEAD)  # the held groups come back after the lease
    assert sorted(g.group_id for g in groups) == list(range(AHEAD))
    s = stats(stub)
    assert (s.groups_produced, s.groups_consumed, s.groups_leased, s.groups_queued) == (
        AHEAD, AHEAD, 0, 0)  # fmt: skip
    # A second server on this state_dir refuses to start: one line, exit code 2.
    out = subprocess.run(
        [sys.executable, "-m", "rollout_server", f"server.state_dir={tmp_path / 'state'}",
         "server.port=0"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 2, out.stderr
    [line] = out.stderr.splitlines()
    assert line.startswith("sat-serve: state_dir ") and "in use by another server" in line, line
    assert stub.Health(rollout_pb2.HealthRequest(), timeout=30).live


def _pulls_waiting(metrics_port: int) -> float:
    """The server's `satjax_rollout_pulls_waiting` gauge (Pulls received, not answered yet)."""
    url = f"http://127.0.0.1:{metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("satjax_rollout_pulls_waiting "):
                return float(line.split()[1])
    raise AssertionError("no satjax_rollout_pulls_waiting in the server's metrics")


def test_long_pulls_block_neither_health_stats_nor_update_weights(server_factory, tmp_path):
    metrics_port = portpicker.pick_unused_port()
    server = _server(
        server_factory, tmp_path, "server.grpc_threads=4", f"server.metrics_port={metrics_port}"
    )
    stub = server.rollout_stub()
    pull = rollout_pb2.PullRequest(max_groups=1, timeout_s=600)
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        pulls = [pool.submit(stub.Pull, pull, timeout=900) for _ in range(16)]
        # Before any weights nothing is generated: every Pull waits for its full timeout, all
        # 16 of them inside the server (4 on its pull threads, 12 queued for one).
        wait_for(lambda: _pulls_waiting(metrics_port) == 16)
        assert stats(stub).groups_produced == 0 and all(not p.done() for p in pulls)
        assert stub.Health(rollout_pb2.HealthRequest(), timeout=60).live
        assert stats(stub).version == 0
        assert _push(stub, tmp_path, 1).version == 1
        assert not any(p.done() for p in pulls)  # all still pending when the update returned
        assert stub.Health(rollout_pb2.HealthRequest(), timeout=60).version == 1
        # The new weights generate groups: the waiting Pulls get them.
        wait_for(lambda: sum(len(p.result().groups) for p in pulls if p.done()) == AHEAD, 300)
        stub.Ack(rollout_pb2.AckRequest(group_ids=list(range(AHEAD))), timeout=30)
        server.stop()  # ends the Pulls still waiting


_FAILING_GENERATE = """
import sys
from rollout_server.engine import MoEEngine

real, calls = MoEEngine.generate, []

def generate(self, *args, **kwargs):  # out of memory (say) on the 5th decode step
    calls.append(1)
    if len(calls) == 5:
        raise MemoryError("RESOURCE_EXHAUSTED: out of memory while allocating")
    return real(self, *args, **kwargs)

MoEEngine.generate = generate
from rollout_server.server import main
main(sys.argv[1:])
"""


def test_a_failed_generate_step_exits_cleanly_with_the_state_saved(tmp_path):
    # JetStream would SIGKILL the process (exit -9, state of the last save only); the server
    # stops instead, saves its state and exits with code 1 for a supervisor to restart it.
    state = tmp_path / "state"
    out = subprocess.run(
        [sys.executable, "-c", _FAILING_GENERATE, "--config", "configs/arith_tiny.yaml",
         f"server.state_dir={state}", "server.wait_for_weights=false", "server.port=0",
         "server.slots=4", "rollout.max_new_tokens=6", "rollout.group_size=2"],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.returncode == 1, out.stderr[-3000:]
    assert "generation failed" in out.stderr and "exiting with code 1" in out.stderr
    saved = json.loads((state / "rollout_state.json").read_text())
    assert saved["unfinished"]  # the groups in flight are re-issued by the next start
    assert not (state / "lock").exists() or _lock_free(state / "lock")


def _lock_free(path) -> bool:
    with open(path) as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
    return True
