"""Train step: sharded (8 simulated CPU devices, several meshes) == one device; alignment; skips."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from sat_jax import objectives, sharding
from sat_jax.model import ModelConfig, placement
from sat_jax.step import (
    StepConfig,
    TrainBatch,
    create_train_state,
    make_train_step,
    shard_batch,
    train_state_shardings,
)

# float32 throughout; sharding only reorders reductions (~1e-7 relative per op).
RTOL, ATOL = 1e-5, 1e-6

MODEL_CFG = ModelConfig.preset("tiny", dispatch="dense", mlp_only_layers=(0,))
OPTIMIZER = optax.sgd(0.1, momentum=0.9)
LOSS_CFG = objectives.PolicyLossConfig(sat=objectives.SATConfig(enabled=True))
B, T, PROMPT = 8, 12, 4


@dataclasses.dataclass(frozen=True)
class Reference:
    params0: dict
    batch: TrainBatch
    noise: np.ndarray
    params1: dict
    metrics: dict
    step_fn: object


def _own_logp_and_routing(params: dict, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float64 log π(tokens[t] | tokens[:t]) at t >= 1 (0 at t = 0) and the model's own routing."""
    graphdef, _ = placement.abstract_model(MODEL_CFG)
    fwd = jax.jit(lambda p, x: nnx.merge(graphdef, p)(x, return_routing=True))
    logits, routing = jax.device_get(fwd(params, tokens))
    logits = logits.astype(np.float64)
    logz = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    logp = np.zeros(tokens.shape)
    for b in range(tokens.shape[0]):
        for t in range(1, tokens.shape[1]):
            logp[b, t] = logits[b, t - 1, tokens[b, t]] - logz[b, t - 1]
    return logp, routing


@pytest.fixture(scope="module")
def ref() -> Reference:
    mesh1 = sharding.make_mesh(sharding.MeshConfig(fsdp=1), jax.devices()[:1])
    _, params0 = placement.init_sharded(MODEL_CFG, mesh1, 0)
    params0 = jax.device_get(params0)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, MODEL_CFG.vocab_size, (B, T)).astype(np.int32)
    ends = rng.integers(PROMPT + 2, T + 1, (B, 1))
    mask = ((np.arange(T) >= PROMPT) & (np.arange(T) < ends)).astype(np.float32)
    own_logp, routing = _own_logp_and_routing(params0, tokens)
    noise = (0.3 * rng.normal(size=(B, T))).astype(np.float32)
    batch = TrainBatch(
        tokens=tokens,
        loss_mask=mask,
        behavior_logp=(own_logp + noise).astype(np.float32),
        advantages=rng.normal(size=(B, T)).astype(np.float32),
        routing=routing,
    )
    step_fn = make_train_step(MODEL_CFG, OPTIMIZER, StepConfig(loss=LOSS_CFG), mesh1)
    state = create_train_state(MODEL_CFG, OPTIMIZER, mesh1, params0)
    state, metrics = step_fn(state, shard_batch(batch, mesh1))
    return Reference(
        params0=params0,
        batch=batch,
        noise=noise,
        params1=jax.device_get(state.params),
        metrics=jax.device_get(metrics),
        step_fn=step_fn,
    )


def _assert_tree_close(got: dict, want: dict) -> None:
    flat_got = jax.tree_util.tree_flatten_with_path(got)[0]
    flat_want = jax.tree.leaves(want)
    assert len(flat_got) == len(flat_want)
    for (path, g), w in zip(flat_got, flat_want, strict=True):
        np.testing.assert_allclose(
            np.asarray(g), w, rtol=RTOL, atol=ATOL, err_msg=jax.tree_util.keystr(path)
        )


