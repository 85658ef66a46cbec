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


def packed_rows(needed: int, most: int, k: int, multiple: int) -> int:
    """Rows per microbatch of a packed batch whose microbatches need at most ``needed`` rows:
    ``sat_jax.packing.row_bucket`` with the quantum that makes k · rows a multiple of
    ``multiple`` (the data shards), capped at ``most``, the padded batch's rows per
    microbatch (they always hold the trajectories)."""
    return packing.row_bucket(needed, most=most, quantum=packing.row_quantum(k, multiple))


def pack_batch(batch: TrainBatch, spec: PackingSpec) -> tuple[TrainBatch, int, int]:
    """``_pack`` with ``spec.microbatches``, or, with ``spec.microbatch_tokens``, with the fewest
    microbatches k (1, 2, 4, ... dividing the rows) whose token slots (rows per microbatch × row
    length) fit the budget (the most k when none does); the packed batch carries that k.

    Returns:
      ``(packed batch, token slots used, all token slots)``.
    """
    if not spec.microbatch_tokens:
        return _pack(batch, spec, spec.microbatches)
    rows, k = np.shape(batch.tokens)[0], 1
    while True:
        packed, used, slots = _pack(batch, spec, k)
        fits = slots // k <= spec.microbatch_tokens
        if fits or rows % (2 * k):
            return packed.replace(microbatches=k), used, slots
        k *= 2


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
    lengths, starts = trajectory_spans(batch.loss_mask)
    R, cap = len(lengths), spec.row_capacity
    plan = packing.layout(
        lengths,
        capacity=cap,
        microbatches=k,
        row_multiple=spec.row_multiple,
        length_bucket=spec.length_bucket,
        most=R // k,
    )
    rows, T = plan.rows, plan.length
    span = int((lengths - starts)[lengths > 0].max(initial=1))
    C = packing.row_length(span, bucket=spec.length_bucket, cap=cap)

    def new(x: np.ndarray | None, fill: np.ndarray | None = None) -> np.ndarray | None:
        if x is None:
            return None
        x = np.asarray(x)
        out = np.zeros((rows, T, *x.shape[2:]), x.dtype)
        if fill is not None:
            out[:] = fill
        return out

    routing = None if batch.routing is None else np.asarray(batch.routing)
    out = {name: new(getattr(batch, name)) for name in PER_TOKEN}
    # Padding positions replay a valid, duplicate-free expert set, as in ``_padding``.
    pad_ids = None if routing is None else np.arange(routing.shape[-1], dtype=routing.dtype)
    out["routing"] = None if routing is None else new(routing, pad_ids)
    segment_ids = np.zeros((rows, T), np.int32)
    positions = np.zeros((rows, T), np.int32)
    view_index = np.full((R, C), -1, np.int32)
    for n in np.flatnonzero(lengths):
        row, off = plan.place[n]
        length = int(lengths[n])
        for name, x in out.items():
            if x is not None:
                x[row, off : off + length] = np.asarray(getattr(batch, name))[n, :length]
        segment_ids[row, off : off + length] = n + 1
        positions[row, off : off + length] = np.arange(length)
        local = (row // k) * T + off  # flat position in microbatch n mod k's rows
        view_index[n, : length - starts[n]] = local + np.arange(starts[n], length)
    packed = TrainBatch(
        **out,
        rewards=batch.rewards,
        group_ids=batch.group_ids,
        session_weights=batch.session_weights,
        format_masks=batch.format_masks,
        segment_ids=segment_ids,
        positions=positions,
        view_index=view_index,
    )
    return packed, plan.used, plan.slots
