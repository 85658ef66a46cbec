"""LoRA against full fine-tuning on one model preset: what a weight push moves and costs, and the
train step's compiled memory and tokens/s.

    python benchmarks/lora.py [--preset small] [--ranks 8 32] [--repeats 3] [--json FILE]
    python benchmarks/lora.py --quick      # the tiny preset, T = 64, 2 repeats (seconds)

Push (what ``train.weight_sync`` and the rollout server's ``WeightsLoader`` do, in this process,
on one device, to a local directory): the trainer's side is ``host_copy`` in the serving dtype
(``--serve-dtype``, bfloat16) then ``params_io.save_params`` of what a push writes: the whole
params for full fine-tuning, the adapters alone under LoRA (targets ``--targets``, alpha = 2 ·
rank). The server's side is ``WeightsLoader.load``: the whole params, or the adapters merged into
the kept base (base + scale·A·B for every target, float32 math, cast back). Bytes are the arrays'
(what moves) and the directory's on disk (orbax compresses). Medians over ``--repeats``, the
variants interleaved in one run.

Step: the real jitted ``sat_jax.step.train_step`` (SAT loss, Adam, float32) at ``--batch`` rows of
``--seq-len`` tokens on one device: XLA's compiled memory (arguments: the params, the frozen base
under LoRA, the optimizer state; temporaries) and the median step time of ``--repeats`` calls after
a warm-up, the variants interleaved. Decode speed is not measured here: the server serves the
merged weights, the same arrays and programs as without LoRA.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shutil
import statistics
import sys
import tempfile
import time

# Run by path from a checkout, installed or not.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import jax
import jax.numpy as jnp
import optax
from train_step import make_batch

from rollout_server.weights import WeightsLoader
from sat_jax import objectives, params_io, sharding
from sat_jax.model import ModelConfig, placement
from sat_jax.model.config import LoRAConfig
from sat_jax.model.lora import abstract_adapters, init_lora
from sat_jax.step import StepConfig, create_train_state, make_train_step, shard_batch
from train.weight_sync import host_copy, tree_bytes


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="small")
    p.add_argument("--ranks", type=int, nargs="+", default=[8, 32])
    p.add_argument("--targets", nargs="+", default=["attention", "experts"])
    p.add_argument("--serve-dtype", default="bfloat16")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="tiny preset, T = 64, 2 repeats")
    p.add_argument("--json", default="", help="also write the results to this file")
    args = p.parse_args(argv)
    if args.quick:
        args.preset, args.seq_len, args.repeats = "tiny", 64, 2
    return args


def _lora(rank: int, targets: list[str]) -> LoRAConfig:
    return LoRAConfig(rank=rank, alpha=2.0 * rank, targets=tuple(targets)) if rank else LoRAConfig()


def _disk_bytes(path: pathlib.Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def bench_push(args: argparse.Namespace, base_cfg: ModelConfig, mesh) -> list[dict]:
    """Per variant (rank 0 = full): bytes, save seconds, server load (+ merge) seconds."""
    serve = jnp.dtype(args.serve_dtype)
    served_cfg = base_cfg.replace(param_dtype=serve)
    _, base = placement.init_sharded(base_cfg, mesh, 0)
    variants = {}
    for rank in [0, *args.ranks]:
        lora = _lora(rank, args.targets)
        if rank:
            pushed = init_lora(base_cfg.replace(lora=lora), rng=1)
            like = abstract_adapters(served_cfg.replace(lora=lora), mesh)
        else:
            pushed, like = base, None
        variants[rank] = (lora, pushed, like)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="sat_lora_bench_"))
    try:
        params_io.save_params(tmp / "base", host_copy(base, serve))  # the first sync's base
        served = jax.tree.map(lambda x: x.astype(serve), base)  # the engine's params
        loaders = {
            r: WeightsLoader(str(tmp), lora, like) for r, (lora, _, like) in variants.items()
        }
        samples = {r: {"save_s": [], "load_s": []} for r in variants}
        disk = {}
        names = list(variants)
        for rep in range(args.repeats + 1):  # round 0 compiles and reads the base: not timed
            for rank in names[rep % len(names) :] + names[: rep % len(names)]:
                path = tmp / f"r{rank}-{rep}"
                start = time.perf_counter()
                params_io.save_params(path, host_copy(variants[rank][1], serve))
                saved = time.perf_counter()
                base_path = str(tmp / "base") if rank else ""
                loaded = loaders[rank].load(str(path), base_path, served)
                jax.block_until_ready(loaded.params)
                done = time.perf_counter()
                disk[rank] = _disk_bytes(path)
                if rep:
                    samples[rank]["save_s"].append(saved - start)
                    samples[rank]["load_s"].append(done - saved)
                del loaded
                shutil.rmtree(path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    rows = []
    full_bytes = tree_bytes(host_copy(base, serve))
    for rank, (_, pushed, _) in variants.items():
        nbytes = tree_bytes(host_copy(pushed, serve))
        rows.append(
            {
                "variant": f"lora r{rank}" if rank else "full",
                "push_bytes": nbytes,
                "fraction_of_full": nbytes / full_bytes,
                "disk_bytes": disk[rank],
                "save_s": statistics.median(samples[rank]["save_s"]),
                "load_s": statistics.median(samples[rank]["load_s"]),
            }
        )
    return rows


def bench_step(args: argparse.Namespace, base_cfg: ModelConfig, mesh) -> list[dict]:
    """Per variant: compiled argument/temp bytes and the median step time."""
    optimizer = optax.adam(1e-5)
    loss_cfg = objectives.PolicyLossConfig(sat=objectives.SATConfig(enabled=True))
    batch = shard_batch(make_batch(base_cfg, args.batch, args.seq_len), mesh)
    states, steps, memory = {}, {}, {}
    for rank in [0, *args.ranks]:
        cfg = base_cfg.replace(lora=_lora(rank, args.targets))
        _, params = placement.init_sharded(cfg, mesh, 0)
        state = create_train_state(cfg, optimizer, mesh, params)
        step = make_train_step(cfg, optimizer, StepConfig(loss=loss_cfg), mesh)
        stats = step.lower(state, batch).compile().memory_analysis()
        memory[rank] = (stats.argument_size_in_bytes, stats.temp_size_in_bytes)
        trained = sum(x.size for x in jax.tree.leaves(state.params))
        states[rank], steps[rank] = (state, trained), step
    samples = {r: [] for r in states}
    names = list(states)
    for rep in range(args.repeats + 1):  # the first round is the warm-up
        for rank in names[rep % len(names) :] + names[: rep % len(names)]:
            state, trained = states[rank]
            start = time.perf_counter()
            state, _ = jax.block_until_ready(steps[rank](state, batch))
            if rep:
                samples[rank].append(time.perf_counter() - start)
            states[rank] = (state, trained)
    rows = []
    for rank in names:
        median = statistics.median(samples[rank])
        rows.append(
            {
                "variant": f"lora r{rank}" if rank else "full",
                "trained_params": states[rank][1],
                "argument_bytes": memory[rank][0],
                "temp_bytes": memory[rank][1],
                "step_s": median,
                "tokens_per_s": args.batch * args.seq_len / median,
            }
        )
    return rows


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB" if n >= 2**20 else f"{n / 2**10:,.1f} KiB"


def format_tables(args: argparse.Namespace, push: list[dict], step: list[dict]) -> str:
    lines = [
        f"Push ({args.preset}, serving dtype {args.serve_dtype}, targets "
        f"{'+'.join(args.targets)}; medians of {args.repeats}):",
        "",
        "| variant | bytes pushed | of full | on disk | save s | server load s |",
        "|---|---|---|---|---|---|",
    ]
    for r in push:
        lines.append(
            f"| {r['variant']} | {_mib(r['push_bytes'])} | {r['fraction_of_full']:.2%} | "
            f"{_mib(r['disk_bytes'])} | {r['save_s']:.3f} | {r['load_s']:.3f} |"
        )
    lines += [
        "",
        f"Train step ({args.preset}, batch {args.batch} x T {args.seq_len}, float32; "
        f"medians of {args.repeats}):",
        "",
        "| variant | trained params | compiled arguments | compiled temp | step s | tokens/s |",
        "|---|---|---|---|---|---|",
    ]
    for r in step:
        lines.append(
            f"| {r['variant']} | {r['trained_params']:,} | {_mib(r['argument_bytes'])} | "
            f"{_mib(r['temp_bytes'])} | {r['step_s']:.3f} | {r['tokens_per_s']:,.0f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> tuple[list[dict], list[dict]]:
    args = parse_args(argv)
    base_cfg = ModelConfig.preset(args.preset, max_seq_len=max(args.seq_len, 64))
    mesh = sharding.make_mesh(sharding.MeshConfig(fsdp=1), jax.devices()[:1])
    push = bench_push(args, base_cfg, mesh)
    step = bench_step(args, base_cfg, mesh)
    print(format_tables(args, push, step), flush=True)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({"push": push, "step": step}, indent=1))
    return push, step


if __name__ == "__main__":
    main()
