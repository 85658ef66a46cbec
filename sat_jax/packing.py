"""Where packed trajectories go: rows, offsets and the bucketed [rows, length] of a packed batch.

The host-side layout of sequence packing (docs/DESIGN.md §7.1), from trajectory lengths alone, so
that the trainer (``train.packing``, which moves the tokens) and the plan (``sat_jax.plan``,
which only counts slots) share one rule:

- Trajectory n goes to microbatch n mod k; each microbatch's trajectories are packed best-fit
  decreasing (longest first, ties by n, into the row that it leaves with the least room, a new
  row when none holds it); microbatch j's i-th row is the batch's row i·k + j.
- Rows per microbatch: the needed count rounded up to ``row_bucket``'s set, numbers with at most
  ``ROW_BITS`` significant bits (times the quantum that keeps the batch's rows a multiple of the
  data shards): 16 counts per octave, so at most 1/16 of the rows are spare, and the few counts
  a run's batches need are the only programs it compiles.
- Row length: the longest row's fill rounded up to ``length_bucket · 2^j`` (``row_length``),
  capped at the row capacity.

With a long-tailed length distribution the spare slots are then the last row's remainder
(``ceil(tokens / capacity)`` rows are needed whatever the packer) plus at most 1/16 of the
rows; best-fit decreasing stays within a row or two of that bound.

A token budget per microbatch (``train.microbatch_tokens``, ``budget_layout``) packs the whole
batch once instead, then chooses the microbatches k and their rows r together
(``budget_shape``): r · T within the budget, k · r ≥ the rows the packing needs, the fewest rows
(the spare rows are empty), then the fewest microbatches; the rows go to the microbatches and
the trajectories are renumbered so that trajectory v still lies in microbatch v mod k (the
step's split, ``sat_jax.step.accumulation``).
"""

from __future__ import annotations

import bisect
import dataclasses
import math

import numpy as np

ROW_BITS = 5


