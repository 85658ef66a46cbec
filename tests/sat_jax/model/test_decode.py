"""KV-cache decoding: per-token log-probs and routing through the cache equal the full forward."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sat_jax.model import ModelConfig, Transformer, token_logprobs

CFG = ModelConfig.preset("tiny")
PROMPT_LENS = (5, 2, 7)
STEPS, MAX_LEN = 6, 16


@pytest.fixture(scope="module")
def model():
    # RBG params and NumPy prompts skip slow threefry compiles (see test_transformer.py).
    return Transformer(CFG, rngs=nnx.Rngs(jax.random.key(0, impl="rbg")))


@functools.partial(nnx.jit, static_argnames=("return_routing",))
def _prefill(model, cache, tokens, mask, return_routing):
    return model.prefill(cache, tokens, mask_bt=mask, return_routing=return_routing)


@functools.partial(nnx.jit, static_argnames=("return_routing",))
def _step(model, cache, tokens, active, return_routing):
    return model.decode_step(cache, tokens, active_b=active, return_routing=return_routing)


@nnx.jit
def _forward(model, tokens, mask):
    return model.forward(tokens, mask_bt=mask)


@functools.partial(jax.jit, static_argnames=("temperature",))
def _sample(logits_bv, seed, temperature):
    tok_b = jax.random.categorical(jax.random.key(seed), logits_bv / temperature)
    logp_b = token_logprobs(logits_bv[:, None], tok_b[:, None], temperature=temperature)[:, 0]
    return tok_b.astype(jnp.int32), logp_b


def _sample_through_cache(model, return_routing, temperature=0.8):
    """Prefills right-padded prompts of different lengths, samples STEPS tokens per row."""
    b, t = len(PROMPT_LENS), max(PROMPT_LENS)
    lens = jnp.array(PROMPT_LENS)
    prompts = jnp.asarray(np.random.default_rng(0).integers(0, CFG.vocab_size, (b, t)), jnp.int32)
    mask = jnp.arange(t)[None] < lens[:, None]
    prompts = jnp.where(mask, prompts, 0)
    pre = _prefill(model, model.init_cache(b, MAX_LEN), prompts, mask, return_routing)
    assert np.array_equal(pre.cache.lengths_b, lens)
    logits_bv = pre.logits_btv[jnp.arange(b), lens - 1]
    cache, sampled, logps, routing = pre.cache, [], [], []
    for i in range(STEPS):
        tok_b, logp_b = _sample(logits_bv, 100 + i, temperature)
        sampled.append(tok_b)
        logps.append(logp_b)
        out = _step(model, cache, tok_b, jnp.ones(b, bool), return_routing)
        assert (out.routing_blk is not None) == return_routing
        routing.append(out.routing_blk)
        cache, logits_bv = out.cache, out.logits_bv
    assert np.array_equal(cache.lengths_b, lens + STEPS)
    return prompts, pre, jnp.stack(sampled, 1), jnp.stack(logps, 1), routing


def _full_sequences(prompts, sampled):
    """Row b: its prompt, then its sampled tokens, right-padded to a common length."""
    b = prompts.shape[0]
    seqs = np.zeros((b, max(PROMPT_LENS) + STEPS), np.int32)
    for r, n in enumerate(PROMPT_LENS):
        seqs[r, :n] = prompts[r, :n]
        seqs[r, n : n + STEPS] = sampled[r]
    mask = np.arange(seqs.shape[1])[None] < (np.array(PROMPT_LENS) + STEPS)[:, None]
    return jnp.asarray(seqs), jnp.asarray(mask)


@pytest.mark.parametrize("return_routing", [False, True])
def test_decode_logprobs_equal_full_forward(model, return_routing):
    prompts, pre, sampled, logps, routing = _sample_through_cache(model, return_routing)
    seqs, mask = _full_sequences(prompts, sampled)
    full = _forward(model, seqs, mask)
    # Token i of row r sits at position n_r + i and is predicted from position n_r + i - 1.
    for r, n in enumerate(PROMPT_LENS):
        want = token_logprobs(
            full.logits_btv[r : r + 1, n - 1 : n - 1 + STEPS], sampled[r : r + 1], temperature=0.8
        )[0]
        np.testing.assert_allclose(logps[r], want, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(
            pre.logits_btv[r, :n], full.logits_btv[r, :n], rtol=1e-4, atol=1e-4
        )
    if return_routing:
        steps_bslk = jnp.stack(routing, axis=1)  # [B, STEPS, L, K], token i at position n_r + i
        for r, n in enumerate(PROMPT_LENS):
            np.testing.assert_array_equal(pre.routing_btlk[r, :n], full.routing_btlk[r, :n])
            np.testing.assert_array_equal(steps_bslk[r], full.routing_btlk[r, n : n + STEPS])
        assert steps_bslk.dtype == jnp.uint8


def test_inactive_rows_do_not_advance(model):
    # Same shapes as above, so the jitted prefill and step are reused.
    b, t = len(PROMPT_LENS), max(PROMPT_LENS)
    mask = jnp.arange(t)[None] < jnp.array(PROMPT_LENS)[:, None]
    pre = _prefill(model, model.init_cache(b, MAX_LEN), jnp.ones((b, t), jnp.int32), mask, False)
    tokens, active = jnp.array([7, 8, 9], jnp.int32), jnp.array([True, False, True])
    out = _step(model, pre.cache, tokens, active, False)
    np.testing.assert_array_equal(out.cache.lengths_b, np.add(PROMPT_LENS, [1, 0, 1]))
    # The inactive row's next step overwrites the slot and sees the same context as before.
    again = _step(model, out.cache, tokens, jnp.ones(b, bool), False)
    np.testing.assert_allclose(again.logits_bv[1], out.logits_bv[1], rtol=1e-5, atol=1e-5)


def test_prompt_longer_than_cache_is_rejected(model):
    with pytest.raises(ValueError, match="cache length"):
        model.prefill(model.init_cache(1, 4), jnp.zeros((1, 5), jnp.int32))


@functools.partial(nnx.jit, static_argnames=("return_routing",))
def _extend(model, cache, tokens, mask, return_routing):
    return model.extend(cache, tokens, mask_bt=mask, return_routing=return_routing)


def test_extend_equals_one_prefill_of_the_whole_sequence(model):
    """A cache filled by prefill + decode steps, then extended by a padded chunk per row (rows
    of different lengths, garbage past each row's length), gives the logits, routing and next
    decode step of one forward over the whole sequence: the multi-turn server's observation
    insertion is exact."""
    prompts, pre, sampled, _, _ = _sample_through_cache(model, False)
    b, chunk = len(PROMPT_LENS), 4
    cache = pre.cache
    for i in range(STEPS):  # the cache of prompt + sampled tokens, as the server holds it
        cache = _step(model, cache, sampled[:, i], jnp.ones(b, bool), False).cache
    # Rewind row 1 by two tokens (the server drops a turn's steps after its end) and fill
    # positions past every row's length with garbage that must be ignored.
    keep = np.array([STEPS, STEPS - 2, STEPS])
    lengths = np.array(PROMPT_LENS) + keep
    cache = cache.replace(lengths_b=jnp.asarray(lengths, jnp.int32))
    obs_lens = np.array([3, 1, 2])  # every row keeps room for one more step
    obs = np.random.default_rng(1).integers(0, CFG.vocab_size, (b, chunk)).astype(np.int32)
    obs_mask = np.arange(chunk)[None] < obs_lens[:, None]
    out = _extend(model, cache, jnp.asarray(obs), jnp.asarray(obs_mask), True)
    np.testing.assert_array_equal(out.cache.lengths_b, lengths + obs_lens)
    total = lengths + obs_lens
    seqs = np.zeros((b, MAX_LEN), np.int32)
    for r, n in enumerate(PROMPT_LENS):
        seqs[r, :n] = prompts[r, :n]
        seqs[r, n : n + keep[r]] = sampled[r, : keep[r]]
        seqs[r, lengths[r] : total[r]] = obs[r, : obs_lens[r]]
    full = _forward(
        model, jnp.asarray(seqs), jnp.asarray(np.arange(MAX_LEN)[None] < total[:, None])
    )
    nxt = jnp.array([3, 4, 5], jnp.int32)
    step = _step(model, out.cache, nxt, jnp.ones(b, bool), False)
    seqs2 = seqs.copy()
    seqs2[np.arange(b), total] = nxt
    full2 = _forward(
        model, jnp.asarray(seqs2), jnp.asarray(np.arange(MAX_LEN)[None] < total[:, None] + 1)
    )
    for r in range(b):
        span = slice(lengths[r], total[r])
        np.testing.assert_allclose(
            out.logits_btv[r, : obs_lens[r]], full.logits_btv[r, span], rtol=1e-4, atol=1e-4
        )
        np.testing.assert_array_equal(
            out.routing_btlk[r, : obs_lens[r]], full.routing_btlk[r, span]
        )
        np.testing.assert_allclose(
            step.logits_bv[r], full2.logits_btv[r, total[r]], rtol=1e-4, atol=1e-4
        )
