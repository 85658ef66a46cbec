"""The gradient and metrics of one batch: in one ``value_and_grad``, or accumulated over k
microbatches in one compiled ``scan`` body, equal to the one-pass ones (docs/DESIGN.md §3.3, §5).

Both take ``forward(params, batch) -> (logp [B, T], ModelOutput)``, the differentiated forward
pass, and the batch with its advantages and (once per (micro)batch, through ``reference``) its
reference log-probs. What must be the whole batch's before any microbatch's gradient (SAT's q,
the router's load f) comes from one extra forward pass without gradient; the loss's counts and
sums stay paired until the end (``objectives.PolicyLossTerms``), so the merge is exact.

Dimension letters: B batch, T sequence, L MoE layers, E experts, k microbatches.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from sat_jax import objectives
from sat_jax.model import (
    ModelOutput,
    router_shift_counts,
    router_shift_from_counts,
    router_shift_ratio,
)
from sat_jax.model.moe import balance_from_stats
from sat_jax.objectives.loss_terms import loss_count
from sat_jax.step.batch import TrainBatch, real_tokens, trajectory_view
from sat_jax.step.config import StepConfig

Metrics = dict[str, jax.Array]
Forward = Callable[[Any, TrainBatch], tuple[jax.Array, ModelOutput]]


def _policy_terms(
    logp_bt: jax.Array,
    batch: TrainBatch,
    cfg: StepConfig,
    sat_q: jax.Array | None = None,
    m2_cutoff: jax.Array | None = None,
) -> objectives.PolicyLossTerms:
    """The (micro)batch's policy-loss terms (sums and counts, ``objectives.policy_loss_terms``),
    with SAT's threshold ``sat_q`` and M2PO's cutoff ``m2_cutoff`` when given (the batch's) and
    the step's own detached log-probs as ``old_logp`` under ``cfg.recompute_old_logp``. Packed
    rows are first gathered into their trajectory view (``trajectory_view``), so every
    per-trajectory reduction of the loss is per segment."""
    if batch.packed:
        batch, logp_bt = trajectory_view(batch, logp_bt)
    old_logp = batch.old_logp
    if cfg.recompute_old_logp:
        # The proximal policy is the params before this (the batch's only) update: the step's
        # own log-probs, detached (docs/DESIGN.md §3.4).
        old_logp = jax.lax.stop_gradient(logp_bt)
    return objectives.policy_loss_terms(
        logp_bt,
        batch.behavior_logp,
        batch.advantages,
        batch.loss_mask,
        cfg.loss,
        old_logp=old_logp,
        ref_logp=batch.ref_logp,
        sat_q=sat_q,
        fresh_mask=batch.fresh_mask,
        m2_cutoff=m2_cutoff,
    )


def one_pass(
    params: Any, batch: TrainBatch, forward: Forward, cfg: StepConfig
) -> tuple[Any, Metrics]:
    """Gradient and metrics of the whole batch in one ``value_and_grad``."""

    def loss_fn(params: Any) -> tuple[jax.Array, Metrics]:
        logp_bt, out = forward(params, batch)
        loss, metrics = _policy_terms(logp_bt, batch, cfg).reduce()
        # ModelOutput.aux_loss is already weighted by config.router_aux_loss_coef (0 = off).
        metrics = _with_aux(loss, metrics, out.aux_loss, out.balance_loss)
        if batch.routing is not None:
            metrics["router_shift_ratio"] = router_shift_ratio(
                batch.routing, out.routing_btlk, batch.loss_mask
            )
        return metrics["total_loss"], metrics

    (_, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    return grads, metrics


def _split(tree: Any, k: int) -> Any:
    """[B, ...] leaves → [k, B/k, ...]; microbatch j holds rows j, j + k, ... so that each device's
    contiguous block of the batch-sharded rows keeps a share of every microbatch."""
    return jax.tree.map(lambda x: jnp.swapaxes(x.reshape(-1, k, *x.shape[1:]), 0, 1), tree)


def _unsplit(x: jax.Array) -> jax.Array:
    """The inverse of ``_split`` for one array."""
    return jnp.swapaxes(x, 0, 1).reshape(-1, *x.shape[2:])


def _whole_view(micro: TrainBatch, logp_kbt: jax.Array) -> tuple[TrainBatch, jax.Array]:
    """The whole batch's trajectory view (each microbatch's, in the batch's trajectory order) of
    packed microbatches ``micro`` and their log-probs [k, B/k, T]."""
    view_k, logp_knc = jax.vmap(trajectory_view)(micro, logp_kbt)
    return jax.tree.map(_unsplit, view_k), _unsplit(logp_knc)


def _batch_statistics(
    params: Any,
    batch: TrainBatch,
    micro: TrainBatch,
    forward: Forward,
    cfg: StepConfig,
    coef: float,
    w_k: jax.Array,
) -> tuple[tuple[jax.Array | None, jax.Array | None], jax.Array | None]:
    """((sat_q, m2_cutoff, kept), router f [L, E]) of the whole batch, from a forward pass without
    gradient; M2PO's cutoff (docs/DESIGN.md §3.6) is a sort over the batch's tokens, like q;
    ``kept`` is the loss mask less MIS's rejected responses (in the trajectory view when packed),
    whose count is the loss's denominator.

    ``w_k`` [k] is each microbatch's share of the batch's real tokens (``_token_shares``); f of
    the batch is the microbatches' f weighted by it.

    q needs the current policy's logp of every token before any microbatch's gradient (its |d| is
    of logp − old_logp, and logp moves with the params); the balance loss's f_e weighs every
    microbatch's gradient of P_e. Each is None when not needed (SAT off or per-microbatch scope;
    no aux loss), and then the extra forward pass is skipped.
    """
    sat = cfg.loss.sat
    need_q = sat.enabled and sat.threshold_scope == "batch"
    mis = cfg.loss.seq_mask_range is not None
    if not need_q and not cfg.loss.m2po and not mis and coef == 0:
        return (None, None, None), None

    def one(_, mb: TrainBatch):
        logp_bt, out = forward(params, mb)
        return None, (logp_bt, out.router_frac_le)

    _, (logp_kbt, frac_kle) = jax.lax.scan(one, None, micro)
    if batch.packed:  # the statistics read the trajectories' tokens, through their view
        batch, logp_bt = _whole_view(micro, logp_kbt)
    else:
        logp_bt = _unsplit(logp_kbt)
    sat_q, m2_cutoff, kept = None, None, None
    if mis:  # MIS's rejected responses leave the loss's denominator (objectives.policy_loss)
        old = jax.lax.stop_gradient(logp_bt) if cfg.recompute_old_logp else batch.old_logp
        active = batch.loss_mask > 0
        kept = objectives.kept_loss_mask(batch.behavior_logp, old, active, cfg.loss)
    if cfg.loss.m2po:
        m2_cutoff = objectives.m2po_batch_cutoff(
            logp_bt, batch.behavior_logp, batch.loss_mask, cfg.loss, advantages=batch.advantages
        )
    if need_q:
        sat_q = objectives.sat_threshold(
            logp_bt,
            batch.behavior_logp,
            batch.loss_mask,
            cfg.loss,
            old_logp=None if cfg.recompute_old_logp else batch.old_logp,
        )
    return (sat_q, m2_cutoff, kept), _weighted(frac_kle, w_k)


def _token_shares(micro: TrainBatch) -> jax.Array:
    """[k] each microbatch's share of the batch's real tokens (``token_mask``); 0s when none.

    The router statistics f and P are means over real tokens, so the batch's are the
    microbatches' weighted by these shares (equal shares only without padding)."""
    n_k = jnp.sum(jax.vmap(real_tokens)(micro), axis=(1, 2)).astype(jnp.float32)
    return n_k / jnp.maximum(jnp.sum(n_k), 1.0)


