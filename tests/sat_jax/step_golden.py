"""The train step's loss, metrics and gradients on fixed inputs, saved before the recipe options
(truncation replay, decoupled PPO, filters, sequence corrections) existed.

``tests/sat_jax/step/test_recipe_off.py`` checks that with every recipe option off the step gives
these bit for bit. XLA's CPU code generation follows the host's instruction set, so the bits are
those of one jax version on one kind of CPU: the file keeps one set of fingerprints per host kind
(``host_kind``: the CPU model and its vector extensions), each written by the same code, the step
before the options. On a host kind the file has, the hashes must match; on another, the sums and
norms (which agree across them to float32 precision).

Regenerate only on purpose (a change that is meant to move the numbers), or add a host kind by
running this module from the commit that wrote the file (``git log`` of the data file):
``XLA_FLAGS=--xla_force_host_platform_device_count=8 .venv/bin/python -m tests.sat_jax.step_golden``.
"""

from __future__ import annotations

import hashlib
import json
import pathlib
import platform

import jax
import numpy as np
import optax

from sat_jax import objectives, sharding
from sat_jax.model import ModelConfig, placement
from sat_jax.step import StepConfig, TrainBatch, create_train_state, make_train_step, shard_batch

GOLDEN = pathlib.Path(__file__).parent / "data" / "step_golden.json"
B, T, PROMPT = 8, 12, 4
MODEL_CFG = ModelConfig.preset(
    "tiny", dispatch="dense", mlp_only_layers=(0,), router_aux_loss_coef=0.01
)
SAT = objectives.SATConfig(enabled=True, quantile=0.8)
# name: (loss config, microbatches, routing replay, with reference params)
CASES = {
    "sat_token_k1_replay": (objectives.PolicyLossConfig(sat=SAT), 1, True, False),
    "sat_token_k2_replay": (objectives.PolicyLossConfig(sat=SAT), 2, True, False),
    "gspo_kl_k2": (
        objectives.PolicyLossConfig(
            ratio_level="sequence", loss_agg="seq_mean_token_mean", sat=SAT, kl_coef=0.1
        ),
        2,
        False,
        True,
    ),
    "ppo_k1": (objectives.PolicyLossConfig(), 1, False, False),
}


def _grads_as_params() -> optax.GradientTransformation:
    """An 'optimizer' whose new params are the gradient."""
    return optax.GradientTransformation(
        init=lambda params: optax.EmptyState(),
        update=lambda g, state, p: (jax.tree.map(lambda gi, pi: gi - pi, g, p), state),
    )


def golden_batch() -> TrainBatch:
    rng = np.random.default_rng(7)
    tokens = rng.integers(0, MODEL_CFG.vocab_size, (B, T)).astype(np.int32)
    ends = rng.integers(PROMPT + 2, T + 1, (B, 1))
    mask = ((np.arange(T) >= PROMPT) & (np.arange(T) < ends)).astype(np.float32)
    shape = (B, T, MODEL_CFG.num_moe_layers, MODEL_CFG.num_experts_per_tok)
    return TrainBatch(
        tokens=tokens,
        loss_mask=mask,
        behavior_logp=np.log(rng.uniform(0.01, 0.3, (B, T))).astype(np.float32),
        rewards=rng.integers(0, 2, B).astype(np.float32),
        group_ids=np.repeat(np.arange(B // 4), 4).astype(np.int32),
        routing=rng.integers(0, MODEL_CFG.num_experts, shape).astype(np.uint8),
    )


def run_case(name: str, **options) -> dict[str, np.ndarray]:
    """{"metric/<name>": value, "grad/<path>": gradient leaf} of one case on one device; ``options``
    are further ``StepConfig`` fields."""
    loss_cfg, k, replay, with_ref = CASES[name]
    mesh = sharding.make_mesh(sharding.MeshConfig(fsdp=1), jax.devices()[:1])
    _, params0 = placement.init_sharded(MODEL_CFG, mesh, 0)
    optimizer = _grads_as_params()
    cfg = StepConfig(loss=loss_cfg, routing_replay=replay, microbatches=k, **options)
    step_fn = make_train_step(MODEL_CFG, optimizer, cfg, mesh)
    state = create_train_state(MODEL_CFG, optimizer, mesh, params0)
    ref_params = None
    if with_ref:
        _, ref_params = placement.init_sharded(MODEL_CFG, mesh, 1)
    state, metrics = step_fn(state, shard_batch(golden_batch(), mesh), ref_params)
    out = {f"metric/{key}": np.asarray(v) for key, v in jax.device_get(metrics).items()}
    for path, leaf in jax.tree_util.tree_flatten_with_path(jax.device_get(state.params))[0]:
        out[f"grad/{jax.tree_util.keystr(path)}"] = np.asarray(leaf)
    return out


def fingerprint(value: np.ndarray) -> dict[str, object]:
    """What the golden file keeps of an array: the SHA-256 of its float32 bytes (for the
    bit-for-bit check) and its float64 sum and L2 norm (for a jax version other than the one that
    wrote the file, whose XLA may round differently)."""
    x = np.ascontiguousarray(np.asarray(value, np.float32))
    return {
        "sha256": hashlib.sha256(x.tobytes()).hexdigest(),
        "sum": float(x.astype(np.float64).sum()),
        "norm": float(np.linalg.norm(x.astype(np.float64))),
    }


def host_kind() -> str:
    """The kind of CPU XLA compiles for: its model name and the vector extensions it reports."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    model = value.strip()
                elif key.strip() == "flags":
                    flags = set(value.split())
    except OSError:
        pass
    vector = sorted(f for f in flags if f.startswith(("avx", "amx", "fma", "f16c", "sse", "bmi")))
    return f"{model} [{' '.join(vector)}]"


def main() -> None:
    golden = json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {"hosts": {}}
    if golden.get("jax_version", jax.__version__) != jax.__version__:
        golden = {"hosts": {}}  # another jax version: the old bits no longer apply
    golden["jax_version"] = jax.__version__
    golden["hosts"][host_kind()] = {
        name: {key: fingerprint(v) for key, v in run_case(name).items()} for name in CASES
    }
    GOLDEN.parent.mkdir(parents=True, exist_ok=True)
    GOLDEN.write_text(json.dumps(golden, indent=1, sort_keys=True) + "\n")
    print(f"wrote {GOLDEN} ({GOLDEN.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
