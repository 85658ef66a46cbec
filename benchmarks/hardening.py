"""The rollout server's hardening measured from outside (docs/DESIGN.md §6.2, §10), for any
checkout: `python benchmarks/hardening.py [--tree PATH] [--repeats 3]`.

One `sat-serve` of `--tree` (default: this checkout) on the tiny setup with a token, driven over
gRPC by this checkout's client (calls carry the token; an `Ack` a tree does not know is skipped):

- lost: two Pulls abandoned by their 1 s deadline while no group exists, then the first weights
  (2 · batch groups admitted); how many of those groups a patient puller never receives.
- update_s: UpdateWeights latency while 16 long Pulls (timeout 30 s) wait (median of repeats).
- health_s: the slowest Health call issued while a 64 MB Decode is in flight, and decode_s, the
  time until that Decode is refused (medians of repeats).

Before/after: run it once with `--tree` at a checkout before the hardening and once on this one.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import pathlib
import signal
import statistics
import subprocess
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import grpc  # noqa: E402
import numpy as np  # noqa: E402

from rollout_server import jetstream_compat  # noqa: E402,F401  (must precede jetstream imports)

# isort: split
from jetstream.core.proto import jetstream_pb2, jetstream_pb2_grpc  # noqa: E402

from rollout_api.client import bearer_metadata, channel_options  # noqa: E402
from rollout_api.proto import rollout_pb2, rollout_pb2_grpc  # noqa: E402

TOKEN = "bench-token"
BATCH = 2
AHEAD = 2 * BATCH  # max_staleness 1: groups admitted by the first weights
MD = bearer_metadata(TOKEN)


def start_server(tree: pathlib.Path, tmp: pathlib.Path, port: int) -> subprocess.Popen:
    """`python -m rollout_server` of `tree`, waiting for weights, logging to tmp/server.log."""
    env = dict(os.environ, PYTHONPATH=str(tree), JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    cmd = [sys.executable, "-m", "rollout_server", "--config", "configs/arith_tiny.yaml",
           f"server.port={port}", f"server.token={TOKEN}", f"server.checkpoint_root={tmp}",
           "server.slots=4", "rollout.group_size=2", "rollout.max_new_tokens=6",
           f"rollout.batch_groups={BATCH}", "rollout.max_staleness=1"]  # fmt: skip
    log = open(tmp / "server.log", "w")
    proc = subprocess.Popen(cmd, cwd=tree, env=env, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while "serving on" not in (tmp / "server.log").read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError((tmp / "server.log").read_text()[-3000:])
        time.sleep(0.5)
    return proc


def checkpoint(tmp: pathlib.Path, version: int) -> str:
    """Random tiny params saved as tmp/v<version> (the format both sides share)."""
    import jax
    from flax import nnx

    from sat_jax.model import ModelConfig, Transformer
    from sat_jax.params_io import save_params

    cfg = ModelConfig.preset("tiny")
    abstract = nnx.to_pure_dict(
        nnx.state(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))
    )
    rng = np.random.default_rng(version)
    params = jax.tree.map(lambda x: (rng.standard_normal(x.shape) * 0.1).astype(x.dtype), abstract)
    path = tmp / f"v{version}"
    save_params(path, params)
    return str(path)


def update(stub, tmp, version: int) -> float:
    path = checkpoint(tmp, version)
    start = time.perf_counter()
    stub.UpdateWeights(
        rollout_pb2.UpdateWeightsRequest(version=version, checkpoint_path=path, token=TOKEN),
        timeout=600,
        metadata=MD,
    )
    return time.perf_counter() - start


def ack(stub, ids) -> None:
    try:
        stub.Ack(rollout_pb2.AckRequest(group_ids=ids), timeout=30, metadata=MD)
    except grpc.RpcError as e:  # a tree without Ack: Pull consumed them already
        if e.code() != grpc.StatusCode.UNIMPLEMENTED:
            raise


def measure_lost(stub, tmp) -> int:
    """Groups never received after two Pulls abandoned by their deadline."""
    for _ in range(2):
        try:
            stub.Pull(rollout_pb2.PullRequest(max_groups=AHEAD, timeout_s=60), timeout=1,
                      metadata=MD)  # fmt: skip
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.DEADLINE_EXCEEDED, e
    update(stub, tmp, 1)
    got: list[int] = []
    deadline = time.monotonic() + 90  # generation takes seconds; leases (5 min) are not awaited
    while len(got) < AHEAD and time.monotonic() < deadline:
        request = rollout_pb2.PullRequest(max_groups=AHEAD, timeout_s=2)
        got += [g.group_id for g in stub.Pull(request, timeout=30, metadata=MD).groups]
    ack(stub, got)
    return AHEAD - len(got)


def measure_update(stub, tmp, version: int) -> float:
    """UpdateWeights seconds while 16 Pulls (timeout 30 s) wait; then collects their groups."""
    pull = rollout_pb2.PullRequest(max_groups=1, timeout_s=30)
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        pulls = [pool.submit(stub.Pull, pull, timeout=120, metadata=MD) for _ in range(16)]
        time.sleep(2.0)  # the Pulls reach the server and wait (admission is closed)
        seconds = update(stub, tmp, version)
        ids = [g.group_id for p in pulls for g in p.result().groups]
    ack(stub, ids)
    return seconds


def measure_health(channel, stub) -> tuple[float, float]:
    """(slowest Health during a 64 MB Decode, seconds until the Decode is refused)."""
    decode = jetstream_pb2_grpc.OrchestratorStub(channel)
    huge = jetstream_pb2.DecodeRequest(
        text_content=jetstream_pb2.DecodeRequest.TextContent(text="1" * (64 << 20)), max_tokens=2
    )

    def send() -> float:
        start = time.perf_counter()
        try:
            list(decode.Decode(huge, timeout=300, metadata=MD))
        except grpc.RpcError:
            pass
        return time.perf_counter() - start

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        refused = pool.submit(send)
        slowest = 0.0
        while not refused.done():
            start = time.perf_counter()
            stub.Health(rollout_pb2.HealthRequest(), timeout=300)
            slowest = max(slowest, time.perf_counter() - start)
        return slowest, refused.result()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", default=str(REPO), help="the checkout whose server runs")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    import portpicker

    tree = pathlib.Path(args.tree).resolve()
    with tempfile.TemporaryDirectory() as d:
        tmp, port = pathlib.Path(d), portpicker.pick_unused_port()
        proc = start_server(tree, tmp, port)
        try:
            options = channel_options(256 << 20)
            channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=options)
            stub = rollout_pb2_grpc.RolloutStub(channel)
            lost = measure_lost(stub, tmp)
            updates = [measure_update(stub, tmp, 2 + i) for i in range(args.repeats)]
            health = [measure_health(channel, stub) for _ in range(args.repeats)]
        finally:
            proc.send_signal(signal.SIGINT)  # at once, state saved (SIGTERM would drain first)
            proc.wait(60)
    result = {
        "tree": str(tree),
        "lost_groups": lost,
        "update_s_with_16_pulls": statistics.median(updates),
        "health_s_during_64mb_decode": statistics.median(h for h, _ in health),
        "decode_refused_s": statistics.median(r for _, r in health),
        "raw": {"update_s": updates, "health_decode_s": health},
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