def _weighted(x_k: jax.Array, w_k: jax.Array) -> jax.Array:
    """Σ_j w_j · x_k[j] over the leading axis."""
    return jnp.tensordot(w_k, x_k, axes=1)


def accumulated(
    params: Any,
    batch: TrainBatch,
    forward: Forward,
    reference: Callable[[TrainBatch], TrainBatch],
    cfg: StepConfig,
    coef: float,
    k: int | None = None,
) -> tuple[Any, Metrics]:
    """Gradient and metrics of the batch summed over k microbatches (one compiled ``scan`` body);
    k defaults to ``cfg.microbatches``.

    Each microbatch j differentiates loss_sum / loss_count(batch) + w_j·coef·E·Σ f_e·P_e^j with
    the batch's f and w_j its share of the batch's real tokens (the balance loss is bilinear in f
    and P, and P of the batch is the w-weighted mean of the microbatches' P), so the summed
    gradient is the one-pass gradient. ``reference`` adds a microbatch's reference log-probs
    (outside its gradient), so the reference's activations are a microbatch's too.
    """
    k = cfg.microbatches if k is None else k
    micro = _split(batch, k)
    w_k = _token_shares(micro)
    stats, frac_le = _batch_statistics(params, batch, micro, forward, cfg, coef, w_k)
    sat_q, m2_cutoff, mask = stats  # mask: the kept tokens under MIS, else None
    if mask is None:
        mask = batch.loss_mask
        if batch.packed:  # seq_mean_token_mean counts trajectories: the view's rows
            mask = _whole_view(micro, jnp.zeros(micro.loss_mask.shape, jnp.float32))[0].loss_mask
    count = jnp.maximum(loss_count(mask, cfg.loss.loss_agg), 1).astype(jnp.float32)

    def objective(p: Any, mb: TrainBatch, w: jax.Array):
        logp_bt, out = forward(p, mb)
        terms = _policy_terms(logp_bt, mb, cfg, sat_q, m2_cutoff)
        value = terms.loss_sum / count
        if coef:
            value = value + w * coef * balance_from_stats(frac_le, out.router_prob_le)
        shift = (jnp.zeros(()), jnp.zeros(()))
        if mb.routing is not None:
            shift = router_shift_counts(mb.routing, out.routing_btlk, mb.loss_mask)
        return value, (terms, out.router_frac_le, out.router_prob_le, shift)

    def step(acc: Any, xs: tuple[TrainBatch, jax.Array]):
        mb, w = xs
        (_, aux), grads = jax.value_and_grad(objective, has_aux=True)(params, reference(mb), w)
        return jax.tree.map(jnp.add, acc, grads), aux

    zeros = jax.tree.map(jnp.zeros_like, params)
    scanned = jax.lax.scan(step, zeros, (micro, w_k))
    grads, (terms_k, frac_kle, prob_kle, (missing_k, slots_k)) = scanned
    unstacked = [jax.tree.map(lambda x, i=i: x[i], terms_k) for i in range(k)]
    loss, metrics = functools.reduce(objectives.PolicyLossTerms.merge, unstacked).reduce()
    balance = balance_from_stats(_weighted(frac_kle, w_k), _weighted(prob_kle, w_k))
    metrics = _with_aux(loss, metrics, coef * balance, balance)
    if batch.routing is not None:
        shift = router_shift_from_counts(jnp.sum(missing_k), jnp.sum(slots_k))
        metrics["router_shift_ratio"] = shift
    return grads, metrics


def _with_aux(loss: jax.Array, metrics: Metrics, aux: jax.Array, balance: jax.Array) -> Metrics:
    """The policy metrics plus the router aux terms and ``total_loss`` = loss + aux."""
    return {**metrics, "aux_loss": aux, "balance_loss": balance, "total_loss": loss + aux}
