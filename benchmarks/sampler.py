"""The comparison grid's in-process rollouts: decoding by full recompute (greedy or sampled).

One jitted ``sample`` gives ``benchmarks/grid.py`` (and ``frontier.py``, through it) its rollouts:
temperature sampling with the behavior log-probs and expert ids recorded from the sampling
weights, the quantities the rollout server records (docs/DESIGN.md §6), reproducible from one PRNG
key per batch. Every new token recomputes the whole forward: the arithmetic task's sequences are a
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


@struct.dataclass
class Completions:
    """Prompts with their sampled completions, aligned as ``TrainBatch`` fields.

    Attributes:
      tokens_bt: [B, T] int32 prompt + completion; 0 (pad) after each row's first EOS.
      mask_bt: [B, T] float32, 1 on each row's completion tokens up to and including its first EOS.
      logp_bt: [B, T] float32 log-probs of the tokens under the sampling weights (at the sampling
        temperature, renormalized over ``vocab_mask``), 0 outside ``mask_bt``; None unless asked.
      routing_btlk: [B, T, L, K] the sampling weights' own expert ids; None unless asked.
    """

    tokens_bt: jax.Array
    mask_bt: jax.Array
    logp_bt: jax.Array | None = None
    routing_btlk: jax.Array | None = None


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
        "eos_id",
        "greedy",
        "return_logp",
        "return_routing",
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
) -> Completions:
    """``max_new_tokens`` tokens after each row's prompt, by full recompute.

    Token s of row b goes to position ``lengths_b[b] + s``. Sampling draws it from
    softmax(logits / temperature) restricted to ``vocab_mask``, with the key of step s taken as
    ``key, sub = split(key)`` once per step; ``greedy`` takes the argmax of the logits over
    ``vocab_mask`` (over every id when it is None) and ignores ``key`` and ``temperature``.
    Decoding runs the full length; tokens after a row's first EOS are then replaced by pad.

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
        one more forward of the finished sequences under the same weights.
    """
    if tokens_bt.shape[1] < max_new_tokens + 1:
        raise ValueError(f"tokens_bt has {tokens_bt.shape[1]} columns for {max_new_tokens} new")
    model = nnx.merge(graphdef, params)
    rows = jnp.arange(tokens_bt.shape[0])
    floor = jnp.finfo(jnp.float32).min

    def body(s: int, carry: tuple[jax.Array, jax.Array | None]):
        tokens, key = carry
        pos = lengths_b + s
        if greedy:
            logits = model(tokens)[rows, pos - 1]
            if vocab_mask is not None:
                logits = jnp.where(vocab_mask, logits, floor)
            nxt = jnp.argmax(logits, axis=-1).astype(tokens.dtype)
            return tokens.at[rows, pos].set(nxt), key
        key, sub = jax.random.split(key)
        logits = model(tokens)[rows, pos - 1] / temperature
        if vocab_mask is not None:
            logits = jnp.where(vocab_mask, logits, floor)
        nxt = jax.random.categorical(sub, logits).astype(tokens.dtype)
        return tokens.at[rows, pos].set(nxt), key

    tokens, _ = jax.lax.fori_loop(0, max_new_tokens, body, (tokens_bt, None if greedy else key))
    cols = jnp.arange(tokens.shape[1])[None, :]
    completion = (cols >= lengths_b[:, None]) & (cols < (lengths_b + max_new_tokens)[:, None])
    is_eos = completion & (tokens == eos_id)
    first_eos = jnp.min(jnp.where(is_eos, cols, tokens.shape[1]), axis=1, keepdims=True)
    kept = completion & (cols <= first_eos)
    tokens = jnp.where(completion & ~kept, 0, tokens)  # pad after EOS
    mask = kept.astype(jnp.float32)
    out = Completions(tokens_bt=tokens, mask_bt=mask)
    if return_logp or return_routing:
        logp, forward = model.logprobs(tokens, temperature=temperature, vocab_mask=vocab_mask)
        out = out.replace(
            logp_bt=logp * mask if return_logp else None,
            routing_btlk=forward.routing_btlk if return_routing else None,
        )
    return out
