"""Log-probs of sampled tokens under the sampler's scaling, vocabulary mask and truncation.

``token_logprobs`` scores targets as the rollout sampler drew them: logits / temperature over the
sampleable ids (and, at a constrained token, the ids its `response_format` mask allowed:
``format_allowed``), and with the sampler's recorded kept-set sizes its top-k / top-p truncation
replayed on this policy's own logits (docs/DESIGN.md §2, §6.6). ``kth_largest_key`` is the exact order
statistic the replay's cut needs, found without a vocabulary-wide sort.

Dimension letters: B batch, T positions, V vocabulary, M mask-table rows, W its uint32 words.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def token_logprobs(
    logits_btv: jax.Array,
    targets_bt: jax.Array,
    *,
    temperature: float = 1.0,
    vocab_mask: jax.Array | None = None,
    kept_bt: jax.Array | None = None,
    format_masks: jax.Array | None = None,
    format_ids_bt: jax.Array | None = None,
) -> jax.Array:
    """[B, T] float32 log softmax(logits / temperature) at the targets (the sampler's scaling).

    ``vocab_mask`` ([V] bool, optional) renormalizes over those ids only.

    ``format_masks`` ([M, W] uint32, bit-packed rows) with ``format_ids_bt`` ([B, T] int, 0 =
    free, r >= 1 = row r − 1) renormalizes a constrained token over its row's ids as well
    (``format_allowed``), like ``vocab_mask`` and before the truncation, the order the sampler
    masks its logits in (``sat_jax.decoding``): the behavior log-prob recorded under
    constrained decoding is this one's at the sampling weights.

    ``kept_bt`` ([B, T] int, optional) replays the sampler's top-k / top-p truncation
    (docs/DESIGN.md §2): at a position with kept count n > 0 the distribution is renormalised
    over this policy's top-max(n, r) scaled logits, r the target's rank (ties at the cut value
    kept, as the sampler keeps them). When the target is among the top n that is the sampler's
    own top-n cut; when this policy ranks it lower, the cut moves down to the target, so every
    token ranked at or above it is kept (a truncation a top-k sampler could have made, and the
    target's log-prob stays finite), not the top n plus the target alone. n = 0 keeps
    everything. The cut is found exactly by `kth_largest_key` and is not differentiated.
    """
    allowed = None if vocab_mask is None else jnp.asarray(vocab_mask, bool)
    if format_masks is not None:
        rows_btv = format_allowed(format_masks, format_ids_bt, logits_btv.shape[-1])
        allowed = rows_btv if allowed is None else allowed & rows_btv
    if allowed is not None:
        # The most negative finite value, not −inf: exp gives exactly 0 and no inf − inf NaN.
        floor = jnp.finfo(logits_btv.dtype).min
        logits_btv = jnp.where(allowed, logits_btv, floor)
    targets = targets_bt[..., None].astype(jnp.int32)
    if kept_bt is None:
        logp_btv = jax.nn.log_softmax(logits_btv.astype(jnp.float32) / temperature, axis=-1)
        return jnp.take_along_axis(logp_btv, targets, axis=-1)[..., 0]
    x_btv = logits_btv.astype(jnp.float32) / temperature
    key_btv = _order_key(jax.lax.stop_gradient(x_btv))
    cut_bt = kth_largest_key(key_btv, kept_bt)
    cut_bt = jnp.minimum(cut_bt, jnp.take_along_axis(key_btv, targets, axis=-1)[..., 0])
    kept_btv = key_btv >= cut_bt[..., None]
    log_z_bt = jax.nn.logsumexp(jnp.where(kept_btv, x_btv, -jnp.inf), axis=-1)
    return jnp.take_along_axis(x_btv, targets, axis=-1)[..., 0] - log_z_bt


def format_allowed(format_masks: jax.Array, format_ids_bt: jax.Array, vocab_size: int) -> jax.Array:
    """[B, T, V] bool: the ids each position's mask allows, from the bit-packed table
    ``format_masks`` [M, W] uint32 (bit v % 32 of word v // 32 = id v, ``MaskTable.packed``)
    and ``format_ids_bt`` [B, T] (0 = free: every id; r >= 1 = row r − 1)."""
    ids_bt = jnp.asarray(format_ids_bt, jnp.int32)
    words_btw = jnp.asarray(format_masks)[jnp.maximum(ids_bt - 1, 0)]
    bits = (words_btw[..., None] >> jnp.arange(32, dtype=jnp.uint32)) & jnp.uint32(1)
    rows_btv = bits.reshape(*ids_bt.shape, -1)[..., :vocab_size] > 0
    return rows_btv | (ids_bt == 0)[..., None]


def _order_key(x: jax.Array) -> jax.Array:
    """uint32 keys of float32 values in the same order (IEEE bits, negatives' flipped, sign bit
    offset), so an exact order statistic is a bitwise search over integers."""
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    negative = (bits >> 31) == 1
    return jnp.where(negative, ~bits, bits | jnp.uint32(0x80000000))


def kth_largest_key(key_btv: jax.Array, k_bt: jax.Array) -> jax.Array:
    """[B, T] uint32: the k-th largest of ``key_btv`` along the last axis (k ≥ 1), exactly; 0
    (the smallest key, so every entry is ≥ it) where k ≤ 0.

    Built bit by bit from the top: the largest key c with #{key ≥ c} ≥ k is the k-th largest.
    32 compare-and-count passes over V, no sort (a vocabulary-wide sort per position is far
    slower on TPU).
    """
    k_bt = k_bt.astype(jnp.int32)

    def step(i, cut_bt):
        bit = jnp.uint32(1) << (jnp.uint32(31) - i.astype(jnp.uint32))
        trial_bt = cut_bt | bit
        count_bt = jnp.sum(key_btv >= trial_bt[..., None], axis=-1, dtype=jnp.int32)
        return jnp.where(count_bt >= k_bt, trial_bt, cut_bt)

    cut_bt = jax.lax.fori_loop(0, 32, step, jnp.zeros(k_bt.shape, jnp.uint32))
    return jnp.where(k_bt > 0, cut_bt, jnp.uint32(0))
