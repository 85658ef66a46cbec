"""A tiny local Hugging Face Qwen3-MoE checkpoint and tokenizer, made from nothing (no download):

    python -m sat_jax.model.make_tiny --out runs/hf_tiny

writes into ``--out`` (new or empty) a random-init ``Transformer`` (``TINY_QWEN3_MOE``, the
embedding padded to a multiple of 64 rows past the tokenizer's ids) exported with
``sat_jax.model.hf_export``, and a byte-level BPE tokenizer trained with ``tokenizers`` on a small
built-in corpus of GSM8K-style text, saved in the Hugging Face format (tokenizer.json,
tokenizer_config.json with a Qwen-style chat template; specials ``<|endoftext|>`` (pad),
``<|im_start|>``, ``<|im_end|>`` (eos); no BOS). The eos set is ``<|im_end|>``, ``<|endoftext|>``.
``configs/hf_tiny_gsm8k.yaml`` points ``model.hf_path`` at it. Needs neither torch nor
transformers.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys
import tempfile

from flax import nnx

from sat_jax.model import hf_export
from sat_jax.model.config import PRESETS, ModelConfig
from sat_jax.model.transformer import Transformer

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
EOS, PAD = "<|im_end|>", "<|endoftext|>"
# Qwen's chat template, reduced to messages and the generation prompt.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# The architecture: the `tiny` preset with room for chat prompts (vocab_size comes from the
# tokenizer).
TINY_QWEN3_MOE = dataclasses.replace(PRESETS["tiny"], max_seq_len=1024)
_TEMPLATES = (
    "Tom has {a} apples and buys {b} more. How many apples does he have?",
    "A box holds {a} pens. {b} pens are taken out. How many pens are left?",
    "Each of {a} bags has {b} marbles. How many marbles are there in total?",
    "Let's think step by step. {a} + {b} = {c}. The answer is \\boxed{{{c}}}.",
    "{a} * {b} = {c}\n#### {c}",
)


def corpus() -> list[str]:
    """The small built-in training text of the tokenizer (word problems, sums, answers)."""
    return [
        t.format(a=a, b=b, c=a + b) for a in range(1, 60) for b in range(1, 8) for t in _TEMPLATES
    ]


def bpe_tokenizer(texts: list[str], *, vocab_size: int):
    """A byte-level BPE (Qwen-style: no prefix space, ``SPECIALS`` first) trained on ``texts``;
    a ``tokenizers.Tokenizer``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return tok


def train_tokenizer(out: str | pathlib.Path, *, vocab_size: int = 512) -> int:
    """Trains the byte-level BPE and writes tokenizer.json and tokenizer_config.json to ``out``.

    Returns:
      The tokenizer's size (ids ``0 .. size - 1``, specials included).
    """
    tok = bpe_tokenizer(corpus(), vocab_size=vocab_size)
    out = pathlib.Path(out)
    tok.save(str(out / "tokenizer.json"))
    added = {
        str(tok.token_to_id(s)): {
            "content": s,
            "special": True,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "single_word": False,
        }
        for s in SPECIALS
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": EOS,
        "pad_token": PAD,
        "unk_token": None,
        "additional_special_tokens": ["<|im_start|>"],
        "added_tokens_decoder": added,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "model_max_length": TINY_QWEN3_MOE.max_seq_len,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return tok.get_vocab_size()


def make_tiny(out: str | pathlib.Path, *, seed: int = 0) -> ModelConfig:
    """Writes the tiny checkpoint and tokenizer into ``out`` (new or empty); returns its config.

    Raises:
      FileExistsError: ``out`` exists and is not empty.
    """
    out = pathlib.Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out} exists and is not empty")
    with tempfile.TemporaryDirectory() as tmp:
        size = train_tokenizer(tmp)
        vocab = json.loads((pathlib.Path(tmp) / "tokenizer.json").read_text())["model"]["vocab"]
        cfg = dataclasses.replace(TINY_QWEN3_MOE, vocab_size=-(-size // 64) * 64 + 64)
        params = nnx.to_pure_dict(nnx.state(Transformer(cfg, rngs=nnx.Rngs(seed))))
        hf_export.export_qwen3_moe(
            params, cfg, out, eos_token_ids=[vocab[EOS], vocab[PAD]], tokenizer_dir=tmp
        )
    return cfg


def main(argv: list[str] | None = None) -> None:
    """``python -m sat_jax.model.make_tiny --out DIR [--seed N]``."""
    parser = argparse.ArgumentParser(prog="make_tiny", description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="output directory (new or empty)")
    parser.add_argument("--seed", type=int, default=0, help="init seed of the random weights")
    args = parser.parse_args(argv)
    try:
        cfg = make_tiny(args.out, seed=args.seed)
    except FileExistsError as e:
        print(f"make_tiny: {e}", file=sys.stderr)
        sys.exit(2)
    print(
        f"wrote {args.out}: vocab {cfg.vocab_size}, {cfg.num_layers} layers, "
        f"{cfg.num_experts} experts",
        flush=True,
    )


if __name__ == "__main__":
    main()
