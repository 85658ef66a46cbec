"""``router_shift_ratio``: how far the trainer's router has moved from the recorded routing
(docs/DESIGN.md §4), as exact sums that add across microbatches.

Dimension letters: B batch, T positions, L MoE layers, K experts per token.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def router_shift_ratio(
    recorded_btlk: jax.Array, current_btlk: jax.Array, mask_bt: jax.Array
) -> jax.Array:
    """Fraction of recorded top-k experts not in the current top-k set (docs/DESIGN.md §4).

    Averaged over active tokens, MoE layers and the K recorded slots.

    Args:
      recorded_btlk: [B, T, L, K] expert ids recorded at rollout.
      current_btlk: [B, T, L, K] the trainer's own top-k ids for the same tokens.
      mask_bt: [B, T] active tokens.

    Returns:
      Scalar float32 in [0, 1]; 0 when nothing is active or there are no MoE layers.
    """
    return router_shift_from_counts(*router_shift_counts(recorded_btlk, current_btlk, mask_bt))


def router_shift_from_counts(missing: jax.Array, slots: jax.Array) -> jax.Array:
    """missing / slots of `router_shift_counts` (summed over microbatches), 0 when slots is 0."""
    return jnp.where(slots > 0, missing / jnp.maximum(slots, 1.0), 0.0)


def router_shift_counts(
    recorded_btlk: jax.Array, current_btlk: jax.Array, mask_bt: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """(missing, slots) of `router_shift_ratio` as float32 sums, which add across microbatches."""
    rec = recorded_btlk.astype(jnp.int32)
    cur = current_btlk.astype(jnp.int32)
    found_btlk = jnp.any(rec[..., :, None] == cur[..., None, :], axis=-1)
    weight_bt = mask_bt.astype(jnp.float32)
    missing = jnp.sum(jnp.sum(~found_btlk, axis=(2, 3)) * weight_bt)
    slots = jnp.sum(weight_bt) * rec.shape[2] * rec.shape[3]
    return missing, slots
