"""The grid's in-process sampler (benchmarks/sampler.py) against the full forward: greedy argmax
step by step, sampled tokens' log-probs (a float64 NumPy log-softmax over the vocab mask), recorded
routing, EOS masking and padding."""

from __future__ import annotations

import pathlib
import sys

import jax
import numpy as np
import pytest
from flax import nnx

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

import sampler  # noqa: E402

from sat_jax import quant, sharding  # noqa: E402
from sat_jax.model import ModelConfig, placement  # noqa: E402
from sat_jax.tasks import CharTokenizer, sampleable_mask  # noqa: E402

MODEL_CFG = ModelConfig.preset("tiny", vocab_size=24)
TOKENIZER = CharTokenizer("0123456789+-*=() ")
EOS = TOKENIZER.eos_id
MAX_NEW = 5
PROMPTS = [TOKENIZER.encode(t, bos=True) for t in ("1+2=", "13-4=", "7=", "21+30=", "5*5=", "0=")]
LOGP_TOL = 1e-5  # float32 forward and log-softmax vs a float64 log-softmax of the same logits


@pytest.fixture(scope="module")
def model():
    mesh = sharding.make_mesh(sharding.MeshConfig(fsdp=1), jax.devices()[:1])
    return placement.init_sharded(MODEL_CFG, mesh, 0)


def _batch(extra: int = 2) -> tuple[np.ndarray, np.ndarray]:
    return sampler.pad_prompts(PROMPTS, max(map(len, PROMPTS)) + MAX_NEW + extra)


def _logits(graphdef, params, tokens_bt) -> np.ndarray:
    return np.asarray(nnx.merge(graphdef, params)(np.asarray(tokens_bt)), np.float64)


def _completion(tokens_bt, lengths_b, b: int) -> list[int]:
    return np.asarray(tokens_bt)[b, lengths_b[b] : lengths_b[b] + MAX_NEW].tolist()


def test_pad_prompts_left_aligns_and_refuses_a_long_prompt():
    tokens, lengths = sampler.pad_prompts([[1, 5], [1, 6, 7]], 4)
    np.testing.assert_array_equal(tokens, [[1, 5, 0, 0], [1, 6, 7, 0]])
    np.testing.assert_array_equal(lengths, [2, 3])
    assert tokens.dtype == lengths.dtype == np.int32
    with pytest.raises(ValueError, match="exceeds seq_len 2"):
        sampler.pad_prompts([[1, 5, 6]], 2)


@pytest.mark.parametrize("masked", [False, True])
def test_greedy_is_the_argmax_of_the_full_forward_step_by_step(model, masked):
    graphdef, params = model
    tokens, lengths = _batch()
    vocab_mask = sampleable_mask(TOKENIZER, MODEL_CFG.vocab_size) if masked else None
    out = sampler.sample(
        graphdef,
        params,
        tokens,
        lengths,
        None,
        max_new_tokens=MAX_NEW,
        temperature=1.0,
        vocab_mask=vocab_mask,
        eos_id=EOS,
        greedy=True,
    )
    assert out.logp_bt is None and out.routing_btlk is None
    allowed = np.ones(MODEL_CFG.vocab_size, bool) if vocab_mask is None else vocab_mask
    # One full forward over each produced sequence: by causality, position len + s - 1 sees exactly
    # the prompt and the first s completion tokens, which is what decoding token s saw.
    for b in range(len(PROMPTS)):
        got = _completion(out.tokens_bt, lengths, b)
        n_new = got.index(EOS) + 1 if EOS in got else MAX_NEW
        assert got[n_new:] == [0] * (MAX_NEW - n_new), (b, got)
        ids = [*PROMPTS[b], *got[:n_new]]
        logits = _logits(graphdef, params, np.asarray([ids], np.int32))[0]
        for s in range(n_new):
            pos = len(PROMPTS[b]) + s - 1
            want = int(np.argmax(np.where(allowed, logits[pos], -np.inf)))
            assert got[s] == want, (b, s, got, want)


