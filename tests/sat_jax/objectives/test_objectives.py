"""Tests of sat_jax.objectives against the float64 reference written from docs/DESIGN.md §3's equations."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sat_jax import objectives
from sat_jax.objectives import PolicyLossConfig, SATConfig
from tests.sat_jax.objectives_reference import quantile_inverted_cdf, reference_policy_loss

# float32 implementation vs float64 reference: ~1e-6 relative rounding per op, a few ops deep.
RTOL, ATOL = 2e-5, 1e-6

REQUIRED_METRICS = (
    "mismatch_abs_mean",
    "is_deviation_frac",
    "kl_k3",
    "clip_frac_low",
    "clip_frac_high",
    "sat_q",
    "sat_gate_rate",
    "sat_eps_low_mean",
    "sat_eps_high_mean",
    "sat_c_min",
)


def make_batch(
    seed, B=6, T=12, scale=0.4, mask_p=0.75, with_old=False, with_ref=False, with_fresh=False
):
    rng = np.random.default_rng(seed)
    logp = np.log(rng.uniform(0.05, 0.95, (B, T))).astype(np.float32)
    beh = (logp + scale * rng.normal(size=(B, T))).astype(np.float32)
    adv = rng.normal(size=(B, T)).astype(np.float32)
    mask = (rng.random((B, T)) < mask_p).astype(np.float32)
    mask[0, :] = 0.0  # one response entirely padding
    out = dict(logp=logp, behavior_logp=beh, advantages=adv, mask=mask)
    if with_old:
        out["old_logp"] = (logp + 0.5 * scale * rng.normal(size=(B, T))).astype(np.float32)
    if with_ref:
        out["ref_logp"] = (logp + scale * rng.normal(size=(B, T))).astype(np.float32)
    if with_fresh:  # drawn last: the other arrays do not depend on it
        out["fresh_mask"] = (rng.random((B, T)) < 0.6).astype(np.float32)
    return out


def _value_and_grad(
    logp, behavior_logp, advantages, mask, old_logp, ref_logp, sat_q, fresh_mask, *, cfg
):
    def f(lp):
        return objectives.policy_loss(
            lp,
            behavior_logp,
            advantages,
            mask,
            cfg,
            old_logp=old_logp,
            ref_logp=ref_logp,
            sat_q=sat_q,
            fresh_mask=fresh_mask,
        )

    (loss, metrics), grad = jax.value_and_grad(f, has_aux=True)(logp)
    return loss, metrics, grad


# One jitted program per (config, shapes), cached across tests of a worker.
_jitted_value_and_grad = jax.jit(_value_and_grad, static_argnames=("cfg",))


def loss_and_grad(batch, cfg, jit=True, sat_q=None):
    """(loss, metrics, d loss / d logp); jit=False runs op by op."""
    args = {k: jnp.asarray(v) for k, v in batch.items()}
    fn = _jitted_value_and_grad if jit else _value_and_grad
    return fn(
        args["logp"],
        args["behavior_logp"],
        args["advantages"],
        args["mask"],
        args.get("old_logp"),
        args.get("ref_logp"),
        sat_q,
        args.get("fresh_mask"),
        cfg=cfg,
    )


SAT = SATConfig(enabled=True, quantile=0.9, exponent=2.0)
CONFIGS = {
    "ppo": PolicyLossConfig(),
    "ppo_seqmean": PolicyLossConfig(loss_agg="seq_mean_token_mean"),
    "clip_higher": PolicyLossConfig(clip_low=0.2, clip_high=0.28),
    "sat": PolicyLossConfig(sat=SAT),
    "sat_p3_q75": PolicyLossConfig(sat=SATConfig(quantile=0.75, exponent=3.0)),
    "sat_seqmean": PolicyLossConfig(sat=SAT, loss_agg="seq_mean_token_mean"),
    "gspo": PolicyLossConfig(ratio_level="sequence", clip_low=3e-4, clip_high=4e-4),
    "gspo_sat": PolicyLossConfig(ratio_level="sequence", sat=SAT, loss_agg="seq_mean_token_mean"),
    "dual_clip": PolicyLossConfig(dual_clip=1.5),
    "sat_dual": PolicyLossConfig(sat=SAT, dual_clip=2.0),
    "tis": PolicyLossConfig(tis_cap=1.2),
    "icepop": PolicyLossConfig(icepop_range=(0.8, 1.25)),
    "seq_tis": PolicyLossConfig(seq_tis_cap=1.5),
    "seq_mask_seqmean": PolicyLossConfig(seq_mask_range=(0.9, 1.1), loss_agg="seq_mean_token_mean"),
    "sat_seq_tis_mask": PolicyLossConfig(sat=SAT, seq_tis_cap=2.0, seq_mask_range=(0.85, 1.15)),
    "dppo_tv": PolicyLossConfig(dppo_tv_delta=0.05),
    "kl_k1": PolicyLossConfig(kl_coef=0.1, kl_estimator="k1"),
    "kl_k2": PolicyLossConfig(kl_coef=0.1, kl_estimator="k2"),
    "kl_k3": PolicyLossConfig(kl_coef=0.1, kl_estimator="k3", sat=SAT),
    "everything": PolicyLossConfig(
        sat=SAT,
        dual_clip=3.0,
        tis_cap=2.0,
        dppo_tv_delta=0.1,
        kl_coef=0.05,
        loss_agg="seq_mean_token_mean",
    ),
    "m2po": PolicyLossConfig(m2_threshold=0.04),
    "m2po_sat_seqmean": PolicyLossConfig(m2_threshold=0.1, sat=SAT, loss_agg="seq_mean_token_mean"),
    "m2po_gspo": PolicyLossConfig(ratio_level="sequence", m2_threshold=0.1),
    "vcpo": PolicyLossConfig(ess_scaling=True),
}


def assert_microbatches_merge_to_full(b, cfg, terms, n_micro):
    """Checks that ``terms(logp, rows)`` over ``n_micro`` row microbatches of the 8-row batch
    ``b``, merged, give the full batch's loss, gradient (Σ of the microbatches' d loss_sum /
    merged loss_count) and every metric to float32 rounding (rtol 1e-6); returns the metrics."""
    full_loss, full_metrics, full_grad = loss_and_grad(b, cfg)
    parts = [slice(i, i + 8 // n_micro) for i in range(0, 8, 8 // n_micro)]
    merged = functools.reduce(lambda x, y: x.merge(y), (terms(b["logp"], s) for s in parts))
    grad = sum(jax.grad(lambda lp, s=s: terms(lp, s).loss_sum)(b["logp"]) for s in parts)
    loss, metrics = merged.reduce()
    np.testing.assert_allclose(loss, full_loss, rtol=1e-6)
    np.testing.assert_allclose(grad / merged.loss_count, full_grad, rtol=1e-6, atol=1e-9)
    assert set(metrics) == set(full_metrics)
    for k in full_metrics:
        np.testing.assert_allclose(metrics[k], full_metrics[k], rtol=1e-6, atol=1e-9, err_msg=k)
    return metrics


def needs(cfg):
    return dict(
        with_old=cfg.tis_cap is not None
        or cfg.icepop_range is not None
        or cfg.seq_tis_cap is not None
        or cfg.seq_mask_range is not None
        or cfg.dppo_tv_delta is not None,
        with_ref=cfg.kl_coef > 0,
    )


def assert_matches_reference(batch, cfg):
    loss, metrics, grad = loss_and_grad(batch, cfg)
    ref_loss, ref_metrics, ref_grad = reference_policy_loss(**batch, cfg=cfg)
    np.testing.assert_allclose(loss, ref_loss, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(grad, ref_grad, rtol=RTOL, atol=ATOL)
    assert set(metrics) == set(ref_metrics), set(metrics) ^ set(ref_metrics)
    for k, v in ref_metrics.items():
        np.testing.assert_allclose(metrics[k], v, rtol=RTOL, atol=ATOL, err_msg=k)
    return metrics


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("seed", [0, 1])
def test_matches_float64_reference(name, seed):
    cfg = CONFIGS[name]
    scale = 2e-3 if cfg.ratio_level == "sequence" and not cfg.sat.enabled else 0.4
    batch = make_batch(seed, scale=scale, with_fresh=seed == 1, **needs(cfg))
    metrics = assert_matches_reference(batch, cfg)
    if cfg.sat.enabled:  # at most the tail above the quantile fires
        assert float(metrics["sat_gate_rate"]) <= 1.0 - cfg.sat.quantile + 1e-6
    if cfg.sat.enabled and cfg.ratio_level == "token":
        assert float(metrics["sat_gate_rate"]) > 0.0 and float(metrics["sat_c_min"]) < 1.0


def test_spec_contract_call_verbatim():
    b = make_batch(3)
    cfg = objectives.PolicyLossConfig(
        ratio_level="token",
        clip_low=0.2,
        clip_high=0.2,
        loss_agg="token_mean",
        sat=objectives.SATConfig(enabled=True, quantile=0.9, exponent=2.0),
    )
    loss, metrics = objectives.policy_loss(
        b["logp"], b["behavior_logp"], b["advantages"], b["mask"], cfg, old_logp=None, ref_logp=None
    )
    assert loss.shape == () and loss.dtype == jnp.float32
    assert set(REQUIRED_METRICS) <= set(metrics)
    assert all(jnp.shape(v) == () for v in metrics.values())


def test_clip_fractions_and_mismatch_by_hand():
    # Token 0: A>0, r=e^0.5 > 1.2 → clipped high. Token 1: A<0, r=e^-0.5 < 0.8 → clipped low.
    # Token 2: A>0, r=e^-0.5 → pull-back, not clipped. Token 3 inactive.
    logp = jnp.array([[0.5, -0.5, -0.5, 9.0]]) - 1.0
    beh = jnp.full((1, 4), -1.0)
    adv = jnp.array([[1.0, -1.0, 1.0, 1.0]])
    mask = jnp.array([[1.0, 1.0, 1.0, 0.0]])
    _, m = objectives.policy_loss(logp, beh, adv, mask, PolicyLossConfig())
    np.testing.assert_allclose(m["clip_frac_high"], 1 / 3, rtol=1e-6)
    np.testing.assert_allclose(m["clip_frac_low"], 1 / 3, rtol=1e-6)
    np.testing.assert_allclose(m["mismatch_abs_mean"], 0.5, rtol=1e-6)
    np.testing.assert_allclose(
        m["kl_k3"], np.mean([np.exp(x) - 1 - x for x in (0.5, -0.5, -0.5)]), rtol=1e-6
    )
    np.testing.assert_allclose(m["active_tokens"], 3.0)


# ------------------------------------------------------------------------------------------
# SAT properties (docs/DESIGN.md §3.3).
# ------------------------------------------------------------------------------------------


def per_token(batch, cfg):
    """Per-token loss and its per-token gradient (token level: token t depends on logp_t only)."""
    args = {k: jnp.asarray(v) for k, v in batch.items()}
    d = args["logp"] - args["behavior_logp"]
    if cfg.sat.enabled:
        fn = lambda lp: objectives.sat_clipped_surrogate_loss(
            lp - args["behavior_logp"],
            args["advantages"],
            clip_low=cfg.clip_low,
            clip_high=cfg.clip_high,
            quantile=cfg.sat.quantile,
            exponent=cfg.sat.exponent,
            where=args["mask"],
        )
    else:
        fn = lambda lp: objectives.clipped_surrogate_loss(
            jnp.exp(lp - args["behavior_logp"]),
            args["advantages"],
            clip_low=cfg.clip_low,
            clip_high=cfg.clip_high,
            where=args["mask"],
        )
    value = fn(args["logp"])
    grad = jax.grad(lambda lp: jnp.sum(fn(lp)))(args["logp"])
    return np.asarray(value, np.float64), np.asarray(grad, np.float64), np.asarray(d)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**31 - 1),
    scale=st.floats(0.01, 3.0),
    quantile=st.floats(0.05, 1.0),
    exponent=st.floats(0.5, 4.0),
    eps=st.tuples(st.floats(0.0, 0.5), st.floats(0.0, 1.0)),
)
def test_sat_properties(seed, scale, quantile, exponent, eps):
    batch = make_batch(seed, B=5, T=9, scale=scale)
    batch.pop("old_logp", None)
    sat_cfg = PolicyLossConfig(
        clip_low=eps[0], clip_high=eps[1], sat=SATConfig(quantile=quantile, exponent=exponent)
    )
    ppo_cfg = dataclasses.replace(sat_cfg, sat=SATConfig(enabled=False))
    loss_sat, g_sat, d = per_token(batch, sat_cfg)
    loss_ppo, g_ppo, _ = per_token(batch, ppo_cfg)
    act = batch["mask"] > 0
    a = batch["advantages"].astype(np.float64)
    r = np.exp(d.astype(np.float64))

    # Pessimism: S_SAT ≤ S_PPO, i.e. loss_SAT ≥ loss_PPO, token by token.
    assert np.all(loss_sat >= loss_ppo - 1e-6 * (1 + np.abs(loss_ppo)))

    # Interval containment and one-sidedness of the contraction.
    q = objectives.masked_quantile(np.abs(d), quantile, where=batch["mask"])
    c_low, c_high = (np.asarray(c) for c in objectives.sat_contraction(d, q, exponent=exponent))
    assert np.all((c_low > 0) & (c_low <= 1) & (c_high > 0) & (c_high <= 1))
    assert np.all(c_low[d >= 0] == 1.0) and np.all(c_high[d <= 0] == 1.0)
    gate = (float(q) > 0) & (np.abs(d) > float(q))
    assert np.all(c_low[~gate] == 1.0) and np.all(c_high[~gate] == 1.0)
    np.testing.assert_allclose(float(q), quantile_inverted_cdf(np.abs(d)[act], quantile))

    # Gradients differ only on the newly clipped outward bands.
    e_lo, e_hi = eps[0] * c_low, eps[1] * c_high
    band = ((a > 0) & (1 + e_hi < r) & (r < 1 + eps[1])) | (
        (a < 0) & (1 - eps[0] < r) & (r < 1 - e_lo)
    )
    differs = ~np.isclose(g_sat, g_ppo, rtol=1e-6, atol=1e-7)
    assert not np.any(differs & ~band & act)
    assert np.all(g_sat[band & act] == 0.0)
    # The pull-back branch always keeps its gradient −A·r (of the loss −S).
    pull_back = act & (a * (r - 1) < 0)
    np.testing.assert_allclose(g_sat[pull_back], -(a * r)[pull_back], rtol=1e-5, atol=1e-7)


def test_sat_gate_is_strict_at_ties():
    # |d| = [0.1, 0.2, 0.3, 0.3, 0.3]; quantile 0.5 → rank 3 → q = 0.3: nothing is strictly above.
    d = jnp.array([[0.1, -0.2, 0.3, -0.3, 0.3]])
    q = objectives.masked_quantile(jnp.abs(d), 0.5)
    assert float(q) == np.float32(0.3)
    c_low, c_high = objectives.sat_contraction(d, q)
    assert np.all(np.asarray(c_low) == 1.0) and np.all(np.asarray(c_high) == 1.0)
    # quantile 0.2 → rank 1 → q = 0.1: every |d| > 0.1 fires, on its own side only.
    q = objectives.masked_quantile(jnp.abs(d), 0.2)
    c_low, c_high = objectives.sat_contraction(d, q)
    np.testing.assert_allclose(c_high, [[1.0, 1.0, 1 / (1 + 9.0), 1.0, 1 / (1 + 9.0)]], rtol=1e-6)
    np.testing.assert_allclose(c_low, [[1.0, 1 / (1 + 4.0), 1.0, 1 / (1 + 9.0), 1.0]], rtol=1e-6)


@pytest.mark.parametrize(
    "d,mask",
    [
        ([[0.7]], [[1.0]]),  # one active token: q = |d| and the strict gate never fires
        ([[0.0, 0.0, 0.0]], [[1.0, 1.0, 1.0]]),  # all |d| = 0: q = 0 and the q > 0 guard holds
        ([[0.5, 2.0, 0.0]], [[0.0, 1.0, 0.0]]),  # one active token among padding
    ],
)
def test_sat_degenerate_quantiles_do_not_fire(d, mask):
    d, mask = jnp.asarray(d), jnp.asarray(mask)
    batch = dict(
        logp=d - 1.0, behavior_logp=jnp.full(d.shape, -1.0), advantages=jnp.ones(d.shape), mask=mask
    )
    sat = PolicyLossConfig(sat=SAT)
    (l_sat, m_sat, g_sat), (l_ppo, _, g_ppo) = (
        loss_and_grad(batch, sat),
        loss_and_grad(batch, PolicyLossConfig()),
    )
    assert float(m_sat["sat_gate_rate"]) == 0.0 and float(m_sat["sat_c_min"]) == 1.0
    assert float(l_sat) == float(l_ppo) and np.array_equal(g_sat, g_ppo)


def test_sat_is_detached():
    # The gradient of the SAT loss equals that of PPO run with ε̃ fed in as constants.
    b = {k: jnp.asarray(v) for k, v in make_batch(5, scale=0.8).items()}
    d = b["logp"] - b["behavior_logp"]
    q = objectives.masked_quantile(jnp.abs(d), 0.9, where=b["mask"])
    c_low, c_high = objectives.sat_contraction(d, q)
    fixed = lambda lp: jnp.sum(
        objectives.clipped_surrogate_loss(
            jnp.exp(lp - b["behavior_logp"]),
            b["advantages"],
            clip_low=0.2 * c_low,
            clip_high=0.2 * c_high,
            where=b["mask"],
        )
    )
    sat = lambda lp: jnp.sum(
        objectives.sat_clipped_surrogate_loss(
            lp - b["behavior_logp"], b["advantages"], where=b["mask"]
        )
    )
    np.testing.assert_allclose(jax.grad(sat)(b["logp"]), jax.grad(fixed)(b["logp"]), rtol=1e-6)
    assert (
        float(jnp.max(jnp.abs(jax.grad(lambda x: jnp.sum(objectives.sat_contraction(x, q)[1]))(d))))
        == 0.0
    )


# ------------------------------------------------------------------------------------------
# Disabled or neutral options are bit-identical to the base.
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "option",
    [
        dict(sat=SATConfig(quantile=1.0)),  # q = max |d|: the strict gate never fires
        dict(tis_cap=1e30),  # old_logp == behavior_logp → w = 1
        dict(icepop_range=(0.0, 1e30)),
        dict(dppo_tv_delta=1.0),  # |p − p_old| ≤ 1 never exceeds δ = 1
        dict(kl_coef=0.0),  # ref_logp given, coefficient 0
        dict(seq_tis_cap=1e30),  # old_logp == behavior_logp → Σ = 0 → w_b = 1
        dict(seq_mask_range=(0.0, 1e30)),  # g_b = 1 is kept
    ],
    ids=["sat_q1", "tis", "icepop", "dppo_tv", "kl0", "seq_tis", "seq_mask"],
)
@pytest.mark.parametrize("base_name", ["ppo", "gspo", "ppo_seqmean"])
def test_neutral_options_are_bit_identical(option, base_name):
    base = CONFIGS[base_name]
    batch = make_batch(7)
    batch["old_logp"] = batch["behavior_logp"]
    batch["ref_logp"] = batch["logp"] - 0.1
    cfg = dataclasses.replace(base, **option)
    # Op by op every value is bit-identical. Under jit the two configs are two XLA programs that may
    # fuse (and so order) the final sums differently: equal to float32 rounding there.
    loss0, m0, g0 = loss_and_grad(batch, base, jit=False)
    loss1, m1, g1 = loss_and_grad(batch, cfg, jit=False)
    assert np.array_equal(loss0, loss1) and np.array_equal(g0, g1)
    for k in m0:
        if k != "sat_q":  # reports the threshold that SAT now computes
            assert np.array_equal(m0[k], m1[k]), k
    jit0, jit1 = loss_and_grad(batch, base), loss_and_grad(batch, cfg)
    np.testing.assert_allclose(jit0[0], jit1[0], rtol=1e-6)
    np.testing.assert_allclose(jit0[2], jit1[2], rtol=1e-6)


def test_sat_disabled_is_the_plain_ppo_kernel():
    b = {k: jnp.asarray(v) for k, v in make_batch(8).items()}
    loss, metrics, grad = loss_and_grad(b, PolicyLossConfig(sat=SATConfig(enabled=False)))
    direct = lambda lp: (
        jnp.sum(
            objectives.clipped_surrogate_loss(
                jnp.exp(lp - b["behavior_logp"]), b["advantages"], where=b["mask"]
            )
        )
        / jnp.sum(b["mask"])
    )
    np.testing.assert_allclose(loss, direct(b["logp"]), rtol=1e-6)
    np.testing.assert_allclose(grad, jax.grad(direct)(b["logp"]), rtol=1e-6)
    assert float(metrics["sat_q"]) == 0.0 and float(metrics["sat_gate_rate"]) == 0.0
    assert float(metrics["sat_eps_low_mean"]) == np.float32(0.2)


# ------------------------------------------------------------------------------------------
# Numerics: extremes, padding, jit, microbatches.
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["ppo", "sat", "gspo_sat", "everything", "kl_k3", "icepop"])
@pytest.mark.parametrize("extreme", [80.0, -80.0])
def test_extreme_log_ratios_stay_finite(name, extreme):
    cfg = CONFIGS[name]
    batch = make_batch(9, with_old=True, with_ref=True)
    batch["logp"] = batch["logp"].copy()
    batch["logp"][1:, ::2] = np.clip(batch["behavior_logp"][1:, ::2] + extreme, -200, 0)
    batch["behavior_logp"][1:, 1::3] = batch["logp"][1:, 1::3] - extreme
    batch["ref_logp"][1:, ::3] = batch["logp"][1:, ::3] + extreme
    batch["old_logp"][1:, 1::2] = batch["logp"][1:, 1::2] - extreme
    loss, metrics, grad = loss_and_grad(batch, cfg)
    assert np.isfinite(loss) and np.all(np.isfinite(grad))
    assert all(np.isfinite(v) for v in metrics.values())


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_all_padding_batch_is_zero_and_finite(name):
    cfg = CONFIGS[name]
    B, T = 3, 5
    batch = dict(
        logp=np.full((B, T), -np.inf, np.float32),  # garbage in the padding must not leak
        behavior_logp=np.full((B, T), np.nan, np.float32),
        advantages=np.full((B, T), np.nan, np.float32),
        mask=np.zeros((B, T), np.float32),
        old_logp=np.full((B, T), -np.inf, np.float32),
        ref_logp=np.full((B, T), np.nan, np.float32),
    )
    batch["logp"][0, 0] = np.nan
    loss, metrics, grad = loss_and_grad(batch, cfg)
    assert float(loss) == 0.0
    assert np.array_equal(grad, np.zeros((B, T)))
    assert all(np.isfinite(v) for v in metrics.values())
    assert float(metrics["active_tokens"]) == 0.0


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_jit_matches_eager(name):
    cfg = CONFIGS[name]
    batch = make_batch(11, **needs(cfg))
    l0, m0, g0 = loss_and_grad(batch, cfg, jit=False)
    l1, m1, g1 = loss_and_grad(batch, cfg, jit=True)
    np.testing.assert_allclose(l0, l1, rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(g0, g1, rtol=1e-6, atol=1e-8)
    for k in m0:
        np.testing.assert_allclose(m0[k], m1[k], rtol=1e-6, atol=1e-8, err_msg=k)


MICROBATCH_CONFIGS = {
    "ppo_dual": PolicyLossConfig(dual_clip=2.0),
    "ppo_dual_seqmean": PolicyLossConfig(dual_clip=2.0, loss_agg="seq_mean_token_mean"),
    "gspo_dual": PolicyLossConfig(ratio_level="sequence", dual_clip=2.0),
    "sat": CONFIGS["sat"],
    "sat_seqmean": CONFIGS["sat_seqmean"],
    "gspo_sat": CONFIGS["gspo_sat"],
    "gspo_sat_token_mean": PolicyLossConfig(ratio_level="sequence", sat=SAT),
    "everything": CONFIGS["everything"],
    "seq_tis_mask": PolicyLossConfig(seq_tis_cap=2.0, seq_mask_range=(0.9, 1.1)),
    "gspo_sat_seq_seqmean": PolicyLossConfig(
        ratio_level="sequence",
        sat=SAT,
        seq_tis_cap=2.0,
        seq_mask_range=(0.9, 1.1),
        loss_agg="seq_mean_token_mean",
    ),
}


@pytest.mark.parametrize("n_micro", [2, 4])
@pytest.mark.parametrize("name", sorted(MICROBATCH_CONFIGS))
def test_microbatches_with_the_batch_threshold_merge_to_full_batch(name, n_micro):
    """Row microbatches given the full batch's q (sat_threshold) merge to the full batch.

    Loss, gradient (Σ of the microbatches' d loss_sum / merged loss_count) and every metric agree
    to float32 rounding of the reordered sums (rtol 1e-6); ``sat_q`` is the shared q.
    """
    cfg = MICROBATCH_CONFIGS[name]
    batch = make_batch(12, B=8, with_old=True, with_ref=True, with_fresh=True)
    b = {k: jnp.asarray(v) for k, v in batch.items()}
    extra = {k: b[k] for k in ("old_logp", "ref_logp", "fresh_mask")}
    q = objectives.sat_threshold(
        b["logp"], b["behavior_logp"], b["mask"], cfg, old_logp=b["old_logp"]
    )

    def terms(lp, rows):
        return objectives.policy_loss_terms(
            lp[rows],
            b["behavior_logp"][rows],
            b["advantages"][rows],
            b["mask"][rows],
            cfg,
            **{k: v[rows] for k, v in extra.items()},
            sat_q=q,
        )

    metrics = assert_microbatches_merge_to_full(b, cfg, terms, n_micro)
    assert float(metrics["sat_q"]) == pytest.approx(float(q), rel=1e-6)


# ------------------------------------------------------------------------------------------
# The batch threshold: sat_threshold and sat_q.
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("with_old", [False, True])
@pytest.mark.parametrize("name", ["sat", "sat_p3_q75", "gspo_sat", "everything"])
def test_sat_threshold_is_the_reference_quantile(name, with_old):
    cfg = CONFIGS[name]
    batch = make_batch(14, with_old=with_old or cfg.tis_cap is not None, with_ref=True)
    _, ref_metrics, _ = reference_policy_loss(**batch, cfg=cfg)
    q = objectives.sat_threshold(
        batch["logp"], batch["behavior_logp"], batch["mask"], cfg, old_logp=batch.get("old_logp")
    )
    assert q.shape == () and q.dtype == jnp.float32
    np.testing.assert_allclose(q, ref_metrics["sat_q"], rtol=RTOL, atol=ATOL)
    if cfg.ratio_level == "token":  # d = logp − old_logp rounds alike; q is a selection, exact
        assert float(q) == np.float32(ref_metrics["sat_q"])
    grad = jax.grad(
        lambda lp: objectives.sat_threshold(lp, batch["behavior_logp"], batch["mask"], cfg)
    )(jnp.asarray(batch["logp"]))
    assert np.all(np.asarray(grad) == 0.0)


def test_sat_threshold_without_sat_or_tokens_is_zero():
    b = make_batch(15)
    off = objectives.sat_threshold(b["logp"], b["behavior_logp"], b["mask"], PolicyLossConfig())
    empty = objectives.sat_threshold(
        b["logp"], b["behavior_logp"], np.zeros_like(b["mask"]), CONFIGS["sat"]
    )
    assert float(off) == 0.0 and float(empty) == 0.0
    with pytest.raises(ValueError, match="shape"):
        objectives.sat_threshold(b["logp"], b["behavior_logp"][:, :3], b["mask"], CONFIGS["sat"])


@pytest.mark.parametrize("name", ["sat", "gspo_sat"])
def test_sat_threshold_checks_old_logp_as_policy_loss_does(name):
    """old_logp does not move q (d_SAT is against the sampler; the reference test above and the
    decoupled-PPO test below check the value) but it is not ignored: a call passes the loss's
    arguments, and an old_logp of the wrong shape is the same error in both."""
    b = make_batch(16, with_old=True)
    cfg = CONFIGS[name]
    q = objectives.sat_threshold(
        b["logp"], b["behavior_logp"], b["mask"], cfg, old_logp=b["old_logp"]
    )
    _, metrics = objectives.policy_loss(
        b["logp"], b["behavior_logp"], b["advantages"], b["mask"], cfg, old_logp=b["old_logp"]
    )
    assert float(q) == float(metrics["sat_q"])
    bad = b["old_logp"][:, :3]
    with pytest.raises(ValueError, match="old_logp"):
        objectives.sat_threshold(b["logp"], b["behavior_logp"], b["mask"], cfg, old_logp=bad)
    with pytest.raises(ValueError, match="old_logp"):
        objectives.policy_loss(
            b["logp"], b["behavior_logp"], b["advantages"], b["mask"], cfg, old_logp=bad
        )


@pytest.mark.parametrize("jit", [True, False])
@pytest.mark.parametrize(
    "name", ["sat", "sat_p3_q75", "sat_dual", "gspo_sat", "kl_k3", "everything"]
)
def test_given_batch_threshold_is_bit_identical(name, jit):
    """policy_loss(..., sat_q=sat_threshold(...)) is policy_loss(...), bit for bit."""
    cfg = CONFIGS[name]
    batch = make_batch(16, **needs(cfg))
    q = objectives.sat_threshold(
        batch["logp"], batch["behavior_logp"], batch["mask"], cfg, old_logp=batch.get("old_logp")
    )
    loss0, m0, g0 = loss_and_grad(batch, cfg, jit=jit)
    loss1, m1, g1 = loss_and_grad(batch, cfg, jit=jit, sat_q=q)
    assert np.array_equal(loss0, loss1) and np.array_equal(g0, g1)
    assert set(m0) == set(m1)
    for k in m0:
        assert np.array_equal(m0[k], m1[k]), k


def test_sat_q_is_ignored_without_sat():
    """sat_threshold gives 0 when SAT is off, so callers may pass sat_q unconditionally."""
    batch = make_batch(17)
    cfg = PolicyLossConfig()
    loss0, m0, g0 = loss_and_grad(batch, cfg, jit=False)
    loss1, m1, g1 = loss_and_grad(batch, cfg, jit=False, sat_q=jnp.float32(0.3))
    assert np.array_equal(loss0, loss1) and np.array_equal(g0, g1)
    assert all(np.array_equal(m0[k], m1[k]) for k in m0) and float(m1["sat_q"]) == 0.0


def test_sat_q_replaces_the_computed_threshold():
    batch = make_batch(18, scale=0.8)
    sat, ppo = CONFIGS["sat"], PolicyLossConfig()
    # A threshold above every |d|: the strict gate never fires and SAT is PPO.
    loss, metrics, grad = loss_and_grad(batch, sat, sat_q=jnp.float32(1e30))
    loss_ppo, _, grad_ppo = loss_and_grad(batch, ppo)
    np.testing.assert_allclose(loss, loss_ppo, rtol=1e-6)
    np.testing.assert_allclose(grad, grad_ppo, rtol=1e-6)
    assert float(metrics["sat_q"]) == np.float32(1e30) and float(metrics["sat_gate_rate"]) == 0.0
    # A smaller threshold than the batch's contracts more tokens.
    q = objectives.sat_threshold(batch["logp"], batch["behavior_logp"], batch["mask"], sat)
    _, m_half, _ = loss_and_grad(batch, sat, sat_q=q / 2)
    _, m_batch, _ = loss_and_grad(batch, sat)
    assert float(m_half["sat_gate_rate"]) > float(m_batch["sat_gate_rate"])
    with pytest.raises(ValueError, match="sat_q"):
        objectives.policy_loss(
            batch["logp"],
            batch["behavior_logp"],
            batch["advantages"],
            batch["mask"],
            sat,
            sat_q=jnp.ones(2),
        )


def test_old_and_ref_logp_are_keyword_only():
    b = make_batch(19, with_old=True)
    args = (b["logp"], b["behavior_logp"], b["advantages"], b["mask"], PolicyLossConfig())
    for fn in (objectives.policy_loss, objectives.policy_loss_terms):
        with pytest.raises(TypeError):
            fn(*args, b["old_logp"])


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    B=st.integers(1, 5),
    T=st.integers(1, 9),
    seed=st.integers(0, 2**31 - 1),
    mask_p=st.sampled_from([0.0, 0.3, 1.0]),
    name=st.sampled_from(sorted(CONFIGS)),
)
def test_hypothesis_shapes_and_masks(B, T, seed, mask_p, name):
    cfg = CONFIGS[name]
    batch = make_batch(seed, B=B, T=T, mask_p=mask_p, **needs(cfg))
    ref_loss, ref_metrics, ref_grad = reference_policy_loss(**batch, cfg=cfg)
    # Padded to one [5, 9] shape (one compilation per config): padding must change nothing.
    padded = {k: np.pad(v, ((0, 5 - B), (0, 9 - T))) for k, v in batch.items()}
    loss, metrics, grad = loss_and_grad(padded, cfg)
    np.testing.assert_allclose(loss, ref_loss, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(grad[:B, :T], ref_grad, rtol=RTOL, atol=ATOL)
    assert np.all(np.asarray(grad)[B:] == 0) and np.all(np.asarray(grad)[:, T:] == 0)
    for k, v in ref_metrics.items():
        np.testing.assert_allclose(metrics[k], v, rtol=RTOL, atol=ATOL, err_msg=k)


# ------------------------------------------------------------------------------------------
# The quantile kernel and config validation.
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("level", [0.01, 0.1, 0.25, 0.3, 0.5, 0.7, 0.9, 0.95, 0.999, 1.0])
@pytest.mark.parametrize("n", [1, 2, 3, 7, 10, 100, 1001])
def test_quantile_matches_numpy_inverted_cdf(level, n):
    rng = np.random.default_rng(n)
    x = np.concatenate([rng.normal(size=n), rng.normal(size=5)]).astype(np.float32)
    x[: n // 3] = x[0]  # ties
    mask = np.r_[np.ones(n), np.zeros(5)]
    got = objectives.masked_quantile(x, level, where=mask)
    want = np.quantile(x[:n].astype(np.float64), level, method="inverted_cdf")
    assert float(got) == np.float32(want)


def test_quantile_special_values():
    x = jnp.array([np.inf, -0.0, 0.0, -np.inf, 1e-45, -3.5, 7e37], jnp.float32)
    for level in (0.1, 0.3, 0.5, 0.8, 1.0):
        want = np.quantile(np.asarray(x, np.float64), level, method="inverted_cdf")
        assert float(objectives.masked_quantile(x, level)) == want
    assert float(objectives.masked_quantile(x, 0.5, where=jnp.zeros(7))) == 0.0
    with pytest.raises(ValueError, match="level"):
        objectives.masked_quantile(x, 0.0)


@pytest.mark.parametrize(
    "kwargs,field",
    [
        (dict(ratio_level="tokens"), "ratio_level"),
        (dict(loss_agg="mean"), "loss_agg"),
        (dict(clip_low=1.0), "clip_low"),
        (dict(clip_high=-0.1), "clip_high"),
        (dict(dual_clip=1.0), "dual_clip"),
        (dict(tis_cap=0.0), "tis_cap"),
        (dict(icepop_range=(2.0, 1.0)), "icepop_range"),
        (dict(seq_tis_cap=0.0), "seq_tis_cap"),
        (dict(seq_tis_cap=-2.0), "seq_tis_cap"),
        (dict(seq_mask_range=(2.0, 1.0)), "seq_mask_range"),
        (dict(seq_mask_range=(-0.5, 1.0)), "seq_mask_range"),
        (dict(seq_mask_range=(0.5, 1.0, 2.0)), "seq_mask_range"),
        (dict(dppo_tv_delta=-1.0), "dppo_tv_delta"),
        (dict(kl_coef=-1.0), "kl_coef"),
        (dict(kl_estimator="k4"), "kl_estimator"),
        (dict(log_ratio_clamp=0.0), "log_ratio_clamp"),
        (dict(sat={"enabled": True}), "sat"),
    ],
)
def test_config_validation_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        PolicyLossConfig(**kwargs)


@pytest.mark.parametrize(
    "kwargs,field",
    [
        (dict(quantile=0.0), "quantile"),
        (dict(quantile=1.5), "quantile"),
        (dict(exponent=0.0), "exponent"),
    ],
)
def test_sat_config_validation(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SATConfig(**kwargs)


def test_missing_inputs_are_named():
    b = make_batch(0)
    with pytest.raises(ValueError, match="tis_cap.*old_logp"):
        objectives.policy_loss(
            b["logp"], b["behavior_logp"], b["advantages"], b["mask"], PolicyLossConfig(tis_cap=2.0)
        )
    for option in (dict(seq_tis_cap=2.0), dict(seq_mask_range=(0.5, 2.0))):
        (name,) = option
        with pytest.raises(ValueError, match=f"{name} is set but old_logp"):
            objectives.policy_loss(
                b["logp"],
                b["behavior_logp"],
                b["advantages"],
                b["mask"],
                PolicyLossConfig(**option),
            )
    with pytest.raises(ValueError, match="ref_logp"):
        objectives.policy_loss(
            b["logp"], b["behavior_logp"], b["advantages"], b["mask"], PolicyLossConfig(kl_coef=0.1)
        )
    with pytest.raises(ValueError, match="fresh_mask.*shape"):
        objectives.policy_loss(
            b["logp"],
            b["behavior_logp"],
            b["advantages"],
            b["mask"],
            PolicyLossConfig(),
            fresh_mask=b["mask"][:, :3],
        )
    with pytest.raises(ValueError, match="shape"):
        objectives.policy_loss(
            b["logp"], b["behavior_logp"][:, :3], b["advantages"], b["mask"], PolicyLossConfig()
        )


@pytest.mark.parametrize("level", [0.1, 0.5, 0.9, 1.0])
def test_quantile_counts_equal_repetition(level):
    rng = np.random.default_rng(4)
    x = rng.normal(size=12).astype(np.float32)
    counts = rng.integers(0, 5, size=12)
    got = objectives.masked_quantile(x, level, counts=counts)
    want = np.quantile(np.repeat(x, counts).astype(np.float64), level, method="inverted_cdf")
    assert float(got) == np.float32(want)


def test_sequence_log_ratio_is_the_masked_row_mean():
    d = jnp.array([[1.0, 2.0, 30.0], [4.0, -4.0, 1.0], [5.0, 5.0, 5.0]])
    mask = jnp.array([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    want = np.array([[1.5] * 3, [1 / 3] * 3, [0.0] * 3])
    np.testing.assert_allclose(objectives.sequence_log_ratio(d, where=mask), want, rtol=1e-6)
    grad = jax.grad(lambda x: jnp.sum(objectives.sequence_log_ratio(x, where=mask)[:, 0]))(d)
    np.testing.assert_allclose(grad, [[0.5, 0.5, 0.0], [1 / 3] * 3, [0.0] * 3], rtol=1e-6)
    kept = objectives.sequence_log_ratio(d, where=mask, keepdims=True)
    assert kept.shape == (3, 1)
    np.testing.assert_array_equal(kept[:, 0], objectives.sequence_log_ratio(d, where=mask)[:, 0])


# ------------------------------------------------------------------------------------------
# Sequence-level rollout corrections (sequence TIS, MIS masking), SAT's d_SAT, sampler_kl.
# ------------------------------------------------------------------------------------------


def make_decoupled_batch(seed, B=8, T=10, ratio_scale=0.2, mismatch_scale=0.4, mask_p=0.8):
    """A decoupled-PPO batch: old_logp near logp (a recent proximal policy), behavior_logp far."""
    b = make_batch(seed, B=B, T=T, scale=mismatch_scale, mask_p=mask_p)
    rng = np.random.default_rng(seed + 1000)
    b["old_logp"] = (b["logp"] + ratio_scale * rng.normal(size=(B, T))).astype(np.float32)
    return b


def _sequence_sums(batch):
    """float64 S_b = Σ_t∈active(b) (old − behavior), n_b and the responses with an active token."""
    act = batch["mask"] > 0
    diff = np.asarray(batch["old_logp"], np.float64) - batch["behavior_logp"]
    total = np.where(act, diff, 0.0).sum(axis=1)
    n = act.sum(axis=1)
    return total, n, n > 0


def test_sequence_kernels_match_numpy():
    rng = np.random.default_rng(24)
    old = rng.normal(-1.0, 0.5, (5, 7)).astype(np.float32)
    beh = (old + 0.3 * rng.normal(size=(5, 7))).astype(np.float32)
    mask = (rng.random((5, 7)) < 0.7).astype(np.float32)
    mask[2] = 0.0  # no active token: S = 0, w = min(1, cap), g = 1
    old[mask == 0], beh[mask == 0] = np.nan, -np.inf  # garbage in the padding must not leak
    S, n, _ = _sequence_sums(dict(old_logp=old, behavior_logp=beh, mask=mask))

    w = objectives.sequence_importance_weights(old, beh, cap=1.2, where=mask)
    want = np.minimum(np.exp(S), 1.2)
    assert 0 < np.sum(want == 1.2) < 5  # some capped, some not
    np.testing.assert_allclose(w, np.broadcast_to(want[:, None], (5, 7)), rtol=1e-6)
    kept = objectives.sequence_importance_weights(old, beh, cap=1.2, where=mask, keepdims=True)
    assert kept.shape == (5, 1)
    np.testing.assert_array_equal(kept[:, 0], w[:, 0])

    masked = objectives.geometric_mean_mask(old, beh, low=0.95, high=1.05, where=mask)
    g = np.exp(S / np.maximum(n, 1))
    want_masked = ~((g >= 0.95) & (g <= 1.05))
    assert 0 < want_masked.sum() < 5
    assert masked.dtype == jnp.bool_
    np.testing.assert_array_equal(masked, np.broadcast_to(want_masked[:, None], (5, 7)))
    assert objectives.geometric_mean_mask(
        old, beh, low=0.9, high=1.1, where=mask, keepdims=True
    ).shape == (
        5,
        1,
    )

    # Detached: no gradient reaches old_logp through either kernel.
    old_j, beh_j = jnp.nan_to_num(jnp.asarray(old)), jnp.nan_to_num(jnp.asarray(beh))
    grad = jax.grad(
        lambda o: jnp.sum(objectives.sequence_importance_weights(o, beh_j, cap=1.2, where=mask))
    )(old_j)
    assert np.all(np.asarray(grad) == 0.0)


@pytest.mark.parametrize("log_k", [100.0, -100.0])
def test_sequence_kernels_do_not_overflow(log_k):
    # Σ = ±1000: exp(Σ) overflows float32 (and float64); the weight is computed as exp(min(Σ, log C)).
    old = jnp.full((2, 10), log_k - 1.0)
    beh = jnp.full((2, 10), -1.0)
    w = objectives.sequence_importance_weights(old, beh, cap=3.0)
    np.testing.assert_allclose(w, 3.0 if log_k > 0 else 0.0, rtol=1e-6)
    assert np.all(np.isfinite(w))
    # g_b = exp(±100) is inf or 0 in float32: outside [0.5, 2], so masked, not NaN.
    assert np.all(np.asarray(objectives.geometric_mean_mask(old, beh, low=0.5, high=2.0)))


SEQ_OPTIONS = {
    "seq_tis": dict(seq_tis_cap=1.5),
    "seq_mask": dict(seq_mask_range=(0.9, 1.1)),
    "both": dict(seq_tis_cap=2.0, seq_mask_range=(0.85, 1.15)),
}


@pytest.mark.parametrize("loss_agg", ["token_mean", "seq_mean_token_mean"])
@pytest.mark.parametrize("ratio_level", ["token", "sequence"])
@pytest.mark.parametrize("option", sorted(SEQ_OPTIONS))
def test_sequence_corrections_match_float64_reference(option, ratio_level, loss_agg):
    gspo = ratio_level == "sequence"
    clips = dict(clip_low=3e-3, clip_high=4e-3) if gspo else {}
    cfg = PolicyLossConfig(
        ratio_level=ratio_level, loss_agg=loss_agg, **clips, **SEQ_OPTIONS[option]
    )
    batch = make_decoupled_batch(20, ratio_scale=5e-3 if gspo else 0.2)
    metrics = assert_matches_reference(batch, cfg)

    # The batch exercises both sides of each correction.
    S, n, responses = _sequence_sums(batch)
    if cfg.seq_tis_cap is not None:
        capped = np.exp(S[responses]) > cfg.seq_tis_cap
        assert 0 < capped.sum() < responses.sum()
        want = np.minimum(np.exp(S[responses]), cfg.seq_tis_cap).mean()
        np.testing.assert_allclose(metrics["seq_tis_weight_mean"], want, rtol=RTOL)
    if cfg.seq_mask_range is not None:
        low, high = cfg.seq_mask_range
        g = np.exp(S / np.maximum(n, 1))
        masked = responses & ~((g >= low) & (g <= high))
        assert 0 < masked.sum() < responses.sum()
        np.testing.assert_allclose(metrics["seq_masked_frac"], masked.sum() / responses.sum())
        _, _, grad = loss_and_grad(batch, cfg)
        assert np.all(np.asarray(grad)[masked] == 0.0)  # masked responses: no gradient
        assert np.any(np.asarray(grad)[responses & ~masked] != 0.0)

    # And it changes the loss and the gradient.
    base = dataclasses.replace(cfg, seq_tis_cap=None, seq_mask_range=None)
    loss0, m0, g0 = loss_and_grad(batch, base)
    loss1, _, g1 = loss_and_grad(batch, cfg)
    assert not np.allclose(g0, g1, rtol=1e-3) and float(loss0) != float(loss1)
    assert "seq_tis_weight_mean" not in m0 and "seq_masked_frac" not in m0


@pytest.mark.parametrize("loss_agg", ["token_mean", "seq_mean_token_mean"])
def test_sequence_mask_rejected_responses_leave_the_denominator(loss_agg):
    """As in verl, MIS's rejected responses leave the batch: the loss is the base loss over the
    kept responses alone (their mask zeroed), not the kept sum over every response."""
    cfg = PolicyLossConfig(loss_agg=loss_agg, seq_mask_range=(0.9, 1.1))
    batch = make_decoupled_batch(20, ratio_scale=0.2)
    S, n, responses = _sequence_sums(batch)
    g = np.exp(S / np.maximum(n, 1))
    masked = responses & ~((g >= 0.9) & (g <= 1.1))
    assert 0 < masked.sum() < responses.sum()
    loss, metrics, grad = loss_and_grad(batch, cfg)
    kept = {**batch, "mask": np.where(masked[:, None], 0.0, batch["mask"]).astype(np.float32)}
    base = dataclasses.replace(cfg, seq_mask_range=None)
    loss_k, _, grad_k = loss_and_grad(kept, base)
    np.testing.assert_allclose(loss, loss_k, rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(grad, grad_k, rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose(metrics["seq_masked_frac"], masked.sum() / responses.sum())
    # Row microbatches merge to the full batch (whole responses, a per-response rule).
    b = {k: jnp.asarray(v) for k, v in batch.items()}
    halves = [slice(0, len(masked) // 2), slice(len(masked) // 2, None)]
    parts = [
        objectives.policy_loss_terms(
            b["logp"][s], b["behavior_logp"][s], b["advantages"][s], b["mask"][s], cfg,
            old_logp=b["old_logp"][s],
        )
        for s in halves
    ]  # fmt: skip
    merged_loss, _ = parts[0].merge(parts[1]).reduce()
    np.testing.assert_allclose(merged_loss, loss, rtol=1e-6)


@pytest.mark.parametrize("ratio_level", ["token", "sequence"])
@pytest.mark.parametrize("log_k", [100.0, -100.0])
def test_sequence_corrections_with_huge_sums_stay_finite(ratio_level, log_k):
    cfg = PolicyLossConfig(
        ratio_level=ratio_level, sat=SAT, seq_tis_cap=2.0, seq_mask_range=(0.5, 2.0)
    )
    batch = make_decoupled_batch(25)
    batch["old_logp"][1:4] = batch["behavior_logp"][1:4] + log_k  # Σ ≈ ±800 on three responses
    loss, metrics, grad = loss_and_grad(batch, cfg)
    assert np.isfinite(loss) and np.all(np.isfinite(grad))
    assert all(np.isfinite(v) for v in metrics.values())
    assert np.all(np.asarray(grad)[1:4] == 0.0)  # g_b = exp(±100): those responses are masked
    # Without the mask: w_b = cap on the huge positive sums, 0 on the huge negative ones.
    tis_only = dataclasses.replace(cfg, seq_mask_range=None)
    assert_matches_reference(batch, tis_only)
    w = objectives.sequence_importance_weights(
        batch["old_logp"], batch["behavior_logp"], cap=2.0, where=batch["mask"], keepdims=True
    )
    np.testing.assert_allclose(w[1:4, 0], 2.0 if log_k > 0 else 0.0, rtol=1e-6)


@pytest.mark.parametrize("name", ["sat", "gspo_sat", "sat_seqmean"])
def test_sat_without_old_logp_is_sat_with_old_logp_equal_to_behavior(name):
    """d_SAT = logp − behavior_logp is d when old_logp is behavior_logp: bit-identical."""
    cfg = CONFIGS[name]
    batch = make_batch(26, B=16, scale=0.6)
    loss0, m0, g0 = loss_and_grad(batch, cfg, jit=False)
    loss1, m1, g1 = loss_and_grad(dict(batch, old_logp=batch["behavior_logp"]), cfg, jit=False)
    assert np.array_equal(loss0, loss1) and np.array_equal(g0, g1)
    assert float(m0["sat_gate_rate"]) > 0
    for k in m0:
        assert np.array_equal(m0[k], m1[k]), k


@pytest.mark.parametrize("ratio_level", ["token", "sequence"])
def test_sat_gates_on_the_behavior_log_ratio_when_old_logp_is_given(ratio_level):
    """Decoupled PPO: SAT's q, gate and contraction read logp − behavior_logp, the clip old_logp."""
    gspo = ratio_level == "sequence"
    clips = dict(clip_low=3e-3, clip_high=4e-3) if gspo else {}
    cfg = PolicyLossConfig(ratio_level=ratio_level, sat=SAT, **clips)
    # GSPO gates whole responses: enough of them that the 10% tail holds several.
    batch = make_decoupled_batch(
        22, B=32 if gspo else 8, ratio_scale=5e-3 if gspo else 0.05, mismatch_scale=0.5
    )
    metrics = assert_matches_reference(batch, cfg)

    act = batch["mask"] > 0
    d_sat = (
        objectives.sequence_log_ratio(batch["logp"] - batch["behavior_logp"], where=batch["mask"])
        if gspo
        else jnp.asarray(batch["logp"] - batch["behavior_logp"])
    )
    d_old = np.asarray(batch["logp"] - batch["old_logp"], np.float64)
    q_beh = quantile_inverted_cdf(np.abs(np.asarray(d_sat, np.float64))[act], SAT.quantile)
    q_old = quantile_inverted_cdf(np.abs(d_old)[act], SAT.quantile)
    assert q_old < 0.5 * q_beh  # the two candidate thresholds are far apart
    np.testing.assert_allclose(metrics["sat_q"], q_beh, rtol=RTOL)
    # The contraction is that of d_SAT, on the side d_SAT points to.
    c_low, c_high = (np.asarray(c) for c in objectives.sat_contraction(d_sat, metrics["sat_q"]))
    sides = [np.any(c_high[act] < 1), np.any(c_low[act] < 1)]
    assert all(sides) if not gspo else any(sides)
    np.testing.assert_allclose(
        metrics["sat_eps_high_mean"], cfg.clip_high * c_high[act].mean(), rtol=RTOL
    )
    np.testing.assert_allclose(
        metrics["sat_eps_low_mean"], cfg.clip_low * c_low[act].mean(), rtol=RTOL
    )
    # sat_threshold gives the same q and does not read old_logp.
    args = (batch["logp"], batch["behavior_logp"], batch["mask"], cfg)
    q = objectives.sat_threshold(*args, old_logp=batch["old_logp"])
    assert float(q) == float(objectives.sat_threshold(*args)) == float(metrics["sat_q"])

    # old_logp recomputed by the current params (AReaL's decoupled objective): logp − old_logp is 0
    # at the update, yet SAT still gates the stale tail, with the same q and gate.
    _, m_fresh, _ = loss_and_grad(dict(batch, old_logp=batch["logp"]), cfg)
    assert float(m_fresh["ratio_mean"]) == 1.0
    assert float(m_fresh["sat_gate_rate"]) == float(metrics["sat_gate_rate"]) > 0
    assert float(m_fresh["sat_q"]) == float(metrics["sat_q"])


@pytest.mark.parametrize("with_fresh", [False, True])
def test_sampler_kl_is_k3_over_the_fresh_active_tokens(with_fresh):
    b = make_batch(23, B=6, T=12, scale=0.2)
    rng = np.random.default_rng(23)
    fresh = rng.random(b["logp"].shape) < 0.5
    # Stale tokens are further from the sampler; one fresh token is past the clamp (x = −30 → −20).
    b["behavior_logp"] = np.where(
        fresh, b["behavior_logp"], b["logp"] + 2.0 * rng.normal(size=fresh.shape)
    ).astype(np.float32)
    fresh[2, 3], b["mask"][2, 3] = True, 1.0
    b["behavior_logp"][2, 3] = b["logp"][2, 3] + 30.0
    if with_fresh:
        b["fresh_mask"] = fresh.astype(np.float32)
    loss, metrics, grad = loss_and_grad(b, PolicyLossConfig())

    act = b["mask"] > 0
    sel = act & fresh if with_fresh else act
    x = np.clip(np.asarray(b["logp"], np.float64) - b["behavior_logp"], -20.0, 20.0)
    k3 = np.exp(x) - 1.0 - x
    np.testing.assert_allclose(metrics["sampler_kl"], k3[sel].mean(), rtol=1e-5)
    assert float(metrics["fresh_tokens"]) == sel.sum()
    if with_fresh:
        assert 0 < sel.sum() < act.sum()
        assert float(metrics["sampler_kl"]) < 0.75 * float(metrics["kl_k3"])  # staleness excluded
        # fresh_mask only feeds the metric: loss and gradient are those of the call without it.
        b.pop("fresh_mask")
        loss0, m0, grad0 = loss_and_grad(b, PolicyLossConfig())
        assert np.array_equal(loss, loss0) and np.array_equal(grad, grad0)
        assert float(m0["sampler_kl"]) == float(m0["kl_k3"]) != float(metrics["sampler_kl"])
    else:
        assert float(metrics["sampler_kl"]) == float(metrics["kl_k3"])
        assert float(metrics["fresh_tokens"]) == float(metrics["active_tokens"])
        # An all-ones fresh mask is the same as none, bit for bit.
        _, m1, _ = loss_and_grad(dict(b, fresh_mask=np.ones_like(b["mask"])), PolicyLossConfig())
        assert np.array_equal(m1["sampler_kl"], metrics["sampler_kl"])
