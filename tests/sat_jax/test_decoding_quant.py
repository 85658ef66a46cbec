"""8-bit serving in sat_jax.decoding: a DecodeCore with quantized weights (`quant.QTensor`
params) and an int8 / fp8 KV cache records behavior log-probs and routing that are the full
forward's of the same quantized weights with the same cache quantization, and its decode step
still writes the donated 8-bit cache in place."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sat_jax import decoding, quant
from sat_jax.model import ModelConfig, Transformer
from tests.random_models import random_params

CFG = ModelConfig.preset("tiny", dispatch="dense")
SAMPLEABLE = (np.arange(CFG.vocab_size) >= 2) & (np.arange(CFG.vocab_size) < 40)
PROMPTS = [[1, 5, 9], [1, 3, 3, 8, 2]]
STEPS = 10


@functools.cache
def _model():
    return random_params(CFG, seed=1)


@functools.cache
def _forward(kv_cache_dtype: str):
    graphdef, _ = _model()

    def run(params, seq):
        out = nnx.merge(graphdef, params).forward(seq, kv_cache_dtype=kv_cache_dtype)
        return out.logits_btv, out.routing_btlk

    return jax.jit(run)


def _decode(weight_dtype: str, kv_cache_dtype: str):
    """Tokens, log-probs [steps] and routing [steps, L, K] per prompt, sampled at temperature 1."""
    graphdef, params = _model()
    served = quant.quantize_params(params, weight_dtype)
    core = decoding.DecodeCore(
        graphdef,
        CFG,
        slots=2,
        max_prefill_length=8,
        max_decode_length=STEPS,
        sampling=decoding.SamplingConfig(),
        sampleable_v=SAMPLEABLE,
        kv_cache_dtype=kv_cache_dtype,
    )
    state = core.init_state()
    assert state.cache.k_lbsgh.dtype == (
        jnp.dtype(CFG.params_dtype)
        if kv_cache_dtype == "bfloat16"
        else quant.kv_storage_dtype(kv_cache_dtype)
    )
    for slot, ids in enumerate(PROMPTS):
        state = core.insert(core.prefill_prompt(served, ids), state, jnp.int32(slot))
    rows = []
    for _ in range(STEPS):
        state, data = core.generate(served, state, jnp.int32(0))
        rows.append(decoding.unpack_step(data, CFG.num_moe_layers, CFG.num_experts_per_tok))
    return served, [
        (
            np.array([r["token"][s] for r in rows]),
            np.array([r["logp"][s] for r in rows]),
            np.stack([r["routing"][s] for r in rows]),
        )
        for s in range(len(PROMPTS))
    ]


def _reference(params, prompt, tokens, kv_cache_dtype):
    """Log-probs of ``tokens`` after ``prompt`` and their routing under the full forward."""
    seq = np.asarray([[*prompt, *tokens]], np.int32)
    logits, routing = _forward(kv_cache_dtype)(params, jnp.asarray(seq))
    n = len(prompt)
    logits = np.where(SAMPLEABLE, np.asarray(logits)[0, n - 1 : -1], -np.inf)
    logp = np.asarray(jax.nn.log_softmax(logits, axis=-1))
    return logp[np.arange(len(tokens)), tokens], np.asarray(routing)[0, n:]


@pytest.mark.parametrize(
    ("weight_dtype", "kv_cache_dtype"),
    [("int8", "fp8"), ("fp8", "int8"), ("bfloat16", "fp8"), ("int8", "bfloat16")],
)
def test_behavior_logprobs_are_the_quantized_models_full_forward(weight_dtype, kv_cache_dtype):
    """The recorded log-probs equal the full forward of the dequantized weights whose attention
    reads keys and values as the 8-bit cache holds them, to float32 tolerance; the routing is
    that forward's routing (what R3 replays)."""
    served, per_prompt = _decode(weight_dtype, kv_cache_dtype)
    dequantized = quant.dequantize_params(served)
    _, exact = _model()
    gaps = []
    for prompt, (tokens, logp, routing) in zip(PROMPTS, per_prompt, strict=True):
        want, want_routing = _reference(dequantized, prompt, tokens, kv_cache_dtype)
        np.testing.assert_allclose(logp, want, rtol=0, atol=1e-5)
        np.testing.assert_array_equal(np.sort(routing, -1), np.sort(want_routing, -1))
        unquantized, _ = _reference(exact, prompt, tokens, "bfloat16")
        gaps.append(np.abs(logp - unquantized).max())
    # The quantization is real: the unquantized model scores the same tokens differently.
    assert max(gaps) > 1e-3, gaps


