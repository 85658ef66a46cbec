"""Builders of tiny local Hugging Face inputs for tests: a BPE tokenizer, a random Qwen3-MoE
checkpoint over several safetensors shards, and a GSM8K-style jsonl. Nothing is downloaded.

    tok = make_tokenizer(tmp_path)                  # tokenizer files in tmp_path
    make_checkpoint(tmp_path, vocab_size=len(tok) + 13, eos_ids=eos_ids(tok))
    make_gsm8k_jsonl(tmp_path / "train.jsonl", 8)

or all three at once with `make_hf_dir(tmp_path)`. The tokenizer is byte-level BPE (any text
encodes) with the specials `<|endoftext|>`, `<|im_start|>`, `<|im_end|>`, a Qwen-style chat
template and no BOS. Needs `tokenizers`, `transformers` and `torch` (the test extra).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any

from sat_jax.model.make_tiny import CHAT_TEMPLATE, bpe_tokenizer

# Architecture of the random checkpoint (transformers.Qwen3MoeConfig field names).
TINY_QWEN3_MOE = dict(
    hidden_size=32,
    intermediate_size=48,
    moe_intermediate_size=16,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    num_experts=4,
    num_experts_per_tok=2,
    max_position_embeddings=512,
    rope_theta=10_000.0,
    norm_topk_prob=True,
    tie_word_embeddings=False,
)
_PROBLEMS = [
    ("Tom has {a} apples and buys {b} more. How many apples does he have?", "{a}+{b}", 1),
    ("A box holds {a} pens. {b} pens are taken out. How many pens are left?", "{a}-{b}", -1),
    ("Each of {a} bags has {b} marbles. How many marbles are there in total?", "{a}*{b}", 0),
]


def _corpus() -> list[str]:
    lines = []
    for a in range(2, 30):
        for text, expr, _ in _PROBLEMS:
            b = a % 7 + 1
            lines.append(
                text.format(a=a, b=b) + f" {expr.format(a=a, b=b)} = {eval(expr.format(a=a, b=b))}"
            )
    lines += ["The answer is \\boxed{42}.", "Let's think step by step.", "#### 17"]
    return lines


def make_tokenizer(path: str | pathlib.Path, *, chat_template: bool = True, vocab_size: int = 400):
    """Trains a byte-level BPE on a small arithmetic corpus and saves it as HF tokenizer files
    (tokenizer.json, tokenizer_config.json, and the chat template when `chat_template`).

    eos is `<|im_end|>`, pad `<|endoftext|>`; no BOS is added. Returns the loaded
    `transformers` tokenizer.
    """
    import transformers

    tok = bpe_tokenizer(_corpus(), vocab_size=vocab_size)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
    )
    if chat_template:
        fast.chat_template = CHAT_TEMPLATE
    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(path))
    return transformers.AutoTokenizer.from_pretrained(str(path))


def eos_ids(tokenizer: Any) -> tuple[int, int]:
    """(`<|im_end|>`, `<|endoftext|>`) ids: the checkpoint's eos set in `make_checkpoint`."""
    return tuple(tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>"))


def make_checkpoint(
    path: str | pathlib.Path,
    *,
    vocab_size: int,
    eos_ids: tuple[int, ...] = (),
    seed: int = 0,
    shard_kb: int = 40,
    **overrides: Any,
):
    """A random Qwen3-MoE checkpoint saved by `transformers` in shards of about `shard_kb` KB
    (so several safetensors files and an index).

    config.json holds the first eos id as an int, generation_config.json all of them as a list
    (the two forms HF checkpoints use). Weights are drawn wider than HF's init so that logits are
    far from uniform. Returns the torch model (eval mode, float32).
    """
    import torch
    import transformers

    kwargs = {**TINY_QWEN3_MOE, **overrides, "vocab_size": vocab_size}
    if eos_ids:
        kwargs["eos_token_id"] = eos_ids[0]
    config = transformers.Qwen3MoeConfig(**kwargs)
    torch.manual_seed(seed)
    model = transformers.Qwen3MoeForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 1.0)
            else:
                p.normal_(0.0, 0.15)
    if eos_ids:
        model.generation_config = transformers.GenerationConfig(eos_token_id=list(eos_ids))
    model.save_pretrained(str(path), max_shard_size=f"{shard_kb}KB")
    return model


def gsm8k_rows(n: int, *, seed: int = 0) -> list[dict[str, str]]:
    """`n` GSM8K-style rows: {"question", "answer"} with the reference after "####"."""
    rows = []
    for i in range(n):
        text, expr, _ = _PROBLEMS[(i + seed) % len(_PROBLEMS)]
        a, b = 3 + (7 * i + seed) % 20, 1 + i % 5
        value = eval(expr.format(a=a, b=b))
        rows.append(
            {
                "question": text.format(a=a, b=b),
                "answer": f"{expr.format(a=a, b=b)} = {value}\n#### {value}",
            }
        )
    return rows


def make_gsm8k_jsonl(path: str | pathlib.Path, n: int, *, extra: list[dict] = ()) -> list[dict]:
    """Writes `gsm8k_rows(n)` and then the `extra` rows (e.g. rows lacking a key) as jsonl."""
    rows = [*gsm8k_rows(n), *extra]
    pathlib.Path(path).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


@dataclasses.dataclass(frozen=True)
class HFDir:
    """What `make_hf_dir` made: the checkpoint directory, its tokenizer, torch model and data."""

    path: pathlib.Path
    tokenizer: Any
    model: Any
    data: pathlib.Path
    eos_ids: tuple[int, ...]


def make_hf_dir(
    root: str | pathlib.Path, *, problems: int = 8, vocab_pad: int = 13, **overrides: Any
) -> HFDir:
    """Tokenizer files + sharded random checkpoint in `root/model`, `problems` rows in
    `root/gsm8k.jsonl`. The embedding has `vocab_pad` rows past the tokenizer's ids (never
    sampleable)."""
    root = pathlib.Path(root)
    model_dir = root / "model"
    tokenizer = make_tokenizer(model_dir)
    eos = eos_ids(tokenizer)
    model = make_checkpoint(
        model_dir, vocab_size=len(tokenizer) + vocab_pad, eos_ids=eos, **overrides
    )
    data = root / "gsm8k.jsonl"
    make_gsm8k_jsonl(data, problems)
    return HFDir(path=model_dir, tokenizer=tokenizer, model=model, data=data, eos_ids=eos)