def test_alignment_logits_at_t_minus_1_score_token_t(ref: Reference) -> None:
    # behavior_logp = own logp + noise, so the mismatch metric recovers |noise| exactly when logp is
    # aligned to the target position; position 0 never counts even if the mask says so.
    active = ref.batch.loss_mask.astype(bool)
    np.testing.assert_allclose(
        ref.metrics["mismatch_abs_mean"], np.abs(ref.noise[active]).mean(), rtol=1e-4
    )
    assert ref.metrics["active_tokens"] == active.sum()
    assert ref.metrics["router_shift_ratio"] == 0.0
    assert ref.metrics["step_skipped"] == 0.0


def _model_logprobs(params: dict, tokens: np.ndarray, **kwargs) -> tuple[np.ndarray, np.ndarray]:
    """(``Transformer.logprobs`` of the tokens, the full forward's float64 logits [B, T, V])."""
    graphdef, _ = placement.abstract_model(MODEL_CFG)
    both = jax.jit(
        lambda p, x: (nnx.merge(graphdef, p).logprobs(x, **kwargs)[0], nnx.merge(graphdef, p)(x))
    )
    logp, logits = jax.device_get(both(params, tokens))
    return logp, logits.astype(np.float64)


def test_model_logprobs_against_numpy(ref: Reference) -> None:
    tokens = ref.batch.tokens[:2, :5]
    got, logits = _model_logprobs(ref.params0, tokens, temperature=0.7)
    scaled = logits / 0.7
    logz = np.log(np.exp(scaled).sum(-1))
    want = np.zeros((2, 5))
    want[:, 1:] = np.take_along_axis(scaled[:, :-1], tokens[:, 1:, None], -1)[..., 0] - logz[:, :-1]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


MESHES = [
    ("data=8", sharding.MeshConfig(data=8, fsdp=1), False),
    ("fsdp=8", sharding.MeshConfig(fsdp=8), False),
    # Replaying the model's own routing is the identity (R3 invariance), so it matches too.
    ("data=2,fsdp=2,expert=2+replay", sharding.MeshConfig(data=2, fsdp=2, expert=2), True),
    ("fsdp=2,tensor=4", sharding.MeshConfig(fsdp=2, tensor=4), False),
    ("expert=4,fsdp=-1", sharding.MeshConfig(expert=4, fsdp=-1), False),
]


@pytest.mark.parametrize(("name", "mesh_cfg", "replay"), MESHES, ids=[m[0] for m in MESHES])
def test_sharded_step_matches_one_device(
    ref: Reference, name: str, mesh_cfg: sharding.MeshConfig, replay: bool
) -> None:
    mesh = sharding.make_mesh(mesh_cfg)
    state = create_train_state(MODEL_CFG, OPTIMIZER, mesh, ref.params0)
    _, abstract = placement.abstract_model(MODEL_CFG)
    specs = sharding.param_specs(abstract, mesh)
    for (path, leaf), spec in zip(
        jax.tree_util.tree_flatten_with_path(state.params)[0],
        jax.tree.leaves(specs, is_leaf=_is_spec),
        strict=True,
    ):
        assert leaf.sharding == jax.sharding.NamedSharding(mesh, spec), path
    old_leaf = jax.tree.leaves(state.params)[0]

    step_fn = make_train_step(
        MODEL_CFG, OPTIMIZER, StepConfig(loss=LOSS_CFG, routing_replay=replay), mesh
    )
    new_state, metrics = step_fn(state, shard_batch(ref.batch, mesh))

    assert old_leaf.is_deleted(), "the train state must be donated"
    assert int(new_state.step) == 1
    for key in ("loss", "total_loss", "grad_norm", "mismatch_abs_mean", "sat_q", "clip_frac_low"):
        np.testing.assert_allclose(
            metrics[key], ref.metrics[key], rtol=RTOL, atol=ATOL, err_msg=key
        )
    _assert_tree_close(new_state.params, ref.params1)
    want_sh = train_state_shardings(MODEL_CFG, OPTIMIZER, mesh)
    assert jax.tree.leaves(jax.tree.map(lambda x: x.sharding, new_state)) == jax.tree.leaves(
        want_sh
    )


