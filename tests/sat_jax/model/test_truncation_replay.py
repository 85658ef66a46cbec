"""Truncation replay (docs/DESIGN.md §2): ``token_logprobs(..., kept_bt=...)`` renormalises over
the top-max(n, r) scaled logits (n the sampler's kept count, r the target's rank), as the
sampler's top-k / top-p did, against a float64 NumPy reference; ``kth_largest_key`` is an exact
order statistic."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sat_jax.decoding import SamplingConfig, sample
from sat_jax.model import token_logprobs
from sat_jax.model.logprobs import _order_key, kth_largest_key


def _reference(logits, targets, kept, temperature, vocab_mask=None):
    """float64 log-probs over each position's top-max(n, r) scaled logits, r the target's rank:
    every logit at or above min(n-th largest, the target's)."""
    x = np.asarray(logits, np.float64) / temperature
    if vocab_mask is not None:
        x = np.where(vocab_mask, x, -np.inf)
    out = np.zeros(np.shape(targets))
    for idx in np.ndindex(*np.shape(targets)):
        row, y, n = x[idx], int(targets[idx]), int(kept[idx])
        cut = np.sort(row)[::-1][n - 1] if n > 0 else -np.inf
        keep = (row >= min(cut, row[y])) & np.isfinite(row)
        z = row[keep].max()
        out[idx] = row[y] - (z + np.log(np.exp(row[keep] - z).sum()))
    return out


@settings(max_examples=60, deadline=None)
@given(
    values=st.lists(
        st.sampled_from([-3.5, -1.0, -0.0, 0.0, 0.25, 1.0, 2.0, 7.5, -1e30, 1e30]),
        min_size=1,
        max_size=12,
    ),
    data=st.data(),
)
def test_kth_largest_is_exact_with_ties_and_signs(values, data):
    k = data.draw(st.integers(0, len(values)))
    x = jnp.asarray(values, jnp.float32)
    keys = _order_key(x)
    got = int(kth_largest_key(keys[None], jnp.asarray([k]))[0])
    if k == 0:
        assert got == 0
        return
    want = int(np.sort(np.asarray(keys))[::-1][k - 1])
    assert got == want
    # The key order is the float order (−0 and +0 are adjacent).
    order = np.argsort(np.asarray(keys), kind="stable")
    assert np.all(np.diff(np.asarray(x)[order]) >= 0)


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"),
    [(1.0, 20, 0.9), (0.7, 0, 0.6), (1.0, 5, 1.0), (1.3, 3, 0.5), (1.0, 0, 1.0)],
)
def test_replay_of_the_samplers_kept_counts_gives_the_sampler_logprobs(temperature, top_k, top_p):
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(32, 300)) * 3, jnp.float32)
    mask = np.arange(300) >= 2  # like a tokenizer's pad and bos, never sampled
    masked = jnp.where(mask, logits, -jnp.inf)
    cfg = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p)
    tokens, behavior, kept = sample(masked, jax.random.key(1), cfg)
    got = token_logprobs(
        logits[None], tokens[None], temperature=temperature, vocab_mask=mask, kept_bt=kept[None]
    )[0]
    np.testing.assert_allclose(got, behavior, atol=1e-5, rtol=0)
    want = _reference(logits, tokens, kept, temperature, mask)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)


def test_no_truncation_and_a_target_outside_the_kept_set():
    rng = np.random.default_rng(1)
    logits = jnp.asarray(rng.normal(size=(2, 5, 40)) * 2, jnp.float32)
    targets = jnp.asarray(rng.integers(0, 40, (2, 5)), jnp.int32)
    # Kept count 0 is the whole vocabulary.
    full = token_logprobs(logits, targets, temperature=0.8)
    zero = token_logprobs(logits, targets, temperature=0.8, kept_bt=jnp.zeros((2, 5), jnp.int32))
    np.testing.assert_allclose(zero, full, atol=1e-6)
    # A target this policy ranks below the n kept stays in the set: finite, the reference's.
    kept = jnp.full((2, 5), 3, jnp.int32)
    got = token_logprobs(logits, targets, temperature=0.8, kept_bt=kept)
    assert np.all(np.isfinite(got))
    np.testing.assert_allclose(got, _reference(logits, targets, kept, 0.8), atol=1e-5)


def test_a_target_ranked_below_n_keeps_every_token_above_it():
    """The documented example: logits 5.0, 4.5, …, 1.5, n = 2, target ranked 6th. The replay
    keeps the top 6 (−3.3817), not the top 2 plus the target (−3.0239), and tokens ranked 3–5
    receive gradient."""
    x = np.arange(5.0, 1.0, -0.5)  # 8 logits
    y, n = 5, 2
    top6 = x[:6].max() + np.log(np.exp(x[:6] - x[:6].max()).sum())
    want = x[y] - top6  # float64, written from the rule
    assert want == pytest.approx(-3.3817, abs=1e-4)
    gap = np.asarray([x[0], x[1], x[y]])
    assert x[y] - (gap.max() + np.log(np.exp(gap - gap.max()).sum())) == pytest.approx(
        -3.0239, abs=1e-4
    )
    logits = jnp.asarray(x[None, None], jnp.float32)
    targets = jnp.asarray([[y]], jnp.int32)
    kept = jnp.asarray([[n]], jnp.int32)
    got = float(token_logprobs(logits, targets, kept_bt=kept)[0, 0])
    np.testing.assert_allclose(got, want, atol=1e-6, rtol=0)
    np.testing.assert_allclose(got, _reference(x, np.int64(y), np.int64(n), 1.0), atol=1e-6)
    grad = np.asarray(
        jax.grad(lambda z: jnp.sum(token_logprobs(z, targets, kept_bt=kept)))(logits)[0, 0]
    )
    assert np.all(grad[2:5] < 0) and np.all(grad[6:] == 0)


def test_replay_gradient_is_the_kept_sets_softmax():
    """d logp / d logits = (onehot(target) − softmax over the kept set) / temperature."""
    rng = np.random.default_rng(2)
    logits = jnp.asarray(rng.normal(size=(1, 3, 16)), jnp.float32)
    targets = jnp.asarray([[0, 5, 9]], jnp.int32)
    kept = jnp.asarray([[4, 1, 16]], jnp.int32)
    t = 0.7
    grad = jax.grad(lambda z: jnp.sum(token_logprobs(z, targets, temperature=t, kept_bt=kept)))(
        logits
    )
    x = np.asarray(logits, np.float64)[0] / t
    for i in range(3):
        row, y, n = x[i], int(targets[0, i]), int(kept[0, i])
        keep = row >= min(np.sort(row)[::-1][n - 1], row[y])
        p = np.where(keep, np.exp(row - row.max()), 0.0)
        p /= p.sum()
        want = (np.eye(16)[y] - p) / t
        np.testing.assert_allclose(grad[0, i], want, atol=1e-5)
