"""Which tokenizer a task names, built or checked from its ``task.*`` keys.

``task.tokenizer`` is "char" (the character tokenizer over ``task.alphabet``) or "hf" (a Hugging
Face tokenizer from ``task.tokenizer_path``, default the checkpoint ``model.hf_path``); "" picks
"hf" when a checkpoint is set, else "char".
"""

from __future__ import annotations

from collections.abc import Sequence

from sat_jax.tasks.config import TaskConfig
from sat_jax.tasks.hf_tokenizer import HFTokenizer, check_tokenizer_files
from sat_jax.tasks.tokenizer import CharTokenizer, Tokenizer


def tokenizer_kind(task: TaskConfig, *, hf_path: str) -> str:
    """``task.tokenizer``, or its default: "hf" when ``hf_path`` is set, else "char"."""
    return task.tokenizer or ("hf" if hf_path else "char")


def tokenizer_path(task: TaskConfig, *, hf_path: str) -> str:
    """The HF tokenizer's directory: ``task.tokenizer_path``, else the checkpoint ``hf_path``."""
    return task.tokenizer_path or hf_path


def _path_key(task: TaskConfig) -> str:
    return "task.tokenizer_path" if task.tokenizer_path else "model.hf_path"


def make_task_tokenizer(
    task: TaskConfig, *, hf_path: str = "", stop_ids: Sequence[int] = ()
) -> Tokenizer:
    """The tokenizer ``task`` names, with ``stop_ids`` (``rollout.stop_token_ids``) as extra
    stops besides its eos ids.

    Raises:
      ValueError: one line naming the key, for missing tokenizer files or a chat template the
        tokenizer lacks.
    """
    if tokenizer_kind(task, hf_path=hf_path) == "char":
        return CharTokenizer(task.alphabet, stop_ids=tuple(stop_ids))
    return HFTokenizer(
        tokenizer_path(task, hf_path=hf_path),
        chat_template=task.chat_template,
        system_prompt=task.system_prompt,
        stop_ids=tuple(stop_ids),
        checkpoint=hf_path,
        path_key=_path_key(task),
    )


def check_tokenizer(task: TaskConfig, *, hf_path: str) -> None:
    """Checks the files an "hf" tokenizer needs without loading it.

    Raises:
      ValueError: one line naming the key (``hf_tokenizer.check_tokenizer_files``).
    """
    if tokenizer_kind(task, hf_path=hf_path) == "hf":
        check_tokenizer_files(
            tokenizer_path(task, hf_path=hf_path),
            chat_template=task.chat_template,
            key=_path_key(task),
        )
