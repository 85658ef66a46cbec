"""``python -m sat_jax.model.make_tiny``: a tiny HF checkpoint + tokenizer that our loader and
transformers both read (chat template, eos set, no BOS)."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

from sat_jax.model import hf, make_tiny


@pytest.mark.slow  # the make_tiny command in a process, then transformers
def test_make_tiny_writes_a_checkpoint_and_tokenizer(tmp_path: pathlib.Path) -> None:
    transformers = pytest.importorskip("transformers")
    out = tmp_path / "tiny"
    run = subprocess.run(
        [sys.executable, "-m", "sat_jax.model.make_tiny", "--out", str(out)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert tok.bos_token_id is None
    im_end, eot = tok.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    assert tok.eos_token_id == im_end
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [im_end, eot]
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "Tom has 3 apples."}], add_generation_prompt=True
    )
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    assert tok.decode(ids) == (
        "<|im_start|>user\nTom has 3 apples.<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tok("12 + 7")["input_ids"][0] != tok.convert_tokens_to_ids("<|im_start|>")
    model = hf.load_qwen3_moe(out)
    assert model.config.vocab_size >= len(tok)
    assert model.config.vocab_size % 64 == 0
    assert json.loads((out / "config.json").read_text())["model_type"] == "qwen3_moe"

    again = subprocess.run(
        [sys.executable, "-m", "sat_jax.model.make_tiny", "--out", str(out)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert again.returncode == 2
    assert again.stderr.strip().splitlines() == [f"make_tiny: {out} exists and is not empty"]


def test_corpus_covers_digits_and_the_answer_marker() -> None:
    text = "".join(make_tiny.corpus())
    assert set("0123456789") <= set(text)
    assert "####" in text and "\\boxed{" in text
