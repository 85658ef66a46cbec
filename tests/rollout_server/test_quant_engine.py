"""8-bit serving in rollout_server.engine (`server.weight_dtype`, `server.kv_cache_dtype`): the
engine quantizes what it installs, its behavior log-probs are the quantized model's own, a LoRA
push is merged into its full-precision base and then quantized, a push that cannot be quantized
changes nothing, and bad settings are refused at start naming the key."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx, traverse_util

from rollout_server.engine import MoEEngine, check_backend_formats, unpack_step
from rollout_server.weights import WeightsLoader
from sat_jax import params_io, quant, sharding
from sat_jax.config.server import ServerConfig
from sat_jax.decoding import SamplingConfig
from sat_jax.model import ModelConfig, Transformer, placement
from sat_jax.model.config import LoRAConfig
from sat_jax.model.lora import abstract_adapters, init_lora, join_lora
from sat_jax.tasks import CharTokenizer
from tests.random_models import random_params

CFG = ModelConfig.preset("tiny", dispatch="dense")
TOK = CharTokenizer("0123456789+-*=() ")
LORA = LoRAConfig(rank=4, alpha=8.0, targets=("attention", "experts"))
STEPS = 6


@functools.cache
def _params():
    return random_params(CFG, seed=0)


def _engine(weight_dtype="int8", kv_cache_dtype="fp8", params=None, cfg=CFG):
    graphdef, default = _params()
    model = nnx.merge(graphdef, default if params is None else params)
    return MoEEngine(
        model,
        tokenizer=TOK,
        slots=2,
        max_prefill_length=16,
        max_decode_length=STEPS,
        sampling=SamplingConfig(),
        weight_dtype=weight_dtype,
        kv_cache_dtype=kv_cache_dtype,
    )


def _sample(engine, text="12+7="):
    """(prompt ids, tokens, behavior log-probs) of one slot's STEPS tokens."""
    ids = np.array([TOK.bos_id, *TOK.encode(text)], np.int32)
    state = engine.init_decode_state()
    padded = np.pad(ids, (0, 16 - len(ids)))
    prefix = engine.prefill(params=None, padded_tokens=padded, true_length=len(ids))
    state = engine.insert(prefix, state, 0)
    rows = []
    for _ in range(STEPS):
        state, result = engine.generate(None, state)
        rows.append(unpack_step(result.data, CFG.num_moe_layers, CFG.num_experts_per_tok))
    return ids, np.array([r["token"][0] for r in rows]), np.array([r["logp"][0] for r in rows])


def _forward_logps(params, prompt, tokens, kv_cache_dtype):
    graphdef, _ = _params()
    seq = jnp.asarray(np.concatenate([prompt, tokens])[None].astype(np.int32))
    logits = nnx.merge(graphdef, params).forward(seq, kv_cache_dtype=kv_cache_dtype).logits_btv
    ids = np.arange(CFG.vocab_size)
    sampleable = (ids < TOK.vocab_size) & (ids != TOK.pad_id) & (ids != TOK.bos_id)
    logits = np.where(sampleable, np.asarray(logits)[0, len(prompt) - 1 : -1], -np.inf)
    logp = np.asarray(jax.nn.log_softmax(logits, axis=-1))
    return logp[np.arange(len(tokens)), tokens]


def _served_leaves(engine):
    return [np.asarray(x) for x in jax.tree.leaves(engine.served_params()[1])]


def test_installed_weights_are_quantized_and_logprobs_are_the_quantized_models():
    engine = _engine()
    _, full = _params()
    served = engine.served_params()[1]
    w = served["layers"][0]["mlp"]["w_gate_edf"]
    assert isinstance(w, quant.QTensor) and w.q.dtype == jnp.int8
    assert not isinstance(served["layers"][0]["mlp"]["w_router_de"], quant.QTensor)
    # current_params is the full-precision layout a push restores into, without the arrays.
    like = engine.current_params()[1]
    assert jax.tree.structure(like) == jax.tree.structure(full)
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(like))
    prompt, tokens, logp = _sample(engine)
    want = _forward_logps(quant.dequantize_params(served), prompt, tokens, "fp8")
    np.testing.assert_allclose(logp, want, rtol=0, atol=1e-5)


