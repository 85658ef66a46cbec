"""Gradient accumulation: k microbatches == the one-pass step (loss, gradient, every metric).

On one device and on 8 simulated CPU devices; SAT with the batch's threshold, GSPO with a KL
penalty, routing replay and the router aux loss; and the per-microbatch threshold scope.

What the step derives from the batch equals what the host used to send, one pass and
microbatched: advantages from per-row rewards and group ids (groups span every microbatch), and
the reference log-probs from the reference's params (vs its full logits' log-softmax).
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from sat_jax import objectives, sharding
from sat_jax.model import ModelConfig, placement, token_logprobs
from sat_jax.step import (
    StepConfig,
    TrainBatch,
    create_train_state,
    make_train_step,
    shard_batch,
    token_mask,
    with_advantages,
)

RTOL, ATOL = 1e-5, 1e-6
B, T, PROMPT = 16, 12, 4
# One dense layer, then MoE layers with a load-balancing loss (its gradient is bilinear in the
# routing statistics, so it checks that microbatches use the batch's f).
MODEL_CFG = ModelConfig.preset(
    "tiny", dispatch="dense", mlp_only_layers=(0,), router_aux_loss_coef=0.01
)
SAT = objectives.SATConfig(enabled=True, quantile=0.8)
LOSSES = {
    "sat-token": objectives.PolicyLossConfig(sat=SAT),
    "sat-gspo-kl": objectives.PolicyLossConfig(
        ratio_level="sequence", loss_agg="seq_mean_token_mean", sat=SAT, kl_coef=0.1
    ),
    "ppo": objectives.PolicyLossConfig(),
    # The large-lag options (docs/DESIGN.md §3.6): M2PO's cutoff is a batch statistic like SAT's
    # q; the ESS (and VCPO's step scale) comes from sums. τ keeps part of this batch's tokens.
    "m2po-sat-vcpo": objectives.PolicyLossConfig(sat=SAT, m2_threshold=2.0, ess_scaling=True),
}


def _grads_as_params() -> optax.GradientTransformation:
    """An 'optimizer' whose new params are the gradient, so the step's gradient can be compared."""
    return optax.GradientTransformation(
        init=lambda params: optax.EmptyState(),
        update=lambda g, state, p: (jax.tree.map(lambda gi, pi: gi - pi, g, p), state),
    )


OPTIMIZER = _grads_as_params()


def _batch() -> TrainBatch:
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, MODEL_CFG.vocab_size, (B, T)).astype(np.int32)
    ends = rng.integers(PROMPT + 2, T + 1, (B, 1))
    mask = ((np.arange(T) >= PROMPT) & (np.arange(T) < ends)).astype(np.float32)
    mask[3] = 0.0  # a response without active token
    shape = (B, T, MODEL_CFG.num_moe_layers, MODEL_CFG.num_experts_per_tok)
    return TrainBatch(
        tokens=tokens,
        loss_mask=mask,
        behavior_logp=np.log(rng.uniform(0.01, 0.3, (B, T))).astype(np.float32),
        advantages=np.repeat(rng.normal(size=(B, 1)), T, 1).astype(np.float32),
        routing=rng.integers(0, MODEL_CFG.num_experts, shape).astype(np.uint8),
        ref_logp=np.log(rng.uniform(0.01, 0.3, (B, T))).astype(np.float32),
    )


@dataclasses.dataclass(frozen=True)
class Setup:
    params0: dict
    batch: TrainBatch
    ref_params: dict  # another init: the KL penalty's reference policy


@pytest.fixture(scope="module")
def setup() -> Setup:
    mesh1 = sharding.make_mesh(sharding.MeshConfig(fsdp=1), jax.devices()[:1])
    _, params0 = placement.init_sharded(MODEL_CFG, mesh1, 0)
    _, ref_params = placement.init_sharded(MODEL_CFG, mesh1, 1)
    return Setup(
        params0=jax.device_get(params0), batch=_batch(), ref_params=jax.device_get(ref_params)
    )