def row_bucket(needed: int, *, most: int, quantum: int = 1) -> int:
    """Rows per microbatch of a batch that needs ``needed``: the smallest ``quantum · y ≥ needed``
    whose y has at most ``ROW_BITS`` significant bits (1, ..., 32, 34, 36, ..., 64, 68, ...:
    16 per octave past 16, a step of at most 1/16), capped at ``most`` (the padded batch's rows
    per microbatch, which always hold the trajectories)."""
    y = max(1, -(-needed // quantum))
    shift = max(0, y.bit_length() - ROW_BITS)
    y = -(-y // (1 << shift)) * (1 << shift)
    return min(quantum * y, most)


def row_quantum(microbatches: int, row_multiple: int) -> int:
    """The least q with ``q · microbatches`` a multiple of ``row_multiple`` (the data shards)."""
    return row_multiple // math.gcd(microbatches, row_multiple)


def row_length(longest: int, *, bucket: int, cap: int) -> int:
    """The smallest ``bucket · 2^j`` (j ≥ 0) holding ``longest``, capped at ``cap``; ``cap`` when
    ``bucket`` is 0 (the rule of ``train.length_bucket``)."""
    if bucket <= 0:
        return cap
    t = bucket
    while t < longest:
        t *= 2
    return min(t, cap)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Layout:
    """A packed batch's layout.

    Attributes:
      place: int64 [N, 2], trajectory n's (batch row, offset in the row); (-1, -1) when it has
        no token to pack.
      rows: the batch's rows (rows per microbatch × k).
      length: the rows' length T.
      needed: the most rows one microbatch's packing used (before ``row_bucket``); of
        ``budget_layout``, the rows the whole batch's packing used.
      used: the trajectories' tokens.
      microbatches: ``budget_layout``'s k (0 for ``layout``, whose k is given).
      order: ``budget_layout``'s int64 [N'] trajectory (index into ``lengths``) of each
        trajectory slot v of the packed batch, in microbatch v mod k; -1 = an empty slot. None
        for ``layout`` (slot n is trajectory n).
    """

    place: np.ndarray
    rows: int
    length: int
    needed: int
    used: int
    microbatches: int = 0
    order: np.ndarray | None = None

    @property
    def slots(self) -> int:
        return self.rows * self.length

    @property
    def pad_frac(self) -> float:
        """Padded token slots ÷ all token slots (the ``pad_frac`` metric)."""
        return 1.0 - self.used / self.slots if self.slots else 0.0


def best_fit_decreasing(lengths: np.ndarray, capacity: int) -> tuple[np.ndarray, list[int]]:
    """Packs items of ``lengths`` (each ≤ ``capacity``; 0s are left out) into bins.

    Returns:
      ``(place, fills)``: int64 [N, 2] (bin, offset) per item ((-1, -1) for a 0) and each bin's
      fill.
    """
    place = np.full((len(lengths), 2), -1, np.int64)
    fills: list[int] = []
    open_bins: list[tuple[int, int]] = []  # (room left, bin), sorted: the tightest fit first
    for n in sorted(np.flatnonzero(lengths), key=lambda n: (-lengths[n], n)):
        length = int(lengths[n])
        i = bisect.bisect_left(open_bins, (length, -1))
        if i == len(open_bins):
            b = len(fills)
            fills.append(0)
        else:
            _, b = open_bins.pop(i)
        place[n] = (b, fills[b])
        fills[b] += length
        if fills[b] < capacity:
            bisect.insort(open_bins, (capacity - fills[b], b))
    return place, fills


def layout(
    lengths: np.ndarray,
    *,
    capacity: int,
    microbatches: int = 1,
    row_multiple: int = 1,
    length_bucket: int = 0,
    most: int | None = None,
) -> Layout:
    """The layout of trajectories of ``lengths`` (tokens to pack, 0 = none) packed into rows of
    ``capacity`` (see the module docstring); ``most`` caps the rows per microbatch (default: one
    trajectory per row, ``ceil(N / k)``).

    Raises:
      ValueError: a trajectory longer than ``capacity``.
    """
    lengths = np.asarray(lengths, np.int64)
    k = microbatches
    if lengths.max(initial=0) > capacity:
        raise ValueError(f"a trajectory of {lengths.max()} tokens exceeds the row of {capacity}")
    place = np.full((len(lengths), 2), -1, np.int64)
    needed, longest = 1, 0
    for j in range(k):
        members = np.arange(j, len(lengths), k)
        local, fills = best_fit_decreasing(lengths[members], capacity)
        has = local[:, 0] >= 0
        place[members[has]] = np.stack([local[has, 0] * k + j, local[has, 1]], axis=1)
        needed, longest = max(needed, len(fills)), max([longest, *fills])
    most = -(-len(lengths) // k) if most is None else most
    rows_mb = row_bucket(needed, most=most, quantum=row_quantum(k, row_multiple))
    return Layout(
        place=place,
        rows=rows_mb * k,
        length=row_length(longest, bucket=length_bucket, cap=capacity),
        needed=needed,
        used=int(lengths.sum()),
    )


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def budget_shape(needed: int, per_microbatch: int, row_multiple: int = 1) -> tuple[int, int]:
    """``(k, r)``: k microbatches of r rows for a batch whose packing needs ``needed`` rows, at
    most ``per_microbatch`` rows each (the token budget ÷ the row length), k · r a multiple of
    ``row_multiple`` (the data shards): the fewest rows k · r ≥ needed, then the fewest k, over
    k from the fewest that can hold the rows to twice that (every microbatch at least about half
    the budget; the spare rows are then fewer than k)."""
    needed, most = max(1, needed), max(1, per_microbatch)
    fewest = -(-needed // most)
    best: tuple[int, int, int] | None = None
    k = fewest
    while best is None or k <= 2 * fewest:
        quantum = row_quantum(k, row_multiple)
        r = _ceil(_ceil(needed, k), quantum) * quantum
        if r <= most and (best is None or (k * r, k) < best[:2]):
            best = (k * r, k, r)
        k += 1
    return best[1], best[2]


def budget_layout(
    lengths: np.ndarray,
    *,
    capacity: int,
    microbatch_tokens: int,
    row_multiple: int = 1,
    length_bucket: int = 0,
    keep: np.ndarray | None = None,
    slots: int = 0,
) -> Layout:
    """The layout of trajectories of ``lengths`` under a token budget per microbatch (module
    docstring): best-fit decreasing over the whole batch into rows of ``capacity``; the row
    length T by ``row_length``; ``(k, r)`` by ``budget_shape`` with ``microbatch_tokens // T``
    rows a microbatch at most; the packed rows to the microbatches (the rows with the most
    trajectories first, each to the microbatch with a free row and the fewest trajectories),
    microbatch j's i-th row the batch's row i·k + j. When ``layout``'s rule (trajectory n in
    microbatch n mod k, each packed apart) fits the same k, r and T, its placement is taken
    instead, and trajectory n keeps slot n.

    Trajectories without tokens that ``keep`` marks (an overlong-masked one: its reward still
    counts in its group) take a slot in the microbatch with the fewest; the others (padding)
    are left out. The slots per microbatch: ``ceil(slots / k)`` (``slots``: the padded batch's
    rows, so that the count follows k alone) rounded up to keep the data shards whole, doubled
    while a microbatch has more trajectories (a few counts per k, so few compiled shapes).

    Raises:
      ValueError: a trajectory longer than ``capacity``, or a budget below one row of T.
    """
    lengths = np.asarray(lengths, np.int64)
    if lengths.max(initial=0) > capacity:
        raise ValueError(f"a trajectory of {lengths.max()} tokens exceeds the row of {capacity}")
    bins, fills = best_fit_decreasing(lengths, capacity)
    length = row_length(max(fills, default=1), bucket=length_bucket, cap=capacity)
    if microbatch_tokens < length:
        raise ValueError(f"microbatch_tokens {microbatch_tokens} < a packed row of {length}")
    k, r = budget_shape(len(fills), microbatch_tokens // length, row_multiple)
    quantum = row_quantum(k, row_multiple)
    per = max(1, _ceil(_ceil(slots, k), quantum)) * quantum
    same = layout(
        lengths,
        capacity=capacity,
        microbatches=k,
        row_multiple=row_multiple,
        length_bucket=length_bucket,
        most=r,
    )
    if same.needed <= r and same.length <= length and len(lengths) <= k * per:
        # Trajectory n in microbatch n mod k fits the same shape: no renumbering.
        order = np.full(k * per, -1, np.int64)
        order[: len(lengths)] = np.arange(len(lengths))
        return dataclasses.replace(same, rows=k * r, microbatches=k, order=order)
    members: list[list[int]] = [[] for _ in range(len(fills))]
    for n in np.flatnonzero(bins[:, 0] >= 0):
        members[bins[n, 0]].append(int(n))
    rows_of: list[list[int]] = [[] for _ in range(k)]
    count = [0] * k
    row_of_bin = np.zeros(len(fills), np.int64)
    for b in sorted(range(len(fills)), key=lambda b: (-len(members[b]), b)):
        j = min((j for j in range(k) if len(rows_of[j]) < r), key=lambda j: (count[j], j))
        row_of_bin[b] = len(rows_of[j]) * k + j
        rows_of[j].append(b)
        count[j] += len(members[b])
    trajectories = [sorted(n for b in bs for n in members[b]) for bs in rows_of]
    empty = np.zeros(len(lengths), bool) if keep is None else np.asarray(keep, bool)
    for n in np.flatnonzero(empty & (lengths == 0)):
        j = min(range(k), key=lambda j: (len(trajectories[j]), j))
        trajectories[j].append(int(n))
    while per < max(len(t) for t in trajectories):
        per *= 2
    order = np.full(k * per, -1, np.int64)
    for j, ns in enumerate(trajectories):
        order[j + k * np.arange(len(ns), dtype=np.int64)] = ns
    place = np.full((len(lengths), 2), -1, np.int64)
    has = bins[:, 0] >= 0
    place[has] = np.stack([row_of_bin[bins[has, 0]], bins[has, 1]], axis=1)
    return Layout(
        place=place,
        rows=k * r,
        length=length,
        needed=len(fills),
        used=int(lengths.sum()),
        microbatches=k,
        order=order,
    )