def test_sampled_logprobs_and_routing_are_the_full_forward_at_the_sampled_tokens(model):
    graphdef, params = model
    tokens, lengths = _batch()
    vocab_mask = sampleable_mask(TOKENIZER, MODEL_CFG.vocab_size)
    out = sampler.sample(
        graphdef,
        params,
        tokens,
        lengths,
        jax.random.key(3),
        max_new_tokens=MAX_NEW,
        temperature=1.0,
        vocab_mask=vocab_mask,
        eos_id=EOS,
        return_logp=True,
        return_routing=True,
    )
    got_tokens, mask = np.asarray(out.tokens_bt), np.asarray(out.mask_bt)
    logits_btv = _logits(graphdef, params, got_tokens)
    masked = np.where(vocab_mask, logits_btv, -np.inf)
    log_softmax = masked - np.logaddexp.reduce(masked, axis=-1, keepdims=True)
    expected = np.zeros_like(mask, np.float64)
    rows, cols = np.nonzero(mask)
    expected[rows, cols] = log_softmax[rows, cols - 1, got_tokens[rows, cols]]
    np.testing.assert_allclose(np.asarray(out.logp_bt), expected, rtol=0, atol=LOGP_TOL)
    assert np.all(vocab_mask[got_tokens[mask > 0]])  # only sampleable ids were drawn
    _, routing = nnx.merge(graphdef, params)(got_tokens, return_routing=True)
    np.testing.assert_array_equal(np.asarray(out.routing_btlk), np.asarray(routing))
    # The trainer's view of the same tokens, replaying the recorded ids, is the same policy.
    replayed, _ = jax.jit(
        lambda p, x, r: nnx.merge(graphdef, p).logprobs(x, vocab_mask=vocab_mask, replay_routing=r)
    )(params, got_tokens, out.routing_btlk)
    np.testing.assert_allclose(np.asarray(replayed) * mask, expected, rtol=0, atol=LOGP_TOL)


def test_a_key_fixes_the_sample_and_temperature_scales_the_recorded_logprobs(model):
    graphdef, params = model
    tokens, lengths = _batch()
    vocab_mask = sampleable_mask(TOKENIZER, MODEL_CFG.vocab_size)
    kwargs = dict(max_new_tokens=MAX_NEW, vocab_mask=vocab_mask, eos_id=EOS, return_logp=True)
    draw = lambda seed, t: sampler.sample(
        graphdef, params, tokens, lengths, jax.random.key(seed), temperature=t, **kwargs
    )
    a, again, other = draw(0, 1.0), draw(0, 1.0), draw(1, 1.0)
    np.testing.assert_array_equal(np.asarray(a.tokens_bt), np.asarray(again.tokens_bt))
    assert not np.array_equal(np.asarray(a.tokens_bt), np.asarray(other.tokens_bt))
    hot = draw(0, 2.0)
    got_tokens, mask = np.asarray(hot.tokens_bt), np.asarray(hot.mask_bt)
    masked = np.where(vocab_mask, _logits(graphdef, params, got_tokens) / 2.0, -np.inf)
    log_softmax = masked - np.logaddexp.reduce(masked, axis=-1, keepdims=True)
    rows, cols = np.nonzero(mask)
    np.testing.assert_allclose(
        np.asarray(hot.logp_bt)[rows, cols],
        log_softmax[rows, cols - 1, got_tokens[rows, cols]],
        rtol=0,
        atol=LOGP_TOL,
    )


@pytest.mark.parametrize(
    "allowed, length",
    [
        ((EOS,), 1),  # EOS first: the mask covers it alone, the rest is padding
        ((5, 6), MAX_NEW),  # EOS impossible: the whole limit
    ],
)
def test_the_mask_ends_at_the_first_eos_and_padding_follows(model, allowed, length):
    graphdef, params = model
    tokens, lengths = _batch()
    vocab_mask = np.isin(np.arange(MODEL_CFG.vocab_size), allowed)
    out = sampler.sample(
        graphdef,
        params,
        tokens,
        lengths,
        jax.random.key(0),
        max_new_tokens=MAX_NEW,
        temperature=1.0,
        vocab_mask=vocab_mask,
        eos_id=EOS,
        return_logp=True,
    )
    got, mask = np.asarray(out.tokens_bt), np.asarray(out.mask_bt)
    for b in range(len(PROMPTS)):
        np.testing.assert_array_equal(got[b, : lengths[b]], PROMPTS[b])  # the prompt is kept
        expected = np.zeros(got.shape[1], np.float32)
        expected[lengths[b] : lengths[b] + length] = 1.0
        np.testing.assert_array_equal(mask[b], expected)
        assert np.all(got[b, lengths[b] + length :] == 0)
    assert np.all(np.asarray(out.logp_bt)[mask == 0] == 0)


