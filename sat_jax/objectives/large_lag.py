"""Large-lag corrections: M2PO's second-moment mask and VCPO's effective-sample-size step scaling.

docs/DESIGN.md §3.6 states both with their sources. Per active token, d = sg(logp − behavior_logp),
the log-ratio of the current policy to the sampler (detached), and w = exp(d):

* M2PO (Zheng et al., arXiv 2510.01161; AReaL's ``actor.m2_threshold``): m2 = d². Sort the active
  tokens' m2 ascending, c_j = the sum of the j smallest; keep the largest j with c_j < τ·j (at
  least one), i.e. mask the fewest largest-m2 tokens after which the mean m2 of the rest is
  below τ. The batch's cutoff v is the smallest masked m2 (+inf when nothing is masked) and a
  token is masked iff m2 ≥ v, so tokens tied at v are masked together (the kept mean stays
  below τ). A masked token contributes 0 to the loss and its gradient; it still counts in the
  loss's denominator (the paper's 1/Σ_i |o_i|).
* ESS (Kong 1992; VCPO, Huang et al., arXiv 2602.17616): ess = (Σ w)² / (N·Σ w²) over the N
  active tokens, in (0, 1], 1 when every w is equal. VCPO scales the step (the learning rate) by
  sqrt(ess), the square-root rule for Adam-type optimizers.

Both are batch statistics. The ESS is rebuilt from the sums (Σ w, Σ w², N), which add across
microbatches and hosts. The M2PO cutoff is a sort over the whole batch; the train step computes it
once per batch (:func:`m2po_cutoff`, in the gradient-free pass that also gives SAT's batch
threshold) and hands it to every microbatch, like SAT's ``sat_q``.

Shapes: ``B`` responses, ``T`` tokens; every per-token array is ``[B, T]``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

# policy imports this module, so its types are named here, not imported (no import cycle).
_PolicyLossConfig = Any  # policy.PolicyLossConfig


# PolicyLossTerms.totals keys of the ESS sums (N is ``active_tokens``).
ESS_WEIGHT_SUM = "ess_weight_sum"
ESS_WEIGHT_SQ_SUM = "ess_weight_sq_sum"


def _active(where: ArrayLike | None, like: jax.Array) -> jax.Array:
    if where is None:
        return jnp.ones(like.shape, bool)
    return jnp.asarray(where) > 0


def m2po_cutoff(
    log_ratio: ArrayLike, *, threshold: float, where: ArrayLike | None = None
) -> jax.Array:
    """M2PO's cutoff v: a token is masked iff (log r)² ≥ v; +inf when nothing is masked.

    With the active m2 = d² sorted ascending (a_1 ≤ … ≤ a_n) and c_j = a_1 + … + a_j, the kept
    count is m = max(#{j : c_j < τ·j}, 1) (the running mean of the smallest values is
    non-decreasing, so these j are 1..m) and v = a_{m+1}, or +inf when m = n. The tokens masked are
    then the n − m largest, and any tied with a_{m+1}.

    Args:
      log_ratio: d, [B, T]; read under stop_gradient (the mask is a constant of the batch).
      threshold: τ > 0, the bound on the kept tokens' mean d².
      where: active tokens, [B, T]; all when None.

    Returns:
      A float32 scalar under stop_gradient.
    """
    d = jax.lax.stop_gradient(jnp.asarray(log_ratio, jnp.float32))
    active = _active(where, d)
    m2 = jnp.where(active, d * d, jnp.inf).reshape(-1)  # inactive sort last
    ascending = jnp.sort(m2)
    n = jnp.sum(active, dtype=jnp.int32)
    rank = jnp.arange(1, m2.shape[0] + 1, dtype=jnp.int32)
    real = rank <= n
    running = jnp.cumsum(jnp.where(real, ascending, 0.0))
    under = real & (running < threshold * rank.astype(jnp.float32))
    kept = jnp.maximum(jnp.sum(under, dtype=jnp.int32), jnp.minimum(n, 1))
    index = jnp.minimum(kept, m2.shape[0] - 1)
    cutoff = jnp.where(kept < n, ascending[index], jnp.inf)
    return jax.lax.stop_gradient(cutoff)


def m2po_batch_cutoff(
    logp: ArrayLike, behavior_logp: ArrayLike, mask: ArrayLike, cfg: _PolicyLossConfig
) -> jax.Array:
    """M2PO's cutoff of a batch: the one :func:`~sat_jax.objectives.policy_loss` computes for it.

    :func:`m2po_cutoff` of d = logp − behavior_logp over the active tokens, always token level
    and against the sampler, like SAT's d_SAT, whatever ``old_logp`` is (at the step's single
    update, logp is AReaL's recomputed proximal policy). Give it as ``m2_cutoff=`` to every
    microbatch of the batch. +inf (nothing masked) when M2PO is off (``cfg.m2po`` false).
    """
    shapes = {jnp.shape(logp), jnp.shape(behavior_logp), jnp.shape(mask)}
    if len(shapes) > 1:
        raise ValueError(f"m2po_batch_cutoff: logp, behavior_logp, mask differ in shape: {shapes}")
    if not cfg.m2po:
        return jnp.full((), jnp.inf, jnp.float32)
    active = jnp.asarray(mask) > 0
    d = jnp.asarray(logp, jnp.float32) - jnp.asarray(behavior_logp, jnp.float32)
    return m2po_cutoff(jnp.where(active, d, 0.0), threshold=cfg.m2_threshold, where=active)


def m2po_mask(log_ratio: ArrayLike, cutoff: ArrayLike, *, where: ArrayLike | None = None):
    """[B, T] bool: the active tokens M2PO masks, (log r)² ≥ ``cutoff`` (:func:`m2po_cutoff`)."""
    d = jax.lax.stop_gradient(jnp.asarray(log_ratio, jnp.float32))
    return _active(where, d) & (d * d >= jnp.asarray(cutoff, jnp.float32))


def importance_weight_sums(
    log_ratio: ArrayLike, *, where: ArrayLike | None = None
) -> tuple[jax.Array, jax.Array]:
    """(Σ w, Σ w²) over the active tokens, w = exp(d), detached: the ESS's additive terms.

    Pass a clamped d (``PolicyLossConfig.log_ratio_clamp``) so that w² stays finite in float32.
    """
    d = jax.lax.stop_gradient(jnp.asarray(log_ratio, jnp.float32))
    active = _active(where, d)
    w = jnp.where(active, jnp.exp(jnp.where(active, d, 0.0)), 0.0)
    return jnp.sum(w), jnp.sum(w * w)


def effective_sample_size(
    weight_sum: ArrayLike, weight_sq_sum: ArrayLike, count: ArrayLike
) -> jax.Array:
    """ess = (Σ w)² / (N·Σ w²), the effective sample size as a fraction of the N tokens; 0 when
    N = 0. Computed as (Σ w / N)·(Σ w / Σ w²) so that (Σ w)² never overflows."""
    s1 = jnp.asarray(weight_sum, jnp.float32)
    s2 = jnp.asarray(weight_sq_sum, jnp.float32)
    n = jnp.asarray(count).astype(jnp.float32)
    ok = (n > 0) & (s2 > 0)
    ess = (s1 / jnp.where(ok, n, 1.0)) * (s1 / jnp.where(ok, s2, 1.0))
    return jnp.where(ok, ess, 0.0)


def ess_step_scale(ess: ArrayLike) -> jax.Array:
    """VCPO's step multiplier sqrt(ess) for the batch's ``ess`` (:func:`effective_sample_size`)."""
    return jnp.sqrt(jnp.clip(jnp.asarray(ess, jnp.float32), 0.0, 1.0))
