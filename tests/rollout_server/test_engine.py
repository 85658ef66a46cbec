"""rollout_server.engine / sampling on the tiny model.

The reference for behavior log-probs is the model's FULL forward over prompt + sampled tokens
(`token_logprobs` at the sampling temperature) under the params of the version each token reports.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rollout_server.engine import FailedPrefix, MoEEngine, unpack_step
from sat_jax.config import RolloutConfig
from sat_jax.decoding import SamplingConfig, sample, sampling_logprobs
from sat_jax.model import ModelConfig, token_logprobs
from sat_jax.tasks import CharTokenizer
from tests.random_models import random_params

CFG = ModelConfig.preset("tiny", dispatch="dense")
TOK = CharTokenizer("0123456789+-*=() ")
PROMPTS = ["12+7=", "3-45=", "9*9=", "100+1=", "7="]


REF_LEN = 32


@functools.cache
def _model():
    """The tiny model with random params drawn by NumPy (eager Flax init takes ~10 s here)."""
    return nnx.merge(*random_params(CFG, seed=0))


@functools.cache
def _jitted_forward():
    graphdef = nnx.split(_model())[0]
    return jax.jit(lambda params, seq: nnx.merge(graphdef, params)(seq, return_routing=True))


def _engine(temperature=1.0, top_k=0, top_p=1.0, slots=4, max_decode=8, seed=0):
    return MoEEngine(
        _model(),
        tokenizer=TOK,
        slots=slots,
        max_prefill_length=16,
        max_decode_length=max_decode,
        sampling=SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p),
        seed=seed,
    )


def _prefill_insert(engine, state, text, slot):
    ids = np.array([TOK.bos_id, *TOK.encode(text)], np.int32)
    padded = np.pad(ids, (0, 16 - len(ids)))
    prefix = engine.prefill(params=None, padded_tokens=padded, true_length=len(ids))
    return engine.insert(prefix, state, slot), ids


def _full_forward(params, prompt, completion):
    """Logits [T, V] and routing [T, L, K] of prompt + completion (right-padded: causal, so the
    padding never changes earlier positions)."""
    seq = np.concatenate([prompt, completion]).astype(np.int32)
    padded = np.pad(seq, (0, REF_LEN - len(seq)))[None]
    logits, routing = _jitted_forward()(params, jnp.asarray(padded))
    return seq, logits[0, : len(seq)], np.asarray(routing[0, : len(seq)])


def _full_forward_logps(params, prompt, completion, temperature):
    seq, logits, _ = _full_forward(params, prompt, completion)
    # The engine samples only the tokenizer's ids other than pad and bos.
    ids = np.arange(CFG.vocab_size)
    sampleable = (ids < TOK.vocab_size) & (ids != TOK.pad_id) & (ids != TOK.bos_id)
    logits = jnp.where(sampleable, logits, -jnp.inf)
    lp = token_logprobs(logits[:-1], jnp.asarray(seq[1:]), temperature=temperature)
    return np.asarray(lp[len(prompt) - 1 :])


def _run(engine, state, steps):
    rows = []
    for _ in range(steps):
        state, result = engine.generate(None, state)
        rows.append(unpack_step(result.data, CFG.num_moe_layers, CFG.num_experts_per_tok))
    return state, rows


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_behavior_logprobs_match_full_forward(temperature):
    engine = _engine(temperature=temperature)
    state = engine.init_decode_state()
    prompts = []
    for slot, text in enumerate(PROMPTS[:3]):
        state, ids = _prefill_insert(engine, state, text, slot)
        prompts.append(ids)
    state, rows = _run(engine, state, 8)
    params = engine.current_params()[1]
    for slot, prompt in enumerate(prompts):
        tokens = np.array([r["token"][slot] for r in rows])
        logp = np.array([r["logp"][slot] for r in rows])
        assert all(r["valid"][slot] for r in rows)
        assert [r["length"][slot] for r in rows] == list(range(1, 9))
        ref = _full_forward_logps(params, prompt, tokens, temperature)
        np.testing.assert_allclose(logp, ref, atol=1e-4)
    # The empty slot never emits a valid token.
    assert not any(r["valid"][3] for r in rows)


def test_routing_matches_full_forward_and_prompt_routing_on_host():
    engine = _engine()
    state = engine.init_decode_state()
    state, ids = _prefill_insert(engine, state, "12+7=", 1)
    prompt_ids, prompt_routing = engine.slot_prompt(1)
    np.testing.assert_array_equal(prompt_ids, ids)
    assert prompt_routing.dtype == np.uint8
    state, rows = _run(engine, state, 5)
    tokens = np.array([r["token"][1] for r in rows])
    gen_routing = np.stack([r["routing"][1] for r in rows])
    _, _, routing = _full_forward(engine.current_params()[1], ids, tokens)
    # Top-k ids are a set; compare sorted.
    np.testing.assert_array_equal(np.sort(prompt_routing, -1), np.sort(routing[: len(ids)], -1))
    np.testing.assert_array_equal(np.sort(gen_routing, -1), np.sort(routing[len(ids) :], -1))


def test_max_decode_length_stops_slot():
    engine = _engine(max_decode=3)
    state = engine.init_decode_state()
    state, _ = _prefill_insert(engine, state, "1+1=", 0)
    state, rows = _run(engine, state, 5)
    assert [bool(r["valid"][0]) for r in rows] == [True, True, True, False, False]


def _perturbed(params, scale, seed):
    leaves, treedef = jax.tree_util.tree_flatten(params)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return jax.tree_util.tree_unflatten(
        treedef,
        [
            x + scale * jax.random.normal(k, x.shape, x.dtype)
            for x, k in zip(leaves, keys, strict=True)
        ],
    )


def test_swap_between_steps_versions_and_logprobs():
    engine = _engine(temperature=1.0)
    state = engine.init_decode_state()
    prompts = {}
    for slot, text in enumerate(PROMPTS[:2]):
        state, prompts[slot] = _prefill_insert(engine, state, text, slot)
    params = {0: engine.current_params()[1]}
    state, rows = _run(engine, state, 3)
    compiled = engine.core.generate_step._cache_size()
    params[5] = _perturbed(params[0], 0.05, 1)
    engine.swap_params(5, params[5])
    assert engine.version == 5
    # A slot inserted after the swap prefills with the new params.
    state, prompts[2] = _prefill_insert(engine, state, PROMPTS[2], 2)
    state, more = _run(engine, state, 4)
    assert engine.core.generate_step._cache_size() == compiled  # no recompilation
    rows += more
    for slot in (0, 1):
        versions = [int(r["version"][slot]) for r in rows]
        # The token sampled right after the swap still comes from the old params' logits.
        assert versions == [0, 0, 0, 0, 5, 5, 5]
    assert [int(r["version"][2]) for r in more] == [5, 5, 5, 5]
    # Tokens of version 0 equal the full forward under the old params. Later tokens of slots 0
    # and 1 attend to KV entries the old params computed (in-flight update: the cache is not
    # recomputed), so no single-params forward reproduces them; they must differ from the old one.
    for slot in (0, 1):
        tokens = np.array([r["token"][slot] for r in rows])
        logp = np.array([r["logp"][slot] for r in rows])
        ref0 = _full_forward_logps(params[0], prompts[slot], tokens, 1.0)
        np.testing.assert_allclose(logp[:4], ref0[:4], atol=1e-4)
        assert np.abs(logp[4:] - ref0[4:]).max() > 1e-3
    # Slot 2 lived only under the new params: exactly their full forward.
    tokens = np.array([r["token"][2] for r in more])
    logp = np.array([r["logp"][2] for r in more])
    np.testing.assert_allclose(
        logp, _full_forward_logps(params[5], prompts[2], tokens, 1.0), atol=1e-4
    )


def test_swap_rejects_mismatched_params():
    engine = _engine()
    params = engine.current_params()[1]
    bad = jax.tree_util.tree_map(lambda x: x[..., :1], params)
    with pytest.raises(ValueError):
        engine.swap_params(1, bad)
    with pytest.raises(ValueError, match="version"):
        engine.swap_params(2**31, params)
    assert engine.version == 0


def test_swap_casts_float32_weights_to_the_serving_dtype():
    # A bfloat16 server (server.dtype) takes the float32 trainer's weights, cast on the way in.
    model = _model()
    graphdef, state = nnx.split(model)
    bf16 = jax.tree_util.tree_map(lambda x: x.astype(jnp.bfloat16), nnx.to_pure_dict(state))
    bf16_model = nnx.merge(graphdef, bf16)
    engine = MoEEngine(
        bf16_model,
        tokenizer=TOK,
        slots=2,
        max_prefill_length=16,
        max_decode_length=4,
        sampling=SamplingConfig(),
    )
    f32 = nnx.to_pure_dict(state)
    engine.swap_params(3, f32)
    got = jax.tree_util.tree_leaves(engine.current_params()[1])
    want = jax.tree_util.tree_leaves(f32)
    assert all(g.dtype == jnp.bfloat16 for g in got)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w.astype(jnp.bfloat16)))
    ints = jax.tree_util.tree_map(lambda x: x.astype(jnp.int32), f32)
    with pytest.raises(ValueError, match="does not match"):
        engine.swap_params(4, ints)
    assert engine.version == 3


def _numpy_sampling_logprobs(logits, temperature, top_k, top_p):
    """float64 reference written from the definitions, not the implementation."""
    x = logits.astype(np.float64) / temperature
    keep = np.ones_like(x, bool)
    if top_k:
        kth = np.sort(x)[::-1][top_k - 1]
        keep &= x >= kth
    p = np.where(keep, np.exp(x - x[keep].max()), 0.0)
    p /= p.sum()
    if top_p < 1:
        order = np.argsort(-p, kind="stable")
        cum = 0.0
        nucleus = np.zeros_like(keep)
        for i in order:
            if cum >= top_p or p[i] == 0:
                break
            nucleus[i] = True
            cum += p[i]
        keep &= nucleus
        p = np.where(keep, p, 0.0)
        p /= p.sum()
    with np.errstate(divide="ignore"):
        return np.log(p)


@pytest.mark.parametrize(
    "temperature, top_k, top_p",
    [(1.0, 0, 1.0), (0.5, 0, 1.0), (1.0, 5, 1.0), (1.0, 0, 0.6), (0.8, 10, 0.9), (2.0, 1, 1.0)],
)
def test_sampling_distribution_matches_reference(temperature, top_k, top_p):
    logits = np.asarray(jax.random.normal(jax.random.key(3), (6, 40)) * 3.0)
    cfg = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p)
    got = np.asarray(sampling_logprobs(jnp.asarray(logits), cfg))
    for b in range(logits.shape[0]):
        ref = _numpy_sampling_logprobs(logits[b], temperature, top_k, top_p)
        np.testing.assert_array_equal(np.isfinite(got[b]), np.isfinite(ref))
        fin = np.isfinite(ref)
        np.testing.assert_allclose(got[b][fin], ref[fin], atol=1e-5)
    tokens, logp, kept = sample(jnp.asarray(logits), jax.random.key(0), cfg)
    np.testing.assert_allclose(np.asarray(logp), got[np.arange(6), np.asarray(tokens)], atol=0)
    assert np.all(np.isfinite(np.asarray(logp)))
    want_kept = [
        int(np.isfinite(_numpy_sampling_logprobs(row, temperature, top_k, top_p)).sum())
        for row in logits
    ]
    assert np.asarray(kept).tolist() == want_kept


def test_engine_validates_config():
    with pytest.raises(ValueError, match="power of two"):
        MoEEngine(
            _model(),
            tokenizer=TOK,
            slots=2,
            max_prefill_length=20,
            max_decode_length=4,
            sampling=SamplingConfig.from_rollout(RolloutConfig()),
            seed=0,
        )


@pytest.mark.parametrize(
    ("n_tokens", "error"),
    [
        (16, None),  # exactly max_prefill_length (prompt ids as the tokenizer made them)
        (1, None),
        (17, "17 tokens; max_prefill_length is 16"),
        (0, "the prompt is empty"),
    ],
)
def test_check_prompt_length(n_tokens, error):
    engine = _engine()
    if error is None:
        engine.check_prompt_length(n_tokens)
    else:
        with pytest.raises(ValueError, match=error):
            engine.check_prompt_length(n_tokens)


def test_failed_prefill_never_raises_and_leaves_slot_empty():
    engine = _engine()
    state = engine.init_decode_state()
    bad = engine.prefill(params=None, padded_tokens=np.zeros(16, np.int32), true_length=0)
    assert isinstance(bad, FailedPrefix)
    state, _ = _prefill_insert(engine, state, "1+1=", 0)
    state = engine.insert(bad, state, 1)
    with pytest.raises(KeyError):
        engine.slot_prompt(1)
    state, rows = _run(engine, state, 2)
    assert all(r["valid"][0] for r in rows) and not any(r["valid"][1] for r in rows)