def _step(
    setup: Setup,
    loss_cfg,
    mesh_cfg,
    k: int,
    replay: bool = False,
    *,
    batch: TrainBatch | None = None,
    ref_params: dict | None = None,
    vocab_mask: np.ndarray | None = None,
    **options,
):
    devices = jax.devices()[:1] if mesh_cfg.fsdp == 1 and mesh_cfg.data == 1 else None
    mesh = sharding.make_mesh(mesh_cfg, devices)
    cfg = StepConfig(loss=loss_cfg, routing_replay=replay, microbatches=k, **options)
    step_fn = make_train_step(MODEL_CFG, OPTIMIZER, cfg, mesh, vocab_mask=vocab_mask)
    state = create_train_state(MODEL_CFG, OPTIMIZER, mesh, setup.params0)
    batch = setup.batch if batch is None else batch
    if ref_params is not None:
        ref_params = jax.device_put(ref_params, jax.tree.map(lambda x: x.sharding, state.params))
    state, metrics = step_fn(state, shard_batch(batch, mesh), ref_params)
    return jax.device_get(state.params), jax.device_get(metrics)


def _assert_same(got, want) -> None:
    grads, metrics = got
    want_grads, want_metrics = want
    assert metrics.keys() == want_metrics.keys()
    for key, value in want_metrics.items():
        np.testing.assert_allclose(metrics[key], value, rtol=RTOL, atol=ATOL, err_msg=key)
    for (path, g), w in zip(
        jax.tree_util.tree_flatten_with_path(grads)[0], jax.tree.leaves(want_grads), strict=True
    ):
        np.testing.assert_allclose(g, w, rtol=RTOL, atol=ATOL, err_msg=jax.tree_util.keystr(path))


ONE = sharding.MeshConfig(fsdp=1)
EIGHT = sharding.MeshConfig(data=2, fsdp=4)


@pytest.mark.parametrize(
    ("loss_name", "k"),
    [("sat-token", 4), ("sat-gspo-kl", 2), ("ppo", 2), ("m2po-sat-vcpo", 2)],
)
def test_microbatches_equal_one_pass(setup: Setup, loss_name: str, k: int) -> None:
    loss_cfg = LOSSES[loss_name]
    want = _step(setup, loss_cfg, ONE, 1)
    assert want[1]["step_skipped"] == 0.0 and want[1]["aux_loss"] > 0
    assert 0 < want[1]["ess"] <= 1
    if loss_cfg.m2po:
        assert 0 < want[1]["m2po_masked_frac"] < 1
    _assert_same(_step(setup, loss_cfg, ONE, k), want)


@pytest.mark.parametrize("loss_agg", ["token_mean", "seq_mean_token_mean"])
def test_sequence_mask_denominator_is_exact_under_microbatches(setup: Setup, loss_agg) -> None:
    """MIS's rejected responses leave the denominator also when the step accumulates: the
    accumulated step's count is the kept responses', so it equals the one-pass step."""
    offsets = np.where(np.arange(B) % 3 == 1, 0.5, 0.0)[:, None]  # g_b = e^0.5: rejected
    beh = setup.batch.behavior_logp
    batch = setup.batch.replace(old_logp=(beh + offsets).astype(np.float32))
    loss_cfg = objectives.PolicyLossConfig(
        loss_agg=loss_agg, seq_mask_range=(0.9, 1.1), m2_threshold=2.0, m2_token_set="all"
    )
    want = _step(setup, loss_cfg, ONE, 1, batch=batch)
    assert 0 < want[1]["seq_masked_frac"] < 1
    _assert_same(_step(setup, loss_cfg, ONE, 2, batch=batch), want)


