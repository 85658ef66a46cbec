"""Cost of SAT on top of the PPO/GSPO loss: jitted loss + gradient, median of interleaved runs.

Usage:  .venv/bin/python benchmarks/objective_overhead.py [--tokens 1048576 4194304] [--repeats 21]

Prints one markdown table: per size and ratio level, the median milliseconds of PPO and SAT loss+grad
and their ratio, and the cost of the exact quantile by three algorithms (full sort, 32-step bisection
on the float bits, and the library's two-pass radix select). Runs are interleaved (PPO, SAT, PPO, ...)
so machine noise hits both alike; compare ratios, not absolute times.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from sat_jax import objectives

BATCH_KINDS = ("mixed", "active")


def make_batch(active_tokens: int, seed: int = 0, kind: str = "mixed"):
    """About `active_tokens` active tokens in rows of T = 1024.

    "mixed": responses of random length in [T/2, T] (mean 3T/4 active), log-ratios ~N(0, 0.3);
    "active": every token active, log-ratios ~N(0, 0.05) (a near-on-policy batch).
    """
    rng = np.random.default_rng(seed)
    T = 1024
    if kind == "mixed":
        B = max(1, round(active_tokens / (0.75 * T)))
        lengths = rng.integers(T // 2, T + 1, size=B)
        scale = 0.3
    else:
        B = max(1, round(active_tokens / T))
        lengths = np.full(B, T)
        scale = 0.05
    mask = (np.arange(T)[None, :] < lengths[:, None]).astype(np.float32)
    logp = np.log(rng.uniform(0.05, 0.99, (B, T))).astype(np.float32)
    behavior = (logp + scale * rng.standard_normal((B, T))).astype(np.float32)
    adv = np.repeat(rng.standard_normal((B, 1)), T, axis=1).astype(np.float32)
    return tuple(jnp.asarray(x) for x in (logp, behavior, adv, mask))


def loss_and_grad_fn(cfg: objectives.PolicyLossConfig, with_metrics: bool = False):
    """Jitted loss + gradient; with_metrics also returns every metric (so none is dead code)."""

    def f(logp, behavior, adv, mask):
        return objectives.policy_loss(logp, behavior, adv, mask, cfg)

    if with_metrics:
        return jax.jit(jax.value_and_grad(f, has_aux=True))
    return jax.jit(jax.value_and_grad(lambda *a: f(*a)[0]))


def sort_quantile(x, mask, level=0.9):
    values = jnp.sort(jnp.where(mask > 0, x, jnp.inf).reshape(-1))
    n = jnp.sum(mask > 0)
    return values[jnp.maximum(jnp.ceil(level * n).astype(jnp.int32) - 1, 0)]


def bisection_quantile(x, mask, level=0.9):
    """32 counting passes over the non-negative float bits (the naive exact selection)."""
    bits = jax.lax.bitcast_convert_type(x, jnp.int32).reshape(-1)
    active = (mask > 0).reshape(-1)
    rank = jnp.ceil(level * jnp.sum(active)).astype(jnp.int32)

    def step(_, bounds):
        lo, hi = bounds
        mid = lo + (hi - lo) // 2
        enough = jnp.sum(active & (bits <= mid)) >= rank
        return jnp.where(enough, lo, mid + 1), jnp.where(enough, mid, hi)

    lo, _ = jax.lax.fori_loop(0, 32, step, (jnp.int32(0), jnp.int32(0x7F800000)))
    return jax.lax.bitcast_convert_type(lo, jnp.float32)


def radix_quantile(x, mask, level=0.9):
    return objectives.masked_quantile(x, level, where=mask)


def time_interleaved(fns: dict, args_for: dict, repeats: int) -> dict[str, float]:
    for name, fn in fns.items():  # compile + warm up
        jax.block_until_ready(fn(*args_for[name]))
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            jax.block_until_ready(fn(*args_for[name]))
            times[name].append(time.perf_counter() - start)
    return {name: 1e3 * statistics.median(ts) for name, ts in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1 << 20, 1 << 22])
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument(
        "--train-step",
        action="store_true",
        help="also time a `small`-model train step with SAT vs PPO (a few minutes on 2 cores)",
    )
    parser.add_argument("--step-batch", type=int, nargs=2, default=(8, 512), metavar=("B", "T"))
    args = parser.parse_args()

    print(
        f"machine: {platform.machine()} {platform.processor() or ''} cores={os.cpu_count()} "
        f"backend={jax.default_backend()} jax={jax.__version__} python={platform.python_version()}"
    )
    time_losses(args.tokens, args.repeats)
    for kind in BATCH_KINDS:
        time_quantiles(args.tokens[0], max(5, args.repeats // 2), kind)
    if args.train_step:
        time_train_step(*args.step_batch, repeats=max(3, args.repeats // 4))


def time_losses(sizes: list[int], repeats: int) -> None:
    """PPO vs SAT loss + gradient, with and without metrics, per size, batch kind and ratio level."""
    sat = objectives.SATConfig(enabled=True, quantile=0.9, exponent=2.0)
    rows = []
    for tokens in sizes:
        for kind in BATCH_KINDS:
            batch = make_batch(tokens, kind=kind)
            active = int(jnp.sum(batch[3]))
            for level in ("token", "sequence"):
                ppo_cfg = objectives.PolicyLossConfig(ratio_level=level)
                sat_cfg = objectives.PolicyLossConfig(ratio_level=level, sat=sat)
                fns = {
                    "ppo": loss_and_grad_fn(ppo_cfg),
                    "sat": loss_and_grad_fn(sat_cfg),
                    "ppo+m": loss_and_grad_fn(ppo_cfg, with_metrics=True),
                    "sat+m": loss_and_grad_fn(sat_cfg, with_metrics=True),
                }
                ms = time_interleaved(fns, dict.fromkeys(fns, batch), repeats)
                rows.append((f"{active:,}", kind, level, ms))
                print(
                    f"  {active:,} tokens {kind} {level}: "
                    + ", ".join(f"{k} {v:.2f} ms" for k, v in ms.items()),
                    flush=True,
                )

    print(
        "\n| active tokens | batch | ratio level | PPO loss+grad (ms) | SAT loss+grad (ms) | SAT/PPO "
        "| PPO with metrics (ms) | SAT with metrics (ms) | SAT/PPO with metrics |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for active, kind, level, ms in rows:
        print(
            f"| {active} | {kind} | {level} | {ms['ppo']:.2f} | {ms['sat']:.2f} "
            f"| {ms['sat'] / ms['ppo']:.2f} | {ms['ppo+m']:.2f} | {ms['sat+m']:.2f} "
            f"| {ms['sat+m'] / ms['ppo+m']:.2f} |"
        )


def time_quantiles(tokens: int, repeats: int, kind: str = "mixed") -> None:
    """The exact 0.9-quantile of |d| by three algorithms (checked equal) against PPO's step."""
    batch = make_batch(tokens, kind=kind)
    abs_d = jnp.abs(batch[0] - batch[1])
    quantile_fns = {
        "sort": jax.jit(sort_quantile),
        "bisection (32 passes)": jax.jit(bisection_quantile),
        "radix select (2 histogram passes, library)": jax.jit(radix_quantile),
    }
    values = {name: float(fn(abs_d, batch[3])) for name, fn in quantile_fns.items()}
    assert len(set(values.values())) == 1, f"quantile algorithms disagree: {values}"
    ppo = loss_and_grad_fn(objectives.PolicyLossConfig())
    fns = {"ppo": ppo, **quantile_fns}
    ms = time_interleaved(
        fns, {"ppo": batch, **{k: (abs_d, batch[3]) for k in quantile_fns}}, repeats
    )
    active = int(jnp.sum(batch[3]))
    print(
        f"\nExact 0.9-quantile of |d| over {active:,} active tokens, {kind} batch "
        f"(all agree: {values['sort']:.6g})"
    )
    print("| algorithm | ms | × PPO loss+grad |")
    print("|---|---|---|")
    for name in quantile_fns:
        print(f"| {name} | {ms[name]:.2f} | {ms[name] / ms['ppo']:.2f} |")


