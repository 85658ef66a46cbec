"""The policy loss as (sum, count) terms that add across microbatches and hosts (docs/DESIGN.md §3.5).

:func:`~sat_jax.objectives.policy_loss_terms` returns a :class:`PolicyLossTerms`; the train step
merges those of its microbatches and divides the summed gradient by :func:`loss_count` of the batch.
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp
from flax import struct
from jax.typing import ArrayLike

from sat_jax.objectives.large_lag import (
    ESS_RESPONSES,
    ESS_SEQ_WEIGHT_SQ_SUM,
    ESS_SEQ_WEIGHT_SUM,
    ESS_WEIGHT_SQ_SUM,
    ESS_WEIGHT_SUM,
    effective_sample_size,
)

LossAgg = Literal["token_mean", "seq_mean_token_mean"]


@struct.dataclass
class PolicyLossTerms:
    """Unreduced loss and metrics, as pairs that add up across microbatches and hosts.

    ``loss_sum / loss_count`` is the loss; ``sums[k] / counts[k]`` is metric k; ``mins`` reduce by
    minimum and ``totals`` by sum (the ESS's Σ w and Σ w² of both levels become the metrics
    ``ess_token`` and ``ess_sequence``, and ``ess`` is the one of ``ess_level``). For gradient
    accumulation differentiate ``loss_sum`` of each microbatch and divide by the merged
    ``loss_count``.
    """

    loss_sum: jax.Array
    loss_count: jax.Array
    sums: dict[str, jax.Array]
    counts: dict[str, jax.Array]
    mins: dict[str, jax.Array]
    totals: dict[str, jax.Array]
    ess_level: str = struct.field(pytree_node=False, default="sequence")

    def merge(self, other: PolicyLossTerms) -> PolicyLossTerms:
        """Combines the terms of two disjoint parts of one batch."""
        add = lambda a, b: jax.tree.map(jnp.add, a, b)
        return PolicyLossTerms(
            loss_sum=self.loss_sum + other.loss_sum,
            loss_count=self.loss_count + other.loss_count,
            sums=add(self.sums, other.sums),
            counts=add(self.counts, other.counts),
            mins=jax.tree.map(jnp.minimum, self.mins, other.mins),
            totals=add(self.totals, other.totals),
            ess_level=self.ess_level,
        )

    def reduce(self) -> tuple[jax.Array, dict[str, jax.Array]]:
        """(loss, metrics): every ratio with its denominator clamped to ≥ 1 (empty ⇒ 0, never NaN)."""
        safe = lambda s, c: s / jnp.maximum(c, 1).astype(s.dtype)
        loss = safe(self.loss_sum, self.loss_count)
        metrics = {k: safe(self.sums[k], self.counts[k]) for k in self.sums}
        metrics.update(self.mins)
        totals = dict(self.totals)
        if ESS_WEIGHT_SUM in totals:  # ess = (Σ w)² / (N·Σ w²) of the merged sums
            w_sum, w_sq_sum = totals.pop(ESS_WEIGHT_SUM), totals.pop(ESS_WEIGHT_SQ_SUM)
            token = effective_sample_size(w_sum, w_sq_sum, totals["active_tokens"])
            ws_sum, ws_sq_sum = totals.pop(ESS_SEQ_WEIGHT_SUM), totals.pop(ESS_SEQ_WEIGHT_SQ_SUM)
            sequence = effective_sample_size(ws_sum, ws_sq_sum, totals.pop(ESS_RESPONSES))
            metrics["ess"] = sequence if self.ess_level == "sequence" else token
            metrics["ess_token"], metrics["ess_sequence"] = token, sequence
        metrics.update({k: v.astype(jnp.float32) for k, v in totals.items()})
        return loss, metrics


def loss_count(mask: ArrayLike, loss_agg: LossAgg) -> jax.Array:
    """The loss's denominator (``PolicyLossTerms.loss_count``) of a [B, T] mask, int32.

    Active tokens (``"token_mean"``) or responses with an active token (``"seq_mean_token_mean"``):
    known before any forward pass, so accumulated microbatch gradients can be divided by it.
    """
    per_seq_count = jnp.sum(jnp.asarray(mask) > 0, axis=-1, dtype=jnp.int32)
    if loss_agg == "token_mean":
        return jnp.sum(per_seq_count)
    return jnp.sum(per_seq_count > 0, dtype=jnp.int32)


def aggregate(
    per_token: jax.Array, active: jax.Array, loss_agg: LossAgg
) -> tuple[jax.Array, jax.Array]:
    """(sum, count) of a per-token loss under ``loss_agg``; inactive tokens are already 0."""
    count = loss_count(active, loss_agg)
    if loss_agg == "token_mean":
        return jnp.sum(per_token), count
    per_seq_count = jnp.sum(active, axis=-1, dtype=jnp.int32)
    per_seq_mean = jnp.sum(per_token, axis=-1) / jnp.maximum(per_seq_count, 1)
    return jnp.sum(per_seq_mean), count