def test_ess_scaling_multiplies_the_update_by_sqrt_ess(setup: Setup) -> None:
    """VCPO: the update (here gradient − params) is the unscaled one times sqrt(ess)."""
    plain = objectives.PolicyLossConfig(sat=SAT)
    params, metrics = _step(setup, plain, ONE, 1)
    scaled, scaled_metrics = _step(setup, dataclasses.replace(plain, ess_scaling=True), ONE, 1)
    scale = float(scaled_metrics["ess_step_scale"])
    assert scale == pytest.approx(np.sqrt(metrics["ess"]), rel=1e-6) and 0 < scale < 1
    for p0, p, s in zip(
        jax.tree.leaves(setup.params0),
        jax.tree.leaves(params),
        jax.tree.leaves(scaled),
        strict=True,
    ):
        np.testing.assert_allclose(s - p0, scale * (p - p0), rtol=1e-5, atol=1e-6)
    assert "ess_step_scale" not in metrics


def test_microbatches_on_eight_devices_with_replay(setup: Setup) -> None:
    assert jax.device_count() == 8
    loss_cfg = LOSSES["sat-token"]
    want = _step(setup, loss_cfg, ONE, 1, replay=True)
    assert 0 < want[1]["router_shift_ratio"] < 1
    _assert_same(_step(setup, loss_cfg, EIGHT, 2, replay=True), want)
    _assert_same(_step(setup, loss_cfg, EIGHT, 1, replay=True), want)


def test_microbatch_threshold_scope_uses_each_microbatch_quantile(setup: Setup) -> None:
    k = 4
    scoped = dataclasses.replace(SAT, threshold_scope="microbatch")
    loss_cfg = objectives.PolicyLossConfig(sat=scoped)
    _, metrics = _step(setup, loss_cfg, ONE, k)
    _, batch_metrics = _step(setup, objectives.PolicyLossConfig(sat=SAT), ONE, k)
    # The current policy's logp, from the reference model's forward.
    graphdef, _ = placement.abstract_model(MODEL_CFG)
    logp = jax.jit(lambda p, x: nnx.merge(graphdef, p).logprobs(x)[0])(
        setup.params0, setup.batch.tokens
    )
    mask = setup.batch.loss_mask.copy()
    mask[:, 0] = 0.0
    qs = [
        objectives.sat_threshold(logp[j::k], setup.batch.behavior_logp[j::k], mask[j::k], loss_cfg)
        for j in range(k)
    ]
    np.testing.assert_allclose(metrics["sat_q"], np.mean(qs), rtol=RTOL)
    whole = objectives.sat_threshold(logp, setup.batch.behavior_logp, mask, loss_cfg)
    np.testing.assert_allclose(batch_metrics["sat_q"], whole, rtol=RTOL)
    assert abs(float(metrics["sat_q"]) - float(whole)) > 1e-4


def test_indivisible_batch_is_a_clear_error(setup: Setup) -> None:
    with pytest.raises(ValueError, match="microbatches=3 must divide the batch size 16"):
        _step(setup, LOSSES["ppo"], ONE, 3)


def test_threshold_scope_is_validated() -> None:
    with pytest.raises(ValueError, match="threshold_scope"):
        objectives.SATConfig(threshold_scope="token")


def test_token_mask_is_each_row_up_to_its_last_completion_token():
    loss_mask = np.array([[0, 0, 1, 1, 0, 0], [0, 1, 0, 1, 1, 1], [0, 0, 0, 0, 0, 0]], np.float32)
    want = np.array([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0]], bool)
    np.testing.assert_array_equal(np.asarray(token_mask(loss_mask)), want)


GROUP = 4  # rows per group, consecutive as assembled: every group spans every microbatch


