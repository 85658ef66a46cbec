"""The trainer's per-step data path, from pulled groups to metrics on the host, at the main job's shapes.

    python benchmarks/step_data_path.py [--repeats 30] [--set key=value ...] [--json FILE]

What one step of `train/main.py`'s loop does once its groups are pulled: select and assemble them
into a `TrainBatch` (host), shard it (host → device), run the jitted step (advantages and the KL
penalty's reference log-probs included) and fetch its metrics. The configuration is
`configs/arith_main.yaml` (the tiny preset, 16 groups × 8, routing replay) with
`train.loss.kl_coef=0.01`, so the reference policy's log-probs are part of every step. The groups
are synthetic `Group` messages of the arithmetic task's shapes (prompts up to
`server.max_prefill_length`, completions up to `rollout.max_new_tokens`, recorded routing, 0/1
rewards), fixed by `--seed`; the policy and its reference are random inits (a warm-up changes the
values, not the work).

Timed per step: `decode` (the trainer's decoding and validation of the pulled protos, made by the
server's own encoding `records.to_proto`), `assemble` (select_groups + assemble_batch), `shard`
(shard_batch until the arrays are on the device), `step` (the step until its metrics are on the
host) and `total` (all of it). After `--warmup` untimed steps (compiles), the medians over
`--repeats` steps are reported, with the bytes each step moves host → device and device → host
besides the metrics, and the trainer's CPU seconds (this thread's) per 1,000 groups of `decode`
and `assemble`.
The machine may be shared and noisy: compare medians of runs made back to back.

`make_data_path` is the only part that knows the train step's API (a copy adapted to an older
tree measures that tree the same way).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

# Run by path from a checkout, installed or not.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jax
import numpy as np

from rollout_api import records
from rollout_api.proto import rollout_pb2
from sat_jax import sharding
from sat_jax.experiment import ExperimentConfig, load_config
from sat_jax.model import placement
from sat_jax.step import create_train_state, shard_batch
from train import batching, main, setup

REPO = pathlib.Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "arith_main.yaml"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30, help="timed steps (default 30)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed first steps (default 3)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the synthetic groups")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="config overrides after train.loss.kl_coef=0.01 (repeatable)",
    )
    parser.add_argument("--json", default="", help="also write the result to this file")
    args = parser.parse_args(argv)
    if args.repeats <= 0 or args.warmup < 0:
        parser.error("--repeats must be positive and --warmup non-negative")
    return args


def make_groups(cfg: ExperimentConfig, seed: int) -> list[rollout_pb2.Group]:
    """One batch's worth of synthetic groups of the configured shapes (lag 0 at version 1), as
    the server's `records.to_proto` writes them (texts included, as a server has them)."""
    rng = np.random.default_rng(seed)
    m, r = cfg.model, cfg.rollout
    groups = []
    for g in range(r.batch_groups):
        prompt = [1, *rng.integers(3, m.vocab_size, rng.integers(4, cfg.server.max_prefill_length))]
        trajectories = []
        for _ in range(r.group_size):
            c = int(rng.integers(1, r.max_new_tokens + 1))
            # Distinct experts per token, as a router's top-k.
            scores = rng.random((len(prompt) + c, m.num_moe_layers, m.num_experts))
            routing = np.argsort(scores, axis=-1)[..., : m.num_experts_per_tok]
            trajectories.append(
                records.Trajectory(
                    prompt_ids=np.array(prompt, np.int32),
                    completion_ids=rng.integers(3, m.vocab_size, c).astype(np.int32),
                    behavior_logprobs=(-rng.uniform(0.1, 3.0, c)).astype(np.float32),
                    versions=np.ones(c, np.int64),
                    routing=routing.astype(m.routing_dtype),
                    reward=float(rng.integers(0, 2)),
                    completion_text="9" * c,
                )
            )
        group = records.Group(
            group_id=g,
            prompt_id=f"p{g}",
            server_id="bench",
            prompt_text="1+2=" * (len(prompt) // 4),
            answer="3",
            trajectories=tuple(trajectories),
        )
        groups.append(records.to_proto(group))
    return groups


def make_data_path(
    cfg: ExperimentConfig, mesh: jax.sharding.Mesh, params: Any
) -> tuple[Callable, Any]:
    """``(one_step, state)``: ``one_step(state, groups) -> (state, metrics, seconds, bytes)``
    runs the loop's data path once (module docstring); ``seconds`` per phase, ``bytes`` as
    ``{"h2d": ..., "d2h": ...}`` (the batch, not the metrics)."""
    optimizer = cfg.train.optimizer.make(cfg.train.steps)
    ref_params = jax.tree.map(jax.numpy.copy, params)
    step_fn = main.make_step_fn(cfg, optimizer, mesh, ref_params)
    spec = setup.batch_spec(cfg)
    state = create_train_state(cfg.model, optimizer, mesh, params)

    def one_step(state: Any, groups: list[rollout_pb2.Group]):
        cpu_start, start = time.thread_time(), time.perf_counter()
        # What the trainer does with a pulled reply: decode and validate once (ServerPool.pull),
        # then select and assemble.
        pulled = records.decode_pulled(groups, spec.limits)
        cpu_decoded, decoded = time.thread_time(), time.perf_counter()
        selection = batching.select_groups(pulled, spec, trainer_version=1, min_version=1)
        batch, _ = batching.assemble_batch(selection, spec, trainer_version=1)
        cpu_assembled, assembled = time.thread_time(), time.perf_counter()
        on_device = jax.block_until_ready(shard_batch(batch, mesh))
        sharded = time.perf_counter()
        state, metrics = step_fn(state, on_device)
        metrics = jax.device_get(metrics)
        done = time.perf_counter()
        seconds = {
            "decode": decoded - start,
            "assemble": assembled - decoded,
            "shard": sharded - assembled,
            "step": done - sharded,
            "total": done - start,
        }
        h2d = sum(np.asarray(x).nbytes for x in jax.tree.leaves(batch))
        # CPU seconds of this thread per 1,000 groups: the trainer's host work on a reply.
        per_k = 1000 / len(groups)
        seconds["decode_cpu_per_1000"] = (cpu_decoded - cpu_start) * per_k
        seconds["assemble_cpu_per_1000"] = (cpu_assembled - cpu_decoded) * per_k
        return state, metrics, seconds, {"h2d": h2d, "d2h": 0}

    return one_step, state


def run(args: argparse.Namespace) -> dict[str, Any]:
    cfg = load_config(str(CONFIG), ["train.loss.kl_coef=0.01", *args.set])
    mesh = sharding.make_mesh(cfg.train.mesh)
    _, params = placement.init_sharded(cfg.model, mesh, cfg.train.seed)
    one_step, state = make_data_path(cfg, mesh, params)
    groups = make_groups(cfg, args.seed)
    samples: dict[str, list[float]] = {}
    moved = {}
    for i in range(args.warmup + args.repeats):
        state, metrics, seconds, moved = one_step(state, groups)
        if not np.isfinite(metrics["total_loss"]) or metrics["step_skipped"]:
            raise RuntimeError(f"step {i}: unexpected metrics {metrics}")
        if i >= args.warmup:
            for phase, value in seconds.items():
                samples.setdefault(phase, []).append(value)
    r = cfg.rollout
    return {
        "shape": f"{r.batch_groups} groups x {r.group_size}, T <= {setup.batch_spec(cfg).seq_len}, "
        f"d_model {cfg.model.d_model}, {cfg.model.num_layers} layers",
        "devices": f"{jax.device_count()} {jax.default_backend()}",
        "repeats": args.repeats,
        "median_ms": {p: 1e3 * statistics.median(v) for p, v in samples.items() if "cpu" not in p},
        "trainer_cpu_s_per_1000_groups": {
            p.removesuffix("_cpu_per_1000"): statistics.median(v)
            for p, v in samples.items()
            if "cpu" in p
        },
        "bytes": moved,
        "load_average": os.getloadavg()[0],
    }


def format_result(result: dict[str, Any]) -> str:
    med = result["median_ms"]
    return (
        f"{result['shape']}, {result['devices']} device(s), {result['repeats']} steps, load "
        f"average {result['load_average']:.1f} at the end\n"
        + ", ".join(f"{p} {ms:.1f} ms" for p, ms in med.items())
        + f"; host->device {result['bytes']['h2d']} B, device->host {result['bytes']['d2h']} B"
        + "\ntrainer CPU s per 1,000 groups: "
        + ", ".join(f"{p} {s:.3f}" for p, s in result["trainer_cpu_s_per_1000_groups"].items())
    )


def main_cli(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    result = run(args)
    print(format_result(result), flush=True)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main_cli()
