"""One process of the two-process trainer test: only process 0 talks to the (fake) servers.

Run as ``python tests/train/multihost_worker.py PORT PROCESS_ID OUT_DIR`` (one CPU device each): joins
a 2-process ``jax.distributed`` job on 127.0.0.1:PORT (gloo), then

- ``pulling.next_batch`` twice, with a ``FakePool`` on process 0 and None on process 1 (the second
  batch's prompt ids are long, so the JSON part is larger); the batches go host to host
  (``multihost_utils.broadcast_one_to_all`` is made to fail);
- ``main.train_loop`` for two steps with prefetch, over a mesh of both processes' devices, with a
  step that gathers the batch it was given (``process_allgather``, in the step, so in the same
  order on both processes): each process made only its own shards, and both train the same
  batches;
- ``main.sync_weights`` with params sharded over both processes (``W_SIZE`` random float32s, pushed
  in bfloat16): process 0 finds its server at version 7 and pushes version 8; each process writes
  its own half of the weights (``process_allgather`` is made to fail, and the bytes of each host
  copy are recorded); both get version 8 back;

and writes what it got to OUT_DIR/p{PROCESS_ID}.npz and .json. ``reference`` and
``reference_loop`` compute the same batches in one process, for the test to compare.
"""

from __future__ import annotations

import json
import pathlib
import sys

import numpy as np

SPEC_KWARGS = dict(
    batch_groups=3,
    group_size=2,
    seq_len=12,
    length_bucket=4,
    routing_lk=(2, 2),
    routing_dtype="uint8",
    max_staleness=1,
    stale_policy="drop",
    vocab_size=64,
    num_experts=8,
)
TRAINER_VERSION = 3
W_SIZE = 1 << 16


def weights() -> np.ndarray:
    """The sharded parameter the processes push (float32, random so it does not compress)."""
    return np.random.default_rng(0).standard_normal(W_SIZE).astype(np.float32)


def _trajectory(seed: int, version: int):
    from rollout_api import records

    rng = np.random.default_rng(seed)
    p, c = 3, int(rng.integers(1, 6))
    routing = rng.integers(0, 8, (p + c, 2, 2)).astype(np.uint8)
    return records.Trajectory(
        prompt_ids=rng.integers(3, 20, p).astype(np.int32),
        completion_ids=rng.integers(3, 20, c).astype(np.int32),
        behavior_logprobs=(-rng.random(c)).astype(np.float32),
        versions=np.full(c, version, np.int64),
        routing=routing,
        reward=float(rng.integers(0, 2)),
    )


def fake_groups(round_: int) -> list:
    """One batch's worth of pulls: three fresh groups, one too stale, one already trained."""
    from rollout_api import records

    long = "x" * 700 * round_  # round 1: > 1 KiB of prompt ids in the JSON part
    specs = [("a", 3), ("stale", 1), ("dup", 3), ("b", 2), ("c", 3)]
    return [
        records.Group(
            group_id=10 * round_ + i,
            prompt_id=f"{name}{round_}{long}" if name != "dup" else "dup",
            trajectories=tuple(_trajectory(100 * round_ + 10 * i + j, v) for j in range(2)),
        )
        for i, (name, v) in enumerate(specs)
    ]


class FakePool:
    """Serves `fake_groups` of ``rounds`` two at a time; a server at version 7 that records weight
    pushes."""

    def __init__(self, rounds: int = 2):
        self.queue = [g for r in range(rounds) for g in fake_groups(r)]
        self.pushes: list[tuple[int, str, bool]] = []
        self.acked: list = []

    def pull(self, max_groups: int, timeout_s: float, *, limits=None, trainer_version=0) -> list:
        n = min(max_groups, 2)
        out, self.queue = self.queue[:n], self.queue[n:]
        return out

    def ack(self, groups, *, rejected: bool = False) -> None:
        self.acked.extend(groups)

    def flush_acks(self) -> None:
        pass

    def versions(self) -> list[int]:
        return [7]

    def update_weights(
        self,
        version: int,
        path: str,
        *,
        new_admission_epoch: bool = False,
        base_path: str = "",
        wait_s: float = 0.0,
    ):
        self.pushes.append((version, path, new_admission_epoch))


def progress():
    from train import checkpointing

    return checkpointing.Progress(
        version=TRAINER_VERSION,
        min_version=1,
        rng_key=(0, 0),
        recent_group_keys=("/2", "/12"),  # the "dup" groups of both rounds (fake_groups)
    )