def _with_rewards(batch: TrainBatch) -> TrainBatch:
    """The batch with 0/1 rewards and group ids instead of advantages; its last 2 rows are
    padding (group -1, no token), and row 3 keeps its group with no token."""
    rng = np.random.default_rng(1)
    group_ids = np.repeat(np.arange(B // GROUP, dtype=np.int32), GROUP)
    group_ids[-2:] = -1
    return batch.replace(
        advantages=None,
        rewards=rng.integers(0, 2, B).astype(np.float32),
        group_ids=group_ids,
        loss_mask=np.where(group_ids[:, None] >= 0, batch.loss_mask, 0.0).astype(np.float32),
    )


def _host_advantages(batch: TrainBatch, estimator: str) -> np.ndarray:
    """[B, T] advantages as the host computed them before the step did (train/batching.py):
    eager group_advantages over the active rows, spread over each row's loss mask."""
    active = batch.group_ids >= 0
    per_row = objectives.group_advantages(
        batch.rewards,
        np.where(active, batch.group_ids, 0),
        num_groups=B // GROUP,
        estimator=estimator,
        where=active,
    )
    return np.asarray(per_row, np.float32)[:, None] * batch.loss_mask


@pytest.mark.parametrize(
    ("estimator", "k", "mesh_cfg"),
    [("grpo", 1, ONE), ("grpo", 4, ONE), ("dr_grpo", 2, ONE), ("grpo", 2, EIGHT)],
)
def test_rewards_and_group_ids_give_the_host_advantages_step(
    setup: Setup, estimator: str, k: int, mesh_cfg
) -> None:
    rows = _with_rewards(setup.batch)
    host = rows.replace(advantages=_host_advantages(rows, estimator), rewards=None, group_ids=None)
    assert np.count_nonzero(host.advantages) > 0
    loss_cfg = LOSSES["sat-token"]
    want = _step(setup, loss_cfg, ONE, 1, batch=host)
    got = _step(setup, loss_cfg, mesh_cfg, k, batch=rows, estimator=estimator)
    grads, metrics = got
    assert metrics.keys() == want[1].keys()
    for key, value in want[1].items():
        np.testing.assert_allclose(metrics[key], value, rtol=1e-6, atol=1e-6, err_msg=key)
    for (path, g), w in zip(
        jax.tree_util.tree_flatten_with_path(grads)[0], jax.tree.leaves(want[0]), strict=True
    ):
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6, err_msg=jax.tree_util.keystr(path))


def _host_reference_logp(ref_params: dict, tokens: np.ndarray, temperature: float, vocab_mask):
    """The reference log-probs the trainer computed outside the step before (train/setup.py):
    the reference's full [B, T, V] logits, log-softmax at the targets, column 0 = 0."""
    graphdef, _ = placement.abstract_model(MODEL_CFG)

    @jax.jit
    def ref_logp(p, x):
        logits = nnx.merge(graphdef, p)(x)
        logp = token_logprobs(
            logits[:, :-1], x[:, 1:], temperature=temperature, vocab_mask=vocab_mask
        )
        return jax.numpy.pad(logp, ((0, 0), (1, 0)))

    return np.asarray(ref_logp(ref_params, tokens))


@pytest.mark.parametrize(("k", "mesh_cfg"), [(1, ONE), (2, ONE), (2, EIGHT)])
def test_reference_params_give_the_host_reference_logprobs_step(setup: Setup, k: int, mesh_cfg):
    # Temperature and the sampleable ids apply to the reference as to the policy.
    temperature, vocab_mask = 0.8, np.isin(np.arange(MODEL_CFG.vocab_size), setup.batch.tokens)
    assert not vocab_mask.all()
    kwargs = dict(temperature=temperature, vocab_mask=vocab_mask)
    host = _host_reference_logp(setup.ref_params, setup.batch.tokens, temperature, vocab_mask)
    loss_cfg = LOSSES["sat-gspo-kl"]
    want = _step(setup, loss_cfg, ONE, 1, batch=setup.batch.replace(ref_logp=host), **kwargs)
    assert want[1]["kl_ref"] > 0.01  # another policy: the penalty is not a no-op
    without = setup.batch.replace(ref_logp=None)
    got = _step(setup, loss_cfg, mesh_cfg, k, batch=without, ref_params=setup.ref_params, **kwargs)
    _assert_same(got, want)


def test_advantages_and_reference_come_in_exactly_one_form(setup: Setup) -> None:
    rows = _with_rewards(setup.batch)
    for bad in (
        rows.replace(advantages=setup.batch.advantages),  # both forms
        rows.replace(group_ids=None),  # rewards alone
        setup.batch.replace(advantages=None),  # neither
    ):
        with pytest.raises(ValueError, match="either advantages"):
            _step(setup, LOSSES["ppo"], ONE, 1, batch=bad)
        with pytest.raises(ValueError, match="either advantages"):
            with_advantages(bad)
    out_of_range = rows.replace(group_ids=np.where(rows.group_ids == 1, B, rows.group_ids))
    with pytest.raises(ValueError, match=r"group_ids must lie in \[0, 16\) or be -1"):
        _step(setup, LOSSES["ppo"], ONE, 1, batch=out_of_range)
    with pytest.raises(ValueError, match="not both"):
        _step(setup, LOSSES["sat-gspo-kl"], ONE, 1, ref_params=setup.ref_params)


def _host_opob_advantages(params: dict, rows: TrainBatch) -> tuple[np.ndarray, float]:
    """[B, T] GRPO advantages centered on VCPO's off-policy optimal baseline, from each row's
    Σ_t log π and ‖∇ Σ_t log π‖² computed one row at a time from the full logits, in float64."""
    from tests.sat_jax.objectives.test_large_lag import reference_opob

    graphdef, _ = placement.abstract_model(MODEL_CFG)
    mask = rows.loss_mask.copy()
    mask[:, 0] = 0.0

    @jax.jit
    @jax.value_and_grad
    def row_logp_sum(p, tokens, m):
        logits = nnx.merge(graphdef, p)(tokens)
        logp = token_logprobs(logits[:, :-1], tokens[:, 1:], temperature=1.0, vocab_mask=None)
        return jax.numpy.sum(jax.numpy.where(m[:, 1:] > 0, logp, 0.0))

    s, g2 = np.zeros(B), np.zeros(B)
    for i in range(B):
        value, grads = row_logp_sum(params, rows.tokens[i : i + 1], mask[i : i + 1])
        s[i] = float(value) - float(np.sum(mask[i] * rows.behavior_logp[i], dtype=np.float64))
        g2[i] = sum(np.sum(np.square(np.asarray(g, np.float64))) for g in jax.tree.leaves(grads))
    active = rows.group_ids >= 0
    base, shift = reference_opob(rows.rewards, rows.group_ids, s, g2, active)
    adv = np.zeros(B)
    for g in np.unique(rows.group_ids[active]):
        r = rows.group_ids == g
        std = rows.rewards[r].astype(np.float64).std(ddof=1)
        adv[r] = 0.0 if std == 0 else (rows.rewards[r] - base[r]) / (std + 1e-6)
    return (adv[:, None] * rows.loss_mask).astype(np.float32), shift


def test_opob_baseline_gives_the_host_baseline_advantages_step(setup: Setup) -> None:
    """VCPO's baseline: the step, microbatched, equals the one-pass plain step on the host's
    float64 OPOB advantages (the baseline is computed over the whole batch before any split)."""
    rows = _with_rewards(setup.batch)
    host, host_shift = _host_opob_advantages(setup.params0, rows)
    assert np.abs(host - _host_advantages(rows, "grpo")).max() > 1e-2  # the baseline acts
    given = rows.replace(advantages=host, rewards=None, group_ids=None)
    want = _step(setup, LOSSES["sat-token"], ONE, 1, batch=given)
    loss_cfg = dataclasses.replace(LOSSES["sat-token"], opob_baseline=True)
    grads, metrics = _step(setup, loss_cfg, ONE, 2, batch=rows)
    assert host_shift > 1e-3 and metrics["opob_shift"] == pytest.approx(host_shift, rel=1e-4)
    assert metrics.keys() - want[1].keys() == {"opob_shift"}
    for key, value in want[1].items():
        np.testing.assert_allclose(metrics[key], value, rtol=1e-4, atol=1e-6, err_msg=key)
    for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want[0]), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-6)
