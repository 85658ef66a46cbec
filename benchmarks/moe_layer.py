"""Forward+backward speed of one MoE layer per dispatch path against a dense SwiGLU FFN.

Run: `python benchmarks/moe_layer.py` (about 3-4 minutes on 2 CPU cores).

Each MoE path (dense, ragged, blocked, auto) runs the real `sat_jax.model.moe.MoE` layer under a
jitted `value_and_grad` with respect to its inputs and every weight; the baseline is a dense SwiGLU
FFN of width K * expert_dim, i.e. the same ACTIVE FLOPs, and a plain 2048³ matmul gives the
machine's dense-matmul speed under the same conditions. Calls are interleaved (the order rotates
each repeat) and timed after a warm-up; medians are reported. GFLOP/s counts active
FLOPs only (forward 6 * T * D * K * F, backward twice that), so paths that compute more than the
active FLOPs show it as lower throughput. Paths whose single call exceeds SLOW_CALL_S are repeated
fewer times (column n) to keep the run short.
"""

from __future__ import annotations

import dataclasses
import pathlib
import statistics
import sys
import time

# Run by path from a checkout, installed or not.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jax
import jax.numpy as jnp
from flax import nnx

from sat_jax.model.layers import DenseMLP
from sat_jax.model.moe import MoE, resolve_dispatch

TOKENS, D_MODEL, EXPERT_DIM, TOP_K = 2048, 512, 256, 2
EXPERT_RATIOS = (4, 8, 16)
REPEATS, SLOW_REPEATS, SLOW_CALL_S = 10, 3, 2.0
PATHS = ("dense", "ragged", "blocked", "auto")


@dataclasses.dataclass(frozen=True)
class Timing:
    median_s: float
    repeats: int


def make_step(module: nnx.Module, dispatch: str | None):
    """A jitted (loss, grads) of sum(y * cotangent) w.r.t. the input and all params."""
    graphdef, params = nnx.split(module)

    def loss(params, x_btd, cot_btd):
        layer = nnx.merge(graphdef, params)
        if dispatch is None:
            y_btd = layer(x_btd)
        else:
            mask_bt = jnp.ones(x_btd.shape[:2], bool)
            y_btd = layer(x_btd, mask_bt=mask_bt, dispatch=dispatch).y_btd
        return jnp.sum(y_btd * cot_btd)

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    return lambda x, c: step(params, x, c)


def time_once(fn, *args) -> float:
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - start


MATMUL_N = 2048


def make_matmul():
    """A plain f32 [N, N] @ [N, N] matmul: the machine's dense-matmul speed, timed alongside."""
    a = jax.random.normal(jax.random.key(0), (MATMUL_N, MATMUL_N))
    f = jax.jit(lambda a, b: a @ b)
    return lambda x, c: f(a, a)


def bench_ratio(ratio: int) -> dict[str, Timing]:
    num_experts = ratio * TOP_K
    rngs = nnx.Rngs(0)
    moe = MoE(
        d_model=D_MODEL,
        num_experts=num_experts,
        k=TOP_K,
        expert_dim=EXPERT_DIM,
        norm_topk_prob=True,
        dispatch="auto",
        dtype=jnp.float32,
        param_dtype=jnp.float32,
        rngs=rngs,
    )
    ffn = DenseMLP(
        d_model=D_MODEL,
        hidden_dim=TOP_K * EXPERT_DIM,
        dtype=jnp.float32,
        param_dtype=jnp.float32,
        rngs=rngs,
    )
    steps = {"matmul": make_matmul(), "ffn": make_step(ffn, None)}
    steps |= {p: make_step(moe, p) for p in PATHS}
    x = jax.random.normal(jax.random.key(1), (1, TOKENS, D_MODEL))
    cot = jax.random.normal(jax.random.key(2), (1, TOKENS, D_MODEL))
    first = {
        name: (time_once(step, x, cot), time_once(step, x, cot))[1] for name, step in steps.items()
    }
    samples = {name: [first[name]] for name in steps}
    names = list(steps)
    for rep in range(REPEATS - 1):
        order = names[rep % len(names) :] + names[: rep % len(names)]
        for name in order:
            if first[name] > SLOW_CALL_S and len(samples[name]) >= SLOW_REPEATS:
                continue
            samples[name].append(time_once(steps[name], x, cot))
    return {n: Timing(statistics.median(s), len(s)) for n, s in samples.items()}


def main() -> None:
    active_flops = 3 * 6 * TOKENS * D_MODEL * TOP_K * EXPERT_DIM  # forward + backward
    print(
        f"backend={jax.default_backend()} devices={jax.device_count()} "
        f"T={TOKENS} D={D_MODEL} F={EXPERT_DIM} K={TOP_K}; active fwd+bwd "
        f"{active_flops / 1e9:.1f} GFLOP per call\n"
    )
    print(
        "| E/K | E | path | resolves to | n | median ms | active GFLOP/s | % of matmul "
        "| × dense FFN |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for ratio in EXPERT_RATIOS:
        timings = bench_ratio(ratio)
        peak = 2 * MATMUL_N**3 / timings.pop("matmul").median_s / 1e9
        print(
            f"| {ratio} | {ratio * TOP_K} | (dense matmul {MATMUL_N}³) | - | - | - "
            f"| {peak:.1f} | 100% | - |"
        )
        base = timings["ffn"].median_s
        for name, tm in timings.items():
            resolved = (
                "-"
                if name == "ffn"
                else resolve_dispatch(name, num_tokens=TOKENS, num_experts=ratio * TOP_K, k=TOP_K)
            )
            gflops = active_flops / tm.median_s / 1e9
            print(
                f"| {ratio} | {ratio * TOP_K} | {name} | {resolved} | {tm.repeats} "
                f"| {tm.median_s * 1e3:.1f} | {gflops:.1f} | {100 * gflops / peak:.0f}% "
                f"| {tm.median_s / base:.2f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