def test_the_8bit_cache_holds_what_the_full_forward_attends_over():
    """With the unquantized cache of the same weights as the reference, an 8-bit cache's
    log-probs are off by more than float32 tolerance: the cache's quantization is what the
    reference above replays."""
    served, per_prompt = _decode("bfloat16", "int8")
    tokens, logp, _ = per_prompt[1]
    plain, _ = _reference(served, PROMPTS[1], tokens, "bfloat16")
    assert np.abs(logp - plain).max() > 1e-5


def _compiled_memory(weight_dtype: str, kv_cache_dtype: str):
    """(cache bytes, generate's and extend's memory analyses) of a deeper tiny model's core."""
    cfg = ModelConfig.preset("tiny", dispatch="dense", num_layers=8)
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))
    params = jax.eval_shape(
        functools.partial(quant.quantize_params, fmt=weight_dtype), nnx.to_pure_dict(abstract)
    )
    core = decoding.DecodeCore(
        graphdef,
        cfg,
        slots=8,
        max_prefill_length=16,
        max_decode_length=239,
        sampling=decoding.SamplingConfig(),
        sampleable_v=np.ones((cfg.vocab_size,), bool),
        kv_cache_dtype=kv_cache_dtype,
    )
    state = jax.eval_shape(core.init_state)
    cache_bytes = sum(x.size * x.dtype.itemsize for x in state.cache.arrays().values())
    scalar = jnp.int32(0)
    generate = core.generate_step.lower(params, state, scalar, core.cache_length).compile()
    tokens = jax.ShapeDtypeStruct((16,), jnp.int32)
    extend = core._extend_step.lower(params, state, scalar, tokens, *(scalar,) * 5).compile()
    return state.cache, cache_bytes, [c.memory_analysis() for c in (generate, extend)]


@pytest.mark.parametrize("weight_dtype", ["bfloat16", "int8"])
@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
def test_generate_and_extend_write_the_donated_8bit_cache_in_place(weight_dtype, kv_cache_dtype):
    """As for the bfloat16 cache (tests/sat_jax/test_decoding.py): the compiled decode step and
    an extension alias the donated 8-bit cache and its scales, and need no more temporaries than
    the same programs over the float cache (which that test bounds), so no second cache, 8-bit
    or dequantized, is built. Structural (XLA's memory analysis)."""
    cache, cache_bytes, stats = _compiled_memory(weight_dtype, kv_cache_dtype)
    assert set(cache.arrays()) == {"k_lbsgh", "v_lbsgh", "k_scale_lbsg", "v_scale_lbsg"}
    assert cache.k_lbsgh.dtype.itemsize == 1
    _, float_bytes, float_stats = _compiled_memory(weight_dtype, "bfloat16")
    assert cache_bytes < float_bytes / 3  # float32 tiny cache: 1 byte + 4/H bytes of scale
    for name, s, f in zip(("generate", "extend"), stats, float_stats, strict=True):
        assert s.alias_size_in_bytes >= cache_bytes, name
        assert s.temp_size_in_bytes <= f.temp_size_in_bytes, (name, s.temp_size_in_bytes)


def test_bad_kv_cache_dtype_is_refused():
    graphdef, _ = _model()
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        decoding.DecodeCore(
            graphdef,
            CFG,
            slots=1,
            max_prefill_length=8,
            max_decode_length=2,
            sampling=decoding.SamplingConfig(),
            sampleable_v=SAMPLEABLE,
            kv_cache_dtype="float8_e5m2",
        )
