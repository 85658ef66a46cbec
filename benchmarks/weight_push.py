"""Weight push seconds per GB: gathered (every process gathers the params, process 0 writes them)
vs per-shard (each process writes its own shards, process 0 finalizes), in one run.

    python benchmarks/weight_push.py [--mb 64] [--arrays 16] [--repeats 5] [--processes 2]

Starts ``--processes`` CPU processes (``jax.distributed``, gloo, one device each) holding a float32
param tree of ``--mb`` MiB in ``--arrays`` arrays, sharded over the processes along the first axis.
Each repeat runs both variants in turn (order alternating), each into a fresh directory, after a
barrier; a push is timed on process 0 from the barrier to the moment the checkpoint is complete
(when ``UpdateWeights`` could go out):

- gathered: ``process_allgather`` to NumPy on every process (the trainer's path before per-shard
  pushes), then process 0 alone saves that host copy (orbax ``StandardCheckpointer`` with itself as
  the only active process, as ``save_params`` did then; same format);
- per-shard: ``train.weight_sync.host_copy`` (each process's shards to pinned host memory), then
  ``save_params`` on every process.

Prints one JSON line: median seconds per GB for each, their ratio, and the bytes each process
wrote (first repeat). The saves are zstd-compressed by orbax; the GB are the params' bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

# benchmarks/ scripts run by path and import each other so, never as a package (JetStream
# installs a top-level `benchmarks` package).
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import worker_group

REPO = pathlib.Path(__file__).resolve().parents[1]


def _bytes_under(root: pathlib.Path) -> int:
    return sum(f.stat().st_size for f in root.rglob("*") if f.is_file())


def worker(port: int, pid: int, n: int, mb: int, arrays: int, repeats: int, out: str) -> None:
    """One process of the benchmark: runs the repeats, process 0 prints the summary."""
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=n, process_id=pid)
    import numpy as np
    import orbax.checkpoint as ocp
    from jax.experimental import multihost_utils
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from sat_jax import params_io
    from train import weight_sync

    rows = mb * (1 << 20) // 4 // arrays // 1024
    rows -= rows % n
    sharding = NamedSharding(Mesh(np.array(jax.devices()), ("data",)), PartitionSpec("data"))
    rng = np.random.default_rng(pid)
    params = {
        f"w{i}": jax.make_array_from_callback(
            (rows, 1024), sharding, lambda idx: rng.standard_normal((rows // n, 1024), np.float32)
        )
        for i in range(arrays)
    }
    gb = sum(x.nbytes for x in params.values()) / 1e9

    def gathered(path: str) -> None:
        host = multihost_utils.process_allgather(params, tiled=True)
        if pid == 0:
            alone = ocp.options.MultiprocessingOptions(primary_host=0, active_processes={0})
            with params_io.ORBAX_LOCK, ocp.StandardCheckpointer(multiprocessing_options=alone) as c:
                c.save(path, jax.tree.map(np.asarray, host), force=True)
                c.wait_until_finished()

    def per_shard(path: str) -> None:
        params_io.save_params(path, weight_sync.host_copy(params))

    variants = {"gathered": gathered, "per_shard": per_shard}
    seconds: dict[str, list[float]] = {k: [] for k in variants}
    written: dict[str, list[int]] = {}
    for r in range(repeats + 1):  # repeat 0 warms up (compilation, first writes)
        for name in sorted(variants, reverse=r % 2 == 1):
            path = os.path.join(out, f"{name}{r}")
            multihost_utils.sync_global_devices(path)
            start = time.perf_counter()
            variants[name](path)
            elapsed = time.perf_counter() - start
            multihost_utils.sync_global_devices(path + "/done")
            if r > 0:
                seconds[name].append(elapsed)
            if r == 1 and pid == 0:
                sub = sorted(pathlib.Path(path).glob("ocdbt.process_*"))
                written[name] = [_bytes_under(p) for p in sub] or [_bytes_under(pathlib.Path(path))]
    if pid == 0:
        med = {k: statistics.median(v) / gb for k, v in seconds.items()}
        print(
            json.dumps(
                {
                    "gb": round(gb, 4),
                    "processes": n,
                    "repeats": repeats,
                    "s_per_gb": {k: round(v, 3) for k, v in med.items()},
                    "gathered_over_per_shard": round(med["gathered"] / med["per_shard"], 2),
                    "bytes_written_per_process": written,
                }
            ),
            flush=True,
        )
    jax.distributed.shutdown()


def main() -> None:
    """Starts the processes and relays process 0's summary line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=64)
    parser.add_argument("--arrays", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)  # port pid out
    args = parser.parse_args()
    shape = (args.processes, args.mb, args.arrays, args.repeats)
    if args.worker:
        port, pid, out = args.worker
        worker(int(port), int(pid), *shape, out)
        return
    import portpicker

    port = portpicker.pick_unused_port()
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    with tempfile.TemporaryDirectory() as out, worker_group.WorkerGroup() as group:
        flags = ["--processes", str(args.processes), "--mb", str(args.mb)]
        flags += ["--arrays", str(args.arrays), "--repeats", str(args.repeats)]
        procs = [
            group.start(
                [sys.executable, __file__, *flags, "--worker", str(port), str(pid), out],
                env=env,
                stdout=subprocess.PIPE if pid == 0 else subprocess.DEVNULL,
                text=True,
            )
            for pid in range(args.processes)
        ]
        summary = procs[0].communicate()[0]
        codes = group.wait()
    if any(codes):
        sys.exit(f"a benchmark process failed (exit codes {codes})")
    print(summary.strip().splitlines()[-1])


if __name__ == "__main__":
    main()
