"""The train batch: one global batch of trajectories as a typed pytree, its host-side checks,
the masks the step derives from it, the advantages computed from its per-row rewards, and its
placement on the mesh.

Token alignment: every per-token array of a ``TrainBatch`` is indexed by the position of the TARGET
token. ``logp[b, t]`` is log π(tokens[b, t] | tokens[b, :t]), computed from the logits at position
t − 1; position 0 has no prediction, so its mask is forced to 0. ``loss_mask[b, t] = 1`` marks the
completion tokens (t ≥ 1), exactly the positions where the rollout engine recorded
``behavior_logp[b, t]`` for the sampled token ``tokens[b, t]``.

Multi-turn rows (docs/DESIGN.md §7.1): an observation token, inserted by the environment between
two generated ones, has loss mask 0 like the prompt, so it is out of the loss, SAT's quantile and
every metric (all of them read only loss-mask tokens); under routing replay it replays the
routing the server's cache extension recorded for it, like every other position.

Packed rows (``train.packing``, docs/DESIGN.md §3.5, §7.1): the rows hold several trajectories
each (``segment_ids`` > 0, ``positions`` restarting at each segment's start), every per-token
field is carried at its packed position, and ``view_index`` maps each trajectory's completion
into a [N, C] trajectory view (``trajectory_view``), where the loss runs unchanged: every
per-trajectory reduction then reads exactly its trajectory's tokens. ``rewards`` and
``group_ids`` are then [N], one per trajectory (view row).

Dimension letters: B batch, T sequence, L MoE layers, K experts per token, N trajectories, C a
trajectory view's length.
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from sat_jax import objectives, sharding


@flax.struct.dataclass
class TrainBatch:
    """One global batch of trajectories, per-token arrays aligned to the target token.

    Attributes:
      tokens: [B, T] int32, prompt followed by completion (and padding).
      loss_mask: [B, T] float, 1 on completion tokens (the target's position), 0 elsewhere
        (also on a multi-turn row's observation tokens).
      behavior_logp: [B, T] float, rollout log-prob of ``tokens[b, t]``.
      advantages: [B, T] float per-token advantages; or None, and then ``rewards`` and
        ``group_ids`` are given and the step computes them (``with_advantages``). Exactly one of
        the two forms.
      rewards: [B] float per-row rewards (with ``group_ids``; instead of ``advantages``).
      group_ids: [B] int32 each row's group in [0, B); -1 marks a padding row (no group, no
        advantage).
      session_weights: optional [B] float with ``rewards``: each row's weight in its group's
        statistics, 1 / the segments of its session (a forked HTTP session counts once,
        docs/DESIGN.md §6.6); None = 1 each.
      routing: optional [B, T, L, K] uint8/uint16 expert ids recorded by the rollout (for R3).
      old_logp: optional [B, T] float proximal log-probs (the step can instead take its own,
        ``recompute_old_logp``).
      ref_logp: optional [B, T] float reference-policy log-probs (KL penalty); the step computes
        them itself when given the reference's params instead.
      kept_counts: optional [B, T] int32, the sampler's kept-set size of ``tokens[b, t]`` after
        top-k / top-p truncation (0 where there was none, and off the completion): the step's
        log-probs (the policy's and the reference's) replay that truncation
        (``Transformer.logprobs``, docs/DESIGN.md §2).
      format_ids: optional [B, T] int32 with ``format_masks``: constrained decoding
        (``response_format``, docs/DESIGN.md §6.6): 0 where ``tokens[b, t]`` was sampled freely,
        r >= 1 where it was sampled under row r − 1 of ``format_masks``: the step's log-probs
        (the policy's and the reference's) renormalize it over that row's ids.
      format_masks: optional [M, W] uint32, the batch's distinct masks, bit-packed (bit v % 32
        of word v // 32 = id v allowed; ``sat_jax.json_mask.MaskTable``); M a multiple of the
        data shards. Not a per-row field: the step hands the whole table to every (micro)batch.
        None (and ``format_ids`` None) when no token of the batch is constrained.
      fresh_mask: optional [B, T] (uint8 from the trainer), 1 on the completion tokens sampled by the weights being
        trained (lag 0): the ``sampler_kl`` metric averages over them (all active tokens when
        None).
      segment_ids: optional [B, T] int32, packed rows: 1 + the trajectory's view row (0 on
        padding); attention stays within a segment. With ``positions`` and ``view_index``
        (all three or none).
      positions: optional [B, T] int32, each token's position within its trajectory.
      view_index: optional [N, C] int32: trajectory n's j-th completion token is at flat
        position ``view_index[n, j]`` of its (micro)batch's [B, T] arrays (row · T + column;
        −1 past its completion). Trajectory n lies in microbatch n mod k of the step's k.
      microbatches: static, not an array: the k this batch is split into, chosen by the host
        from its tokens (``train.microbatch_tokens``); 0 = the step's ``microbatches``.
    """

    tokens: jax.Array
    loss_mask: jax.Array
    behavior_logp: jax.Array
    advantages: jax.Array | None = None
    rewards: jax.Array | None = None
    group_ids: jax.Array | None = None
    routing: jax.Array | None = None
    old_logp: jax.Array | None = None
    ref_logp: jax.Array | None = None
    kept_counts: jax.Array | None = None
    fresh_mask: jax.Array | None = None
    segment_ids: jax.Array | None = None
    positions: jax.Array | None = None
    view_index: jax.Array | None = None
    session_weights: jax.Array | None = None
    format_ids: jax.Array | None = None
    format_masks: jax.Array | None = None
    microbatches: int = flax.struct.field(pytree_node=False, default=0)

    @property
    def packed(self) -> bool:
        """Whether the rows are packed (static under ``jit``)."""
        return self.segment_ids is not None


def with_advantages(
    batch: TrainBatch,
    *,
    estimator: objectives.AdvantageEstimator = "grpo",
    normalize_std: bool = True,
    baseline: jax.Array | None = None,
) -> TrainBatch:
    """The batch with per-token ``advantages`` and without ``rewards`` / ``group_ids``.

    Given advantages are kept. Otherwise each row's ``objectives.group_advantages`` over the whole
    batch (``num_groups`` = B, static; rows of group id -1 are padding) is spread over its
    loss-mask tokens, exactly what the host used to send as [B, T]; ``baseline`` [B] (VCPO's
    off-policy optimal baseline) replaces the group means (``group_advantages``). Jittable.

    Raises:
      ValueError: not exactly one of ``advantages`` and (``rewards``, ``group_ids``).
    """
    _check_advantage_form(batch)
    if batch.advantages is not None:
        return batch
    group_ids = jnp.asarray(batch.group_ids, jnp.int32)
    per_row_b = objectives.group_advantages(
        batch.rewards,
        jnp.maximum(group_ids, 0),
        num_groups=group_ids.shape[0],
        estimator=estimator,
        normalize_std=normalize_std,
        where=group_ids >= 0,
        baseline=baseline,
        weights=batch.session_weights,
    )
    if batch.packed:  # each packed token takes its trajectory's (segment's) advantage
        per_row_b = per_row_b[jnp.maximum(jnp.asarray(batch.segment_ids) - 1, 0)]
    else:
        per_row_b = per_row_b[:, None]
    advantages_bt = per_row_b * jnp.asarray(batch.loss_mask, jnp.float32)
    return batch.replace(
        advantages=advantages_bt, rewards=None, group_ids=None, session_weights=None
    )


def _check_advantage_form(batch: TrainBatch) -> None:
    """Raises ValueError unless the batch has exactly one of ``advantages`` and (``rewards``,
    ``group_ids``) (which fields are set is static: this holds under ``jit`` too)."""
    per_row = (batch.rewards is not None, batch.group_ids is not None)
    if (batch.advantages is None) != all(per_row) or any(per_row) != all(per_row):
        shape = lambda x: "None" if x is None else str(tuple(np.shape(x)))
        raise ValueError(
            "TrainBatch needs either advantages [B, T] or both rewards [B] and group_ids [B]; got "
            f"advantages={shape(batch.advantages)}, rewards={shape(batch.rewards)}, "
            f"group_ids={shape(batch.group_ids)}"
        )


def check_batch(batch: TrainBatch) -> None:
    """Host-side checks of a concrete batch that the jitted step cannot make on values: exactly
    one form of advantages; rewards and group ids [B], the ids in [0, B) or -1 (padding).

    Raises:
      ValueError: naming what is wrong.
    """
    _check_advantage_form(batch)
    _check_formats(batch)
    packing = (batch.segment_ids, batch.positions, batch.view_index)
    if any(x is not None for x in packing) and any(x is None for x in packing):
        raise ValueError("a packed TrainBatch needs segment_ids, positions and view_index")
    if batch.group_ids is None:
        return
    group_ids = np.asarray(batch.group_ids)
    rows = np.shape(batch.view_index if batch.packed else batch.tokens)[0]
    if group_ids.shape != (rows,) or np.shape(batch.rewards) != (rows,):
        raise ValueError(
            f"TrainBatch rewards and group_ids must be [B] = [{rows}], got "
            f"{np.shape(batch.rewards)} and {group_ids.shape}"
        )
    weights = batch.session_weights
    if weights is not None and np.shape(weights) != (rows,):
        raise ValueError(f"TrainBatch.session_weights must be [{rows}], got {np.shape(weights)}")
    if group_ids.size and (group_ids.min() < -1 or group_ids.max() >= rows):
        raise ValueError(
            f"TrainBatch.group_ids must lie in [0, {rows}) or be -1 (padding), got "
            f"[{group_ids.min()}, {group_ids.max()}]"
        )


def _check_formats(batch: TrainBatch) -> None:
    """Raises ValueError unless ``format_ids`` and ``format_masks`` come together, the ids in
    [0, M]."""
    ids, table = batch.format_ids, batch.format_masks
    if (ids is None) != (table is None):
        raise ValueError("a TrainBatch carries format_ids and format_masks together or neither")
    if ids is None:
        return
    ids, m = np.asarray(ids), np.shape(table)[0]
    if ids.size and (ids.min() < 0 or ids.max() > m):
        raise ValueError(
            f"TrainBatch.format_ids must lie in [0, {m}] (the format_masks rows, 1-based), got "
            f"[{ids.min()}, {ids.max()}]"
        )


def token_mask(loss_mask_bt: jax.Array) -> jax.Array:
    """[B, T] bool: each row's real tokens, everything up to its last completion token.

    Padding sits after the completion, so it is what follows the last ``loss_mask`` position; a
    row without completion tokens counts none. The model takes it as ``mask_bt``: padded keys
    leave attention (a no-op for the real queries of right-padded causal rows) and padded
    positions leave the router's load statistics and the balance loss.
    """
    active_bt = jnp.asarray(loss_mask_bt) > 0
    t = jnp.arange(active_bt.shape[1])
    last_b1 = jnp.max(jnp.where(active_bt, t, -1), axis=1, keepdims=True)
    return t <= last_b1


def real_tokens(batch: TrainBatch) -> jax.Array:
    """[B, T] bool: the positions holding a trajectory's token (the model's ``mask_bt``):
    ``token_mask`` of right-padded rows, ``segment_ids > 0`` of packed ones (the host packs
    each trajectory up to its last completion token, what ``token_mask`` keeps of its row)."""
    if batch.packed:
        return jnp.asarray(batch.segment_ids) > 0
    return token_mask(batch.loss_mask)


def trainable_mask(batch: TrainBatch) -> jax.Array:
    """The float32 loss mask the step trains: 0 where no prediction exists, column 0 of a row
    and, in packed rows, each segment's first token."""
    mask = jnp.asarray(batch.loss_mask, jnp.float32).at[:, 0].set(0.0)
    if batch.packed:
        mask = jnp.where(jnp.asarray(batch.positions) > 0, mask, 0.0)
    return mask


