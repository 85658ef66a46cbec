"""LoRA adapters: the config, the adapter parameters, W + (alpha / r) A B in every path, HF import.

A fresh adapter (B = 0) leaves the model bit for bit the base on every dispatch path and through
the KV cache; a trained one equals the base with its weights merged in float64 NumPy.
"""

from __future__ import annotations

import math
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sat_jax import sharding
from sat_jax.model import LoRAConfig, ModelConfig, Transformer, hf, hf_export
from sat_jax.model.layers import LORA_A, LORA_B, is_lora_path
from sat_jax.model.lora import init_lora, join_lora, split_lora

ALL = ("attention", "mlp", "experts", "router")
# A dense layer, then a MoE layer: every target has weights to adapt.
BASE = ModelConfig.preset("tiny", mlp_only_layers=(0,), dispatch="dense")
LORA = BASE.replace(lora=LoRAConfig(rank=4, alpha=8.0, targets=ALL))
# (module path in a layer, weight, batch dims, input dims) of every adapted weight.
ADAPTED = {
    "attention": [("attn", w, 0, n) for w, n in [("w_q_dnh", 1), ("w_k_dgh", 1), ("w_v_dgh", 1)]]
    + [("attn", "w_o_nhd", 0, 2)],
    "mlp": [("mlp", w, 0, 1) for w in ("w_gate_df", "w_up_df", "w_down_fd")],
    "experts": [("mlp", w, 1, 1) for w in ("w_gate_edf", "w_up_edf", "w_down_efd")],
    "router": [("mlp", "w_router_de", 0, 1)],
}


def _rngs() -> nnx.Rngs:
    return nnx.Rngs(jax.random.key(0, impl="rbg"))


def _pure(model: nnx.Module) -> dict:
    return nnx.to_pure_dict(nnx.state(model))


def _tokens(b: int = 2, t: int = 12, seed: int = 0) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).integers(0, BASE.vocab_size, (b, t)), jnp.int32)


@nnx.jit(static_argnames=("dispatch",))
def _forward(model, tokens, dispatch=None):
    out = model.forward(tokens, dispatch=dispatch)
    return out.logits_btv, out.routing_btlk


@pytest.fixture(scope="module")
def models() -> tuple[Transformer, Transformer]:
    """(the base, the same base with fresh adapters on every target)."""
    return Transformer(BASE, rngs=_rngs()), Transformer(LORA, rngs=_rngs())


# Config.


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(rank=-1), "lora.rank must be an int >= 0"),
        (dict(rank=True), "lora.rank must be an int >= 0"),
        (dict(rank=4, alpha=0.0), "lora.alpha must be a positive"),
        (dict(targets=["attention"]), "lora.targets must be a tuple"),
        (dict(targets=("attention", "mlpp")), "unknown target 'mlpp'"),
        (dict(targets=("shared_expert",)), "Qwen3-MoE has no shared expert"),
        (dict(targets=("attention", "attention")), "lists a target twice"),
        (dict(rank=4, targets=()), "lora.targets is empty"),
    ],
)
def test_lora_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LoRAConfig(**kwargs)


