"""M2PO's second-moment mask and the effective sample size (VCPO) against float64 NumPy (§3.6).

The references (``objectives_reference.m2po_masked``, ``reference_ess``,
``reference_ess_sequence``) follow the sources' wording (AReaL's descending sort and suffix means
over the paper's trust-region tokens or all; (Σ w)² / (N·Σ w²) over tokens or over responses), not
the implementation's ascending cumulative sums.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sat_jax import objectives
from sat_jax.objectives import PolicyLossConfig, SATConfig
from tests.sat_jax.objectives_reference import (
    m2po_masked,
    reference_ess,
    reference_ess_sequence,
    reference_policy_loss,
)

from .test_objectives import assert_microbatches_merge_to_full, loss_and_grad, make_batch

RTOL, ATOL = 2e-5, 1e-6


def _heavy_tailed(seed, B=6, T=12, mask_p=0.8):
    """d = logp − behavior_logp with a few large stale outliers, and a mask."""
    rng = np.random.default_rng(seed)
    d = 0.15 * rng.normal(size=(B, T))
    d[rng.random((B, T)) < 0.1] *= 12.0
    mask = rng.random((B, T)) < mask_p
    mask[0] = False
    return d.astype(np.float32), mask


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("threshold", [0.01, 0.04, 0.2, 10.0])
def test_m2po_mask_is_the_areal_rule(seed, threshold):
    d, mask = _heavy_tailed(seed)
    cutoff = objectives.m2po_cutoff(d, threshold=threshold, where=mask)
    got = np.asarray(objectives.m2po_mask(d, cutoff, where=mask))
    want = m2po_masked(d, mask, threshold)
    np.testing.assert_array_equal(got, want)
    kept = (d.astype(np.float64) ** 2)[mask & ~want]
    assert kept.size >= 1 and (kept.mean() < threshold or kept.size == 1)
    if (d.astype(np.float64) ** 2)[mask].mean() < threshold:
        assert not want.any() and np.isinf(float(cutoff))


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("threshold", [0.01, 0.04, 10.0])
def test_m2po_trust_region_mask_is_the_papers_rule(seed, threshold):
    d, mask = _heavy_tailed(seed)
    adv = np.random.default_rng(seed + 100).normal(size=d.shape).astype(np.float32)
    adv[:, ::5] = 0.0  # A = 0 is in neither half of the trust-region set
    cand = objectives.m2po_candidates(d, adv, "trust_region", where=mask)
    want_cand = mask & (((adv > 0) & (d > 0)) | ((adv < 0) & (d < 0)))
    np.testing.assert_array_equal(np.asarray(cand), want_cand)
    cfg = PolicyLossConfig(m2_threshold=threshold)
    logp = np.zeros_like(d)
    cut = objectives.m2po_batch_cutoff(logp + d, logp, mask, cfg, advantages=adv)
    got = np.asarray(objectives.m2po_mask(d, cut, where=cand))
    np.testing.assert_array_equal(got, m2po_masked(d, mask, threshold, adv, "trust_region"))
    assert not (got & ~want_cand).any()  # tokens outside the set are never masked
    all_cut = objectives.m2po_batch_cutoff(
        logp + d, logp, mask, PolicyLossConfig(m2_threshold=threshold, m2_token_set="all")
    )
    all_mask = np.asarray(objectives.m2po_mask(d, all_cut, where=mask))
    np.testing.assert_array_equal(all_mask, m2po_masked(d, mask, threshold))
    if threshold == 0.01:
        assert got.any() and not np.array_equal(got, all_mask)


def test_m2po_trust_region_needs_advantages():
    d, mask = _heavy_tailed(0)
    with pytest.raises(ValueError, match="needs the advantages"):
        objectives.m2po_batch_cutoff(d, np.zeros_like(d), mask, PolicyLossConfig(m2_threshold=0.04))


def test_m2po_degenerate_batches():
    d = np.full((2, 3), 0.5, np.float32)
    mask = np.ones((2, 3), bool)
    # All tied above τ: at least one token is kept, so the tied smallest all stay.
    cut = objectives.m2po_cutoff(d, threshold=0.04, where=mask)
    assert np.isinf(float(cut)) and not np.asarray(objectives.m2po_mask(d, cut, where=mask)).any()
    # Tied smallest below one larger value: the larger one goes, the tied ones stay.
    d2 = d.copy()
    d2[1, 2] = 0.9
    cut = objectives.m2po_cutoff(d2, threshold=0.04, where=mask)
    want = np.zeros((2, 3), bool)
    want[1, 2] = True
    np.testing.assert_array_equal(np.asarray(objectives.m2po_mask(d2, cut, where=mask)), want)
    np.testing.assert_array_equal(m2po_masked(d2, mask, 0.04), want)
    # One active token above τ: AReaL keeps one token, so nothing is masked.
    one = np.zeros((2, 3), bool)
    one[1, 2] = True
    cut = objectives.m2po_cutoff(d, threshold=0.04, where=one)
    assert np.isinf(float(cut)) and not np.asarray(objectives.m2po_mask(d, cut, where=one)).any()
    # No active token: +inf, nothing masked, no NaN.
    none = np.zeros((2, 3), bool)
    assert np.isinf(float(objectives.m2po_cutoff(d, threshold=0.04, where=none)))


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize(
    "cfg",
    [
        PolicyLossConfig(m2_threshold=0.04),
        PolicyLossConfig(m2_threshold=0.04, sat=SATConfig(quantile=0.8)),
        PolicyLossConfig(m2_threshold=0.02, loss_agg="seq_mean_token_mean", dual_clip=2.0),
        PolicyLossConfig(m2_threshold=0.04, m2_token_set="all"),
        PolicyLossConfig(m2_threshold=0.02, m2_token_set="all", sat=SATConfig(quantile=0.8)),
    ],
    ids=["m2po", "m2po_sat", "m2po_seqmean_dual", "m2po_all", "m2po_all_sat"],
)
def test_m2po_loss_gradient_and_metrics_match_float64(seed, cfg):
    batch = make_batch(seed, scale=0.3)
    loss, metrics, grad = loss_and_grad(batch, cfg)
    ref_loss, ref_metrics, ref_grad = reference_policy_loss(**batch, cfg=cfg)
    np.testing.assert_allclose(loss, ref_loss, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(grad, ref_grad, rtol=RTOL, atol=ATOL)
    assert set(metrics) == set(ref_metrics)
    for k, v in ref_metrics.items():
        np.testing.assert_allclose(metrics[k], v, rtol=RTOL, atol=ATOL, err_msg=k)
    assert 0.0 < float(metrics["m2po_masked_frac"]) < 0.5
    # Masked tokens get no gradient; they stay in the denominator: the loss is the base loss
    # with their advantages zeroed.
    d = batch["logp"].astype(np.float64) - batch["behavior_logp"]
    masked = m2po_masked(
        d, batch["mask"] > 0, cfg.m2_threshold, batch["advantages"], cfg.m2_token_set
    )
    assert np.all(np.asarray(grad)[masked] == 0.0)
    zeroed = {**batch, "advantages": np.where(masked, 0.0, batch["advantages"]).astype(np.float32)}
    base = PolicyLossConfig(**{**cfg.__dict__, "m2_threshold": None})
    np.testing.assert_allclose(loss, loss_and_grad(zeroed, base)[0], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("scale", [0.01, 0.4, 3.0])
def test_ess_matches_float64(seed, scale):
    batch = make_batch(seed, scale=scale, with_old=True)
    args = (batch["logp"], batch["behavior_logp"], batch["mask"])
    token, sequence = reference_ess(*args), reference_ess_sequence(*args)
    for cfg in (
        PolicyLossConfig(),
        PolicyLossConfig(ratio_level="sequence", tis_cap=2.0),
        PolicyLossConfig(ess_level="token"),
    ):
        _, metrics, _ = loss_and_grad(batch, cfg)
        np.testing.assert_allclose(metrics["ess_token"], token, rtol=RTOL)
        np.testing.assert_allclose(metrics["ess_sequence"], sequence, rtol=RTOL)
        want = sequence if cfg.ess_level == "sequence" else token
        assert float(metrics["ess"]) == float(metrics[f"ess_{cfg.ess_level}"])
        np.testing.assert_allclose(metrics["ess"], want, rtol=RTOL)
        assert 0.0 < float(metrics["ess"]) <= 1.0 + 1e-6
    if scale > 0.01:  # the two levels are different statistics
        assert abs(sequence - token) > 1e-3


def test_ess_bounds_and_step_scale():
    n = 8
    equal = objectives.effective_sample_size(n * 2.0, n * 4.0, n)  # every w = 2
    np.testing.assert_allclose(equal, 1.0, rtol=1e-6)
    # One weight dominating: ess → 1/N.
    w = np.array([1e6] + [1e-3] * (n - 1), np.float32)
    one = objectives.effective_sample_size(w.sum(), (w.astype(np.float64) ** 2).sum(), n)
    np.testing.assert_allclose(one, 1.0 / n, rtol=1e-4)
    assert float(objectives.effective_sample_size(0.0, 0.0, 0)) == 0.0
    np.testing.assert_allclose(objectives.ess_step_scale(0.25), 0.5)
    # Extreme log-ratios (clamped at ±20): finite, in (0, 1].
    d = np.array([[80.0, -80.0, 0.0, 1.0]], np.float32)
    s1, s2 = objectives.importance_weight_sums(np.clip(d, -20, 20))
    ess = float(objectives.effective_sample_size(s1, s2, 4))
    assert np.isfinite(ess) and 0.0 < ess <= 1.0


@pytest.mark.parametrize("base", ["ppo", "sat", "gspo"])
def test_options_off_are_bit_identical(base):
    cfgs = {
        "ppo": PolicyLossConfig(),
        "sat": PolicyLossConfig(sat=SATConfig(quantile=0.8)),
        "gspo": PolicyLossConfig(ratio_level="sequence", clip_low=3e-4, clip_high=4e-4),
    }
    cfg = cfgs[base]
    batch = make_batch(3, scale=0.3)
    loss, metrics, grad = loss_and_grad(batch, cfg)
    # m2_threshold 0 is off (so its token set is unread); ess_scaling changes only the train
    # step's update, not the loss.
    offs = (
        dict(m2_threshold=0.0),
        dict(m2_threshold=None),
        dict(m2_threshold=None, m2_token_set="all"),
        dict(ess_scaling=True),
    )
    for off in offs:
        other = PolicyLossConfig(**{**cfg.__dict__, **off})
        loss2, metrics2, grad2 = loss_and_grad(batch, other)
        assert np.asarray(loss2).tobytes() == np.asarray(loss).tobytes()
        assert np.asarray(grad2).tobytes() == np.asarray(grad).tobytes()
        assert metrics2.keys() == metrics.keys()
        for k in metrics:
            assert np.asarray(metrics2[k]).tobytes() == np.asarray(metrics[k]).tobytes(), k


@pytest.mark.parametrize("n_micro", [2, 4])
@pytest.mark.parametrize("token_set", ["trust_region", "all"])
def test_microbatches_with_the_batch_cutoff_merge_to_full_batch(n_micro, token_set):
    """Row microbatches given the batch's M2PO cutoff merge to the full batch; both ESS levels
    are exact."""
    cfg = PolicyLossConfig(m2_threshold=0.04, m2_token_set=token_set, sat=SATConfig(quantile=0.8))
    batch = make_batch(12, B=8, scale=0.3)
    b = {k: jnp.asarray(v) for k, v in batch.items()}
    q = objectives.sat_threshold(b["logp"], b["behavior_logp"], b["mask"], cfg)
    cut = objectives.m2po_batch_cutoff(
        b["logp"], b["behavior_logp"], b["mask"], cfg, advantages=b["advantages"]
    )

    def terms(lp, rows):
        args = (lp[rows], b["behavior_logp"][rows], b["advantages"][rows], b["mask"][rows], cfg)
        return objectives.policy_loss_terms(*args, sat_q=q, m2_cutoff=cut)

    metrics = assert_microbatches_merge_to_full(b, cfg, terms, n_micro)
    parts = [slice(i, i + 8 // n_micro) for i in range(0, 8, 8 // n_micro)]
    assert 0.0 < float(metrics["m2po_masked_frac"]) < 1.0
    # Each microbatch's own cutoff would mask differently: the batch statistic matters.
    own = functools.reduce(
        lambda x, y: x.merge(y),
        (
            objectives.policy_loss_terms(
                b["logp"][s], b["behavior_logp"][s], b["advantages"][s], b["mask"][s], cfg, sat_q=q
            )
            for s in parts
        ),
    )
    assert float(own.reduce()[1]["m2po_masked_frac"]) != float(metrics["m2po_masked_frac"])


def test_all_padding_batch_is_zero_and_finite():
    cfg = PolicyLossConfig(m2_threshold=0.04, ess_scaling=True)
    batch = make_batch(0)
    batch["mask"] = np.zeros_like(batch["mask"])
    loss, metrics, grad = loss_and_grad(batch, cfg)
    assert float(loss) == 0.0 and not np.asarray(grad).any()
    assert all(np.isfinite(float(v)) for v in metrics.values())
    assert float(metrics["ess"]) == 0.0 and float(metrics["m2po_masked_frac"]) == 0.0


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        (dict(m2_threshold=-0.1), "m2_threshold"),
        (dict(ess_scaling=1), "ess"),
        (dict(opob_baseline=1), "opob_baseline"),
        (dict(m2_token_set="paper"), "m2_token_set"),
        (dict(ess_level="trajectory"), "ess_level"),
    ],
)
def test_config_validation(kwargs, field):
    with pytest.raises(ValueError, match=field):
        PolicyLossConfig(**kwargs)


# --- VCPO's off-policy optimal baseline (OPOB) --------------------------------------------------


def reference_opob(rewards, group_ids, s, g2, active):
    """b_g = Σ W R / Σ W over the group's real responses, W = exp(s)²·G, in float64 (the mean
    where every W is 0); the per-response baseline and the mean |b − mean|."""
    rewards, s, g2 = (np.asarray(x, np.float64) for x in (rewards, s, g2))
    base = np.zeros_like(rewards)
    for g in np.unique(group_ids[active]):
        rows = active & (group_ids == g)
        live = g2[rows] > 0
        top = s[rows][live].max() if live.any() else 0.0
        w = np.where(live, np.exp(2.0 * (s[rows] - top)) * g2[rows], 0.0)  # W up to a factor
        mean = rewards[rows].mean()
        base[rows] = mean if w.sum() == 0 else (w * rewards[rows]).sum() / w.sum()
    means = {g: rewards[active & (group_ids == g)].mean() for g in np.unique(group_ids[active])}
    shift = np.mean([abs(base[i] - means[group_ids[i]]) for i in np.flatnonzero(active)])
    return base, shift


def _opob_inputs(seed, n=24, groups=4, scale=3.0):
    rng = np.random.default_rng(seed)
    rewards = rng.integers(0, 2, n).astype(np.float32)
    ids = rng.integers(0, groups, n).astype(np.int32)
    s = (scale * rng.normal(size=n)).astype(np.float32)
    g2 = rng.uniform(0.1, 5.0, n).astype(np.float32)
    g2[rng.random(n) < 0.2] = 0.0  # responses without a gradient (no active token)
    active = rng.random(n) < 0.9
    return rewards, ids, s, g2, active


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("scale", [0.1, 3.0, 200.0])
def test_opob_baselines_match_float64(seed, scale):
    rewards, ids, s, g2, active = _opob_inputs(seed, scale=scale)
    base, shift = objectives.opob_baselines(rewards, ids, s, g2, num_groups=4, where=active)
    want, want_shift = reference_opob(rewards, ids, s, g2, active)
    assert np.isfinite(np.asarray(base)).all()  # s up to ±600: w² = e^1200 never formed
    np.testing.assert_allclose(np.asarray(base), np.where(active, want, 0.0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(float(shift), want_shift, rtol=1e-5, atol=1e-6)


def test_opob_baseline_degenerate_groups():
    rewards = np.array([1, 1, 1, 0, 1, 0, 0.5, 0.5], np.float32)
    ids = np.array([0, 0, 0, 1, 1, 1, 2, 2], np.int32)
    s = np.array([0.0, 50.0, -3.0, 0.0, 900.0, 0.0, 1.0, 2.0], np.float32)
    g2 = np.array([1, 1, 1, 1, 1, 1, 0, 0], np.float32)
    base, _ = objectives.opob_baselines(rewards, ids, s, g2, num_groups=3)
    base = np.asarray(base)
    # A constant group's baseline is exactly its reward, so its advantage stays exactly 0.
    assert (base[:3] == 1.0).all()
    adv = objectives.group_advantages(rewards, ids, num_groups=3, baseline=base)
    assert (np.asarray(adv)[:3] == 0.0).all()
    # One weight dominates (w² = e^1800 relative): the baseline is that response's reward.
    assert base[3:6] == pytest.approx([1.0, 1.0, 1.0])
    # Every G = 0: the group's mean.
    assert (base[6:] == 0.5).all()


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo"])
def test_group_advantages_with_a_baseline_match_float64(estimator):
    rewards, ids, s, g2, active = _opob_inputs(7)
    base, _ = objectives.opob_baselines(rewards, ids, s, g2, num_groups=4, where=active)
    got = objectives.group_advantages(
        rewards, ids, num_groups=4, estimator=estimator, where=active, baseline=base
    )
    want = np.zeros(rewards.shape)
    for g in range(4):
        rows = active & (ids == g)
        r = rewards[rows].astype(np.float64)
        std = r.std(ddof=1) if rows.sum() > 1 else 0.0
        centered = r - np.asarray(base, np.float64)[rows]
        if estimator == "dr_grpo":
            want[rows] = centered
        elif std > 0:
            want[rows] = centered / (std + 1e-6)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="baseline must be"):
        objectives.group_advantages(rewards, ids, num_groups=4, baseline=base[:3])


@pytest.mark.parametrize("rows_per_pass", [1, 3])
def test_sequence_score_stats_are_each_rows_value_and_gradient_norm(rows_per_pass):
    rng = np.random.default_rng(0)
    params = {"a": jnp.asarray(rng.normal(size=(3, 4)), jnp.float32), "b": jnp.float32(0.7)}
    rows = {"x": rng.normal(size=(5, 4)).astype(np.float32), "m": rng.random((5, 4)) < 0.7}

    def score(p, row):  # row leaves keep a leading dimension of 1
        h = jnp.tanh(row["x"] @ p["a"].T) * p["b"]
        return jnp.sum(jnp.where(row["m"][:, :3], h, 0.0))

    value, g2 = objectives.sequence_score_stats(score, params, rows, rows_per_pass=rows_per_pass)
    for i in range(5):
        row = {k: v[i : i + 1] for k, v in rows.items()}
        v, g = jax.value_and_grad(score)(params, row)
        want = sum(float(np.sum(np.square(np.asarray(x, np.float64)))) for x in jax.tree.leaves(g))
        assert float(value[i]) == pytest.approx(float(v), rel=1e-5)
        assert float(g2[i]) == pytest.approx(want, rel=1e-5)
    with pytest.raises(ValueError, match="rows_per_pass must be >= 1"):
        objectives.sequence_score_stats(score, params, rows, rows_per_pass=0)
