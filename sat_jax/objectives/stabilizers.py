"""Stabilizers of the policy loss (docs/DESIGN.md §3.4): KL penalty, TIS, IcePop, DPPO-TV and the
sequence-level rollout corrections (sequence TIS, geometric-mean sequence masking).

Re-exported by :mod:`sat_jax.objectives`; :func:`~sat_jax.objectives.policy_loss` applies them
when its config enables them. Every function is unreduced, [B, T] in and out; the sequence-level
ones give each response's value broadcast to its tokens ([B, 1] with ``keepdims``).
"""

from __future__ import annotations

import math
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


def _sequence_log_ratio_sum(
    old_logp: ArrayLike, behavior_logp: ArrayLike, where: ArrayLike | None
) -> tuple[jax.Array, jax.Array]:
    """(Σ, count) over each response's active tokens of old_logp − behavior_logp, each [B, 1].

    Inactive tokens are zeroed before the sum, so garbage there (−inf, NaN) never reaches it.
    """
    log_k = jnp.asarray(old_logp, jnp.float32) - jnp.asarray(behavior_logp, jnp.float32)
    active = jnp.ones(log_k.shape, bool) if where is None else jnp.asarray(where) > 0
    total = jnp.sum(jnp.where(active, log_k, 0.0), axis=-1, keepdims=True)
    count = jnp.sum(active, axis=-1, keepdims=True, dtype=jnp.int32)
    return jax.lax.stop_gradient(total), count


def sequence_importance_weights(
    old_logp: ArrayLike,
    behavior_logp: ArrayLike,
    *,
    cap: float,
    where: ArrayLike | None = None,
    keepdims: bool = False,
) -> jax.Array:
    """Sequence TIS weights w_b = min(exp(S_b), cap), S_b = Σ_t∈active(b) (old_logp − behavior_logp).

    Computed in log space as exp(min(S_b, log cap)), so a huge S_b gives cap, never inf (for a
    finite cap); a very negative one gives 0. A response with no active token has S_b = 0.
    Detached.

    Args:
      old_logp, behavior_logp: [B, T].
      cap: the truncation C > 0.
      where: 1 on active tokens, [B, T]; every token when None.
      keepdims: return [B, 1] instead of w_b broadcast to [B, T].

    Returns:
      [B, T] (or [B, 1]) float32 weights in [0, cap].
    """
    total_b1, _ = _sequence_log_ratio_sum(old_logp, behavior_logp, where)
    w_b1 = jnp.exp(jnp.minimum(total_b1, math.log(cap)))
    w_b1 = jax.lax.stop_gradient(w_b1)
    shape = jnp.shape(old_logp)
    return w_b1 if keepdims else jnp.broadcast_to(w_b1, shape)


def geometric_mean_mask(
    old_logp: ArrayLike,
    behavior_logp: ArrayLike,
    *,
    low: float,
    high: float,
    where: ArrayLike | None = None,
    keepdims: bool = False,
) -> jax.Array:
    """Sequence masking (MIS): True where response b is masked out, i.e. g_b ∉ [low, high].

    g_b = exp(mean_t∈active(b) (old_logp − behavior_logp)) is the geometric mean of b's token
    importance ratios (1 for a response with no active token). Like :func:`dppo_tv_mask`, True
    marks what is removed. Detached boolean.

    Args:
      old_logp, behavior_logp: [B, T].
      low, high: the kept interval, 0 ≤ low ≤ high.
      where: 1 on active tokens, [B, T]; every token when None.
      keepdims: return [B, 1] instead of the flag broadcast to [B, T].

    Returns:
      [B, T] (or [B, 1]) bool.
    """
    total_b1, count_b1 = _sequence_log_ratio_sum(old_logp, behavior_logp, where)
    g_b1 = jnp.exp(total_b1 / jnp.maximum(count_b1, 1))
    masked_b1 = ~((g_b1 >= low) & (g_b1 <= high))
    return masked_b1 if keepdims else jnp.broadcast_to(masked_b1, jnp.shape(old_logp))
