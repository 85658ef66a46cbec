"""sat_jax.tasks tokenizers against transformers: prompt ids exactly the chat template's (no BOS
added), decode with specials skipped, the stop set (tokenizer eos + config.json + generation_config
+ rollout.stop_token_ids), the one sampleable mask, and the bad-input lines."""

from __future__ import annotations

import json

import numpy as np
import pytest

from sat_jax.experiment import ConfigError, load_config, make_tokenizer
from sat_jax.tasks import CharTokenizer, sampleable_mask
from sat_jax.tasks.hf_tokenizer import HFTokenizer, checkpoint_eos_ids
from tests import hf_fixtures

transformers = pytest.importorskip("transformers")

QUESTION = "Tom has 3 apples and buys 4 more. How many apples does he have?"


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    hf_fixtures.make_tokenizer(path)
    return path


def test_prompt_ids_are_exactly_the_chat_templates(tok_dir):
    ref = transformers.AutoTokenizer.from_pretrained(str(tok_dir))
    tok = HFTokenizer(str(tok_dir), chat_template=True, system_prompt="Be brief.")
    want = ref.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTION}],
        tokenize=True,
        add_generation_prompt=True,
        return_dict=False,
    )
    assert tok.encode_prompt(QUESTION) == list(want)
    start = ref.convert_tokens_to_ids("<|im_start|>")
    assert tok.encode_prompt(QUESTION)[0] == start  # no BOS: the tokenizer adds none
    assert ref.decode(want).endswith("<|im_start|>assistant\n")
    plain = HFTokenizer(str(tok_dir))
    assert plain.encode_prompt(QUESTION) == ref(QUESTION)["input_ids"]


def test_decode_skips_specials_and_len_counts_added_tokens(tok_dir):
    ref = transformers.AutoTokenizer.from_pretrained(str(tok_dir))
    tok = HFTokenizer(str(tok_dir))
    ids = [*ref(" 7 apples")["input_ids"], ref.convert_tokens_to_ids("<|im_end|>")]
    assert tok.decode(ids) == ref.decode(ids, skip_special_tokens=True) == " 7 apples"
    assert len(tok) == len(ref) == tok.vocab_size
    assert tok.pad_id == ref.convert_tokens_to_ids("<|endoftext|>")


def test_stop_ids_are_the_checkpoints_eos_set_plus_the_configured_ones(tmp_path, tok_dir):
    im_end, endoftext = hf_fixtures.eos_ids(transformers.AutoTokenizer.from_pretrained(tok_dir))
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 5}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [endoftext, 6]}))
    assert checkpoint_eos_ids(str(tmp_path)) == {5, 6, endoftext}
    tok = HFTokenizer(str(tok_dir), stop_ids=(9,), checkpoint=str(tmp_path))
    assert tok.stop_ids == {im_end, endoftext, 5, 6, 9}
    assert tok.eos_id == im_end
    assert HFTokenizer(str(tok_dir)).stop_ids == {im_end}


def test_one_sampleable_mask_every_tokenizer_id_never_the_padding_rows(tok_dir):
    tok = HFTokenizer(str(tok_dir))
    mask = sampleable_mask(tok, len(tok) + 13)
    assert mask[: len(tok)].all() and not mask[len(tok) :].any()
    char = CharTokenizer("0123")
    assert sampleable_mask(char, 9).tolist() == [False, False] + [True] * 5 + [False] * 2
    with pytest.raises(ValueError, match="smaller than the tokenizer's"):
        sampleable_mask(tok, len(tok) - 1)


def test_make_tokenizer_follows_the_config(tmp_path):
    d = hf_fixtures.make_hf_dir(tmp_path, problems=2)
    cfg = load_config(
        None,
        [f"model.hf_path={d.path}", "task.chat_template=true", "rollout.stop_token_ids=[7]"],
    )
    tok = make_tokenizer(cfg)
    assert isinstance(tok, HFTokenizer) and tok.chat_template
    assert tok.stop_ids == {*d.eos_ids, 7}
    np.testing.assert_array_equal(
        sampleable_mask(tok, cfg.model.vocab_size), np.arange(cfg.model.vocab_size) < len(tok)
    )
    char = make_tokenizer(load_config(None, ["rollout.stop_token_ids=[5]"]))
    assert isinstance(char, CharTokenizer) and char.stop_ids == {char.eos_id, 5}


def test_a_chat_template_the_tokenizer_lacks_is_one_line(tmp_path):
    hf_fixtures.make_tokenizer(tmp_path, chat_template=False)
    with pytest.raises(ValueError, match=r"^task\.chat_template: the tokenizer in .* has no chat"):
        HFTokenizer(str(tmp_path), chat_template=True)
    with pytest.raises(ValueError, match=r"^task\.tokenizer_path: .*nowhere is not a directory"):
        HFTokenizer(str(tmp_path / "nowhere"))
    (tmp_path / "tokenizer.json").unlink()
    with pytest.raises(ValueError, match=r"^task\.tokenizer_path: no tokenizer files in"):
        HFTokenizer(str(tmp_path))
    cfg_dir = tmp_path / "ckpt"
    cfg_dir.mkdir()
    (cfg_dir / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ConfigError, match=r"^model\.hf_path: .*'llama', expected 'qwen3_moe'"):
        load_config(None, [f"model.hf_path={cfg_dir}"])
