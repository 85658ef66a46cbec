"""Bytes each process of a multi-process trainer receives per batch: the whole batch, or only
its own rows (``train.pulling``'s broadcast with the step's mesh).

    python benchmarks/host_rows.py [--rows 64] [--tokens 2048] [--layers 48] [--top-k 8]
        [--processes 2 4 8]

A synthetic batch of the given shape (int32 tokens, uint8 loss mask, float32 behavior log-probs,
uint8 routing [rows, tokens, layers, top-k], [rows] rewards and group ids, one int64 lag per
token) is encoded as process 0 sends it (``pulling.encode_pulled``): whole, and for each process
count P the part of a process whose devices hold 1/P of the rows (the per-token fields by rows,
the [B] fields, the lags and the stats whole). The defaults are the paper's routing shape
(Qwen3-30B-A3B: 48 layers, 8 experts per token).
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import sys

# Run by path from a checkout, installed or not.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import numpy as np

from sat_jax.step import TrainBatch
from train import batching, pulling


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=64, help="rows of the batch (default 64)")
    parser.add_argument("--tokens", type=int, default=2048, help="tokens per row (default 2048)")
    parser.add_argument("--layers", type=int, default=48, help="MoE layers routed (default 48)")
    parser.add_argument("--top-k", type=int, default=8, help="experts per token (default 8)")
    parser.add_argument("--processes", type=int, nargs="+", default=[2, 4, 8])
    args = parser.parse_args(argv)
    for name in ("rows", "tokens", "layers", "top_k"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be ≥ 1, got {getattr(args, name)}")
    bad = [p for p in args.processes if p < 2 or args.rows % p]
    if bad:
        parser.error(f"--processes must be ≥ 2 and divide --rows {args.rows}, got {bad}")
    return args


def synthetic(rows: int, tokens: int, layers: int, top_k: int) -> pulling.PulledBatch:
    """A batch of the given shape, random values, every token trained."""
    rng = np.random.default_rng(0)
    batch = TrainBatch(
        tokens=rng.integers(0, 151_936, (rows, tokens)).astype(np.int32),
        loss_mask=np.ones((rows, tokens), np.uint8),
        behavior_logp=rng.standard_normal((rows, tokens)).astype(np.float32),
        rewards=rng.random(rows).astype(np.float32),
        group_ids=np.arange(rows, dtype=np.int32),
        routing=rng.integers(0, 128, (rows, tokens, layers, top_k)).astype(np.uint8),
    )
    zero = {int: 0, float: 0.0, "int": 0, "float": 0.0}
    stats = {f.name: zero.get(f.type, ()) for f in dataclasses.fields(batching.BatchStats)} | {
        "lags": np.zeros(rows * tokens, np.int64),
        "tokens": rows * tokens,
    }
    return pulling.PulledBatch(batch=batch, stats=batching.BatchStats(**stats))


def main_cli(argv: list[str] | None = None) -> dict[int, tuple[int, int]]:
    """Prints and returns {P: (whole bytes, own-rows bytes)}."""
    args = parse_args(argv)
    pulled = synthetic(args.rows, args.tokens, args.layers, args.top_k)
    whole = len(pulling.encode_pulled(pulled))
    out = {}
    for p in args.processes:
        own = np.arange(args.rows // p)
        rows = {k: own for k, v in vars(pulled.batch).items() if v is not None and np.ndim(v) >= 2}
        part = len(pulling.encode_pulled(pulled, rows))
        out[p] = (whole, part)
        print(
            f"{p} processes: whole batch {whole / 2**20:.1f} MiB per process, own rows "
            f"{part / 2**20:.1f} MiB ({part / whole:.3f})"
        )
    return out


if __name__ == "__main__":
    main_cli()
