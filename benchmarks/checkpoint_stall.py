"""The training loop's stall for a checkpoint: a background save against a synchronous one.

    PYTHONPATH=. JAX_PLATFORMS=cpu python benchmarks/checkpoint_stall.py [--preset small]
        [--repeats 3] [--dir DIR] [--json OUT]

The state is the trainer's own (``init_train_state`` of the preset: params and AdamW moments).
For each mode, ``--repeats`` checkpoints of it are written to a fresh directory: ``sync`` times
``Checkpointer(background=False).save`` (the loop waits for the commit, as before), ``background``
times ``save`` returning (the loop's stall: the arrays copied off the devices) and, separately,
the commit the loop does not wait for. Printed: median seconds of each, and the stall as a
fraction of the synchronous save.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import jax
import optax

from sat_jax import params_io, sharding
from sat_jax.model import ModelConfig
from sat_jax.step import init_train_state
from train import checkpointing


def measure(state, directory: str, *, background: bool, repeats: int) -> dict[str, float]:
    ckpt = checkpointing.Checkpointer(directory, keep=2, background=background)
    progress = checkpointing.Progress(version=1, min_version=1, rng_key=(0, 1))
    stall, commit = [], []
    for step in range(1, repeats + 1):
        start = time.perf_counter()
        ckpt.save(step, state, progress)
        stall.append(time.perf_counter() - start)
        ckpt.wait()
        commit.append(time.perf_counter() - start)
    ckpt.close()
    return {"stall_s": statistics.median(stall), "commit_s": statistics.median(commit)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default="", help="where to write (default: a temporary dir)")
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    cfg = ModelConfig.preset(args.preset)
    mesh = sharding.make_mesh(sharding.MeshConfig(fsdp=1), jax.devices()[:1])
    state = init_train_state(cfg, optax.adamw(1e-4), mesh, 0)
    size = params_io.tree_bytes(state)
    out = {"preset": args.preset, "state_bytes": size, "repeats": args.repeats}
    with tempfile.TemporaryDirectory(dir=args.dir or None) as root:
        out["sync"] = measure(state, f"{root}/sync", background=False, repeats=args.repeats)
        out["background"] = measure(state, f"{root}/bg", background=True, repeats=args.repeats)
    out["stall_vs_sync"] = out["background"]["stall_s"] / out["sync"]["stall_s"]
    print(
        f"state {size / 2**20:.0f} MiB: synchronous save {out['sync']['stall_s']:.2f} s; "
        f"background save stalls the loop {out['background']['stall_s']:.3f} s "
        f"({100 * out['stall_vs_sync']:.1f}% of the synchronous save), commits after "
        f"{out['background']['commit_s']:.2f} s"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
