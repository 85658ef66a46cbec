"""Gradient accumulation: k microbatches == the one-pass step (loss, gradient, every metric).

On one device and on 8 simulated CPU devices; SAT with the batch's threshold, GSPO with a KL
penalty, routing replay and the router aux loss; and the per-microbatch threshold scope.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from sat_jax import objectives, train_step
from sat_jax.model import ModelConfig
from sat_jax.parallel import sharding

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
}


def _grads_as_params() -> optax.GradientTransformation:
    """An 'optimizer' whose new params are the gradient, so the step's gradient can be compared."""
    return optax.GradientTransformation(
        init=lambda params: optax.EmptyState(),
        update=lambda g, state, p: (jax.tree.map(lambda gi, pi: gi - pi, g, p), state),
    )


OPTIMIZER = _grads_as_params()


def _batch() -> train_step.TrainBatch:
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, MODEL_CFG.vocab_size, (B, T)).astype(np.int32)
    ends = rng.integers(PROMPT + 2, T + 1, (B, 1))
    mask = ((np.arange(T) >= PROMPT) & (np.arange(T) < ends)).astype(np.float32)
    mask[3] = 0.0  # a response without active token
    shape = (B, T, MODEL_CFG.num_moe_layers, MODEL_CFG.num_experts_per_tok)
    return train_step.TrainBatch(
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
    batch: train_step.TrainBatch


@pytest.fixture(scope="module")
def setup() -> Setup:
    mesh1 = sharding.make_mesh(sharding.MeshConfig(fsdp=1), jax.devices()[:1])
    _, params0 = sharding.init_sharded(MODEL_CFG, mesh1, 0)
    return Setup(params0=jax.device_get(params0), batch=_batch())


def _step(setup: Setup, loss_cfg, mesh_cfg, k: int, replay: bool = False):
    devices = jax.devices()[:1] if mesh_cfg.fsdp == 1 and mesh_cfg.data == 1 else None
    mesh = sharding.make_mesh(mesh_cfg, devices)
    step_fn = train_step.make_train_step(
        MODEL_CFG, OPTIMIZER, loss_cfg, mesh, routing_replay=replay, microbatches=k
    )
    state = train_step.create_train_state(MODEL_CFG, OPTIMIZER, mesh, setup.params0)
    state, metrics = step_fn(state, train_step.shard_batch(setup.batch, mesh))
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


@pytest.mark.parametrize(("loss_name", "k"), [("sat-token", 4), ("sat-gspo-kl", 2), ("ppo", 2)])
def test_microbatches_equal_one_pass(setup: Setup, loss_name: str, k: int) -> None:
    loss_cfg = LOSSES[loss_name]
    want = _step(setup, loss_cfg, ONE, 1)
    assert want[1]["step_skipped"] == 0.0 and want[1]["aux_loss"] > 0
    _assert_same(_step(setup, loss_cfg, ONE, k), want)


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
    graphdef, _ = sharding.abstract_model(MODEL_CFG)
    logp = jax.jit(lambda p, x: train_step.next_token_logprobs(nnx.merge(graphdef, p)(x), x))(
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
    np.testing.assert_array_equal(np.asarray(train_step.token_mask(loss_mask)), want)
