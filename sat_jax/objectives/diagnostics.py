"""The metrics of :func:`~sat_jax.objectives.policy_loss_terms` (docs/DESIGN.md §4), as (sum, count)
pairs: the per-token diagnostics averaged over active tokens, ``sampler_kl`` over the fresh ones,
and the additive terms of the batch's effective sample size ``ess`` (§3.6).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from sat_jax.objectives.large_lag import (
    ESS_RESPONSES,
    ESS_SEQ_WEIGHT_SQ_SUM,
    ESS_SEQ_WEIGHT_SUM,
    ESS_WEIGHT_SQ_SUM,
    ESS_WEIGHT_SUM,
    importance_weight_sums,
    sequence_weight_sums,
)

# policy imports this module, so its types are named here, not imported (no import cycle).
PolicyLossConfig = Any  # policy.PolicyLossConfig
Batch = Any  # policy._Batch
TrustRegion = Any  # policy._TrustRegion


# docs/DESIGN.md §4: a token counts as an importance-sampling outlier when |r − 1| > 1.5.
_IS_DEVIATION_THRESHOLD = 1.5


def clamp(log_ratio: jax.Array, limit: float | None) -> jax.Array:
    return log_ratio if limit is None else jnp.clip(log_ratio, -limit, limit)


def diagnostics(ratio: jax.Array, region: TrustRegion, batch: Batch, cfg: PolicyLossConfig):
    """The per-token docs/DESIGN.md §4 metrics, each to be averaged over active tokens."""
    # The mismatch diagnostics are always against the behavior policy, at token level.
    mismatch = jax.lax.stop_gradient(jnp.where(batch.active, batch.logp - batch.behavior, 0.0))
    clamped = clamp(mismatch, cfg.log_ratio_clamp)
    r_sg, adv = jax.lax.stop_gradient(ratio), batch.adv
    metrics = {
        "mismatch_abs_mean": jnp.abs(mismatch),
        "is_deviation_frac": jnp.abs(jnp.exp(clamped) - 1.0) > _IS_DEVIATION_THRESHOLD,
        "kl_k3": jnp.exp(clamped) - 1.0 - clamped,
        "clip_frac_low": (adv < 0) & (r_sg < 1.0 - region.eps_low),
        "clip_frac_high": (adv > 0) & (r_sg > 1.0 + region.eps_high),
    }
    if cfg.dual_clip is not None:
        metrics["dual_clip_frac"] = (adv < 0) & (r_sg > cfg.dual_clip)
    metrics["ratio_mean"] = r_sg
    metrics["sat_gate_rate"] = region.gate
    metrics["sat_eps_low_mean"] = region.c_low  # times ε in metric_terms
    metrics["sat_eps_high_mean"] = region.c_high
    return metrics


def metric_terms(token_metrics: dict, region: TrustRegion, active: jax.Array, cfg):
    """(sums, counts) of the metrics: ``sat_q`` and the active-token means of ``token_metrics``."""
    sums, counts = {"sat_q": region.q}, {"sat_q": jnp.ones((), jnp.int32)}
    # One fused reduction per metric. Boolean metrics are counted as (active & flag): on CPU XLA
    # that is much faster than summing where(active, flag, 0.0) in float32.
    n_active = jnp.sum(active, dtype=jnp.int32)
    for name, value in token_metrics.items():
        value = jax.lax.stop_gradient(value)
        if value.dtype == jnp.bool_:
            sums[name] = jnp.sum(active & value, dtype=jnp.float32)
        else:
            sums[name] = jnp.sum(jnp.where(active, value.astype(jnp.float32), 0.0))
        counts[name] = n_active
    # ε·mean(c) rather than mean(ε·c): equal, and exact (ε itself) whenever nothing contracts.
    sums["sat_eps_low_mean"] = cfg.clip_low * sums["sat_eps_low_mean"]
    sums["sat_eps_high_mean"] = cfg.clip_high * sums["sat_eps_high_mean"]
    return sums, counts


def sampler_kl_terms(k3: jax.Array, batch: Batch, sums: dict, counts: dict):
    """(sum, count) of ``sampler_kl``: k3 to the sampler over the active tokens that are fresh
    (lag 0), all active tokens without a fresh mask (then it is ``kl_k3``'s pair)."""
    if batch.fresh is None:
        return sums["kl_k3"], counts["kl_k3"]
    k3 = jax.lax.stop_gradient(k3)
    total = jnp.sum(jnp.where(batch.fresh, k3, 0.0))
    return total, jnp.sum(batch.fresh, dtype=jnp.int32)


def ess_totals(batch: Batch, cfg: PolicyLossConfig) -> dict[str, jax.Array]:
    """The ESS's additive terms of both levels, d = logp − behavior_logp (the sampler → current
    log-ratio, detached): (Σ w, Σ w²) over the active tokens, w = exp(d) with d clamped by
    ``cfg.log_ratio_clamp`` (with ``active_tokens``: ``ess_token``), and (Σ w_i, Σ w_i², B) over
    the responses, w_i = exp(Σ_t d) with the sum clamped likewise (``ess_sequence``), exactly
    across microbatches and hosts (``PolicyLossTerms.reduce``)."""
    d = jnp.where(batch.active, batch.logp - batch.behavior, 0.0)
    w_sum, w_sq_sum = importance_weight_sums(clamp(d, cfg.log_ratio_clamp), where=batch.active)
    seq = sequence_weight_sums(d, where=batch.active, clamp=cfg.log_ratio_clamp)
    return {
        ESS_WEIGHT_SUM: w_sum,
        ESS_WEIGHT_SQ_SUM: w_sq_sum,
        ESS_SEQ_WEIGHT_SUM: seq[0],
        ESS_SEQ_WEIGHT_SQ_SUM: seq[1],
        ESS_RESPONSES: seq[2],
    }
