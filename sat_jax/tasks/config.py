"""The task's config: where prompts come from and how completions are scored (the ``task.*`` keys).

Lives with the tasks it configures; ``sat_jax.experiment`` composes it into ``ExperimentConfig``.
"""

from __future__ import annotations

import dataclasses

from sat_jax.tasks.envs.base import EnvConfig
from sat_jax.tasks.envs.registry import SHIPPED, load_environment

REWARDS = ("exact_match", "math", "gsm8k")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TaskConfig:
    """Where prompts come from and how completions are scored.

    Attributes:
      source: "arithmetic" (generated problems) or "file" (jsonl/parquet rows with answers).
      seed: seeds problem generation and file shuffling.
      min_digits, max_digits: operand length range of arithmetic problems.
      operators: the arithmetic operators drawn from, a subset of "+-*".
      path: the jsonl (or parquet) prompt file when `source == "file"`.
      prompt_key, answer_key, id_key: columns of a file row; rows without `id_key` get their
        line number as id.
      reward: "exact_match" (completion == answer after stripping), "math" (a `\\boxed{}`
        answer checked by math-verify) or "gsm8k" (the reference is the text after "####" in
        the answer; the completion's last `\\boxed{}`, else its last number, checked by
        math-verify).
      alphabet: the characters of the character tokenizer (after pad, bos and eos).
      tokenizer: "char" (the character tokenizer over `alphabet`) or "hf" (a Hugging Face
        tokenizer directory); "" = "hf" when `model.hf_path` is set, else "char"
        (`ExperimentConfig.tokenizer_kind`).
      tokenizer_path: the HF tokenizer's directory; "" = `model.hf_path`.
      chat_template: render each prompt as one user message with the tokenizer's chat template
        and its generation prompt (the tokenizer must have a template).
      system_prompt: a system message placed before the user message ("" = none; needs
        `chat_template`).
      env: what answers between turns (docs/DESIGN.md §2): "" or "single_turn" (one answer,
        scored by `reward`), "feedback" (a wrong answer is asked again), "calculator" (a
        calculator tool), or a user's class as `module:Class` (imported and checked when the
        config loads). Anything but single-turn needs `chat_template`.
      max_turns: the most assistant turns of an episode (single_turn always stops after one).
      max_episode_tokens: the most tokens after the prompt, generated and inserted by the
        environment together (0 = what `model.max_seq_len` leaves after the prompt); the
        rollout server enforces it.
      turn_discount: `feedback`'s reward is the last answer's times
        `turn_discount ** (turns - 1)`; in (0, 1], unset = 1.0 (no discount). Refused with the
        other shipped environments, which never read it (a user's class may).
    """

    source: str = "arithmetic"
    seed: int = 0
    min_digits: int = 1
    max_digits: int = 2
    operators: str = "+-"
    path: str = ""
    prompt_key: str = "prompt"
    answer_key: str = "answer"
    id_key: str = "id"
    reward: str = "exact_match"
    alphabet: str = "0123456789+-*=() "
    tokenizer: str = ""
    tokenizer_path: str = ""
    chat_template: bool = False
    system_prompt: str = ""
    env: str = ""
    max_turns: int = 4
    max_episode_tokens: int = 0
    turn_discount: float | None = None

    def __post_init__(self) -> None:
        if self.source not in ("arithmetic", "file"):
            raise ValueError(f"source must be 'arithmetic' or 'file', got {self.source!r}")
        if not 1 <= self.min_digits <= self.max_digits <= 9:
            raise ValueError(
                f"need 1 <= min_digits <= max_digits <= 9, got {self.min_digits}, {self.max_digits}"
            )
        if not self.operators or set(self.operators) - set("+-*"):
            raise ValueError(
                f"operators must be a non-empty subset of '+-*', got {self.operators!r}"
            )
        if self.source == "file" and not self.path:
            raise ValueError("source 'file' needs a path")
        if self.reward not in REWARDS:
            raise ValueError(f"reward must be one of {REWARDS}, got {self.reward!r}")
        if self.tokenizer not in ("", "char", "hf"):
            raise ValueError(f"tokenizer must be 'char' or 'hf', got {self.tokenizer!r}")
        if self.system_prompt and not self.chat_template:
            raise ValueError("system_prompt needs chat_template: true")
        if not self.alphabet or len(set(self.alphabet)) != len(self.alphabet):
            raise ValueError("alphabet must be non-empty without repeated characters")
        self.env_config  # noqa: B018 (checks max_turns, max_episode_tokens, turn_discount)
        load_environment(self.env)
        if self.turn_discount is not None and self.env in ("", *SHIPPED) and self.env != "feedback":
            raise ValueError(
                f"turn_discount is inert with env {self.env or 'single_turn'!r} (only 'feedback' "
                "or a user's class reads it): drop it, or set env 'feedback'"
            )
        if self.multi_turn and not self.chat_template:
            raise ValueError(
                f"env {self.env!r} needs chat_template: true (its turns are chat messages)"
            )

    @property
    def multi_turn(self) -> bool:
        """Whether `env` runs episodes of several turns (anything but "" and "single_turn")."""
        return self.env not in ("", "single_turn")

    @property
    def env_config(self) -> EnvConfig:
        """The environment's part: `reward`, `system_prompt` and the episode limits."""
        return EnvConfig(
            reward=self.reward,
            system_prompt=self.system_prompt,
            max_turns=self.max_turns,
            max_episode_tokens=self.max_episode_tokens,
            turn_discount=1.0 if self.turn_discount is None else self.turn_discount,
        )
