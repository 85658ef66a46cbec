"""A Hugging Face tokenizer directory behind `sat_jax.tasks.tokenizer.Tokenizer` (docs/DESIGN.md
§11).

Prompts are exactly what the tokenizer produces: with `chat_template`, one user message (after an
optional system message) rendered by the tokenizer's chat template with the generation prompt
added, then encoded without adding special tokens (as `apply_chat_template(tokenize=True)` does);
without it, the text encoded as the tokenizer's config says (a BOS only if it adds one). Stops are
the tokenizer's eos, every eos id of the checkpoint's config.json and generation_config.json (an
int or a list), and the configured extra ids.

Needs `transformers` (and `jinja2` for chat templates), imported on first use.
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Iterable, Sequence
from typing import Any

# Any one of these makes a directory a tokenizer (fast tokenizers, SentencePiece, GPT-2 BPE).
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
_TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")


def check_tokenizer_files(path: str, *, chat_template: bool, key: str) -> None:
    """Checks, without loading it, that `path` holds a tokenizer (and a chat template if asked).

    Args:
      path: the tokenizer directory.
      chat_template: whether a chat template is required.
      key: the config key that named `path`, for the error message.

    Raises:
      ValueError: one line naming `key` (or `task.chat_template`) and what is missing.
    """
    root = pathlib.Path(path)
    if not root.is_dir():
        raise ValueError(f"{key}: {path} is not a directory")
    if not any((root / name).is_file() for name in _TOKENIZER_FILES):
        raise ValueError(
            f"{key}: no tokenizer files in {path} (need one of {', '.join(_TOKENIZER_FILES)})"
        )
    if chat_template and not _has_chat_template(root):
        raise ValueError(f"task.chat_template: the tokenizer in {path} has no chat template")


def _has_chat_template(root: pathlib.Path) -> bool:
    if any((root / name).is_file() for name in _TEMPLATE_FILES):
        return True
    config = _read_json(root / "tokenizer_config.json")
    return bool(config.get("chat_template"))


def _read_json(path: pathlib.Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        doc = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not JSON: {e}") from e
    return doc if isinstance(doc, dict) else {}


def checkpoint_eos_ids(path: str) -> frozenset[int]:
    """Every `eos_token_id` of `path`'s config.json and generation_config.json (each an int, a
    list of ints, or absent); empty when `path` is ""."""
    if not path:
        return frozenset()
    ids: set[int] = set()
    for name in ("config.json", "generation_config.json"):
        value = _read_json(pathlib.Path(path) / name).get("eos_token_id")
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(int(i) for i in value)
    return frozenset(ids)


class HFTokenizer:
    """`transformers.AutoTokenizer` of a local directory, as a `Tokenizer`.

    Args:
      path: the tokenizer directory (tokenizer.json etc.).
      chat_template: render prompts with the tokenizer's chat template.
      system_prompt: a system message before the user message ("" = none).
      stop_ids: extra ids that end a completion.
      checkpoint: the model directory whose config.json / generation_config.json eos ids also
        stop ("" = none).
      path_key: the config key that named `path`, for error messages.

    Raises:
      ValueError: one line, for missing tokenizer files, a missing chat template, or a tokenizer
        with no eos and no `stop_ids`.
    """

    unsampleable_ids: tuple[int, ...] = ()

    def __init__(
        self,
        path: str,
        *,
        chat_template: bool = False,
        system_prompt: str = "",
        stop_ids: Sequence[int] = (),
        checkpoint: str = "",
        path_key: str = "task.tokenizer_path",
    ):
        check_tokenizer_files(path, chat_template=chat_template, key=path_key)
        from transformers import AutoTokenizer  # heavy; only when an HF tokenizer is used

        self._tok = AutoTokenizer.from_pretrained(path)
        if chat_template and not self._tok.chat_template:
            raise ValueError(f"task.chat_template: the tokenizer in {path} has no chat template")
        self.path = path
        self.chat_template = chat_template
        self.system_prompt = system_prompt
        own_eos = {self._tok.eos_token_id} - {None}
        stops = own_eos | checkpoint_eos_ids(checkpoint) | set(stop_ids)
        if not stops:
            raise ValueError(
                f"{path_key}: the tokenizer in {path} has no eos token; set rollout.stop_token_ids"
            )
        self.stop_ids = frozenset(stops)
        self.eos_id = min(own_eos or stops)
        pad = self._tok.pad_token_id
        self.pad_id = self.eos_id if pad is None else int(pad)
        bos = self._tok.bos_token_id
        # JetStream's API wants a bos id; it is never prepended (docs/DESIGN.md §11).
        self.bos_id = self.pad_id if bos is None else int(bos)

    def __len__(self) -> int:
        return len(self._tok)

    @property
    def vocab_size(self) -> int:
        """The number of ids, added tokens included (`len(self)`)."""
        return len(self._tok)

    def encode(self, text: str) -> list[int]:
        """Ids of `text` as the tokenizer encodes it (its own special tokens, if it adds any)."""
        return list(self._tok(text)["input_ids"])

    def encode_prompt(self, text: str) -> list[int]:
        """The prompt's ids: chat-templated when configured (see the module docstring)."""
        if not self.chat_template:
            return self.encode(text)
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        rendered = self._tok.apply_chat_template(
            [*system, {"role": "user", "content": text}],
            tokenize=False,
            add_generation_prompt=True,
        )
        return list(self._tok(rendered, add_special_tokens=False)["input_ids"])

    def decode(self, ids: Iterable[int]) -> str:
        """Text of `ids` with special tokens skipped."""
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)
