"""Held-out problems and greedy accuracy (train/held_out.py)."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

from sat_jax import sharding
from sat_jax.experiment import load_config
from sat_jax.model import ModelConfig, placement
from sat_jax.tasks import CharTokenizer, Prompt, sampleable_mask
from sat_jax.tasks.config import TaskConfig
from train import held_out, warmup

MODEL_CFG = ModelConfig.preset("tiny", vocab_size=20)
TASK = TaskConfig()
TOKENIZER = CharTokenizer(TASK.alphabet)


@pytest.fixture(scope="module")
def model():
    mesh = sharding.make_mesh(sharding.MeshConfig(fsdp=1), jax.devices()[:1])
    return placement.init_sharded(MODEL_CFG, mesh, 0)


def test_held_out_problems_are_a_separate_stream():
    held = held_out.held_out_problems(TASK, 50)
    assert len({p.id for p in held}) == 50
    assert all(p.id.startswith(f"arith-{TASK.seed + held_out.EVAL_SEED_OFFSET}-") for p in held)
    assert held_out.EVAL_SEED_OFFSET != warmup.SFT_SEED_OFFSET


def test_greedy_completions_are_the_argmax_of_the_full_forward(model):
    """Greedy = argmax over the sampleable ids (the server's set), through the decoding core."""
    graphdef, params = model
    sampleable = sampleable_mask(TOKENIZER, MODEL_CFG.vocab_size)
    problems = held_out.held_out_problems(TASK, 4)
    texts = held_out.greedy_completions(graphdef, params, problems, TOKENIZER, max_new_tokens=4)
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
    assert held_out.greedy_completions(graphdef, params, [], TOKENIZER, max_new_tokens=4) == []


def test_accuracy_is_the_exact_match_rate_of_the_greedy_completions(model):
    graphdef, params = model
    problems = held_out.held_out_problems(TASK, 6)
    texts = held_out.greedy_completions(graphdef, params, problems, TOKENIZER, max_new_tokens=4)
    # Odd problems get the model's own completion (with spaces) as their answer: hits; even ones
    # an answer no completion can be: misses.
    rigged = [
        Prompt(id=p.id, text=p.text, answer=f" {t} " if i % 2 else "x")
        for i, (p, t) in enumerate(zip(problems, texts, strict=True))
    ]
    acc = held_out.greedy_accuracy(graphdef, params, rigged, TOKENIZER, max_new_tokens=4)
    assert acc == 0.5


@pytest.mark.parametrize(
    "overrides", [["train.eval.problems=0"], ["task.source=file", "task.path=p.jsonl"]]
)
def test_no_held_out_accuracy_without_problems(overrides):
    # A file task's default is no held-out evaluation; asking for one is refused by the config.
    cfg = load_config(None, overrides)
    assert held_out.held_out_accuracy(cfg, None, None) is None


def test_a_multi_turn_env_evaluates_whole_episodes(tmp_path):
    """With `task.env=feedback` every sample is an episode played as the server plays it: the
    greedy transcript holds the environment's retry turns, and each reward is its episode's."""
    from sat_jax.tasks.envs import RETRY_MESSAGE
    from tests.hf_fixtures import make_tokenizer

    make_tokenizer(tmp_path / "tok")
    cfg = load_config(
        None,
        [
            "task.tokenizer=hf",
            f"task.tokenizer_path={tmp_path / 'tok'}",
            "task.chat_template=true",
            "task.env=feedback",
            "task.max_turns=3",
            "task.max_episode_tokens=200",
            "rollout.max_new_tokens=4",
            "model.vocab_size=512",
            "model.max_seq_len=512",
            "server.max_prefill_length=64",
            "server.slots=2",
        ],
    )
    mesh = sharding.make_mesh(sharding.MeshConfig(fsdp=1), jax.devices()[:1])
    graphdef, state = placement.init_sharded(cfg.model, mesh, 0)
    evaluator = held_out.Evaluator.from_config(cfg, graphdef)
    problems = [Prompt(id=f"p{i}", text=f"What is {i} + 1?", answer=str(i + 1)) for i in range(3)]
    result = evaluator.evaluate(state, problems, k=2)
    assert result.problems == 3 and result.skipped == 0
    wrong = [row for row in result.rows if row["greedy_reward"] == 0.0]
    assert all(len(row["rewards"]) == 2 for row in result.rows)
    # Random weights answer wrong: the environment asks again until max_turns.
    assert wrong and all(row["greedy"].count(RETRY_MESSAGE) == 2 for row in wrong), wrong
