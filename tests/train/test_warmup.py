"""Warm-up data alignment, greedy decoding and held-out accuracy, and the warm-up cache."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

from sat_jax import sharding
from sat_jax.experiment import TaskConfig
from sat_jax.model import ModelConfig
from sat_jax.tasks import CharTokenizer, Prompt
from train import warmup

MODEL_CFG = ModelConfig.preset("tiny", vocab_size=20)
TASK = TaskConfig()
TOKENIZER = CharTokenizer(TASK.alphabet)


@pytest.fixture(scope="module")
def model():
    mesh = sharding.make_mesh(sharding.MeshConfig(fsdp=1), jax.devices()[:1])
    return sharding.init_sharded(MODEL_CFG, mesh, 0)


def test_supervised_rows_mask_the_answer_and_eos():
    tokens, mask = warmup.encode_supervised([Prompt(id="a", text="1+2=", answer="3")], TOKENIZER, 9)
    expected = [TOKENIZER.bos_id, *TOKENIZER.encode("1+2=3"), TOKENIZER.eos_id]
    np.testing.assert_array_equal(tokens[0], [*expected, 0, 0])
    np.testing.assert_array_equal(mask[0], [0, 0, 0, 0, 0, 1, 1, 0, 0])


def test_held_out_problems_are_a_separate_stream():
    held = warmup.held_out_problems(TASK, 50)
    assert len({p.id for p in held}) == 50
    assert all(p.id.startswith(f"arith-{TASK.seed + warmup.EVAL_SEED_OFFSET}-") for p in held)


def test_greedy_tokens_are_the_argmax_of_the_full_forward(model):
    graphdef, params = model
    problems = warmup.held_out_problems(TASK, 4)
    texts = warmup.greedy_completions(graphdef, params, problems, TOKENIZER, max_new_tokens=4)
    # Re-check every generated token against one forward pass over prompt + completion.
    for p, text in zip(problems, texts, strict=True):
        prompt = TOKENIZER.encode(p.text, bos=True)
        ids = prompt + TOKENIZER.encode(text)
        logits = np.asarray(nnx.merge(graphdef, params)(np.asarray([ids], np.int32)))[0]
        for t in range(len(prompt), len(ids)):
            assert ids[t] == int(np.argmax(logits[t - 1]))
        if len(text) < 4:  # stopped early: EOS was the argmax after the text
            assert int(np.argmax(logits[-1])) == TOKENIZER.eos_id
    acc = warmup.greedy_accuracy(graphdef, params, problems, TOKENIZER, max_new_tokens=4)
    assert 0.0 <= acc <= 1.0


def test_warmup_learns_and_is_cached(model, tmp_path):
    graphdef, params = model
    kwargs = dict(init_seed=0, steps=30, batch=32, learning_rate=3e-3, seq_len=16)
    tuned, cached = warmup.cached_warmup(str(tmp_path), MODEL_CFG, TASK, params, **kwargs)
    again, cached_again = warmup.cached_warmup(str(tmp_path), MODEL_CFG, TASK, params, **kwargs)
    assert not cached and cached_again
    same = jax.tree.map(lambda a, b: np.array_equal(np.asarray(a), np.asarray(b)), tuned, again)
    assert all(jax.tree.leaves(same))
    # 30 steps already teach the answer format: an EOS-terminated digit string.
    problems = warmup.held_out_problems(TASK, 16)
    texts = warmup.greedy_completions(graphdef, tuned, problems, TOKENIZER, max_new_tokens=6)
    assert sum(t.lstrip("-").isdigit() for t in texts) >= 8, texts
