"""Warm-up data alignment and the warm-up cache (what it learns, checked by greedy decoding)."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from sat_jax import sharding
from sat_jax.config import WarmupConfig
from sat_jax.model import ModelConfig, placement
from sat_jax.tasks import CharTokenizer, Prompt
from sat_jax.tasks.config import TaskConfig
from train import held_out, warmup

MODEL_CFG = ModelConfig.preset("tiny", vocab_size=20)
TASK = TaskConfig()
TOKENIZER = CharTokenizer(TASK.alphabet)


@pytest.fixture(scope="module")
def model():
    mesh = sharding.make_mesh(sharding.MeshConfig(fsdp=1), jax.devices()[:1])
    return placement.init_sharded(MODEL_CFG, mesh, 0)


def test_supervised_rows_mask_the_answer_and_eos():
    tokens, mask = warmup.encode_supervised([Prompt(id="a", text="1+2=", answer="3")], TOKENIZER, 9)
    expected = [TOKENIZER.bos_id, *TOKENIZER.encode("1+2=3"), TOKENIZER.eos_id]
    np.testing.assert_array_equal(tokens[0], [*expected, 0, 0])
    np.testing.assert_array_equal(mask[0], [0, 0, 0, 0, 0, 1, 1, 0, 0])


def test_warmup_learns_and_is_cached(model, tmp_path):
    graphdef, params = model
    kwargs = dict(init_seed=0, steps=30, batch=32, learning_rate=3e-3, seq_len=16)
    tuned, cached = warmup.cached_warmup(str(tmp_path), MODEL_CFG, TASK, params, **kwargs)
    again, cached_again = warmup.cached_warmup(str(tmp_path), MODEL_CFG, TASK, params, **kwargs)
    assert not cached and cached_again
    same = jax.tree.map(lambda a, b: np.array_equal(np.asarray(a), np.asarray(b)), tuned, again)
    assert all(jax.tree.leaves(same))
    # 30 steps already teach the answer format: an EOS-terminated digit string.
    problems = held_out.held_out_problems(TASK, 16)
    texts = held_out.greedy_completions(graphdef, tuned, problems, TOKENIZER, max_new_tokens=6)
    assert sum(t.lstrip("-").isdigit() for t in texts) >= 8, texts


def test_run_without_warmup_steps_returns_the_params_and_caches_nothing(tmp_path):
    part = WarmupConfig(steps=0, cache_dir=str(tmp_path / "cache"))
    params = {"w": np.zeros(2, np.float32)}
    assert warmup.run(part, MODEL_CFG, TASK, params, init_seed=0, seq_len=16) is params
    assert not (tmp_path / "cache").exists()