def test_a_push_is_quantized_on_install_and_one_with_nan_changes_nothing():
    engine = _engine()
    _, full = _params()
    pushed = jax.tree.map(lambda x: x * 1.1, full)
    engine.swap_params(1, pushed)
    want = jax.tree.leaves(jax.jit(functools.partial(quant.quantize_params, fmt="int8"))(pushed))
    for g, w in zip(_served_leaves(engine), want, strict=True):
        np.testing.assert_array_equal(g, np.asarray(w))
    before = _served_leaves(engine)
    bad = jax.tree.map(lambda x: x, pushed)
    bad["layers"][1]["attn"]["w_q_dnh"] = (
        bad["layers"][1]["attn"]["w_q_dnh"].at[0, 0, 0].set(jnp.nan)
    )
    with pytest.raises(ValueError, match="server.weight_dtype int8 cannot quantize"):
        engine.swap_params(2, bad)
    assert engine.version == 1
    for g, w in zip(_served_leaves(engine), before, strict=True):
        np.testing.assert_array_equal(g, w)


def test_options_off_serve_the_params_as_they_are():
    engine = _engine("bfloat16", "bfloat16")
    _, full = _params()
    for g, w in zip(
        jax.tree.leaves(engine.current_params()[1]), jax.tree.leaves(full), strict=True
    ):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    assert engine.served_params()[1] is engine.current_params()[1]


def test_lora_push_is_merged_into_the_full_precision_base_then_quantized(tmp_path):
    """Adapters stay full precision up to the merge: the served weights are quantize(base +
    scale·AB), never base quantized plus adapters."""
    lora_cfg = CFG.replace(lora=LORA)
    mesh = sharding.make_mesh(sharding.MeshConfig(), jax.devices()[:1])
    _, base = placement.init_sharded(CFG, mesh, 0)
    params_io.save_params(tmp_path / "base", base)
    rng = np.random.default_rng(3)
    adapters = jax.tree.map(
        lambda x: jnp.asarray(rng.standard_normal(x.shape) * 0.05, x.dtype),
        init_lora(lora_cfg, rng=1),
    )
    params_io.save_params(tmp_path / "v1", adapters)
    engine = _engine(params=base)
    loader = WeightsLoader(str(tmp_path), LORA, abstract_adapters(lora_cfg, mesh))
    loaded = loader.load(str(tmp_path / "v1"), str(tmp_path / "base"), engine.current_params()[1])
    engine.swap_params(1, loaded.params)
    served = quant.dequantize_params(engine.served_params()[1])
    # The served model is quantize(merge): it computes what that quantized merge computes.
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, CFG.vocab_size, (2, 12)))
    graph_lora, _ = nnx.split(nnx.eval_shape(lambda: Transformer(lora_cfg, rngs=nnx.Rngs(0))))
    trained = nnx.merge(graph_lora, join_lora(base, adapters))(tokens)
    graph, _ = _params()
    got = nnx.merge(graph, served)(tokens)
    merged = nnx.merge(graph, loaded.params)(tokens)
    want_served = nnx.merge(
        graph, quant.dequantize_params(quant.quantize_params(loaded.params, "int8"))
    )(tokens)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want_served), rtol=0, atol=1e-5)
    np.testing.assert_allclose(np.asarray(merged), np.asarray(trained), rtol=1e-4, atol=1e-5)
    assert np.abs(np.asarray(got) - np.asarray(trained)).max() > 1e-4  # int8 is not exact
    flat = traverse_util.flatten_dict(
        engine.served_params()[1], is_leaf=lambda _, x: isinstance(x, quant.QTensor)
    )
    assert any(isinstance(x, quant.QTensor) for x in flat.values())


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"weight_dtype": "int4"}, "server.weight_dtype must be one of"),
        ({"kv_cache_dtype": "float8"}, "server.kv_cache_dtype must be one of"),
        (
            {"dtype": "float8_e4m3fn", "weight_dtype": "int8"},
            "server.weight_dtype int8 needs server.dtype of 16 or 32 bits",
        ),
    ],
)
def test_bad_settings_are_refused_naming_the_key(kwargs, error):
    with pytest.raises(ValueError, match=error):
        ServerConfig(**kwargs)


def test_engine_refuses_an_unknown_format_naming_the_key():
    with pytest.raises(ValueError, match="server.kv_cache_dtype must be one of"):
        check_backend_formats("int8", "e5m2")
    check_backend_formats("fp8", "int8")  # the CPU backend runs both
