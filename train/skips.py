"""A run that cannot progress stops: ``train.max_skipped_steps`` consecutive skipped steps end it
with one line naming the count and the likely cause (docs/DESIGN.md §7).

A skipped step (``step_skipped``: nothing active, or a non-finite loss or gradient) consumes its
batch and moves the version on but applies no update, so it does not count towards
``train.steps``; a run whose every step is skipped would otherwise never end. ``SkipStreak``
counts the consecutive ones and the cause of each (``skip_cause``); the loop
(``train.main.train_loop``) checkpoints and raises ``NoProgress`` once the streak reaches the
limit, and the command line turns that into exit status 1 and one line.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

import numpy as np

from sat_jax.step import TrainBatch
from train.batching import BatchStats

# Each cause of a skipped step, and what to change (the config keys that decide it).
CAUSES = {
    "cut": (
        "every completion was cut at rollout.max_new_tokens and train.overlong=mask leaves "
        "nothing to train: raise rollout.max_new_tokens or set train.overlong=soft"
    ),
    "nonfinite": (
        "the loss or gradient was not finite (metrics total_loss, grad_norm): lower "
        "train.optimizer.learning_rate or set train.optimizer.grad_clip"
    ),
    "all_equal": (
        "every group's rewards were all equal (zero advantage): check the task's rewards "
        "(task.*) or set train.filter_groups=all_equal"
    ),
    "empty": "no batch had a token to train (every completion empty or masked)",
}


class NoProgress(RuntimeError):
    """``train.max_skipped_steps`` consecutive steps were skipped; the message is the one line.

    Attributes:
      state, progress: the loop's ``TrainState`` and ``Progress`` when it stopped (checkpointed).
    """

    def __init__(self, message: str, *, state: Any = None, progress: Any = None):
        super().__init__(message)
        self.state, self.progress = state, progress


def skip_cause(metrics: dict[str, Any], batch: TrainBatch, stats: BatchStats, overlong: str) -> str:
    """The likely cause (a key of ``CAUSES``) of a skipped step, from its host-side batch
    (``PulledBatch.batch``), the batch's stats and the step's metrics."""
    if overlong == "mask" and stats.groups and stats.overlong_frac >= 1.0:
        return "cut"
    finite = [np.isfinite(metrics[k]) for k in ("total_loss", "grad_norm") if k in metrics]
    if not all(finite):
        return "nonfinite"
    group_ids, rewards = np.asarray(batch.group_ids), np.asarray(batch.rewards)
    ids = np.unique(group_ids[group_ids >= 0])
    if ids.size and all(np.ptp(rewards[group_ids == g]) == 0 for g in ids):
        return "all_equal"
    return "empty"


@dataclasses.dataclass(frozen=True)
class SkipStreak:
    """The consecutive skipped steps so far and their causes (reset by an applied update)."""

    count: int = 0
    causes: tuple[str, ...] = ()

    def after(self, skipped: bool, cause: str = "empty") -> SkipStreak:
        """The streak after one more step (``cause`` is read only when it was skipped)."""
        if not skipped:
            return SkipStreak()
        return SkipStreak(self.count + 1, (*self.causes, cause))

    def exhausted(self, limit: int) -> bool:
        """Whether the run should stop: ``limit`` (> 0; 0 = never) consecutive steps skipped."""
        return limit > 0 and self.count >= limit

    def message(self) -> str:
        """The one line: the count and the most frequent cause, with its keys."""
        cause = collections.Counter(self.causes).most_common(1)[0][0] if self.causes else "empty"
        return (
            f"stopped: {self.count} consecutive steps were skipped (train.max_skipped_steps); "
            f"likely cause: {CAUSES[cause]}"
        )
