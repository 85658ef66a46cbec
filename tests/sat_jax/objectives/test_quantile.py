"""sat_jax.objectives.quantile: the exact masked quantile on large inputs, where the radix bins matter."""

from __future__ import annotations

import numpy as np
import pytest

from sat_jax.objectives.quantile import masked_quantile


def _reference(x, level, weights):
    return np.quantile(np.repeat(x.astype(np.float64), weights), level, method="inverted_cdf")


@pytest.mark.parametrize("scale", [0.05, 0.3, 30.0])
@pytest.mark.parametrize("level", [0.001, 0.5, 0.9, 0.99, 1.0])
def test_large_masked_inputs_match_numpy(scale, level):
    # |d| of a near-on-policy batch: thousands of values share one high-16-bit bin, so both
    # radix passes and both levels of each bin search are exercised.
    rng = np.random.default_rng(int(scale * 100))
    x = np.abs(scale * rng.standard_normal(200_003)).astype(np.float32)
    x[:5_000] = x[7]  # a long run of ties
    mask = rng.random(x.size) < 0.8
    got = masked_quantile(x, level, where=mask)
    assert float(got) == np.float32(_reference(x, level, mask.astype(int)))


def test_signed_values_spanning_many_bins():
    rng = np.random.default_rng(1)
    x = (rng.standard_normal(65_537) * np.exp(rng.uniform(-30, 30, 65_537))).astype(np.float32)
    for level in (0.01, 0.37, 0.5, 0.93):
        assert float(masked_quantile(x, level)) == np.float32(_reference(x, level, 1))


@pytest.mark.parametrize("level", [0.1, 0.9, 1.0])
def test_counts_with_a_mask_on_many_values(level):
    rng = np.random.default_rng(2)
    x = rng.normal(size=(300, 7)).astype(np.float32)
    counts = rng.integers(0, 1000, size=(300, 1))
    mask = rng.random((300, 7)) < 0.7
    got = masked_quantile(x, level, where=mask, counts=counts)
    weights = (mask * counts).reshape(-1)
    assert float(got) == np.float32(_reference(x.reshape(-1), level, weights))