def _gather(x_bt: jax.Array, index_nc: jax.Array) -> jax.Array:
    """x at the view's flat positions; 0 where the index is −1."""
    valid = index_nc >= 0
    flat = jnp.asarray(x_bt).reshape(-1)
    return jnp.where(valid, flat[jnp.maximum(index_nc, 0)], jnp.zeros((), flat.dtype))


def trajectory_view(batch: TrainBatch, logp_bt: jax.Array) -> tuple[TrainBatch, jax.Array]:
    """A packed (micro)batch's per-token loss inputs and ``logp_bt`` gathered into the
    trajectory view [N, C] (``view_index``): one row per trajectory, what the loss reduces per
    row. Differentiable in ``logp_bt`` (the gather's transpose scatters back). The view carries
    no model inputs (routing, kept counts, segments); its ``tokens`` are the gathered ids."""
    idx = jnp.asarray(batch.view_index, jnp.int32)
    take = lambda x: None if x is None else _gather(x, idx)
    view = TrainBatch(
        tokens=take(batch.tokens),
        loss_mask=take(batch.loss_mask),
        behavior_logp=take(batch.behavior_logp),
        advantages=take(batch.advantages),
        rewards=batch.rewards,
        group_ids=batch.group_ids,
        session_weights=batch.session_weights,
        old_logp=take(batch.old_logp),
        ref_logp=take(batch.ref_logp),
        fresh_mask=take(batch.fresh_mask),
    )
    return view, _gather(logp_bt, idx)


def batch_shardings(batch: TrainBatch, mesh: Mesh) -> TrainBatch:
    """``NamedSharding`` per batch field: dimension 0 over the batch mesh axes (checked)."""
    return jax.tree.map(
        lambda x: NamedSharding(mesh, sharding.batch_spec(x.shape[0], mesh, x.ndim)), batch
    )


def shard_batch(batch: TrainBatch, mesh: Mesh) -> TrainBatch:
    """Host arrays (the full global batch, on every process) → global sharded ``jax.Array``s,
    after ``check_batch``.

    Works single- and multi-host: each process only transfers the slices its devices hold.
    """
    check_batch(batch)
    shardings = batch_shardings(batch, mesh)

    def put(x: Any, sh: NamedSharding) -> jax.Array:
        x = np.asarray(x)
        return jax.make_array_from_callback(x.shape, sh, lambda idx: x[idx])

    return jax.tree.map(put, batch, shardings)
