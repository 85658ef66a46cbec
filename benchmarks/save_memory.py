"""Memory kept by repeated weight saves (`sat_jax.params_io.save_params`), with and without the
workaround for tensorstore's leaking `KvStore.Spec.to_json` (`params_io.leak_free_kvstore_specs`).

    python benchmarks/save_memory.py [--saves 150] [--rss-saves 500] [--warmup 30] [--arrays 20]
                                     [--size 64]

Each variant runs in a fresh subprocess: `--warmup` saves of `--arrays` float32 arrays of
`--size`² (three directories in turn, as the trainer's weights versions), then `--rss-saves` saves
with the resident set size (VmRSS) read before and after, then `--saves` more under `tracemalloc`.
Printed per variant: the RSS growth per save, and the traced Python heap kept after the traced
saves (total, and the part allocated inside orbax's `tensorstore_utils.py`), per save.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import tracemalloc


def rss_kib() -> int:
    """This process's resident set size (VmRSS), KiB."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def measure(
    saves: int, rss_saves: int, warmup: int, arrays: int, size: int, patched: bool
) -> dict[str, float]:
    """Runs the saves in this process; returns the kept bytes and RSS growth (see the module)."""
    import numpy as np
    import tensorstore
    from orbax.checkpoint._src.serialization import tensorstore_utils

    from sat_jax import params_io

    if not patched:
        tensorstore_utils.ts = tensorstore
    params = {f"w{i}": np.full((size, size), i, np.float32) for i in range(arrays)}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(warmup):
            params_io.save_params(os.path.join(tmp, f"v{i % 3}"), params)
        gc.collect()
        rss_before = rss_kib()
        for i in range(rss_saves):
            params_io.save_params(os.path.join(tmp, f"v{i % 3}"), params)
        gc.collect()
        rss_after = rss_kib()
        tracemalloc.start(25)
        before = tracemalloc.take_snapshot()
        for i in range(saves):
            params_io.save_params(os.path.join(tmp, f"v{i % 3}"), params)
        gc.collect()
        after = tracemalloc.take_snapshot()
    diff = after.compare_to(before, "traceback")
    kept = sum(d.size_diff for d in diff)
    in_ts_utils = sum(
        d.size_diff
        for d in diff
        if any(f.filename.endswith("serialization/tensorstore_utils.py") for f in d.traceback)
    )
    return {
        "kept_b_per_save": kept / saves,
        "tensorstore_utils_b_per_save": in_ts_utils / saves,
        "rss_kib_per_save": (rss_after - rss_before) / rss_saves,
    }


def main() -> None:
    """Runs both variants in subprocesses and prints one line each (JSON)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--saves", type=int, default=150)
    parser.add_argument("--rss-saves", type=int, default=500)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--arrays", type=int, default=20)
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--variant", choices=("patched", "unpatched"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    shape = (args.saves, args.rss_saves, args.warmup, args.arrays, args.size)
    if args.variant:
        print(json.dumps(measure(*shape, patched=args.variant == "patched")))
        return
    for variant in ("unpatched", "patched"):
        cmd = [sys.executable, __file__, "--variant", variant]
        cmd += [
            f"--{k}={v}"
            for k, v in zip(("saves", "rss-saves", "warmup", "arrays", "size"), shape, strict=True)
        ]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        print(variant, out.strip().splitlines()[-1], flush=True)


if __name__ == "__main__":
    main()
