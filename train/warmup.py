"""Supervised warm-up on the arithmetic task (a weak base policy for RL) and held-out greedy accuracy.

Warm-up sequences are ``BOS prompt answer EOS`` — exactly what the rollout server feeds the policy
(``BOS prompt``) followed by the completion that earns reward 1 — with the loss on the answer and
EOS tokens. The result is cached under ``runs/sft_cache/<hash of everything it depends on>/``, so
only the first run pays for it.

Problems come from disjoint seed streams: the server's prompts use ``task.seed``, the warm-up
``task.seed + SFT_SEED_OFFSET`` and the held-out evaluation ``task.seed + EVAL_SEED_OFFSET``.

Dimension letters: N problems, B batch, T sequence, V vocabulary.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx

from sat_jax import sharding
from sat_jax.experiment import TaskConfig
from sat_jax.model import ModelConfig
from sat_jax.tasks import ArithmeticTask, CharTokenizer, Prompt
from sat_jax.train_step import next_token_logprobs

SFT_SEED_OFFSET = 2_000_003
EVAL_SEED_OFFSET = 1_000_003


def task_stream(task: TaskConfig, offset: int) -> ArithmeticTask:
    """The arithmetic problems of ``task`` under seed ``task.seed + offset``."""
    if task.source != "arithmetic":
        raise ValueError("the warm-up and the held-out evaluation need task.source = 'arithmetic'")
    return ArithmeticTask(
        seed=task.seed + offset,
        min_digits=task.min_digits,
        max_digits=task.max_digits,
        operators=task.operators,
    )


def held_out_problems(task: TaskConfig, n: int) -> list[Prompt]:
    """``n`` evaluation problems, disjoint in stream from the training prompts."""
    stream = task_stream(task, EVAL_SEED_OFFSET)
    return [stream.problem(i) for i in range(n)]


def encode_supervised(
    problems: Sequence[Prompt], tokenizer: CharTokenizer, seq_len: int
) -> tuple[np.ndarray, np.ndarray]:
    """``BOS prompt answer EOS`` rows, padded: tokens [B, T] int32 and a target mask [B, T]."""
    tokens = np.zeros((len(problems), seq_len), np.int32)
    mask = np.zeros((len(problems), seq_len), np.float32)
    for b, p in enumerate(problems):
        prompt = tokenizer.encode(p.text, bos=True)
        answer = tokenizer.encode(p.answer, eos=True)
        row = prompt + answer
        if len(row) > seq_len:
            raise ValueError(f"problem {p.id} needs {len(row)} tokens > {seq_len}")
        tokens[b, : len(row)] = row
        mask[b, len(prompt) : len(row)] = 1.0
    return tokens, mask


def supervised_warmup(
    graphdef: nnx.GraphDef,
    params: Any,
    task: TaskConfig,
    tokenizer: CharTokenizer,
    *,
    steps: int,
    batch: int,
    learning_rate: float,
    seq_len: int,
) -> Any:
    """``steps`` Adam steps of next-token cross-entropy on the answers; returns the new params."""
    optimizer = optax.adam(learning_rate)

    @jax.jit
    def step(params: Any, opt_state: Any, tokens: jax.Array, mask: jax.Array):
        def loss_fn(p: Any) -> jax.Array:
            logits = nnx.merge(graphdef, p)(tokens)
            logp = next_token_logprobs(logits, tokens)
            return -jnp.sum(logp * mask) / jnp.maximum(jnp.sum(mask), 1.0)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    stream = task_stream(task, SFT_SEED_OFFSET)
    opt_state = optimizer.init(params)
    for s in range(steps):
        problems = [stream.problem(s * batch + i) for i in range(batch)]
        tokens, mask = encode_supervised(problems, tokenizer, seq_len)
        params, opt_state, _ = step(params, opt_state, tokens, mask)
    return params


def cached_warmup(
    cache_root: str,
    model_cfg: ModelConfig,
    task: TaskConfig,
    params: Any,
    *,
    init_seed: int,
    steps: int,
    batch: int,
    learning_rate: float,
    seq_len: int,
) -> tuple[Any, bool]:
    """``supervised_warmup`` from ``params``, loaded from ``cache_root`` when already computed.

    Returns:
      ``(params, from_cache)``.
    """
    key = json.dumps(
        {
            "model": dataclasses.asdict(model_cfg),
            "task": dataclasses.asdict(task),
            "init_seed": init_seed,
            "steps": steps,
            "batch": batch,
            "learning_rate": learning_rate,
            "seq_len": seq_len,
        },
        sort_keys=True,
        default=str,
    )
    path = os.path.abspath(os.path.join(cache_root, hashlib.sha256(key.encode()).hexdigest()[:16]))
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), params
    )
    with ocp.StandardCheckpointer() as checkpointer:
        if os.path.isdir(path):
            return checkpointer.restore(path, abstract), True
        tokenizer = CharTokenizer(task.alphabet)
        graphdef, _ = sharding.abstract_model(model_cfg)
        params = supervised_warmup(
            graphdef,
            params,
            task,
            tokenizer,
            steps=steps,
            batch=batch,
            learning_rate=learning_rate,
            seq_len=seq_len,
        )
        checkpointer.save(path, params)  # orbax renames a finished temporary directory
        checkpointer.wait_until_finished()
    return params, False


def greedy_completions(
    graphdef: nnx.GraphDef,
    params: Any,
    problems: Sequence[Prompt],
    tokenizer: CharTokenizer,
    *,
    max_new_tokens: int,
) -> list[str]:
    """Greedy (argmax) completions of ``BOS prompt``, decoded up to the first EOS."""
    prompts = [tokenizer.encode(p.text, bos=True) for p in problems]
    lengths = np.asarray([len(p) for p in prompts], np.int32)
    seq_len = int(lengths.max()) + max_new_tokens
    tokens = np.zeros((len(problems), seq_len), np.int32)
    for b, p in enumerate(prompts):
        tokens[b, : len(p)] = p
    out = np.asarray(_greedy(graphdef, params, tokens, lengths, max_new_tokens))
    # The model's vocabulary may be larger than the tokenizer's: such ids become U+FFFD (a miss).
    out = np.where(out < tokenizer.vocab_size, out, -1)
    texts = []
    for b in range(len(problems)):
        ids = out[b, lengths[b] : lengths[b] + max_new_tokens].tolist()
        stop = ids.index(tokenizer.eos_id) if tokenizer.eos_id in ids else len(ids)
        texts.append("".join("\ufffd" if i < 0 else tokenizer.decode([i]) for i in ids[:stop]))
    return texts


@functools.partial(jax.jit, static_argnums=(0, 4))
def _greedy(
    graphdef: nnx.GraphDef,
    params: Any,
    tokens_bt: jax.Array,
    lengths_b: jax.Array,
    max_new_tokens: int,
) -> jax.Array:
    # Full recompute per token: the task's sequences are a few dozen tokens, and causal
    # attention makes the padding after each row's cursor irrelevant.
    rows = jnp.arange(tokens_bt.shape[0])

    def body(s: int, tokens: jax.Array) -> jax.Array:
        logits_btv = nnx.merge(graphdef, params)(tokens)
        pos_b = lengths_b + s
        nxt = jnp.argmax(logits_btv[rows, pos_b - 1], axis=-1).astype(tokens.dtype)
        return tokens.at[rows, pos_b].set(nxt)

    return jax.lax.fori_loop(0, max_new_tokens, body, tokens_bt)


def greedy_accuracy(
    graphdef: nnx.GraphDef,
    params: Any,
    problems: Sequence[Prompt],
    tokenizer: CharTokenizer,
    *,
    max_new_tokens: int,
) -> float:
    """Exact-match accuracy of greedy completions (the task's reward, 0/1)."""
    completions = greedy_completions(
        graphdef, params, problems, tokenizer, max_new_tokens=max_new_tokens
    )
    hits = [c.strip() == p.answer.strip() for c, p in zip(completions, problems, strict=True)]
    return float(np.mean(hits)) if hits else 0.0
