"""The comparison grid's in-process rollouts: decoding by full recompute (greedy or sampled).

One jitted ``sample`` gives ``benchmarks/grid.py`` (and ``frontier.py``, through it) its rollouts:
temperature sampling with the behavior log-probs and expert ids recorded from the sampling
weights, the quantities the rollout server records (docs/DESIGN.md §6), reproducible from one PRNG
key per batch. With ``top_p < 1`` each token is drawn by the rollout server's own sampling code
(``sat_jax.decoding.sample``: the top-p nucleus, renormalised) and the sampler records, as the
server does, the token's log-prob under that truncated distribution and the kept set's size (the
trainer's truncation replay, docs/DESIGN.md §2). Every new token recomputes the whole forward: the arithmetic task's sequences are a
few dozen tokens, and causal attention makes the padding after each row's cursor irrelevant.

The project's decoder is ``sat_jax.decoding`` (KV cache, continuous batching over slots: the rollout
server's and the evaluation's). This one lives with the benchmarks because the grid needs what
that one does not give: a whole batch decoded at once from one key, with every position's expert
ids (prompt included) for routing replay. Its log-probs are the trainer's
(``Transformer.logprobs``).

Dimension letters: B rows, T positions, V vocabulary, L MoE layers, K experts per token.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from sat_jax import decoding, quant


@struct.dataclass
class Completions:
    """Prompts with their sampled completions, aligned as ``TrainBatch`` fields.

    Attributes:
      tokens_bt: [B, T] int32 prompt + completion; 0 (pad) after each row's first EOS.
      mask_bt: [B, T] float32, 1 on each row's completion tokens up to and including its first EOS.
      logp_bt: [B, T] float32 log-probs of the tokens under the sampling weights (at the sampling
        temperature, renormalized over ``vocab_mask``), 0 outside ``mask_bt``; None unless asked.
      routing_btlk: [B, T, L, K] the sampling weights' own expert ids; None unless asked.
      kept_bt: [B, T] int32, with ``top_p < 1``: the size of the kept set each completion token
        was drawn from (``TrainBatch.kept_counts``), 0 outside ``mask_bt``; None otherwise.
    """

    tokens_bt: jax.Array
    mask_bt: jax.Array
    logp_bt: jax.Array | None = None
    routing_btlk: jax.Array | None = None
    kept_bt: jax.Array | None = None


def pad_prompts(prompts: Sequence[Sequence[int]], seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Left-aligned prompt ids in a zero-padded [B, seq_len] int32 array, and their [B] lengths."""
    lengths_b = np.asarray([len(p) for p in prompts], np.int32)
    if len(prompts) and int(lengths_b.max()) > seq_len:
        raise ValueError(f"a prompt of {int(lengths_b.max())} tokens exceeds seq_len {seq_len}")
    tokens_bt = np.zeros((len(prompts), seq_len), np.int32)
    for b, p in enumerate(prompts):
        tokens_bt[b, : len(p)] = p
    return tokens_bt, lengths_b


