"""Sequence packing of a train batch (``train.packing``, docs/DESIGN.md §3.5, §7.1).

``pack_batch`` turns ``assemble_batch``'s padded batch (one trajectory per row) into packed rows:
the layout (which row and offset each trajectory gets, the bucketed [rows, T]) is
``sat_jax.packing.layout``'s, shared with the plan; this module moves every per-token field to
it and builds the segment ids, positions and trajectory view of the packed ``TrainBatch``.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from sat_jax import packing
from sat_jax.step import TrainBatch


class PackingSpec(Protocol):
    """What packing reads of a batch's spec (``train.batching.BatchSpec`` has it; a protocol, so
    that ``batching``, which packs, is not imported back)."""

    @property
    def row_capacity(self) -> int: ...
    @property
    def row_multiple(self) -> int: ...
    @property
    def microbatches(self) -> int: ...
    @property
    def microbatch_tokens(self) -> int: ...
    @property
    def length_bucket(self) -> int: ...


PER_TOKEN = ("tokens", "loss_mask", "behavior_logp", "kept_counts", "fresh_mask", "format_ids")
# Per-token fields the trainer does not send but a caller may give (moved when not None).
GIVEN_PER_TOKEN = ("old_logp", "ref_logp")


def packed_rows(needed: int, most: int, k: int, multiple: int) -> int:
    """Rows per microbatch of a packed batch whose microbatches need at most ``needed`` rows:
    ``sat_jax.packing.row_bucket`` with the quantum that makes k · rows a multiple of
    ``multiple`` (the data shards), capped at ``most``, the padded batch's rows per
    microbatch (they always hold the trajectories)."""
    return packing.row_bucket(needed, most=most, quantum=packing.row_quantum(k, multiple))


def pack_batch(batch: TrainBatch, spec: PackingSpec) -> tuple[TrainBatch, int, int]:
    """``batch`` packed for ``spec.microbatches`` microbatches (``sat_jax.packing.layout``:
    trajectory n in microbatch n mod k), or, with ``spec.microbatch_tokens``, packed once over
    the whole batch with k and the rows per microbatch chosen together
    (``sat_jax.packing.budget_layout``: the fewest rows within the budget, then the fewest
    microbatches; the trajectories renumbered so that trajectory v lies in microbatch v mod k);
    the packed batch then carries that k.

    Returns:
      ``(packed batch, token slots used, all token slots)``.

    Raises:
      ValueError: a trajectory longer than the row capacity (``select_groups`` rejects those).
    """
    if not spec.microbatch_tokens:
        return _pack(batch, spec, spec.microbatches)
    lengths, _ = trajectory_spans(batch.loss_mask)
    keep = None if batch.group_ids is None else np.asarray(batch.group_ids) >= 0
    plan = packing.budget_layout(
        lengths,
        capacity=spec.row_capacity,
        microbatch_tokens=spec.microbatch_tokens,
        row_multiple=spec.row_multiple,
        length_bucket=spec.length_bucket,
        keep=keep,
        slots=len(lengths),
    )
    packed = _move(batch, spec, plan, plan.microbatches)
    return packed.replace(microbatches=plan.microbatches), plan.used, plan.slots


def trajectory_spans(loss_mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(lengths, starts)`` [N] of padded rows: the tokens a row packs (up to its last loss-mask
    token, the positions the padded step's ``token_mask`` keeps; 0 without one) and its first
    loss-mask token."""
    has = np.asarray(loss_mask) > 0
    t_idx = np.arange(has.shape[1])
    lengths = np.where(has.any(1), np.max(np.where(has, t_idx + 1, 0), axis=1), 0)
    starts = np.where(has.any(1), np.argmax(has, axis=1), 0)
    return lengths, starts


