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
      needed: the most rows one microbatch's packing used (before ``row_bucket``).
      used: the trajectories' tokens.
    """

    place: np.ndarray
    rows: int
    length: int
    needed: int
    used: int

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
