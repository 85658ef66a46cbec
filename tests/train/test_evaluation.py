"""Held-out problems and greedy accuracy (train/evaluation.py)."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

from sat_jax.experiment import TaskConfig, load_config
from sat_jax.model import ModelConfig
from sat_jax.parallel import sharding
from sat_jax.tasks import CharTokenizer, Prompt, sampleable_mask
from train import evaluation, warmup

MODEL_CFG = ModelConfig.preset("tiny", vocab_size=20)
TASK = TaskConfig()
TOKENIZER = CharTokenizer(TASK.alphabet)


@pytest.fixture(scope="module")
def model():
    mesh = sharding.make_mesh(sharding.MeshConfig(fsdp=1), jax.devices()[:1])
    return sharding.init_sharded(MODEL_CFG, mesh, 0)


def test_held_out_problems_are_a_separate_stream():
    held = evaluation.held_out_problems(TASK, 50)
    assert len({p.id for p in held}) == 50
    assert all(p.id.startswith(f"arith-{TASK.seed + evaluation.EVAL_SEED_OFFSET}-") for p in held)
    assert evaluation.EVAL_SEED_OFFSET != warmup.SFT_SEED_OFFSET


def test_greedy_completions_are_the_argmax_of_the_full_forward(model):
    """Greedy = argmax over the sampleable ids (the server's set), through the decoding core."""
    graphdef, params = model
    sampleable = sampleable_mask(TOKENIZER, MODEL_CFG.vocab_size)
    problems = evaluation.held_out_problems(TASK, 4)
    texts = evaluation.greedy_completions(graphdef, params, problems, TOKENIZER, max_new_tokens=4)
    # Re-check every generated token against one forward pass over prompt + completion.
    for p, text in zip(problems, texts, strict=True):
        prompt = TOKENIZER.encode(p.text, bos=True)
        ids = prompt + TOKENIZER.encode(text)
        logits = np.asarray(nnx.merge(graphdef, params)(np.asarray([ids], np.int32)))[0]
        logits = np.where(sampleable, logits, -np.inf)
        for t in range(len(prompt), len(ids)):
            assert ids[t] == int(np.argmax(logits[t - 1]))
        if len(text) < 4:  # stopped early: EOS was the argmax after the text
            assert int(np.argmax(logits[-1])) == TOKENIZER.eos_id
    assert evaluation.greedy_completions(graphdef, params, [], TOKENIZER, max_new_tokens=4) == []


def test_accuracy_is_the_exact_match_rate_of_the_greedy_completions(model):
    graphdef, params = model
    problems = evaluation.held_out_problems(TASK, 6)
    texts = evaluation.greedy_completions(graphdef, params, problems, TOKENIZER, max_new_tokens=4)
    # Odd problems get the model's own completion (with spaces) as their answer: hits; even ones
    # an answer no completion can be: misses.
    rigged = [
        Prompt(id=p.id, text=p.text, answer=f" {t} " if i % 2 else "x")
        for i, (p, t) in enumerate(zip(problems, texts, strict=True))
    ]
    acc = evaluation.greedy_accuracy(graphdef, params, rigged, TOKENIZER, max_new_tokens=4)
    assert acc == 0.5


@pytest.mark.parametrize(
    "overrides", [["train.eval_problems=0"], ["task.source=file", "task.path=p.jsonl"]]
)
def test_no_held_out_accuracy_without_problems_or_off_the_arithmetic_task(overrides):
    cfg = load_config(None, overrides)
    assert evaluation.held_out_accuracy(cfg, None, None) is None
