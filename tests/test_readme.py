"""The README's code runs as written: its optax example is executed from the README text itself."""

import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
STEP_SIGNATURE = "def train_step(params, opt_state, batch)"
# The docs/DESIGN.md §4 names every policy_loss call reports.
REQUIRED_METRICS = {
    "mismatch_abs_mean",
    "is_deviation_frac",
    "kl_k3",
    "clip_frac_low",
    "clip_frac_high",
    "sat_q",
    "sat_gate_rate",
    "sat_eps_low_mean",
    "sat_eps_high_mean",
    "sat_c_min",
}


def python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python[ \t]*\n(.*?)^```[ \t]*$", text, flags=re.M | re.S)


@struct.dataclass
class Batch:
    """The fields the README's step reads, plus what the toy model needs; all [B, T]."""

    tokens: jax.Array
    targets: jax.Array
    behavior_logp: jax.Array
    advantages: jax.Array
    mask: jax.Array


def log_probs(p, batch):
    """A toy model: logits = p["w"][token], log π of each target token, [B, T]."""
    logp_btv = jax.nn.log_softmax(p["w"][batch.tokens], axis=-1)
    return jnp.take_along_axis(logp_btv, batch.targets[..., None], axis=-1)[..., 0]


def make_batch(params, B=4, T=6, V=5, seed=0):
    rng = np.random.default_rng(seed)
    tokens = jnp.asarray(rng.integers(0, V, (B, T)))
    targets = jnp.asarray(rng.integers(0, V, (B, T)))
    mask = jnp.asarray((rng.random((B, T)) < 0.8).astype(np.float32)).at[0].set(0.0)
    batch = Batch(tokens, targets, jnp.zeros((B, T)), jnp.asarray(rng.normal(size=(B, T))), mask)
    # A stale behavior policy: the current log-probs moved by noise, so SAT has a tail to contract.
    stale = log_probs(params, batch) + 0.3 * jnp.asarray(rng.normal(size=(B, T)))
    return batch.replace(behavior_logp=stale.astype(jnp.float32))


def test_readme_optax_example_runs():
    blocks = [b for b in python_blocks(README.read_text()) if STEP_SIGNATURE in b]
    assert len(blocks) == 1, f"README.md: expected one ```python block with {STEP_SIGNATURE!r}"
    namespace = {"log_probs": log_probs}
    exec(compile(blocks[0], f"{README}:train_step block", "exec"), namespace)
    train_step, optimizer = namespace["train_step"], namespace["optimizer"]

    V = 5
    params = {"w": 0.1 * jnp.asarray(np.random.default_rng(1).normal(size=(V, V)), jnp.float32)}
    batch = make_batch(params, V=V)
    opt_state = optimizer.init(params)
    new_params = params
    for _ in range(3):
        new_params, opt_state, metrics = train_step(new_params, opt_state, batch)
        assert np.isfinite(float(metrics["loss"]))
    assert REQUIRED_METRICS <= set(metrics), REQUIRED_METRICS - set(metrics)
    assert all(np.isfinite(float(v)) for v in metrics.values())
    assert not np.array_equal(new_params["w"], params["w"])
    assert float(metrics["sat_gate_rate"]) > 0.0  # the README's config runs SAT