@functools.partial(
    jax.jit,
    static_argnames=(
        "graphdef",
        "max_new_tokens",
        "temperature",
        "top_p",
        "eos_id",
        "greedy",
        "return_logp",
        "return_routing",
        "kv_cache_dtype",
    ),
)
def sample(
    graphdef: nnx.GraphDef,
    params: Any,
    tokens_bt: jax.Array,
    lengths_b: jax.Array,
    key: jax.Array | None,
    *,
    max_new_tokens: int,
    temperature: float,
    vocab_mask: jax.Array | None,
    eos_id: int,
    greedy: bool = False,
    return_logp: bool = False,
    return_routing: bool = False,
    top_p: float = 1.0,
    kv_cache_dtype: str = "bfloat16",
) -> Completions:
    """``max_new_tokens`` tokens after each row's prompt, by full recompute.

    Token s of row b goes to position ``lengths_b[b] + s``. Sampling draws it from
    softmax(logits / temperature) restricted to ``vocab_mask``, with the key of step s taken as
    ``key, sub = split(key)`` once per step; ``greedy`` takes the argmax of the logits over
    ``vocab_mask`` (over every id when it is None) and ignores ``key`` and ``temperature``.
    Decoding runs the full length; tokens after a row's first EOS are then replaced by pad.

    With ``top_p < 1`` (not greedy) token s is drawn by ``sat_jax.decoding.sample`` from the
    smallest nucleus of mass ``top_p`` of that distribution, renormalised, and its log-prob there
    and the nucleus's size are recorded at the step (``logp_bt``, ``kept_bt``), as the rollout
    server records them; the trainer replays the truncation from ``kept_bt``.

    Args:
      graphdef, params: the policy (``nnx.split`` of a ``Transformer``).
      tokens_bt: [B, T] int32 prompts, left-aligned; needs ``lengths_b + max_new_tokens <= T``.
      lengths_b: [B] int32 prompt lengths (at least 1: BOS).
      key: a PRNG key; unused (may be None) when ``greedy``.
      max_new_tokens: completion length limit (EOS included).
      temperature: the sampling temperature, also that of the recorded log-probs.
      vocab_mask: [V] bool, the ids that may be sampled; None = every id.
      eos_id: the end-of-sequence id.
      greedy: argmax decoding.
      return_logp, return_routing: also record ``Completions.logp_bt`` / ``routing_btlk`` from
        one more forward of the finished sequences under the same weights (with ``top_p < 1``
        the log-probs are the ones recorded while sampling, and ``kept_bt`` comes with them).
      top_p: the nucleus mass, in (0, 1]; 1 = no truncation.
      kv_cache_dtype: "int8" / "fp8": attention reads keys and values as a rollout server's 8-bit
        decode cache holds them (``Transformer.forward(kv_cache_dtype=...)``), in every forward
        (sampling and the recorded log-probs). ``params`` may hold the server's 8-bit weights
        (``sat_jax.quant.quantize_params``): they are dequantized here, as the server's
        ``DecodeCore`` does. Both off ("bfloat16", a float tree): the same program as before.
    """
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    truncates = top_p < 1.0 and not greedy
    if tokens_bt.shape[1] < max_new_tokens + 1:
        raise ValueError(f"tokens_bt has {tokens_bt.shape[1]} columns for {max_new_tokens} new")
    quant.check_format(kv_cache_dtype, "kv_cache_dtype")
    model = nnx.merge(graphdef, quant.dequantize_params(params))
    if quant.is_quantized(kv_cache_dtype):
        forward = lambda t: model.forward(t, kv_cache_dtype=kv_cache_dtype).logits_btv
    else:
        forward = model  # the original program, bit for bit
    rows = jnp.arange(tokens_bt.shape[0])
    floor = jnp.finfo(jnp.float32).min

    def body(s: int, carry: tuple[jax.Array, jax.Array | None]):
        tokens, key = carry
        pos = lengths_b + s
        if greedy:
            logits = forward(tokens)[rows, pos - 1]
            if vocab_mask is not None:
                logits = jnp.where(vocab_mask, logits, floor)
            nxt = jnp.argmax(logits, axis=-1).astype(tokens.dtype)
            return tokens.at[rows, pos].set(nxt), key
        key, sub = jax.random.split(key)
        logits = forward(tokens)[rows, pos - 1] / temperature
        if vocab_mask is not None:
            logits = jnp.where(vocab_mask, logits, floor)
        nxt = jax.random.categorical(sub, logits).astype(tokens.dtype)
        return tokens.at[rows, pos].set(nxt), key

    def truncated_body(s: int, carry: tuple[jax.Array, ...]):
        # The rollout server's own draw: masked ids at -inf, then temperature and the nucleus.
        tokens, key, logp_bt, kept_bt = carry
        pos = lengths_b + s
        key, sub = jax.random.split(key)
        logits = forward(tokens)[rows, pos - 1]
        if vocab_mask is not None:
            logits = jnp.where(vocab_mask, logits, -jnp.inf)
        nxt, logp_b, kept_b = decoding.sample(logits, sub, sampling)
        return (
            tokens.at[rows, pos].set(nxt.astype(tokens.dtype)),
            key,
            logp_bt.at[rows, pos].set(logp_b),
            kept_bt.at[rows, pos].set(kept_b),
        )

    if truncates:
        sampling = decoding.SamplingConfig(temperature=temperature, top_p=top_p)
        zeros = jnp.zeros(tokens_bt.shape, jnp.float32)
        carry = (tokens_bt, key, zeros, zeros.astype(jnp.int32))
        tokens, _, logp_bt, kept_bt = jax.lax.fori_loop(0, max_new_tokens, truncated_body, carry)
    else:
        carry = (tokens_bt, None if greedy else key)
        tokens, _ = jax.lax.fori_loop(0, max_new_tokens, body, carry)
    cols = jnp.arange(tokens.shape[1])[None, :]
    completion = (cols >= lengths_b[:, None]) & (cols < (lengths_b + max_new_tokens)[:, None])
    is_eos = completion & (tokens == eos_id)
    first_eos = jnp.min(jnp.where(is_eos, cols, tokens.shape[1]), axis=1, keepdims=True)
    upto_eos = completion & (cols <= first_eos)
    tokens = jnp.where(completion & ~upto_eos, 0, tokens)  # pad after EOS
    mask = upto_eos.astype(jnp.float32)
    out = Completions(tokens_bt=tokens, mask_bt=mask)
    if truncates:
        out = out.replace(
            logp_bt=logp_bt * mask if return_logp else None,
            kept_bt=jnp.where(upto_eos, kept_bt, 0),
        )
    if return_routing or (return_logp and not truncates):
        logp, scored = model.logprobs(
            tokens, temperature=temperature, vocab_mask=vocab_mask, kv_cache_dtype=kv_cache_dtype
        )
        out = out.replace(
            logp_bt=out.logp_bt if truncates else logp * mask if return_logp else None,
            routing_btlk=scored.routing_btlk if return_routing else None,
        )
    return out
