"""The prompt record every task, dataset and environment shares: an id, the text the policy
continues, and the reference answer its reward compares against."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True, kw_only=True)
class Prompt:
    """One prompt with its reference answer.

    Attributes:
      id: stable across runs and restarts (e.g. "arith-0-17", or a file row's id).
      text: what the policy continues.
      answer: the reference the reward compares against.
    """

    id: str
    text: str
    answer: str