def record(pulled) -> tuple[dict[str, np.ndarray], dict]:
    """A PulledBatch as (arrays, JSON-able facts): every field of its stats, whatever they are,
    and the lag summaries derived from them."""
    import dataclasses

    batch = {k: np.asarray(v) for k, v in vars(pulled.batch).items() if v is not None}
    s = pulled.stats
    facts = {f.name: _jsonable(getattr(s, f.name)) for f in dataclasses.fields(s)}
    facts |= {"lag_hist": s.lag_hist.tolist(), "lag_mean": s.lag_mean, "lag_max": s.lag_max}
    facts["lags_dtype"] = str(s.lags.dtype)
    return batch, facts


def _jsonable(value):
    if isinstance(value, np.ndarray):
        return value.tolist()
    return list(value) if isinstance(value, tuple) else value


def reference() -> list[tuple[dict[str, np.ndarray], dict]]:
    """Both batches as one process gets them (no broadcast)."""
    from train import batching, pulling

    pool, spec = FakePool(), batching.BatchSpec(**SPEC_KWARGS)
    return [
        record(pulling.next_batch(pool, spec, progress(), timeout_s=0.1, stall_s=5))
        for _ in range(2)
    ]


def reference_loop() -> list[np.ndarray]:
    """The tokens of the two batches the loop trains, made in one process: the second against the
    progress after the first (its version, and its groups counted as trained)."""
    import jax

    from train import batching, main, pulling

    pool, spec = FakePool(rounds=3), batching.BatchSpec(**SPEC_KWARGS)
    first = pulling.next_batch(pool, spec, progress(), timeout_s=0.1, stall_s=5)
    after = main.advance(progress(), first.stats, False, jax.random.key(0))
    second = pulling.next_batch(pool, spec, after, timeout_s=0.1, stall_s=5)
    return [np.asarray(first.batch.tokens), np.asarray(second.batch.tokens)]


def _train_two_steps(pool, mesh) -> dict[str, np.ndarray]:
    """Runs ``main.train_loop`` for two steps with prefetch; returns what each step was given:
    the global tokens (gathered inside the step) and this process's own shards of them."""
    from jax.experimental import multihost_utils

    from sat_jax.experiment import load_config
    from sat_jax.step import TrainState
    from train import batching, main, pulling

    cfg = load_config(
        str(pathlib.Path(__file__).resolve().parents[2] / "configs" / "arith_tiny.yaml"),
        [
            "train.steps=2",
            "train.checkpoint.every=100",
            "train.eval.every=0",
            "train.client.wait_s=5",
        ],
    )
    got: dict[str, np.ndarray] = {}

    def step(state, batch):
        n = int(state.step)
        got[f"loop/{n}/tokens"] = np.asarray(
            multihost_utils.process_allgather(batch.tokens, tiled=True)
        )
        [shard] = batch.tokens.addressable_shards
        got[f"loop/{n}/own_rows"] = np.arange(batch.tokens.shape[0])[shard.index[0]]
        got[f"loop/{n}/own"] = np.asarray(shard.data)
        return state.replace(step=state.step + 1), {"step_skipped": np.float32(0)}

    parts = main.LoopParts(
        pool=pool,
        pusher=None,
        ckpt=None,
        writer=None,
        graphdef=None,
        step_fn=step,
        mesh=mesh,
        spec=batching.BatchSpec(**SPEC_KWARGS),
    )
    state = TrainState(params={}, opt_state=(), step=np.int32(0))
    received = _record_received(got)
    main.train_loop(cfg, parts, state, progress())
    pulling.decode_pulled = received
    return got


def _record_received(got: dict[str, np.ndarray]):
    """Makes ``pulling.decode_pulled`` record, per batch this process receives, the rows of each
    field in the part it was sent and the host batch it made of it; returns the original."""
    import io

    from train import pulling

    decode, count = pulling.decode_pulled, iter(range(100))

    def recording(data: bytes):
        n = next(count)
        with np.load(io.BytesIO(data), allow_pickle=False) as npz:
            for name in ("tokens", "routing", "rewards"):
                got[f"recv/{n}/{name}_rows_sent"] = np.int64(npz[f"batch/{name}"].shape[0])
        pulled = decode(data)
        got[f"recv/{n}/tokens"] = np.asarray(pulled.batch.tokens)
        got[f"recv/{n}/routing"] = np.asarray(pulled.batch.routing)
        return pulled

    pulling.decode_pulled = recording
    return decode