def time_train_step(batch: int, length: int, repeats: int) -> None:
    """The share of a `small`-model train step that SAT's gate costs: SAT vs PPO, same batch."""
    import optax

    from sat_jax import sharding
    from sat_jax.model import ModelConfig
    from sat_jax.step import StepConfig, TrainBatch, init_train_state, make_train_step

    model_cfg = ModelConfig.preset("small")
    mesh = sharding.make_mesh(sharding.MeshConfig(fsdp=1), devices=jax.devices()[:1])
    optimizer = optax.adamw(1e-5, b2=0.98)
    rng = np.random.default_rng(0)
    tokens = rng.integers(3, model_cfg.vocab_size, (batch, length)).astype(np.int32)
    mask = np.zeros((batch, length), np.float32)
    mask[:, length // 4 :] = 1.0
    step_batch = TrainBatch(
        tokens=jnp.asarray(tokens),
        loss_mask=jnp.asarray(mask),
        behavior_logp=jnp.asarray(
            np.log(rng.uniform(0.01, 1.0, (batch, length)), dtype=np.float32)
        ),
        advantages=jnp.asarray(np.repeat(rng.standard_normal((batch, 1)), length, 1), jnp.float32),
    )
    steps, states = {}, {}
    for name, sat_on in (("ppo", False), ("sat", True)):
        loss_cfg = objectives.PolicyLossConfig(sat=objectives.SATConfig(enabled=sat_on))
        steps[name] = make_train_step(model_cfg, optimizer, StepConfig(loss=loss_cfg), mesh)
        states[name] = init_train_state(model_cfg, optimizer, mesh, rng=0)
    times = {name: [] for name in steps}
    for i in range(repeats + 1):  # the first round compiles
        for name, step in steps.items():
            start = time.perf_counter()
            states[name], metrics = step(states[name], step_batch)
            jax.block_until_ready(metrics)
            if i:
                times[name].append(time.perf_counter() - start)
    ppo_ms, sat_ms = (1e3 * statistics.median(times[k]) for k in ("ppo", "sat"))
    print(
        f"\n`small` train step (B={batch}, T={length}, {int(mask.sum()):,} active tokens, "
        f"{repeats} interleaved repeats)"
    )
    print("| loss | step (ms) | SAT gate share of the step |")
    print("|---|---|---|")
    print(f"| PPO | {ppo_ms:.0f} | - |")
    print(f"| SAT | {sat_ms:.0f} | {(sat_ms - ppo_ms) / sat_ms:+.1%} |")


if __name__ == "__main__":
    main()