def _is_spec(x: object) -> bool:
    return isinstance(x, jax.sharding.PartitionSpec)


@pytest.mark.parametrize("broken", ["nan_advantage", "empty_mask"])
def test_non_finite_or_empty_batch_skips_the_update(ref: Reference, broken: str) -> None:
    mesh1 = sharding.make_mesh(sharding.MeshConfig(fsdp=1), jax.devices()[:1])
    if broken == "nan_advantage":
        adv = ref.batch.advantages.copy()
        adv[np.nonzero(ref.batch.loss_mask)[0][0], np.nonzero(ref.batch.loss_mask)[1][0]] = np.nan
        batch = ref.batch.replace(advantages=adv)
    else:
        batch = ref.batch.replace(loss_mask=np.zeros_like(ref.batch.loss_mask))
    state = create_train_state(MODEL_CFG, OPTIMIZER, mesh1, ref.params0)
    state, metrics = ref.step_fn(state, shard_batch(batch, mesh1))
    assert metrics["step_skipped"] == 1.0
    assert int(state.step) == 0
    _assert_tree_close(state.params, ref.params0)
    assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(state.opt_state))


def test_replay_without_recorded_routing_is_an_error(ref: Reference) -> None:
    mesh1 = sharding.make_mesh(sharding.MeshConfig(fsdp=1), jax.devices()[:1])
    step_fn = make_train_step(
        MODEL_CFG, OPTIMIZER, StepConfig(loss=LOSS_CFG, routing_replay=True), mesh1
    )
    state = create_train_state(MODEL_CFG, OPTIMIZER, mesh1, ref.params0)
    with pytest.raises(ValueError, match="routing"):
        step_fn(state, shard_batch(ref.batch.replace(routing=None), mesh1))


def test_batch_not_divisible_by_data_shards_is_a_clear_error(ref: Reference) -> None:
    mesh = sharding.make_mesh(sharding.MeshConfig(data=8, fsdp=1))
    small = jax.tree.map(lambda x: x[:6], ref.batch)
    with pytest.raises(ValueError, match="batch size 6 is not divisible by the 8 data shards"):
        shard_batch(small, mesh)


def test_adam_moments_are_sharded_like_their_params() -> None:
    mesh = sharding.make_mesh(sharding.MeshConfig(data=2, fsdp=2, tensor=2))
    adam = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3, b2=0.98))
    sh = train_state_shardings(MODEL_CFG, adam, mesh)
    adam_state = sh.opt_state[1][0]
    assert adam_state.mu == sh.params and adam_state.nu == sh.params
    assert adam_state.count.spec == jax.sharding.PartitionSpec()
    assert sh.step.spec == jax.sharding.PartitionSpec()


def test_vocab_mask_renormalizes_over_the_sampleable_ids(ref: Reference):
    from sat_jax.tasks import CharTokenizer, sampleable_mask

    tokenizer = CharTokenizer("0123456789")
    mask_v = sampleable_mask(tokenizer, 16)
    assert mask_v.tolist() == [False, False] + [True] * 11 + [False] * 3
    mask_v = sampleable_mask(tokenizer, MODEL_CFG.vocab_size)
    rng = np.random.default_rng(0)
    tokens = rng.integers(2, 13, size=(2, 5)).astype(np.int32)
    got, logits = _model_logprobs(ref.params0, tokens, vocab_mask=mask_v)
    sub = logits[:, :-1][..., mask_v]
    log_z = np.log(np.exp(sub).sum(-1))
    want = np.take_along_axis(logits[:, :-1], tokens[:, 1:, None], -1)[..., 0] - log_z
    np.testing.assert_allclose(got[:, 1:], want, rtol=1e-5, atol=1e-6)
    assert np.all(np.asarray(got[:, 0]) == 0.0)
    with pytest.raises(ValueError, match="vocab"):
        sampleable_mask(tokenizer, 8)
