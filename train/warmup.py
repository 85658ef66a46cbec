"""Supervised warm-up on the arithmetic task: a weak base policy for RL (docs/DESIGN.md §7).

Warm-up sequences are ``BOS prompt answer EOS`` — exactly what the rollout server feeds the policy
(``BOS prompt``) followed by the completion that earns reward 1 — with the loss on the answer and
EOS tokens. The result is cached under ``<train.warmup.cache_dir>/<hash of everything it depends
on>/``, so only the first run pays for it.

``run`` is the builder of the config's part (``cfg.train.warmup``, a
``sat_jax.experiment.WarmupConfig``): it runs the configured warm-up or loads it from the cache.

The warm-up's problems come from their own seed stream, ``task.seed + SFT_SEED_OFFSET``, disjoint
from the server's prompts (``task.seed``) and the held-out evaluation's (``train.held_out``).

Dimension letters: B batch, T sequence.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx

from sat_jax.config import WarmupConfig
from sat_jax.model import ModelConfig, placement
from sat_jax.tasks import CharTokenizer, Prompt, arithmetic_task
from sat_jax.tasks.config import TaskConfig

SFT_SEED_OFFSET = 2_000_003

log = logging.getLogger(__name__)


def run(
    cfg: WarmupConfig,
    model_cfg: ModelConfig,
    task: TaskConfig,
    params: Any,
    *,
    init_seed: int,
    seq_len: int,
) -> Any:
    """The warm-up ``cfg`` configures, from the initial ``params``: none when
    ``cfg.steps`` is 0, else ``cached_warmup`` under ``cfg.cache_dir``.

    Args:
      cfg: the part (``cfg.train.warmup``).
      model_cfg, task: the policy's architecture and the task it learns.
      params: the initial params, sharded.
      init_seed: the seed ``params`` were made from (``train.seed``; part of the cache key).
      seq_len: the rows' length (the server's prefill plus the completion limit).

    Returns:
      The warmed-up params (``params`` when there is no warm-up).
    """
    if not cfg.steps:
        return params
    start = time.monotonic()
    params, cached = cached_warmup(
        cfg.cache_dir,
        model_cfg,
        task,
        params,
        init_seed=init_seed,
        steps=cfg.steps,
        batch=cfg.batch,
        learning_rate=cfg.learning_rate,
        seq_len=seq_len,
    )
    how = f"loaded from {cfg.cache_dir}" if cached else f"{cfg.steps} steps"
    log.info("supervised warm-up: %s (%.1fs)", how, time.monotonic() - start)
    return params


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
            logp, _ = nnx.merge(graphdef, p).logprobs(tokens)  # the trainer's log-probs
            return -jnp.sum(logp * mask) / jnp.maximum(jnp.sum(mask), 1.0)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    stream = arithmetic_task(task, seed_offset=SFT_SEED_OFFSET)
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
        graphdef, _ = placement.abstract_model(model_cfg)
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