def test_a_mixed_batch_pads_each_row_after_its_own_first_eos(model):
    graphdef, params = model
    tokens, lengths = _batch()
    vocab_mask = np.isin(np.arange(MODEL_CFG.vocab_size), (EOS, 5))
    out = sampler.sample(
        graphdef,
        params,
        tokens,
        lengths,
        jax.random.key(7),
        max_new_tokens=MAX_NEW,
        temperature=4.0,  # flat: rows end at different steps
        vocab_mask=vocab_mask,
        eos_id=EOS,
    )
    got, mask = np.asarray(out.tokens_bt), np.asarray(out.mask_bt)
    ends = set()
    for b in range(len(PROMPTS)):
        completion = _completion(got, lengths, b)
        n = completion.index(EOS) + 1 if EOS in completion else MAX_NEW
        ends.add(n)
        assert set(completion[:n]) <= {EOS, 5} and EOS not in completion[: n - 1]
        assert completion[n:] == [0] * (MAX_NEW - n)
        assert mask[b].sum() == n and mask[b, lengths[b] : lengths[b] + n].all()
    assert len(ends) > 1, ends


def _nucleus_logp(logits_v: np.ndarray, allowed: np.ndarray, top_p: float) -> np.ndarray:
    """float64 log-probs of the top-p nucleus of softmax(logits) over ``allowed`` (-inf outside):
    the smallest set of the most likely ids whose mass reaches ``top_p``, renormalised."""
    x = np.where(allowed, logits_v, -np.inf)
    p = np.exp(x - np.logaddexp.reduce(x))
    order = np.argsort(-p, kind="stable")
    before = np.cumsum(p[order]) - p[order]
    keep = np.zeros_like(allowed)
    keep[order[before < top_p]] = True
    kept = np.where(keep, x, -np.inf)
    return kept - np.logaddexp.reduce(kept)


def _bf16(graphdef_params):
    """The sampler row set's model: weights and matmuls in bfloat16 (frontier --sampler-dtype)."""
    _, params = graphdef_params
    dtype = jax.numpy.bfloat16
    graphdef, _ = placement.abstract_model(MODEL_CFG.replace(dtype=dtype, param_dtype=dtype))
    return graphdef, jax.tree.map(lambda x: x.astype(dtype), params)


def test_top_p_records_the_truncated_bf16_logprobs_and_the_trainer_replays_them(model):
    graphdef, params = _bf16(model)
    tokens, lengths = _batch()
    vocab_mask = sampleable_mask(TOKENIZER, MODEL_CFG.vocab_size)
    out = sampler.sample(
        graphdef,
        params,
        tokens,
        lengths,
        jax.random.key(5),
        max_new_tokens=MAX_NEW,
        temperature=1.0,
        vocab_mask=vocab_mask,
        eos_id=EOS,
        return_logp=True,
        return_routing=True,
        top_p=0.9,
    )
    got_tokens, mask = np.asarray(out.tokens_bt), np.asarray(out.mask_bt)
    logp, kept = np.asarray(out.logp_bt), np.asarray(out.kept_bt)
    logits_btv = _logits(graphdef, params, got_tokens)  # the bf16 model's own float32 logits
    rows, cols = np.nonzero(mask)
    for b, t in zip(rows, cols, strict=True):
        want = _nucleus_logp(logits_btv[b, t - 1], vocab_mask, 0.9)
        assert np.isfinite(want[got_tokens[b, t]])  # every drawn token is in its nucleus
        assert kept[b, t] == np.isfinite(want).sum() < vocab_mask.sum()
        np.testing.assert_allclose(logp[b, t], want[got_tokens[b, t]], rtol=0, atol=1e-4)
    assert np.all(kept[mask == 0] == 0) and np.all(logp[mask == 0] == 0)
    score = jax.jit(
        lambda g, p, x, k: nnx.merge(g, p).logprobs(x, vocab_mask=vocab_mask, kept_bt=k)[0],
        static_argnums=0,
    )
    # The step's truncation replay on the sampler's own weights gives back the recorded log-probs.
    replayed = np.asarray(score(graphdef, params, got_tokens, out.kept_bt))
    np.testing.assert_allclose(replayed * mask, logp, rtol=0, atol=1e-4)
    # The float32 trainer differs by bf16 rounding with the replay; without it, also by the
    # nucleus's mass (the truncation then reads as a mismatch).
    trainer_graphdef, trainer_params = model
    with_replay = np.asarray(score(trainer_graphdef, trainer_params, got_tokens, out.kept_bt))
    full = np.asarray(score(trainer_graphdef, trainer_params, got_tokens, None))
    d_replay = np.abs(with_replay - logp)[mask > 0]
    d_full = np.abs(full - logp)[mask > 0]
    assert d_replay.max() > 0 and d_replay.mean() < d_full.mean()


