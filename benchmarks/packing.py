"""Sequence packing against padding: padded fraction and useful tokens/s of the real train step.

Run: `python benchmarks/packing.py` (the `small` preset, 16 trajectories of a long-tailed length
distribution capped at 2048 tokens; tens of minutes on 2 loaded CPU cores) or `--quick` (the
`tiny` preset, cap 256, seconds). `--layouts 16 64 256 512` runs no step: it prints the padded
fraction of the packed layout (`sat_jax.packing.layout`) of `--seeds` batches of each size, with
the part of it that no packer avoids (the last row's remainder, `ceil(tokens / cap)` rows), and
with `--microbatch-tokens` that of the token-budget layout (`sat_jax.packing.budget_layout`) and
its distinct shapes (k, rows per microbatch, T, trajectory slots per microbatch: the programs a
run of such batches compiles).

Trajectory lengths (prompt + completion) are lognormal with median `--median` and shape
`--sigma`, capped at `--cap`, and a fraction `--cut` of them is exactly `--cap` (completions cut
by the length limit). The same trajectories make both batches: padded (`assemble_batch`'s layout,
one trajectory per row, T = the length bucket of the longest) and packed (`train.packing.pack_batch`, rows of
`--cap` tokens). Both run the real jitted `sat_jax.train_step` (SAT loss, Adam, the CPU path's
blockwise attention, `--remat`) on one device in float32, split by the same token budget
(`--microbatch-tokens`: the padded step into row-count microbatches of budget / cap rows, the
packed one by `train.microbatch_tokens`; 0 = one pass each), each compiled ahead of time
(`lower(...).compile()`, not timed, never run untimed), then `--repeats` calls each,
interleaved (the order alternates), and the medians are reported:
useful tokens/s = the trajectories' tokens / median step time; padded fraction = padded token
slots / all token slots of the step (the `pad_frac` metric).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jax
import numpy as np
import optax

from sat_jax import objectives, packing, sharding
from sat_jax.model import ModelConfig, placement
from sat_jax.step import StepConfig, TrainBatch, create_train_state, make_train_step, shard_batch
from train import batching
from train import packing as train_packing

PROMPT = 64


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="small")
    p.add_argument("--trajectories", type=int, default=16)
    p.add_argument("--median", type=float, default=300.0)
    p.add_argument("--sigma", type=float, default=1.0)
    p.add_argument("--cap", type=int, default=2048)
    p.add_argument("--cut", type=float, default=0.05)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--remat", default="layer", help="model.remat of both steps")
    p.add_argument(
        "--microbatch-tokens",
        type=int,
        default=8192,
        help="token budget per microbatch: the padded step takes budget / cap rows per "
        "microbatch, the packed one train.microbatch_tokens = budget (0 = one pass each)",
    )
    p.add_argument("--quick", action="store_true", help="tiny preset, cap 256, median 40")
    p.add_argument(
        "--layouts",
        type=int,
        nargs="+",
        help="no step: the packed layout's padded fraction at these trajectory counts",
    )
    p.add_argument("--seeds", type=int, default=10, help="batches per count of --layouts")
    args = p.parse_args(argv)
    if args.quick:
        args.preset, args.cap, args.median, args.repeats = "tiny", 256, 40.0, 2
        args.microbatch_tokens = 0
    return args


def lengths(args: argparse.Namespace) -> np.ndarray:
    """Trajectory lengths: lognormal, capped, a fraction exactly at the cap, >= PROMPT + 2."""
    rng = np.random.default_rng(args.seed)
    n = args.trajectories
    out = np.exp(np.log(args.median) + args.sigma * rng.standard_normal(n))
    out = np.clip(np.round(out), PROMPT + 2, args.cap).astype(int)
    cut = rng.permutation(n)[: max(1, round(args.cut * n))]
    out[cut] = args.cap
    return out


def padded_batch(model: ModelConfig, lens: np.ndarray, spec: batching.BatchSpec) -> TrainBatch:
    rng = np.random.default_rng(1)
    n = len(lens)
    t = batching.bucket_length(int(lens.max()), spec)
    tokens = np.zeros((n, t), np.int32)
    mask = np.zeros((n, t), np.float32)
    for i, length in enumerate(lens):
        tokens[i, :length] = rng.integers(0, model.vocab_size, length)
        mask[i, PROMPT:length] = 1.0
    return TrainBatch(
        tokens=tokens,
        loss_mask=mask,
        behavior_logp=np.where(mask > 0, np.log(rng.uniform(0.01, 0.3, (n, t))), 0).astype(
            np.float32
        ),
        rewards=rng.normal(size=n).astype(np.float32),
        group_ids=(np.arange(n) // 4).astype(np.int32),
    )


def layouts(args: argparse.Namespace) -> dict:
    """Per trajectory count: the packed layout's padded fraction over ``args.seeds`` batches
    (mean and max), the bound's (``ceil(tokens / cap)`` full rows), and the rows' counts."""
    out = {}
    for n in args.layouts:
        pads, bounds, rows, budget_pads, shapes = [], [], set(), [], set()
        for seed in range(args.seeds):
            lens = lengths(argparse.Namespace(**{**vars(args), "trajectories": n, "seed": seed}))
            lay = packing.layout(lens, capacity=args.cap, length_bucket=64)
            pads.append(lay.pad_frac)
            bounds.append(1 - lay.used / (-(-lay.used // args.cap) * args.cap))
            rows.add(lay.rows)
            if args.microbatch_tokens:
                lay = packing.budget_layout(
                    lens,
                    capacity=args.cap,
                    microbatch_tokens=args.microbatch_tokens,
                    length_bucket=64,
                    slots=n,
                )
                budget_pads.append(lay.pad_frac)
                k = lay.microbatches
                shapes.add((k, lay.rows // k, lay.length, len(lay.order) // k))
        out[n] = {
            "pad_frac_mean": round(float(np.mean(pads)), 4),
            "pad_frac_max": round(float(np.max(pads)), 4),
            "bound_mean": round(float(np.mean(bounds)), 4),
            "row_counts": sorted(rows),
        }
        if args.microbatch_tokens:  # k, rows per microbatch, T, trajectory slots per microbatch
            out[n]["budget"] = {
                "pad_frac_mean": round(float(np.mean(budget_pads)), 4),
                "pad_frac_max": round(float(np.max(budget_pads)), 4),
                "shapes": len(shapes),
                "k_rows_T_slots": sorted(shapes),
            }
    print(json.dumps(out, indent=1))
    return out


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.layouts:
        return layouts(args)
    model = ModelConfig.preset(args.preset, remat=args.remat)
    lens = lengths(args)
    n = len(lens)
    spec = batching.BatchSpec(
        batch_groups=n // 4,
        group_size=4,
        seq_len=args.cap,
        length_bucket=64,
        routing_lk=None,
        routing_dtype="uint8",
        max_staleness=1,
        stale_policy="drop",
        vocab_size=model.vocab_size,
        num_experts=model.num_experts,
        packing=True,
        row_tokens=args.cap,
        microbatch_tokens=args.microbatch_tokens,
    )
    padded = padded_batch(model, lens, spec)
    packed, used, slots = train_packing.pack_batch(padded, spec)
    useful = int(lens.sum())
    assert used == useful
    mesh = sharding.make_mesh(sharding.MeshConfig(fsdp=1), jax.devices()[:1])
    optimizer = optax.adam(1e-5)
    loss = objectives.PolicyLossConfig(sat=objectives.SATConfig(enabled=True))
    k_padded = max(1, n * args.cap // args.microbatch_tokens) if args.microbatch_tokens else 1
    step = make_train_step(model, optimizer, StepConfig(loss=loss, microbatches=k_padded), mesh)
    _, params = placement.init_sharded(model, mesh, 0)
    state = create_train_state(model, optimizer, mesh, params)
    batches = {"padded": shard_batch(padded, mesh), "packed": shard_batch(packed, mesh)}
    shapes = {"padded": padded.tokens.shape, "packed": packed.tokens.shape}
    pad = {"padded": 1 - useful / padded.tokens.size, "packed": 1 - used / slots}
    times: dict[str, list[float]] = {name: [] for name in batches}
    compiled, compile_s = {}, {}
    for name, batch in batches.items():  # ahead of time: compiled, never run untimed
        start = time.perf_counter()
        compiled[name] = step.lower(state, batch).compile()
        compile_s[name] = time.perf_counter() - start
        print(f"{name}: compiled in {compile_s[name]:.0f} s", file=sys.stderr, flush=True)
    names = list(batches)
    for r in range(args.repeats):
        for name in names if r % 2 == 0 else names[::-1]:
            start = time.perf_counter()
            with jax.set_mesh(mesh):
                state, metrics = compiled[name](state, batches[name])
            jax.block_until_ready(metrics)
            times[name].append(time.perf_counter() - start)
            print(f"{name}: {times[name][-1]:.0f} s", file=sys.stderr, flush=True)
    result = {
        "preset": args.preset,
        "trajectories": n,
        "useful_tokens": useful,
        "length_median": float(np.median(lens)),
        "length_mean": float(lens.mean()),
        "cap": args.cap,
        "repeats": args.repeats,
        "backend": jax.default_backend(),
        "compiled_programs": len(compiled),
        "remat": args.remat,
        "microbatch_tokens": args.microbatch_tokens,
        "microbatches": {"padded": k_padded, "packed": packed.microbatches or 1},
        "packed_trajectory_slots": int(np.shape(packed.view_index)[0]),
    }
    for name in names:
        median = statistics.median(times[name])
        result[name] = {
            "shape": list(shapes[name]),
            "pad_frac": round(pad[name], 4),
            "median_step_s": round(median, 3),
            "compile_s": round(compile_s[name], 1),
            "useful_tokens_per_s": round(useful / median, 1),
        }
    result["speedup"] = round(
        result["padded"]["median_step_s"] / result["packed"]["median_step_s"], 2
    )
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