class BrokenPool(FakePool):
    """A pool whose every pull fails (a server gone)."""

    def pull(self, max_groups: int, timeout_s: float, *, limits=None, trainer_version=0) -> list:
        raise ConnectionError("server gone mid-Pull")


def _failed_batch(process_id: int) -> str:
    """``next_batch`` with process 0's pull failing: what each process raised, as a string."""
    from train import batching, pulling

    pool = BrokenPool() if process_id == 0 else None
    try:
        pulling.next_batch(
            pool, batching.BatchSpec(**SPEC_KWARGS), progress(), timeout_s=0.1, stall_s=5
        )
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "nothing raised"


def _no_device_broadcast() -> None:
    from jax.experimental import multihost_utils

    def fail(*args, **kwargs):
        raise AssertionError("a batch went through the devices (broadcast_one_to_all)")

    multihost_utils.broadcast_one_to_all = fail


def _record_host_copies() -> list[int]:
    """Makes ``process_allgather`` fail and ``weight_sync.host_copy`` record the bytes of every
    host copy it makes in this process (the list returned)."""
    from jax.experimental import multihost_utils

    from train import weight_sync

    def no_gather(*args, **kwargs):
        raise AssertionError("process_allgather called on the weight-push path")

    copied: list[int] = []
    host_copy = weight_sync.host_copy

    def recording(params, dtype=None, weight_dtype="bfloat16"):
        out = host_copy(params, dtype, weight_dtype)
        copied.append(sum(s.data.nbytes for x in out.values() for s in x.addressable_shards))
        return out

    multihost_utils.process_allgather = no_gather
    weight_sync.host_copy = recording
    return copied


def main(port: int, process_id: int, out_dir: str) -> None:
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}",
        num_processes=2,
        process_id=process_id,
        initialization_timeout=60,
    )
    from jax.experimental import multihost_utils
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from sat_jax import sharding
    from sat_jax.step import TrainState
    from train import batching, main, pulling

    assert jax.process_count() == 2 and jax.device_count() == 2, jax.devices()
    pool = FakePool() if process_id == 0 else None
    spec = batching.BatchSpec(**SPEC_KWARGS)
    arrays, facts = {}, {}
    broadcast_one_to_all = multihost_utils.broadcast_one_to_all
    _no_device_broadcast()
    for round_ in range(2):
        got = pulling.next_batch(pool, spec, progress(), timeout_s=0.1, stall_s=5)
        batch, fact = record(got)
        arrays.update({f"{round_}/{k}": v for k, v in batch.items()})
        facts[str(round_)] = fact
    loop_mesh = sharding.make_mesh(sharding.MeshConfig())
    arrays.update(_train_two_steps(FakePool(rounds=3) if process_id == 0 else None, loop_mesh))
    facts["failure"] = _failed_batch(process_id)
    multihost_utils.broadcast_one_to_all = broadcast_one_to_all  # sync_weights' version
    if process_id == 0:  # the batches still stored: those not yet marked read when the last went
        left = pulling._client().key_value_dir_get_bytes("sat_jax/")
        facts["batches_left"] = sorted(k for k, _ in left if k.endswith("/count"))

    mesh = Mesh(np.array(jax.devices()), ("data",))
    w = weights()
    sharded = jax.make_array_from_callback(
        w.shape, NamedSharding(mesh, PartitionSpec("data")), lambda idx: w[idx]
    )
    state = TrainState(params={"w": sharded}, opt_state=(), step=np.int32(0))
    weights_dir = pathlib.Path(out_dir) / "weights"
    weights_dir.mkdir(parents=True, exist_ok=True)
    host_bytes = _record_host_copies()
    synced = main.sync_weights(pool, state, progress(), str(weights_dir), "bfloat16")
    facts["synced"] = [synced.version, synced.min_version]
    facts["host_bytes"] = host_bytes
    if pool is not None:
        facts["pushes"] = pool.pushes
    out = pathlib.Path(out_dir)
    np.savez(out / f"p{process_id}.npz", **arrays)
    (out / f"p{process_id}.json").write_text(json.dumps(facts))
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