def test_top_p_is_checked_and_one_is_the_untruncated_sampler(model):
    graphdef, params = model
    tokens, lengths = _batch()
    kwargs = dict(max_new_tokens=MAX_NEW, temperature=1.0, vocab_mask=None, eos_id=EOS)
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\], got 1.5"):
        sampler.sample(graphdef, params, tokens, lengths, jax.random.key(0), top_p=1.5, **kwargs)
    out = sampler.sample(
        graphdef, params, tokens, lengths, jax.random.key(0), return_logp=True, **kwargs
    )
    assert out.kept_bt is None and out.logp_bt is not None


@pytest.mark.parametrize("weights, cache", [("fp8", "fp8"), ("int8", "fp8"), ("bfloat16", "int8")])
def test_an_8bit_sampler_records_the_quantized_models_own_logprobs(model, weights, cache):
    """The frontier's 8-bit rollouts: weights quantized by the server's function, the cache read
    as the server's 8-bit cache holds it. Tokens and recorded log-probs are those of the
    quantized model's full forward (the forward the server's decode matches,
    tests/sat_jax/test_decoding_quant.py), not of the unquantized one."""
    graphdef, params = model
    served = quant.quantize_params(params, weights)
    tokens, lengths = _batch()
    vocab_mask = sampleable_mask(TOKENIZER, MODEL_CFG.vocab_size)
    kwargs = dict(max_new_tokens=MAX_NEW, vocab_mask=vocab_mask, eos_id=EOS, return_logp=True)
    out = sampler.sample(
        graphdef, served, tokens, lengths, jax.random.key(5), temperature=1.0,
        kv_cache_dtype=cache, **kwargs,
    )  # fmt: skip
    got_tokens, mask = np.asarray(out.tokens_bt), np.asarray(out.mask_bt)
    quantized = nnx.merge(graphdef, quant.dequantize_params(served))
    logits = np.asarray(quantized.forward(got_tokens, kv_cache_dtype=cache).logits_btv, np.float64)
    masked = np.where(vocab_mask, logits, -np.inf)
    log_softmax = masked - np.logaddexp.reduce(masked, axis=-1, keepdims=True)
    rows, cols = np.nonzero(mask)
    want = log_softmax[rows, cols - 1, got_tokens[rows, cols]]
    np.testing.assert_allclose(np.asarray(out.logp_bt)[rows, cols], want, rtol=0, atol=LOGP_TOL)
    # The unquantized model scores the same tokens otherwise: the option changes the policy.
    plain = np.where(vocab_mask, _logits(graphdef, params, got_tokens), -np.inf)
    plain = plain - np.logaddexp.reduce(plain, axis=-1, keepdims=True)
    assert np.abs(plain[rows, cols - 1, got_tokens[rows, cols]] - want).max() > 100 * LOGP_TOL
    # Greedy decoding steps through the quantized model too: each token is its argmax.
    greedy = sampler.sample(
        graphdef, served, tokens, lengths, None, greedy=True, temperature=1.0,
        kv_cache_dtype=cache, **kwargs,
    )  # fmt: skip
    ids = np.asarray(greedy.tokens_bt)
    step_logits = np.asarray(quantized.forward(ids, kv_cache_dtype=cache).logits_btv)
    for r, c in zip(*np.nonzero(np.asarray(greedy.mask_bt)), strict=True):
        assert ids[r, c] == np.argmax(np.where(vocab_mask, step_logits[r, c - 1], -np.inf))


def test_the_8bit_options_off_are_the_unquantized_sampler_bit_for_bit(model):
    graphdef, params = model
    tokens, lengths = _batch()
    vocab_mask = sampleable_mask(TOKENIZER, MODEL_CFG.vocab_size)
    kwargs = dict(
        max_new_tokens=MAX_NEW, vocab_mask=vocab_mask, eos_id=EOS, temperature=1.0,
        return_logp=True, return_routing=True,
    )  # fmt: skip
    base = sampler.sample(graphdef, params, tokens, lengths, jax.random.key(2), **kwargs)
    off = sampler.sample(
        graphdef, quant.quantize_params(params, "bfloat16"), tokens, lengths, jax.random.key(2),
        kv_cache_dtype="bfloat16", **kwargs,
    )  # fmt: skip
    for a, b in zip(jax.tree.leaves(base), jax.tree.leaves(off), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of bfloat16, int8, fp8"):
        sampler.sample(
            graphdef, params, tokens, lengths, jax.random.key(2), kv_cache_dtype="fp4", **kwargs
        )
