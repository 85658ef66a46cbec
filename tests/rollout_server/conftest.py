"""A rollout server in a subprocess (JetStream SIGKILLs its process on a thread error, so a crash
must fail a test, not kill pytest)."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import time

import grpc
import numpy as np
import portpicker
import pytest
from flax import nnx

from rollout_api.client import bearer_metadata, channel_options
from rollout_api.proto import rollout_pb2, rollout_pb2_grpc
from sat_jax.experiment import load_config

REPO = pathlib.Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "arith_tiny.yaml"
# Shared by every server process of the session: restarts skip XLA compilation.
JAX_CACHE = pathlib.Path(tempfile.gettempdir()) / "sat_jax_rollout_test_jax_cache"
# Every test server uses these shapes, so later processes hit the compilation cache.
SHAPES = ["server.slots=4", "rollout.max_new_tokens=6", "rollout.group_size=2"]
# The test servers' gRPC message limit, for the clients' channels.
MAX_MESSAGE_BYTES = load_config(str(CONFIG), SHAPES).server.max_message_bytes


class ServerProcess:
    """`python -m rollout_server --config configs/arith_tiny.yaml ...` on a free port, on one CPU
    device (or `devices` simulated ones); `module` runs another server command (the stand-in)."""

    def __init__(
        self,
        tmp: pathlib.Path,
        overrides: list[str],
        devices: int = 1,
        module: str = "rollout_server",
    ):
        self.token = [o.split("=", 1)[1] for o in overrides if o.startswith("server.token=")]
        self.token = self.token[-1] if self.token else ""
        self.port = portpicker.pick_unused_port()
        self.address = f"127.0.0.1:{self.port}"
        self.log_path = tmp / f"server-{self.port}.log"
        env = dict(os.environ)
        env.pop("XLA_FLAGS", None)  # one CPU device is enough for the server
        if devices > 1:
            env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
        env.update(
            JAX_PLATFORMS="cpu",
            JAX_COMPILATION_CACHE_DIR=str(JAX_CACHE),
            JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
            JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
        )
        # Its own state_dir unless the test names one (the config's is shared, and locked).
        state = f"server.state_dir={tmp / f'state-{self.port}'}"
        cmd = [sys.executable, "-m", module, "--config", str(CONFIG),
               f"server.port={self.port}", state, *SHAPES, *overrides]  # fmt: skip
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            cmd, cwd=REPO, env=env, stdout=self._log, stderr=subprocess.STDOUT
        )

    def log(self) -> str:
        return self.log_path.read_text()

    def wait_ready(self, timeout_s: float = 180) -> ServerProcess:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            if "serving on" in self.log():
                return self
            time.sleep(0.2)
        raise AssertionError(f"server not ready after {timeout_s}s:\n{self.log()}")

    def raw_channel(self) -> grpc.Channel:
        """A channel whose calls carry no token."""
        return grpc.insecure_channel(self.address, options=channel_options(MAX_MESSAGE_BYTES))

    def channel(self) -> grpc.Channel:
        """A channel whose calls carry the server's token (when it has one)."""
        return grpc.intercept_channel(self.raw_channel(), BearerToken(self.token))

    def rollout_stub(self) -> rollout_pb2_grpc.RolloutStub:
        return rollout_pb2_grpc.RolloutStub(self.channel())

    def stop(self) -> int:
        """SIGINT (a stop at once, state saved: SIGTERM would drain for `server.drain_s`), then
        SIGKILL after 30 s; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self._log.close()


class BearerToken(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    """Adds `authorization: Bearer <token>` to every call (nothing for "")."""

    def __init__(self, token: str):
        self.metadata = list(bearer_metadata(token))

    def _with_token(self, details):
        metadata = [*(details.metadata or ()), *self.metadata]
        return details._replace(metadata=metadata)

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._with_token(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._with_token(details), request)


def wait_for(predicate, timeout_s: float = 120, interval_s: float = 0.2):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    raise AssertionError(f"condition not met within {timeout_s}s")


_PER_TOKEN = {
    "prompt_ids": np.int32,
    "completion_ids": np.int32,
    "behavior_logprobs": np.float32,
    "versions": np.int64,
    "kept_counts": np.int32,
    "loss_mask": np.int64,
}


def unpacked(groups) -> list[rollout_pb2.Group]:
    """Copies of pulled group messages with their packed per-token arrays (`*_packed`, what the
    server sends) in the repeated fields too, so a test reads `list(t.prompt_ids)`."""
    from rollout_api.records import unpack_array

    out = []
    for g in groups:
        g = rollout_pb2.Group.FromString(g.SerializeToString())
        for t in g.trajectories:
            for name, dtype in _PER_TOKEN.items():
                if t.HasField(f"{name}_packed") and not len(getattr(t, name)):
                    getattr(t, name).extend(unpack_array(getattr(t, f"{name}_packed"), dtype))
        out.append(g)
    return out


def pull_all(stub, n, timeout_s=120.0):
    """Pulls `n` groups (with their texts), acknowledging each Pull's groups with the next and
    the last with Ack; the messages `unpacked`."""
    groups = []

    def pull():
        acks = [g.group_id for g in groups]
        request = rollout_pb2.PullRequest(
            max_groups=n - len(groups), timeout_s=5, ack_group_ids=acks, include_texts=True
        )
        groups.extend(unpacked(stub.Pull(request, timeout=30).groups))
        return len(groups) >= n

    wait_for(pull, timeout_s=timeout_s, interval_s=0)
    stub.Ack(rollout_pb2.AckRequest(group_ids=[g.group_id for g in groups]), timeout=30)
    return groups


def stats(stub: rollout_pb2_grpc.RolloutStub) -> rollout_pb2.StatsResponse:
    return stub.Stats(rollout_pb2.StatsRequest(), timeout=10)


def random_params(preset: str, seed: int):
    """Params of the right structure for a preset, without running the (slow) eager init."""
    from sat_jax.model import ModelConfig, Transformer

    cfg = ModelConfig.preset(preset)
    abstract = nnx.to_pure_dict(
        nnx.state(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))
    )
    rng = np.random.default_rng(seed)
    import jax

    return jax.tree_util.tree_map(
        lambda x: (rng.standard_normal(x.shape) * 0.1).astype(x.dtype), abstract
    )


@pytest.fixture
def server_factory(tmp_path):
    started: list[ServerProcess] = []

    def start(
        overrides: list[str], devices: int = 1, module: str = "rollout_server"
    ) -> ServerProcess:
        server = ServerProcess(tmp_path, overrides, devices, module)
        started.append(server)
        return server.wait_ready()

    yield start
    for server in started:
        if server.proc.poll() is None:
            server.stop()