@pytest.mark.parametrize(
    ("model", "targets", "match"),
    [
        (dict(num_experts=0), ("experts",), "'experts' but the model has no MoE layers"),
        (dict(num_experts=0), ("router",), "'router' but the model has no MoE layers"),
        (dict(), ("mlp",), "'mlp' but the model has no dense layers"),
    ],
)
def test_targets_the_model_lacks_are_errors(model, targets, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig.preset("tiny", **model, lora=LoRAConfig(rank=2, targets=targets))
    # Off, the same targets are only names.
    ModelConfig.preset("tiny", **model, lora=LoRAConfig(rank=0, targets=targets))


def test_scale_is_alpha_over_rank():
    assert LoRAConfig(rank=8, alpha=16.0).scale == 2.0
    assert LoRAConfig().scale == 0.0 and LoRAConfig().rank == 0


# Parameters.


def test_rank_zero_has_no_adapters_and_lora_leaves_the_base_init_alone(models):
    base, lora = models
    assert not any(is_lora_path(p) for p, _ in nnx.to_flat_state(nnx.state(base)))
    got_base, adapters = split_lora(_pure(lora))
    want = _pure(base)
    assert jax.tree.structure(got_base) == jax.tree.structure(want)
    for x, y in zip(jax.tree.leaves(got_base), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(x, y)
    assert len(jax.tree.leaves(adapters)) == 2 * (4 * LORA.num_layers + 3 + 3 + 1)


@pytest.mark.parametrize("target", ALL)
def test_adapters_shapes_axes_types_and_init(models, target):
    _, lora = models
    r = LORA.lora.rank
    layer = 0 if target == "mlp" else 1
    for module_name, name, nb, ni in ADAPTED[target]:
        module = getattr(lora.layers[layer], module_name)
        w = getattr(module, name)
        a, b = getattr(module, name + LORA_A), getattr(module, name + LORA_B)
        assert type(a) is nnx.LoRAParam and type(b) is nnx.LoRAParam
        assert isinstance(a, nnx.Param)
        shape, axes = w.shape, w.get_metadata()["out_sharding"]
        assert a.shape == (*shape[: nb + ni], r), name
        assert b.shape == (*shape[:nb], r, *shape[nb + ni :]), name
        assert a.get_metadata()["out_sharding"] == (*axes[: nb + ni], "lora_rank")
        assert b.get_metadata()["out_sharding"] == (*axes[:nb], "lora_rank", *axes[nb + ni :])
        assert a.dtype == b.dtype == w.dtype
        np.testing.assert_array_equal(b[...], 0.0)
        fan_in = math.prod(shape[nb : nb + ni])
        assert 0.5 < float(jnp.std(a[...])) * math.sqrt(fan_in) < 1.5, name
    # Nothing is adapted outside the targets.
    only = Transformer(BASE.replace(lora=LoRAConfig(rank=2, targets=(target,))), rngs=_rngs())
    names = {str(p[-1]) for p, _ in nnx.to_flat_state(nnx.state(only)) if is_lora_path(p)}
    assert names == {n + s for _, n, _, _ in ADAPTED[target] for s in (LORA_A, LORA_B)}


def test_adapters_shard_like_their_weights_with_the_rank_replicated(models):
    mesh = {"data": 1, "fsdp": 2, "expert": 2, "tensor": 2}
    specs = sharding.param_specs(nnx.state(models[1]), mesh)
    moe = specs["layers"][1]["mlp"]
    P = jax.sharding.PartitionSpec
    assert moe["w_gate_edf_lora_a"] == P("expert", "fsdp", None)
    assert moe["w_gate_edf_lora_b"] == P("expert", None, "tensor")
    assert moe["w_down_efd_lora_b"] == P("expert", None, "fsdp")
    assert moe["w_router_de_lora_b"] == P()  # the router's rule: replicated
    assert specs["layers"][0]["attn"]["w_q_dnh_lora_b"] == P(None, "tensor", None)


# The forward.


# "gmm" runs the megablox kernels in Pallas interpret mode off TPU.
@pytest.mark.parametrize("dispatch", ["dense", "ragged", "blocked", "gmm"])
def test_fresh_adapters_give_bit_identical_logits(models, dispatch):
    base, lora = models
    tokens = _tokens()
    want_logits, want_routing = _forward(base, tokens, dispatch)
    got_logits, got_routing = _forward(lora, tokens, dispatch)
    np.testing.assert_array_equal(got_logits, want_logits)
    np.testing.assert_array_equal(got_routing, want_routing)


@nnx.jit
def _prefill_and_decode(model, prompts, mask, next_b):
    pre = model.prefill(model.init_cache(prompts.shape[0], 16), prompts, mask_bt=mask)
    step = model.decode_step(pre.cache, next_b, return_routing=True)
    again = model.decode_step(step.cache, next_b, window=12)
    return pre.logits_btv, step.logits_bv, step.routing_blk, again.logits_bv


def test_fresh_adapters_give_bit_identical_prefill_and_decode(models):
    base, lora = models
    prompts = _tokens(3, 7, seed=1)
    mask = jnp.arange(7)[None] < jnp.array([[7], [3], [5]])
    next_b = jnp.array([1, 2, 3], jnp.int32)
    want = _prefill_and_decode(base, prompts, mask, next_b)
    got = _prefill_and_decode(lora, prompts, mask, next_b)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w)


def _trained(lora: Transformer, seed: int = 0) -> dict:
    """The LoRA model's params with every B drawn at random (as after some training)."""
    rng = np.random.default_rng(seed)
    base, adapters = split_lora(_pure(lora))
    adapters = jax.tree_util.tree_map_with_path(
        lambda p, x: (
            jnp.asarray(rng.normal(0, 0.3, x.shape), x.dtype)
            if str(p[-1].key).endswith(LORA_B)
            else x
        ),
        adapters,
    )
    return join_lora(base, adapters)


def _merged(params: dict, scale: float) -> dict:
    """The base params with each adapted W replaced by W + scale · A B, in float64 NumPy."""
    base, adapters = split_lora(params)
    base = jax.tree.map(lambda x: np.asarray(x, np.float64), base)

    def merge(tree: dict, ads: dict) -> None:
        for key, value in ads.items():
            if isinstance(value, dict):
                merge(tree[key], value)
            elif key.endswith(LORA_A):
                name = key.removesuffix(LORA_A)
                a = np.asarray(value, np.float64)
                b = np.asarray(ads[name + LORA_B], np.float64)
                w = tree[name]
                nb = a.ndim + b.ndim - 2 - w.ndim
                a2 = a.reshape(*a.shape[:nb], -1, a.shape[-1])
                b2 = b.reshape(*b.shape[: nb + 1], -1)
                tree[name] = w + scale * (a2 @ b2).reshape(w.shape)

    merge(base, adapters)
    return jax.tree.map(lambda x: np.asarray(x, np.float32), base)


@pytest.mark.parametrize("dispatch", ["dense", "ragged", "blocked"])
def test_trained_adapters_equal_the_merged_weights(models, dispatch):
    base, lora = models
    params = _trained(lora)
    graphdef, _ = nnx.split(lora)
    adapted = nnx.merge(graphdef, params)
    merged = nnx.merge(nnx.split(base)[0], _merged(params, LORA.lora.scale))
    tokens = _tokens(seed=2)
    got, got_routing = _forward(adapted, tokens, dispatch)
    want, want_routing = _forward(merged, tokens, "dense")
    assert not np.allclose(got, _forward(base, tokens, "dense")[0], atol=1e-2)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    assert np.mean(np.asarray(got_routing) == np.asarray(want_routing)) > 0.95


def test_gradients_reach_the_adapters(models):
    _, lora = models
    tokens = _tokens()

    @nnx.jit
    def grads(model):
        loss = lambda m: jnp.mean(jax.nn.log_softmax(m(tokens))[..., 0])
        return nnx.grad(loss, argnums=nnx.DiffState(0, nnx.LoRAParam))(model)

    g = nnx.to_pure_dict(grads(lora))
    flat = {
        jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(g)
    }
    assert flat and all("_lora_" in k for k in flat)
    # At B = 0 the gradient reaches B; A's is zero until B moves.
    assert all(np.any(v != 0) for k, v in flat.items() if k.endswith(f"{LORA_B}']"))
    assert all(np.all(v == 0) for k, v in flat.items() if k.endswith(f"{LORA_A}']"))


# HF import.


def test_hf_import_with_lora_reads_the_base_and_makes_fresh_adapters(tmp_path: pathlib.Path):
    cfg = BASE.replace(dispatch="auto")
    params = _pure(Transformer(cfg, rngs=nnx.Rngs(0)))
    out = hf_export.export_qwen3_moe(params, cfg, tmp_path / "hf")
    lora_cfg = hf.config_from_dir(out, lora=LoRAConfig(rank=4, targets=ALL))
    graphdef, loaded = hf.load_params(out, lora_cfg)
    base, adapters = split_lora(loaded)
    for x, y in zip(jax.tree.leaves(base), jax.tree.leaves(params), strict=True):
        np.testing.assert_array_equal(x, y)
    want = init_lora(lora_cfg, None, 0)
    assert jax.tree.structure(adapters) == jax.tree.structure(want)
    for x, y in zip(jax.tree.leaves(adapters), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(x, y)
    tokens = _tokens()
    np.testing.assert_array_equal(
        _forward(nnx.merge(graphdef, loaded), tokens)[0],
        _forward(hf.load_qwen3_moe(out), tokens)[0],
    )
    # Onto a mesh, adapters included, each on its rule's sharding.
    mesh = sharding.make_mesh(sharding.MeshConfig(fsdp=2, expert=2, tensor=2))
    model = hf.load_qwen3_moe(out, mesh=mesh, lora=lora_cfg.lora)
    want_sh = sharding.param_shardings(nnx.state(model), mesh)
    for (path, x), sh in zip(
        jax.tree_util.tree_leaves_with_path(_pure(model)), jax.tree.leaves(want_sh), strict=True
    ):
        assert x.sharding.is_equivalent_to(sh, x.ndim), path
    np.testing.assert_array_equal(_pure(model)["layers"][1]["mlp"]["w_up_edf_lora_b"], 0.0)
