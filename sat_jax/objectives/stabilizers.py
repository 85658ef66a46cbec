"""Per-token stabilizers of the policy loss (docs/DESIGN.md §3.4): KL penalty, TIS, IcePop, DPPO-TV.

Re-exported by :mod:`sat_jax.objectives`; :func:`~sat_jax.objectives.policy_loss` applies them
when its config enables them. Every function is per-token and unreduced, [B, T] in and out.
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

KLEstimator = Literal["k1", "k2", "k3"]

KL_ESTIMATORS = ("k1", "k2", "k3")
# The k3 ("low_var_kl") estimator is clamped to ±10 after its log-ratio is clamped to ±20, as in
# verl: exp() of a larger log-ratio overflows float32 and would turn the clamp's zero gradient NaN.
_KL_LOG_RATIO_CLAMP = 20.0
_K3_CLAMP = 10.0


def kl_penalty(
    logp: ArrayLike,
    ref_logp: ArrayLike,
    *,
    estimator: KLEstimator = "k3",
    where: ArrayLike | None = None,
) -> jax.Array:
    """Per-token estimate of KL(π ‖ π_ref) from samples of π: k1, k2 or k3 (``low_var_kl``).

    k1 = log π − log π_ref; k2 = ½(log π − log π_ref)²; k3 = e^x − x − 1 with
    x = clip(log π_ref − log π, ±20), the result clipped to ±10. Returns [B, T], 0 where inactive.
    """
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"kl_penalty: estimator must be one of {KL_ESTIMATORS}, got {estimator!r}")
    lp = jnp.asarray(logp, jnp.float32)
    active = jnp.ones(lp.shape, bool) if where is None else jnp.asarray(where) > 0
    diff = jnp.where(active, lp - jnp.asarray(ref_logp, jnp.float32), 0.0)
    if estimator == "k1":
        kl = diff
    elif estimator == "k2":
        kl = 0.5 * jnp.square(diff)
    else:
        x = jnp.clip(-diff, -_KL_LOG_RATIO_CLAMP, _KL_LOG_RATIO_CLAMP)
        kl = jnp.clip(jnp.exp(x) - x - 1.0, -_K3_CLAMP, _K3_CLAMP)
    return jnp.where(active, kl, 0.0)


def truncated_importance_weights(
    old_logp: ArrayLike, behavior_logp: ArrayLike, *, cap: float
) -> jax.Array:
    """TIS weights w = min(exp(old_logp − behavior_logp), cap), detached. [B, T]."""
    log_k = jnp.asarray(old_logp, jnp.float32) - jnp.asarray(behavior_logp, jnp.float32)
    return jax.lax.stop_gradient(jnp.minimum(jnp.exp(log_k), cap))


def icepop_weights(
    old_logp: ArrayLike, behavior_logp: ArrayLike, *, low: float, high: float
) -> jax.Array:
    """IcePop weights w = k·1[low ≤ k ≤ high], k = exp(old_logp − behavior_logp), detached."""
    log_k = jnp.asarray(old_logp, jnp.float32) - jnp.asarray(behavior_logp, jnp.float32)
    k = jnp.exp(log_k)
    return jax.lax.stop_gradient(jnp.where((k >= low) & (k <= high), k, 0.0))


def dppo_tv_mask(
    logp: ArrayLike,
    old_logp: ArrayLike,
    ratio: ArrayLike,
    advantages: ArrayLike,
    *,
    delta: float,
) -> jax.Array:
    """DPPO-TV: True where a token's gradient is to be zeroed (outward and TV distance > δ).

    Outward means A·(r − 1) > 0; the distance is |exp(logp) − exp(old_logp)| of the sampled token.
    Detached boolean [B, T].
    """
    lp = jax.lax.stop_gradient(jnp.asarray(logp, jnp.float32))
    r = jax.lax.stop_gradient(jnp.asarray(ratio, jnp.float32))
    outward = jnp.asarray(advantages, jnp.float32) * (r - 1.0) > 0
    distance = jnp.abs(jnp.exp(lp) - jnp.exp(jnp.asarray(old_logp, jnp.float32)))
    return outward & (distance > delta)
