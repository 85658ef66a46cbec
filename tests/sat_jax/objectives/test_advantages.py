"""Tests of sat_jax.objectives.advantages against a float64 NumPy reference written per group."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sat_jax.objectives.advantages import group_advantages


def reference(rewards, group_ids, estimator, normalize_std, eps, where):
    rewards = np.asarray(rewards, np.float64)
    out = np.zeros_like(rewards)
    for g in np.unique(group_ids):
        idx = [i for i in range(len(rewards)) if group_ids[i] == g and where[i]]
        if not idx:
            continue
        r = rewards[idx]
        centered = r - r.mean()
        if estimator == "grpo" and normalize_std:
            if len(idx) < 2:
                centered = np.zeros_like(r)
            else:
                std = r.std(ddof=1)
                centered = centered / (std + eps) if std > 0 else np.zeros_like(r)
        out[idx] = centered
    return out


@settings(max_examples=40, deadline=None)
@given(
    data=st.lists(
        st.tuples(st.integers(0, 4), st.sampled_from([0.0, 1.0, 0.5, -2.0]), st.booleans()),
        min_size=1,
        max_size=24,
    ),
    estimator=st.sampled_from(["grpo", "dr_grpo"]),
    normalize_std=st.booleans(),
)
def test_matches_reference(data, estimator, normalize_std):
    group_ids = np.array([g for g, _, _ in data])
    rewards = np.array([r for _, r, _ in data], np.float32)
    where = np.array([w for _, _, w in data])
    got = group_advantages(
        rewards,
        group_ids,
        num_groups=5,
        estimator=estimator,
        normalize_std=normalize_std,
        where=where,
    )
    want = reference(rewards, group_ids, estimator, normalize_std, 1e-6, where)
    assert np.all(np.isfinite(got))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_known_values_and_zero_variance_groups():
    rewards = jnp.array([1.0, 0.0, 1.0, 1.0, 1.0, 2.0, 5.0])
    ids = jnp.array([0, 0, 0, 1, 1, 2, 3])
    adv = group_advantages(rewards, ids, num_groups=4)
    std = np.std([1.0, 0.0, 1.0], ddof=1)
    np.testing.assert_allclose(adv[:3], np.array([1 / 3, -2 / 3, 1 / 3]) / (std + 1e-6), rtol=1e-6)
    assert np.all(np.asarray(adv[3:]) == 0.0)  # constant group and single-response groups
    dr = group_advantages(rewards, ids, num_groups=4, estimator="dr_grpo")
    np.testing.assert_allclose(dr[:3], [1 / 3, -2 / 3, 1 / 3], rtol=1e-6)
    # eps = 0 with a constant group: still 0, not NaN.
    assert np.all(np.isfinite(group_advantages(rewards, ids, num_groups=4, eps=0.0)))


def test_jit_matches_eager():
    rewards = jnp.array([1.0, 0.0, 3.0, 1.0, 2.0, 2.0])
    ids = jnp.array([0, 0, 0, 1, 1, 1])
    f = lambda r, i: group_advantages(r, i, num_groups=2)
    np.testing.assert_allclose(jax.jit(f)(rewards, ids), f(rewards, ids), rtol=1e-6)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(estimator="ppo"), "estimator"),
        (dict(num_groups=0), "num_groups"),
        (dict(eps=-1.0), "eps"),
        (dict(group_ids=jnp.array([0, 5])), "group_ids"),
        (dict(group_ids=jnp.array([0, 0, 1])), "group_ids"),
    ],
)
def test_bad_input_is_named(kwargs, match):
    args = dict(rewards=jnp.array([1.0, 0.0]), group_ids=jnp.array([0, 1]), num_groups=2)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        group_advantages(**args)


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo"])
def test_weights_count_each_forked_session_once(estimator):
    """A session's k segments weigh 1/k each and share its reward: the advantages are those of
    the group of sessions, each segment taking its session's (docs/DESIGN.md §6.6)."""
    sessions = jnp.array([1.0, 0.0, 0.5, 2.0, 2.0])  # group 0: three sessions; group 1: two
    ids = jnp.array([0, 0, 0, 1, 1])
    want = group_advantages(sessions, ids, num_groups=2, estimator=estimator)
    # Session 0 of group 0 forked twice (three segments), session 1 of group 1 once.
    rewards = jnp.array([1.0, 1.0, 1.0, 0.0, 0.5, 2.0, 2.0, 2.0])
    seg_ids = jnp.array([0, 0, 0, 0, 0, 1, 1, 1])
    weights = jnp.array([1 / 3, 1 / 3, 1 / 3, 1.0, 1.0, 1.0, 0.5, 0.5])
    got = group_advantages(rewards, seg_ids, num_groups=2, estimator=estimator, weights=weights)
    expand = np.array([0, 0, 0, 1, 2, 3, 4, 4])
    np.testing.assert_allclose(got, np.asarray(want)[expand], rtol=1e-5, atol=1e-7)
    one = group_advantages(rewards[:3], seg_ids[:3], num_groups=1, weights=weights[:3])
    np.testing.assert_array_equal(one, 0.0)  # one session, however many segments: no spread
