"""The train step under LoRA: only the adapters train, the base comes back bit for bit; the
optimizer state covers the adapters only; microbatched == one pass; sharded (8 simulated CPU
devices) == one device; rank 0 keeps ``TrainState.frozen`` None."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from sat_jax import objectives, sharding
from sat_jax.model import LoRAConfig, ModelConfig, placement
from sat_jax.model.lora import join_lora, split_lora
from sat_jax.step import (
    StepConfig,
    TrainBatch,
    TrainState,
    abstract_train_state,
    create_train_state,
    make_train_step,
    shard_batch,
    train_state_shardings,
)

RTOL, ATOL = 1e-5, 1e-6
B, T, PROMPT = 8, 12, 4
MODEL_CFG = ModelConfig.preset(
    "tiny",
    dispatch="dense",
    mlp_only_layers=(0,),
    router_aux_loss_coef=0.01,
    lora=LoRAConfig(rank=4, targets=("attention", "mlp", "experts", "router")),
)
OPTIMIZER = optax.sgd(0.1, momentum=0.9)
LOSS_CFG = objectives.PolicyLossConfig(sat=objectives.SATConfig(enabled=True))
ONE = sharding.MeshConfig(fsdp=1)


@dataclasses.dataclass(frozen=True)
class Setup:
    params0: dict  # the whole model, B already moved off zero so A gets gradients too
    batch: TrainBatch


@pytest.fixture(scope="module")
def setup() -> Setup:
    _, params0 = placement.init_sharded(MODEL_CFG, _mesh(ONE), 0)
    base, adapters = split_lora(jax.device_get(params0))
    rng = np.random.default_rng(0)
    adapters = jax.tree_util.tree_map_with_path(
        lambda p, x: (
            rng.normal(0, 0.1, x.shape).astype(x.dtype) if str(p[-1].key).endswith("_lora_b") else x
        ),
        adapters,
    )
    tokens = rng.integers(0, MODEL_CFG.vocab_size, (B, T)).astype(np.int32)
    ends = rng.integers(PROMPT + 2, T + 1, (B, 1))
    mask = ((np.arange(T) >= PROMPT) & (np.arange(T) < ends)).astype(np.float32)
    batch = TrainBatch(
        tokens=tokens,
        loss_mask=mask,
        behavior_logp=np.log(rng.uniform(0.01, 0.3, (B, T))).astype(np.float32),
        advantages=np.repeat(rng.normal(size=(B, 1)), T, 1).astype(np.float32),
    )
    return Setup(params0=join_lora(base, adapters), batch=batch)


def _mesh(mesh_cfg: sharding.MeshConfig) -> jax.sharding.Mesh:
    devices = jax.devices()[:1] if mesh_cfg == ONE else None
    return sharding.make_mesh(mesh_cfg, devices)


def _step(setup: Setup, mesh_cfg=ONE, k: int = 1):
    """(the state after one step, its metrics on the host)."""
    mesh = _mesh(mesh_cfg)
    state = create_train_state(MODEL_CFG, OPTIMIZER, mesh, setup.params0)
    step_fn = make_train_step(MODEL_CFG, OPTIMIZER, StepConfig(loss=LOSS_CFG, microbatches=k), mesh)
    state, metrics = step_fn(state, shard_batch(setup.batch, mesh))
    assert metrics["step_skipped"] == 0.0
    return state, jax.device_get(metrics)


def _assert_close(got, want) -> None:
    flat_got = jax.tree_util.tree_leaves_with_path(got)
    assert len(flat_got) == len(jax.tree.leaves(want))
    for (path, g), w in zip(flat_got, jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(g, w, rtol=RTOL, atol=ATOL, err_msg=jax.tree_util.keystr(path))


@dataclasses.dataclass(frozen=True)
class OneStep:
    after: TrainState  # on the host
    metrics: dict
    base_moved: bool  # the base's buffers after the step are not those before


@pytest.fixture(scope="module")
def one(setup: Setup) -> OneStep:
    mesh = _mesh(ONE)
    # Arrays XLA owns: the CPU client may wrap NumPy memory without a copy, and it copies
    # such a buffer rather than alias it to an output.
    params = jax.tree.map(lambda x: jnp.copy(jnp.asarray(x)), setup.params0)
    state = create_train_state(MODEL_CFG, OPTIMIZER, mesh, params)
    # (Not read back before the step: a host view of a buffer keeps it from being donated.)
    pointers = [x.unsafe_buffer_pointer() for x in jax.tree.leaves(state.frozen)]
    step_fn = make_train_step(MODEL_CFG, OPTIMIZER, StepConfig(loss=LOSS_CFG), mesh)
    state, metrics = step_fn(state, shard_batch(setup.batch, mesh))
    assert metrics["step_skipped"] == 0.0
    moved = [x.unsafe_buffer_pointer() for x in jax.tree.leaves(state.frozen)] != pointers
    return OneStep(jax.device_get(state), jax.device_get(metrics), moved)


def test_only_the_adapters_change_and_the_base_is_bit_identical(setup: Setup, one) -> None:
    after = one.after
    want_base, want_adapters = split_lora(setup.params0)
    assert jax.tree.structure(after.frozen) == jax.tree.structure(want_base)
    for x, y in zip(jax.tree.leaves(after.frozen), jax.tree.leaves(want_base), strict=True):
        np.testing.assert_array_equal(x, y)
        assert x.dtype == y.dtype
    assert jax.tree.structure(after.params) == jax.tree.structure(want_adapters)
    for (path, x), y in zip(
        jax.tree_util.tree_leaves_with_path(after.params),
        jax.tree.leaves(want_adapters),
        strict=True,
    ):
        assert not np.array_equal(x, y), f"{jax.tree_util.keystr(path)} did not train"
    assert int(after.step) == 1
    full = after.model_params
    assert jax.tree.structure(full) == jax.tree.structure(setup.params0)
    # The donated base is the new state's: aliased, never copied.
    assert not one.base_moved


def test_optimizer_state_covers_only_the_adapters(setup: Setup, one) -> None:
    _, adapters = split_lora(setup.params0)
    n_adapter = sum(x.size for x in jax.tree.leaves(adapters))
    assert jax.tree.structure(one.after.opt_state[0].trace) == jax.tree.structure(adapters)
    adamw = optax.adamw(1e-3)
    state = create_train_state(MODEL_CFG, adamw, _mesh(ONE), setup.params0)
    adam = state.opt_state[0]
    for moment in (adam.mu, adam.nu):
        assert jax.tree.structure(moment) == jax.tree.structure(adapters)
    assert sum(x.size for x in jax.tree.leaves(state.opt_state)) == 2 * n_adapter + 1


def test_state_shardings_split_base_and_adapters() -> None:
    mesh = _mesh(sharding.MeshConfig(data=2, fsdp=2, tensor=2))
    sh = train_state_shardings(MODEL_CFG, OPTIMIZER, mesh)
    _, abstract = placement.abstract_model(MODEL_CFG)
    want_frozen, want_params = split_lora(sharding.param_shardings(abstract, mesh))
    assert sh.frozen == want_frozen and sh.params == want_params
    assert sh.opt_state[0].trace == want_params
    abstract_state = abstract_train_state(MODEL_CFG, OPTIMIZER, mesh)
    assert jax.tree.map(lambda x: x.sharding, abstract_state) == sh


def test_microbatches_equal_one_pass(setup: Setup, one) -> None:
    got, metrics = _step(setup, k=2)
    assert metrics.keys() == one.metrics.keys()
    for key, value in one.metrics.items():
        np.testing.assert_allclose(metrics[key], value, rtol=RTOL, atol=ATOL, err_msg=key)
    _assert_close(jax.device_get(got.params), one.after.params)


@pytest.mark.parametrize(
    "mesh_cfg",
    [sharding.MeshConfig(data=2, fsdp=4), sharding.MeshConfig(fsdp=2, expert=2, tensor=2)],
    ids=["data=2,fsdp=4", "fsdp=2,expert=2,tensor=2"],
)
def test_sharded_step_matches_one_device(setup: Setup, one, mesh_cfg) -> None:
    want, want_metrics = one.after, one.metrics
    mesh = _mesh(mesh_cfg)
    state, metrics = _step(setup, mesh_cfg)
    for key in ("loss", "total_loss", "grad_norm", "aux_loss", "sat_q"):
        np.testing.assert_allclose(metrics[key], want_metrics[key], rtol=RTOL, atol=ATOL)
    _assert_close(jax.device_get(state.params), want.params)
    frozen = jax.tree.leaves(jax.device_get(state.frozen))
    for x, y in zip(frozen, jax.tree.leaves(want.frozen), strict=True):
        np.testing.assert_array_equal(x, y)
    want_sh = train_state_shardings(MODEL_CFG, OPTIMIZER, mesh)
    got_sh = jax.tree.map(lambda x: x.sharding, state)
    assert jax.tree.leaves(got_sh) == jax.tree.leaves(want_sh)


def test_reference_params_are_the_whole_model(setup: Setup) -> None:
    # The base (fresh adapters: B = 0) as the reference of the KL penalty.
    base, adapters = split_lora(setup.params0)
    zero_b = jax.tree_util.tree_map_with_path(
        lambda p, x: np.zeros_like(x) if str(p[-1].key).endswith("_lora_b") else x, adapters
    )
    mesh = _mesh(ONE)
    ref = join_lora(base, zero_b)
    loss_cfg = dataclasses.replace(LOSS_CFG, kl_coef=0.1)
    step_fn = make_train_step(MODEL_CFG, OPTIMIZER, StepConfig(loss=loss_cfg), mesh)
    state = create_train_state(MODEL_CFG, OPTIMIZER, mesh, setup.params0)
    _, metrics = step_fn(state, shard_batch(setup.batch, mesh), ref)
    assert metrics["step_skipped"] == 0.0 and metrics["kl_ref"] > 0


def test_rank_zero_keeps_the_state_as_before() -> None:
    cfg = MODEL_CFG.replace(lora=LoRAConfig())
    mesh = _mesh(ONE)
    _, abstract = placement.abstract_model(cfg)
    params = jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), nnx.to_pure_dict(abstract))
    state = create_train_state(cfg, OPTIMIZER, mesh, params)
    assert state.frozen is None
    assert jax.tree.structure(state.params) == jax.tree.structure(params)
    assert train_state_shardings(cfg, OPTIMIZER, mesh).frozen is None


def test_lora_params_without_adapters_are_a_clear_error() -> None:
    mesh = _mesh(ONE)
    _, base = placement.abstract_model(MODEL_CFG.replace(lora=LoRAConfig()))
    params = jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), nnx.to_pure_dict(base))
    with pytest.raises(ValueError, match="no LoRA adapters"):
        create_train_state(MODEL_CFG, OPTIMIZER, mesh, params)
