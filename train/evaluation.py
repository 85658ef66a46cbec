"""Held-out greedy accuracy on the arithmetic task (docs/DESIGN.md §4): the main job's before/after
number and the comparison grid's accuracy curves.

The held-out problems come from their own seed stream, ``task.seed + EVAL_SEED_OFFSET``, disjoint
from the server's prompts (``task.seed``) and the supervised warm-up's. Completions are the greedy
(argmax over every id) continuations of ``BOS prompt`` from ``sat_jax.sampler.sample``, cut at the
first EOS and scored by exact match, the task's reward.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from flax import nnx

from sat_jax import sampler
from sat_jax.experiment import ExperimentConfig, TaskConfig
from sat_jax.tasks import CharTokenizer, Prompt, arithmetic_task

EVAL_SEED_OFFSET = 1_000_003


def held_out_problems(task: TaskConfig, n: int) -> list[Prompt]:
    """``n`` evaluation problems, disjoint in stream from the training prompts."""
    stream = arithmetic_task(task, seed_offset=EVAL_SEED_OFFSET)
    return [stream.problem(i) for i in range(n)]


def greedy_completions(
    graphdef: nnx.GraphDef,
    params: Any,
    problems: Sequence[Prompt],
    tokenizer: CharTokenizer,
    *,
    max_new_tokens: int,
) -> list[str]:
    """Greedy (argmax) completions of ``BOS prompt``, decoded up to the first EOS."""
    if not problems:
        return []
    prompts = [tokenizer.encode(p.text, bos=True) for p in problems]
    tokens_bt, lengths_b = sampler.pad_prompts(prompts, max(map(len, prompts)) + max_new_tokens)
    out = sampler.sample(
        graphdef,
        params,
        tokens_bt,
        lengths_b,
        None,
        max_new_tokens=max_new_tokens,
        temperature=1.0,  # unused by greedy decoding
        vocab_mask=None,
        eos_id=tokenizer.eos_id,
        greedy=True,
    )
    ids_bt = np.asarray(out.tokens_bt)
    # The model's vocabulary may be larger than the tokenizer's: such ids become U+FFFD (a miss).
    ids_bt = np.where(ids_bt < tokenizer.vocab_size, ids_bt, -1)
    texts = []
    for b in range(len(problems)):
        ids = ids_bt[b, lengths_b[b] : lengths_b[b] + max_new_tokens].tolist()
        stop = ids.index(tokenizer.eos_id) if tokenizer.eos_id in ids else len(ids)
        texts.append("".join("\ufffd" if i < 0 else tokenizer.decode([i]) for i in ids[:stop]))
    return texts


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


def held_out_accuracy(cfg: ExperimentConfig, graphdef: nnx.GraphDef, params: Any) -> float | None:
    """Greedy accuracy on ``train.eval_problems`` held-out problems; None when evaluation is off
    or the task is not the arithmetic one."""
    if not cfg.train.eval_problems or cfg.task.source != "arithmetic":
        return None
    return greedy_accuracy(
        graphdef,
        params,
        held_out_problems(cfg.task, cfg.train.eval_problems),
        CharTokenizer(cfg.task.alphabet),
        max_new_tokens=cfg.rollout.max_new_tokens,
    )
