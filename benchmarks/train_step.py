"""Train-step tokens/s and MFU of a model preset, remat off/on and 1 or 4 microbatches, per T.

Run: `python benchmarks/train_step.py` (the `small` preset at T = 512 and 2048, batch 4; tens of
minutes on 2 loaded CPU cores) or `--quick` (the `tiny` preset at T = 64, seconds).

Every configuration is the real jitted `sat_jax.train_step` (SAT loss, Adam, the blockwise
attention and chunked log-probs of the CPU path) on one device, in float32 (`--dtype bfloat16`:
bfloat16 matmuls over float32 master weights). Per T, one train state
is threaded through every configuration (the step donates it), the configurations run
interleaved (the order rotates each repeat) after one warm-up call each (compile + first run,
not timed), and medians over the repeats are reported, so ratios between rows of one T come from
one run. The machine's matmul peak is a large `jnp.dot` in that dtype, timed in the same rotation.

MFU = active FLOPs per step / median step time / matmul peak, with active FLOPs per token =
6 · (active matmul parameters: every active parameter but the input embedding, a lookup) + 12 · L ·
H · head_dim · T (attention scores and values, forward and backward, the full T × T that the
blockwise path computes). Remat's recomputation is not counted (it lowers MFU, as it should).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import statistics
import sys
import time

# Run by path from a checkout, installed or not.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jax
import jax.numpy as jnp
import numpy as np
import optax

from sat_jax import objectives, sharding
from sat_jax.model import ModelConfig, placement
from sat_jax.plan import memory as plan
from sat_jax.step import StepConfig, TrainBatch, create_train_state, make_train_step, shard_batch

PROMPT = 64  # prompt tokens per row (not in the loss); the rest of T is completion


@dataclasses.dataclass(frozen=True, kw_only=True)
class Row:
    """One configuration's result."""

    seq_len: int
    remat: str
    microbatches: int
    repeats: int
    median_s: float
    tokens_per_s: float
    mfu: float


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small", help="model preset (default small)")
    parser.add_argument("--seq-lens", default="512,2048", help="comma-separated T values")
    parser.add_argument("--batch", type=int, default=4, help="rows per step (divisible by 4)")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per configuration")
    parser.add_argument("--matmul-n", type=int, default=4096, help="N of the N³ peak matmul")
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=("float32", "bfloat16"),
        help="compute dtype of the model's matmuls and of the peak matmul (master weights and "
        "Adam stay float32)",
    )
    parser.add_argument("--quick", action="store_true", help="tiny preset, T = 64, 2 repeats")
    parser.add_argument("--json", default="", help="also write the rows to this file")
    args = parser.parse_args(argv)
    if args.quick:
        args.preset, args.seq_lens, args.repeats, args.matmul_n = "tiny", "64", 2, 512
    try:
        args.seq_lens = [int(t) for t in args.seq_lens.split(",")]
    except ValueError:
        parser.error(f"--seq-lens must be comma-separated integers, got {args.seq_lens!r}")
    if args.batch <= 0 or args.batch % 4 or args.repeats <= 0:
        parser.error("--batch must be a positive multiple of 4 and --repeats positive")
    if any(t <= PROMPT // 2 for t in args.seq_lens):
        parser.error(f"every T must exceed {PROMPT // 2}")
    return args


def step_flops(cfg: ModelConfig, batch: int, seq_len: int) -> float:
    """Active training FLOPs of one step of ``batch`` rows of ``seq_len`` tokens (module doc)."""
    active = plan.plan_memory(cfg, sharding.MeshConfig(fsdp=1)).active_params
    matmul_params = active - cfg.vocab_size * cfg.d_model  # the input embedding is a lookup
    attention = 12 * cfg.num_layers * cfg.num_heads * cfg.head_dim * seq_len
    return batch * seq_len * (6 * matmul_params + attention)


def make_batch(cfg: ModelConfig, batch: int, seq_len: int) -> TrainBatch:
    """Random tokens, a prompt of PROMPT (or T/2) tokens, the rest completion in the loss."""
    rng = np.random.default_rng(0)
    prompt = min(PROMPT, seq_len // 2)
    mask = np.zeros((batch, seq_len), np.float32)
    mask[:, prompt:] = 1.0
    return TrainBatch(
        tokens=rng.integers(3, cfg.vocab_size, (batch, seq_len)).astype(np.int32),
        loss_mask=mask,
        behavior_logp=(mask * (-3.0 + 0.1 * rng.standard_normal((batch, seq_len)))).astype(
            np.float32
        ),
        advantages=(mask * rng.standard_normal((batch, 1))).astype(np.float32),
    )


def timed(fn, *args):
    """(result, seconds) of ``fn(*args)`` once its outputs are ready."""
    start = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
    return out, time.perf_counter() - start


def bench_seq_len(args: argparse.Namespace, seq_len: int) -> tuple[list[Row], float]:
    """The rows of one T and the matmul peak (FLOP/s) measured beside them."""
    base = ModelConfig.preset(args.preset, max_seq_len=max(seq_len, 64), dtype=args.dtype)
    mesh = sharding.make_mesh(sharding.MeshConfig(fsdp=1), jax.devices()[:1])
    optimizer = optax.adam(1e-5)
    loss_cfg = objectives.PolicyLossConfig(sat=objectives.SATConfig(enabled=True))
    configs = [(r, k) for r in ("none", "layer") for k in (1, 4)]
    steps = {
        c: make_train_step(
            base.replace(remat=c[0]), optimizer, StepConfig(loss=loss_cfg, microbatches=c[1]), mesh
        )
        for c in configs
    }
    _, params = placement.init_sharded(base, mesh, 0)
    state = create_train_state(base, optimizer, mesh, params)
    batch = shard_batch(make_batch(base, args.batch, seq_len), mesh)
    n = args.matmul_n
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32).astype(args.dtype)
    matmul = jax.jit(lambda x: jnp.dot(x, x))
    samples = {c: [] for c in [*configs, "matmul"]}
    for c in configs:  # warm-up: compile and first run
        (state, _), _ = timed(steps[c], state, batch)
    timed(matmul, a)
    names = list(samples)
    for rep in range(args.repeats):
        for c in names[rep % len(names) :] + names[: rep % len(names)]:
            if c == "matmul":
                samples[c].append(timed(matmul, a)[1])
            else:
                (state, _), seconds = timed(steps[c], state, batch)
                samples[c].append(seconds)
    peak = 2 * n**3 / statistics.median(samples["matmul"])
    flops = step_flops(base, args.batch, seq_len)
    rows = []
    for remat, k in configs:
        median = statistics.median(samples[(remat, k)])
        rows.append(
            Row(
                seq_len=seq_len,
                remat=remat,
                microbatches=k,
                repeats=args.repeats,
                median_s=median,
                tokens_per_s=args.batch * seq_len / median,
                mfu=flops / median / peak,
            )
        )
    return rows, peak


def format_table(args: argparse.Namespace, results: list[tuple[list[Row], float]]) -> str:
    """A markdown table; `vs base` is tokens/s over remat none, 1 microbatch, at the same T."""
    lines = [
        f"preset {args.preset}, batch {args.batch}, {args.dtype}, {jax.device_count()} "
        f"{jax.default_backend()} device(s), load average {os.getloadavg()[0]:.1f} at the end",
        "",
        "| T | remat | microbatches | n | median step s | tokens/s | vs base | matmul GFLOP/s "
        "| MFU |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for rows, peak in results:
        base = rows[0].tokens_per_s
        for r in rows:
            lines.append(
                f"| {r.seq_len} | {r.remat} | {r.microbatches} | {r.repeats} | {r.median_s:.2f} "
                f"| {r.tokens_per_s:.0f} | {r.tokens_per_s / base:.2f} | {peak / 1e9:.0f} "
                f"| {100 * r.mfu:.1f}% |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[tuple[list[Row], float]]:
    args = parse_args(argv)
    print(f"load average before: {os.getloadavg()[0]:.1f}", flush=True)
    results = []
    for seq_len in args.seq_lens:
        results.append(bench_seq_len(args, seq_len))
        print(format_table(args, results[-1:]), flush=True)
    print(format_table(args, results), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                [{**dataclasses.asdict(r), "peak_flops": p} for rows, p in results for r in rows],
                f,
                indent=1,
            )
    return results


if __name__ == "__main__":
    main()
