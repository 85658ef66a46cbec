"""The exact masked quantile behind SAT's threshold (docs/DESIGN.md §3.3).

:func:`masked_quantile` is re-exported by :mod:`sat_jax.objectives`, where SAT uses it for q.
"""

from __future__ import annotations

import fractions

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

# Largest denominator used to read the quantile level as a fraction (0.9 -> 9/10), so that
# ceil(level·n) is exact integer arithmetic without int64: (n mod den)·num stays below 2**31.
_MAX_LEVEL_DENOMINATOR = 10_000
# Radix select: 2**16 bins per pass over 16 bits of the key, located in two levels of 256.
_BINS = 1 << 16
_ROWS = 256


def _quantile_rank(level: float, n: jax.Array) -> jax.Array:
    """ceil(level·n) in exact int32 arithmetic, level read as the nearest fraction num/den."""
    frac = fractions.Fraction(level).limit_denominator(_MAX_LEVEL_DENOMINATOR)
    num, den = frac.numerator, frac.denominator
    return (n // den) * num + ((n % den) * num + den - 1) // den


def _ordered_key(x: jax.Array) -> jax.Array:
    """Maps float32 to uint32 so that unsigned order equals float order (−0 sorts before +0)."""
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    negative = bits >> 31 == 1
    return jnp.where(negative, ~bits, bits | jnp.uint32(0x80000000))


def _key_to_float(key: jax.Array) -> jax.Array:
    negative = key >> 31 == 0
    bits = jnp.where(negative, ~key, key & jnp.uint32(0x7FFFFFFF))
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def masked_quantile(
    x: ArrayLike,
    level: float,
    *,
    where: ArrayLike | None = None,
    counts: ArrayLike | None = None,
) -> jax.Array:
    """Exact inverted-CDF quantile inf{v : F̂(v) ≥ level} of ``x`` over the active entries.

    Sorting the active values ascending, this is the element at 1-indexed position ceil(level·n),
    NumPy's ``method="inverted_cdf"``. It is found by a two-pass radix select on the order-preserving
    uint32 image of float32: pass 1 histograms the high 16 bits (65,536 bins) and locates the bin
    holding rank k; pass 2 histograms the low 16 bits of the entries in that bin: two passes over the
    data instead of a sort or a 32-step bisection (benchmarks/objective_overhead.py compares them).
    Each bin is found by two 256-long prefix sums rather than one over 65,536 bins.

    Args:
      x: float array, any shape (NaN is not allowed among active entries).
      level: quantile level in (0, 1]; read as the nearest fraction with denominator ≤ 10⁴ so
        ceil(level·n) is exact (0.9 is 9/10).
      where: optional mask of the same shape; entries where it is ≤ 0 are ignored.
      counts: optional non-negative integer multiplicity of each entry (e.g. the number of active
        tokens of each response, for a token-level quantile of per-response values); default 1.

    Returns:
      A float32 scalar; 0 when no entry is active. Not differentiable (use under stop_gradient).
    """
    if not 0.0 < level <= 1.0:
        raise ValueError(f"masked_quantile: level must be in (0, 1], got {level!r}")
    x = jnp.asarray(x, jnp.float32)
    active = jnp.ones(x.shape, bool) if where is None else jnp.asarray(where) > 0
    weight = None  # every active entry counts once
    if counts is not None:
        weight = (active * jnp.broadcast_to(jnp.asarray(counts, jnp.int32), x.shape)).reshape(-1)
        active = weight > 0
    x, active = x.reshape(-1), active.reshape(-1)
    n = jnp.sum(active, dtype=jnp.int32) if weight is None else jnp.sum(weight)
    rank = _quantile_rank(level, n)  # 1-indexed
    key = _ordered_key(x)
    high = (key >> 16).astype(jnp.int32)
    low = (key & jnp.uint32(0xFFFF)).astype(jnp.int32)

    bin_high, below = _locate(_histogram(jnp.where(active, high, _BINS), weight), rank)
    in_bin = active & (high == bin_high)
    bin_low, _ = _locate(_histogram(jnp.where(in_bin, low, _BINS), weight), rank - below)

    value = _key_to_float((bin_high.astype(jnp.uint32) << 16) | bin_low.astype(jnp.uint32))
    return jnp.where(n > 0, value, 0.0)


def _histogram(index: jax.Array, weight: jax.Array | None) -> jax.Array:
    """[65,536] int32 sums of ``weight`` (1 when None) per ``index``; index 65,536 is not counted.

    A constant update (no weight) is a third cheaper than scattering an array of ones on CPU.
    """
    hist = jnp.zeros(_BINS + 1, jnp.int32).at[index].add(1 if weight is None else weight)
    return hist[:_BINS]


def _locate(hist: jax.Array, rank: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(bin, count before it): the first bin whose cumulative count reaches ``rank`` (1-indexed).

    Two levels of 256: a 65,536-long ``cumsum`` costs as much as a histogram pass on CPU.
    """
    rows = hist.reshape(_ROWS, _BINS // _ROWS)
    cum_rows = jnp.cumsum(jnp.sum(rows, axis=1))
    row = jnp.minimum(jnp.sum(cum_rows < rank, dtype=jnp.int32), _ROWS - 1)
    before_row = jnp.where(row > 0, cum_rows[jnp.maximum(row - 1, 0)], 0)
    cum_cols = jnp.cumsum(rows[row]) + before_row
    col = jnp.minimum(jnp.sum(cum_cols < rank, dtype=jnp.int32), _BINS // _ROWS - 1)
    before = jnp.where(col > 0, cum_cols[jnp.maximum(col - 1, 0)], before_row)
    return row * (_BINS // _ROWS) + col, before
