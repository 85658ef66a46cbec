"""The packed layout (``sat_jax.packing``): valid placements, few row counts, little padding."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sat_jax import packing


def test_row_counts_step_by_at_most_a_sixteenth() -> None:
    counts = sorted({packing.row_bucket(n, most=10**6) for n in range(1, 1025)})
    assert counts[:32] == list(range(1, 33))  # exact up to 32 rows
    for lo, hi in itertools.pairwise(counts):
        assert hi - lo <= max(1, lo // 16)
    for octave in range(5, 10):  # 16 counts per octave past 32
        assert sum(2**octave < c <= 2 ** (octave + 1) for c in counts) == 16
    assert all(packing.row_bucket(n, most=10**6) >= n for n in range(1, 1025))


@pytest.mark.parametrize(("k", "multiple", "quantum"), [(1, 1, 1), (2, 8, 4), (4, 2, 1), (3, 8, 8)])
def test_row_counts_keep_the_data_shards_whole(k: int, multiple: int, quantum: int) -> None:
    assert packing.row_quantum(k, multiple) == quantum
    for needed in range(1, 300):
        rows = packing.row_bucket(needed, most=10**6, quantum=quantum)
        assert rows >= needed and (rows * k) % multiple == 0
    assert packing.row_bucket(90, most=64, quantum=quantum) == 64  # the padded rows' cap


def test_row_length_is_the_length_bucket_rule() -> None:
    assert [packing.row_length(n, bucket=64, cap=2048) for n in (1, 64, 65, 1500, 2048)] == [
        64,
        64,
        128,
        2048,
        2048,
    ]
    assert packing.row_length(100, bucket=64, cap=96) == 96
    assert packing.row_length(5, bucket=0, cap=96) == 96


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 40), min_size=1, max_size=60),
    k=st.sampled_from([1, 2, 4]),
    multiple=st.sampled_from([1, 2, 8]),
)
def test_layout_places_every_trajectory_once_in_its_microbatch(
    lengths: list[int], k: int, multiple: int
) -> None:
    lengths_n = np.array(lengths)
    lay = packing.layout(lengths_n, capacity=40, microbatches=k, row_multiple=multiple, most=10**6)
    assert lay.rows % k == 0 and lay.rows % multiple == 0 and lay.length <= 40
    taken = np.zeros((lay.rows, lay.length), int)
    for n, (row, off) in enumerate(lay.place):
        if lengths_n[n] == 0:
            assert row == off == -1
            continue
        assert row % k == n % k and off + lengths_n[n] <= lay.length
        taken[row, off : off + lengths_n[n]] += 1
    assert taken.max(initial=0) <= 1 and taken.sum() == lay.used == lengths_n.sum()
    per_mb = [lengths_n[j::k].sum() for j in range(k)]
    assert lay.needed >= -(-max(per_mb) // 40)


def test_best_fit_takes_the_tightest_row() -> None:
    # 8 and 6 open rows with room 2 and 4; 3 fits only the second, then 1 goes to the row it
    # leaves fullest (the second: room 1, not the first's 2, where first fit would put it).
    place, fills = packing.best_fit_decreasing(np.array([8, 6, 3, 1, 0]), 10)
    assert fills == [8, 10] and place.tolist() == [[0, 0], [1, 0], [1, 6], [1, 9], [-1, -1]]


def test_a_trajectory_longer_than_a_row_is_refused() -> None:
    with pytest.raises(ValueError, match="exceeds the row of 8"):
        packing.layout(np.array([3, 9]), capacity=8)


def test_long_tailed_batches_pack_within_five_percent() -> None:
    """The benchmark's distribution (lognormal, median 300, σ = 1, 5% at a 2,048 cap) at 64 to
    512 trajectories: the padded fraction is at most the last row's remainder + 1/16 of the
    rows, and at most 5% for these seeds."""
    rng = np.random.default_rng(0)
    for n in (64, 256, 512):
        lengths = np.clip(np.round(np.exp(np.log(300) + rng.standard_normal(n))), 66, 2048)
        lengths[rng.permutation(n)[: round(0.05 * n)]] = 2048
        lay = packing.layout(lengths.astype(int), capacity=2048, length_bucket=64)
        bound = -(-lay.used // 2048)
        assert lay.needed <= bound + 1 and lay.rows <= lay.needed + max(1, lay.needed // 16)
        assert lay.pad_frac <= 0.05, (n, lay.pad_frac)


@settings(max_examples=80, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 40), min_size=1, max_size=60),
    budget=st.sampled_from([40, 80, 120, 200]),
    multiple=st.sampled_from([1, 2, 8]),
)
def test_budget_layout_places_every_trajectory_once_in_its_slots_microbatch(
    lengths: list[int], budget: int, multiple: int
) -> None:
    """``budget_layout``: k microbatches of r rows within the budget, the rows and slots
    multiples of k and of the data shards; every trajectory with tokens, or kept, has one slot
    v, and its tokens lie in a row of microbatch v mod k, apart from every other's; the rows
    are fewer than the whole batch's packing needs plus k · the data shards."""
    lengths_n = np.array(lengths)
    keep = np.arange(len(lengths)) % 3 > 0
    lay = packing.budget_layout(
        lengths_n, capacity=40, microbatch_tokens=budget, row_multiple=multiple, keep=keep, slots=7
    )
    k = lay.microbatches
    assert lay.rows % k == 0 and lay.rows % multiple == 0 and lay.length <= 40
    assert (lay.rows // k) * lay.length <= budget
    assert len(lay.order) % k == 0 and len(lay.order) % multiple == 0
    assert len(lay.order) >= 7 or k > 7
    slots = [v for v in range(len(lay.order)) if lay.order[v] >= 0]
    placed = lay.order[slots]
    assert len(set(placed)) == len(placed)  # once each; a padding one (no token, not kept) may
    assert set(np.flatnonzero((lengths_n > 0) | keep)) <= set(placed)  # keep its slot n
    taken = np.zeros((lay.rows, lay.length), int)
    for v in slots:
        n = lay.order[v]
        row, off = lay.place[n]
        if not lengths_n[n]:
            assert row == off == -1
            continue
        assert row % k == v % k and off + lengths_n[n] <= lay.length
        taken[row, off : off + lengths_n[n]] += 1
    assert taken.max(initial=0) <= 1 and taken.sum() == lay.used == lengths_n.sum()
    _, fills = packing.best_fit_decreasing(lengths_n, 40)
    assert lay.rows < max(1, len(fills)) + k * multiple


@pytest.mark.parametrize(
    ("needed", "most", "multiple", "shape"),
    [
        (18, 4, 1, (6, 3)),  # 18 rows exactly (the old rule: 8 × 4)
        (19, 4, 1, (5, 4)),  # 20: k = 19 × 1 is past twice the fewest k (5)
        (17, 4, 1, (6, 3)),  # 18, and of (6, 3), (9, 2) the fewer microbatches
        (5, 1, 1, (5, 1)),
        (3, 4, 8, (2, 4)),  # rows a multiple of 8 shards: 8, the fewest k
        (0, 4, 1, (1, 1)),
    ],
)
def test_budget_shape_takes_the_fewest_rows_then_the_fewest_microbatches(
    needed: int, most: int, multiple: int, shape: tuple[int, int]
) -> None:
    assert packing.budget_shape(needed, most, multiple) == shape
