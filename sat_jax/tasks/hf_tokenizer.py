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
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

# Any one of these makes a directory a tokenizer (fast tokenizers, SentencePiece, GPT-2 BPE).
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
_TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")
# The content of the placeholder assistant message `observation_ids` renders to find the delta.
_PLACEHOLDER = "\u2063sat-jax assistant turn\u2063"


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

    def encode_messages(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] = (),
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        """The ids of an episode's opening: `messages` rendered by the chat template with
        `tools` (if any) and the generation prompt, encoded without adding special tokens.
        `template_kwargs` are the template's own variables (e.g. Qwen3's `enable_thinking`).

        Raises:
          ValueError: the tokenizer has no chat template.
        """
        rendered = self._render(messages, tools, generation_prompt=True, kwargs=template_kwargs)
        return list(self._tok(rendered, add_special_tokens=False)["input_ids"])

    def observation_ids(
        self,
        observations: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] = (),
        close_turn: bool = False,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        """The ids that follow an assistant turn ended by a stop token: `observations` rendered
        by the chat template as exactly the delta between turns, up to the next generation
        prompt. Only the delta is encoded: earlier turns are never re-rendered or re-tokenised.

        The delta is what the template renders after an assistant message's end-of-turn stop
        token (e.g. Qwen's "\n<|im_start|>user\n...<|im_end|>\n<|im_start|>assistant\n"),
        found by rendering a placeholder conversation (a user message, an assistant message, the
        observations) and cutting after the first stop token's text that follows the assistant's
        content.

        Args:
          observations: the messages that follow the turn (user or tool messages); may be empty
            (then only the next generation prompt follows).
          tools: the tool schemas the episode's opening was rendered with.
          close_turn: the turn did not end with the template's end-of-turn token (it was cut,
            or another stop id ended it, see `closes_turn`): prepend what the template closes an
            assistant message with (e.g. "<|im_end|>").
          template_kwargs: the template's own variables, as the opening was rendered with.

        Raises:
          ValueError: no chat template, or one that closes an assistant message with none of
            the stop tokens.
        """
        close, delta = self._turn_delta(observations, tools, template_kwargs)
        ids = list(self._tok(delta, add_special_tokens=False)["input_ids"]) if delta else []
        if close_turn:
            ids = list(self._tok(close, add_special_tokens=False)["input_ids"]) + ids
        return ids

    def closes_turn(self, token_id: int) -> bool:
        """Whether `token_id` is the stop token the chat template closes an assistant message
        with (e.g. Qwen's `<|im_end|>`): a turn that ends with another stop id (an extra
        `rollout.stop_token_ids`, or the base model's `<|endoftext|>`) is closed by the template's
        end-of-turn tokens before the next observation, as a cut turn is.

        Raises:
          ValueError: as `observation_ids`.
        """
        close, _ = self._turn_delta((), ())
        return self._tok.decode([int(token_id)]) == close.strip() and bool(close.strip())

    def _turn_delta(
        self,
        observations: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]],
        kwargs: Mapping[str, Any] | None = None,
    ) -> tuple[str, str]:
        """(the template's close of an assistant message from its content to its stop token, the
        text after that stop token up to the next generation prompt)."""
        placeholder = [
            {"role": "user", "content": "u"},
            {"role": "assistant", "content": _PLACEHOLDER},
        ]
        text = self._render(
            [*placeholder, *observations], tools, generation_prompt=True, kwargs=kwargs
        )
        start = text.find(_PLACEHOLDER)
        if start < 0:
            raise ValueError("the chat template does not render an assistant message's content")
        start += len(_PLACEHOLDER)
        ends = [(text.find(t, start), t) for t in self._stop_texts() if text.find(t, start) >= 0]
        if not ends:
            raise ValueError(
                "the chat template closes an assistant message with none of the stop tokens "
                f"({sorted(self._stop_texts())}): a multi-turn episode cannot continue after a "
                "turn ends; add the template's end-of-turn id to rollout.stop_token_ids"
            )
        at, stop = min(ends)
        return text[start : at + len(stop)], text[at + len(stop) :]

    def _stop_texts(self) -> set[str]:
        return {self._tok.decode([i]) for i in self.stop_ids} - {""}

    def _render(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]],
        *,
        generation_prompt: bool,
        kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        if not self._tok.chat_template:
            raise ValueError(
                f"task.chat_template: the tokenizer in {self.path} has no chat template"
            )
        return self._tok.apply_chat_template(
            [dict(m) for m in messages],
            tools=[dict(t) for t in tools] or None,
            tokenize=False,
            add_generation_prompt=generation_prompt,
            **(kwargs or {}),
        )

    def decode(self, ids: Iterable[int]) -> str:
        """Text of `ids` with special tokens skipped."""
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)