def _pack(batch: TrainBatch, spec: PackingSpec, k: int) -> tuple[TrainBatch, int, int]:
    """The padded ``batch`` packed into rows of ``spec.row_capacity`` tokens, for a step of k
    microbatches: ``(packed batch, token slots used, all token slots)``.

    Trajectory n (padded row n) keeps its first ``L_n`` tokens (``trajectory_spans``) and goes
    where ``sat_jax.packing.layout`` puts it: a row of microbatch n mod k, so the step's split
    (``accumulation._split``) hands every microbatch the padded step's trajectories; rows per
    microbatch from ``row_bucket`` (the batch's rows a multiple of ``spec.row_multiple``), the
    row length from ``length_bucket``'s rule capped at the row capacity, so the step compiles a
    handful of shapes.

    Every per-token field moves with its token; ``segment_ids`` = n + 1 (0 on padding),
    ``positions`` restart at 0 per trajectory, and ``view_index`` [R, C] (C the bucketed
    longest span from a trajectory's first to its last loss token) gives each trajectory's
    tokens from its first loss token on as flat positions of its microbatch's rows
    (``sat_jax.step.batch.trajectory_view``). ``rewards`` and ``group_ids`` stay per trajectory.

    Raises:
      ValueError: a trajectory longer than the row capacity (``select_groups`` rejects those).
    """
    lengths, _ = trajectory_spans(batch.loss_mask)
    plan = packing.layout(
        lengths,
        capacity=spec.row_capacity,
        microbatches=k,
        row_multiple=spec.row_multiple,
        length_bucket=spec.length_bucket,
        most=len(lengths) // k,
    )
    return _move(batch, spec, plan, k), plan.used, plan.slots


def _move(batch: TrainBatch, spec: PackingSpec, plan: packing.Layout, k: int) -> TrainBatch:
    """The packed batch of ``plan`` (k microbatches, microbatch j's rows j, j + k, ...): every
    per-token field moved (``_pack``); trajectory slot v holds trajectory ``plan.order[v]``
    (slot n trajectory n without an order), empty slots are padding (reward 0, group -1, no
    token); group ids are renumbered 0, 1, ... in order of appearance when reordered (they only
    name groups)."""
    lengths, starts = trajectory_spans(batch.loss_mask)
    order = np.arange(len(lengths)) if plan.order is None else plan.order
    rows, T, N = plan.rows, plan.length, len(order)
    span = int((lengths - starts)[lengths > 0].max(initial=1))
    C = packing.row_length(span, bucket=spec.length_bucket, cap=spec.row_capacity)

    def new(x: np.ndarray | None, fill: np.ndarray | None = None) -> np.ndarray | None:
        if x is None:
            return None
        x = np.asarray(x)
        out = np.zeros((rows, T, *x.shape[2:]), x.dtype)
        if fill is not None:
            out[:] = fill
        return out

    routing = None if batch.routing is None else np.asarray(batch.routing)
    out = {name: new(getattr(batch, name)) for name in PER_TOKEN + GIVEN_PER_TOKEN}
    # Padding positions replay a valid, duplicate-free expert set, as in ``_padding``.
    pad_ids = None if routing is None else np.arange(routing.shape[-1], dtype=routing.dtype)
    out["routing"] = None if routing is None else new(routing, pad_ids)
    segment_ids = np.zeros((rows, T), np.int32)
    positions = np.zeros((rows, T), np.int32)
    view_index = np.full((N, C), -1, np.int32)
    for v in np.flatnonzero(order >= 0):
        n = order[v]
        if not lengths[n]:
            continue
        row, off = plan.place[n]
        length = int(lengths[n])
        for name, x in out.items():
            if x is not None:
                x[row, off : off + length] = np.asarray(getattr(batch, name))[n, :length]
        segment_ids[row, off : off + length] = v + 1
        positions[row, off : off + length] = np.arange(length)
        local = (row // k) * T + off  # flat position in microbatch v mod k's rows
        view_index[v, : length - starts[n]] = local + np.arange(starts[n], length)
    per_trajectory = {"rewards": batch.rewards, "group_ids": batch.group_ids}
    per_trajectory["session_weights"] = batch.session_weights
    if plan.order is not None:
        per_trajectory = _reordered(per_trajectory, order)
    return TrainBatch(
        **out,
        **per_trajectory,
        format_masks=batch.format_masks,
        segment_ids=segment_ids,
        positions=positions,
        view_index=view_index,
    )


def _reordered(fields: dict, order: np.ndarray) -> dict:
    """Per-trajectory ``fields`` (rewards, group ids, session weights; None stays None) in the
    slots' ``order`` (-1: an empty slot: reward 0, group -1, weight 0), group ids renumbered
    0, 1, ... so that they lie in [0, slots)."""
    out = {}
    for name, x in fields.items():
        if x is None:
            out[name] = None
            continue
        x = np.asarray(x)
        empty = np.array(-1 if name == "group_ids" else 0, x.dtype)
        out[name] = np.where(order >= 0, x[np.maximum(order, 0)], empty)
    ids = out["group_ids"]
    if ids is not None:
        real = ids >= 0
        _, first, inverse = np.unique(ids[real], return_index=True, return_inverse=True)
        rank = np.argsort(np.argsort(first))  # groups numbered in order of appearance
        ids[real] = rank[inverse].astype(ids.dtype)
    return out
