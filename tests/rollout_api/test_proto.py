"""The committed generated modules match a fresh grpcio-tools generation; size limits are set."""

import pathlib
import subprocess
import sys

import pytest

from rollout_api.client import channel_options
from rollout_api.proto import regenerate, rollout_pb2
from sat_jax.config import ServerConfig

GENERATED = ("rollout_pb2.py", "rollout_pb2_grpc.py")


def test_committed_modules_match_fresh_generation(tmp_path):
    # protoc runs in a subprocess: in-process it can crash a worker that already loaded protobuf.
    out = subprocess.run(
        [sys.executable, "-m", "rollout_api.proto.regenerate", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=regenerate.REPO_ROOT,
    )
    assert out.returncode == 0, out.stderr
    fresh_dir = tmp_path / "rollout_api" / "proto"
    assert out.stdout.split() == [str(fresh_dir / name) for name in GENERATED]
    for name in GENERATED:
        fresh, committed = fresh_dir / name, regenerate.PROTO_DIR / name
        assert fresh.is_file(), f"regeneration wrote no {name}"
        assert committed.read_bytes() == fresh.read_bytes(), (
            f"{name} is stale: run python -m rollout_api.proto.regenerate"
        )


def test_package_is_distinct_from_jetstream():
    assert rollout_pb2.DESCRIPTOR.package == "satjax.rollout.v1"


def test_message_limits():
    limit = ServerConfig().max_message_bytes
    assert limit >= 256 * 1024 * 1024  # real batches, far above gRPC's 4 MB default
    opts = dict(channel_options(limit))
    assert opts["grpc.max_send_message_length"] == limit
    assert opts["grpc.max_receive_message_length"] == limit


@pytest.mark.parametrize(
    "path", ["rollout_server/proto", "sat_jax/parallel", "sat_jax/advantages.py"]
)
def test_one_name_per_module_no_alias_modules(path):
    # The protocol lives in rollout_api/proto only; the former aliases are gone (DESIGN §1).
    assert not (pathlib.Path(__file__).resolve().parents[2] / path).exists()
