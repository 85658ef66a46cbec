"""The corrections :func:`~sat_jax.objectives.policy_loss_terms` applies to the per-token loss −S.

The token stabilizers (DPPO-TV, TIS, IcePop; docs/DESIGN.md §3.4), the sequence-level rollout
corrections (sequence TIS, MIS sequence masking; §3.4) and M2PO's second-moment mask (§3.6). Each
takes the wrapper's prepared batch (``policy._Batch``) and config and returns the corrected loss
with its metrics; the kernels they call are in ``stabilizers`` and ``large_lag``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from sat_jax.objectives.large_lag import m2po_candidates, m2po_mask
from sat_jax.objectives.stabilizers import (
    dppo_tv_mask,
    geometric_mean_mask,
    icepop_weights,
    sequence_importance_weights,
    truncated_importance_weights,
)

# policy imports this module, so its types are named here, not imported (no import cycle).
PolicyLossConfig = Any  # policy.PolicyLossConfig
Batch = Any  # policy._Batch


def stabilize(per_token: jax.Array, ratio: jax.Array, batch: Batch, cfg: PolicyLossConfig):
    """Applies the docs/DESIGN.md §3.4 stabilizers to −S; returns it and their per-token metrics."""
    metrics = {}
    if cfg.dppo_tv_delta is not None:
        mask = dppo_tv_mask(batch.logp, batch.old, ratio, batch.adv, delta=cfg.dppo_tv_delta)
        tv_masked = batch.active & mask
        per_token = jnp.where(tv_masked, jax.lax.stop_gradient(per_token), per_token)
        metrics["dppo_tv_masked_frac"] = tv_masked
    if cfg.tis_cap is not None:
        weight = truncated_importance_weights(batch.old, batch.behavior, cap=cfg.tis_cap)
        per_token = jnp.where(batch.active, per_token * weight, 0.0)
        metrics["tis_weight_mean"] = weight
    if cfg.icepop_range is not None:
        low, high = cfg.icepop_range
        weight = icepop_weights(batch.old, batch.behavior, low=low, high=high)
        per_token = jnp.where(batch.active, per_token * weight, 0.0)
        metrics["icepop_kept_frac"] = weight > 0
    return per_token, metrics


def kept_loss_mask(
    behavior_logp: jax.Array, old_logp: jax.Array, active: jax.Array, cfg: PolicyLossConfig
) -> jax.Array:
    """[B, T] bool: the active tokens that stay in the loss's denominator: all of them, except
    with MIS sequence masking (``cfg.seq_mask_range``) the tokens of a rejected response, which
    leave it as in verl (the response leaves the batch). ``active`` itself when MIS is off."""
    if cfg.seq_mask_range is None:
        return active
    low, high = cfg.seq_mask_range
    masked_b1 = geometric_mean_mask(
        old_logp, behavior_logp, low=low, high=high, where=active, keepdims=True
    )
    return active & ~masked_b1


def sequence_corrections(per_token: jax.Array, batch: Batch, cfg: PolicyLossConfig):
    """Applies the sequence-level rollout corrections (docs/DESIGN.md §3.4: sequence TIS and MIS
    sequence masking) to −S; returns it and their metrics' (sums, counts), each a mean over the
    responses with an active token (exact across row microbatches, which split whole responses).
    A response MIS rejects gets weight 0; :func:`kept_loss_mask` takes it out of the loss's
    denominator."""
    sums, counts = {}, {}
    if cfg.seq_tis_cap is None and cfg.seq_mask_range is None:
        return per_token, sums, counts
    has_active_b1 = jnp.any(batch.active, axis=-1, keepdims=True)
    n_responses = jnp.sum(has_active_b1, dtype=jnp.int32)
    seq = dict(where=batch.active, keepdims=True)
    if cfg.seq_tis_cap is not None:
        w_b1 = sequence_importance_weights(batch.old, batch.behavior, cap=cfg.seq_tis_cap, **seq)
        per_token = jnp.where(batch.active, per_token * w_b1, 0.0)
        sums["seq_tis_weight_mean"] = jnp.sum(jnp.where(has_active_b1, w_b1, 0.0))
        counts["seq_tis_weight_mean"] = n_responses
    if cfg.seq_mask_range is not None:
        low, high = cfg.seq_mask_range
        masked_b1 = geometric_mean_mask(batch.old, batch.behavior, low=low, high=high, **seq)
        per_token = jnp.where(masked_b1, 0.0, per_token)
        sums["seq_masked_frac"] = jnp.sum(has_active_b1 & masked_b1, dtype=jnp.float32)
        counts["seq_masked_frac"] = n_responses
    return per_token, sums, counts


def m2po_correction(per_token: jax.Array, batch: Batch, cfg: PolicyLossConfig, cutoff: jax.Array):
    """M2PO (docs/DESIGN.md §3.6): zeroes −S (value and gradient) on the candidate tokens
    (``cfg.m2_token_set``, ``large_lag.m2po_candidates``) whose squared log-ratio to the sampler,
    (logp − behavior_logp)², is at least the batch's ``cutoff`` (``large_lag.m2po_cutoff``). They
    stay in the loss's denominator. Returns the loss and the (sums, counts) of
    ``m2po_masked_frac`` and ``m2po_second_moment`` (the batch's mean (log r)² before the mask),
    over the active tokens."""
    d = jax.lax.stop_gradient(jnp.where(batch.active, batch.logp - batch.behavior, 0.0))
    candidates = m2po_candidates(d, batch.adv, cfg.m2_token_set, where=batch.active)
    masked = m2po_mask(d, cutoff, where=candidates)
    per_token = jnp.where(masked, 0.0, per_token)
    n_active = jnp.sum(batch.active, dtype=jnp.int32)
    sums = {
        "m2po_masked_frac": jnp.sum(masked, dtype=jnp.float32),
        "m2po_second_moment": jnp.sum(d * d),
    }
    return per_token, sums, dict.fromkeys(sums, n_active)
