"""The rollout loop's durable state: prompt position, counters, and prompts not yet pulled.

One small JSON file, replaced atomically (write, fsync, rename), so a killed server restarts at
the same prompt position and re-issues every prompt whose group the trainer has not pulled.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
from typing import Any

_FILE = "rollout_state.json"


@dataclasses.dataclass(kw_only=True)
class RolloutState:
    """The persisted counters and positions of the rollout loop.

    Attributes:
      iterator: the grain iterator state after the last prompt drawn.
      unfinished: dispatched prompts whose groups are not pulled yet, in dispatch order, each
        {"group_id", "id", "text", "answer"}.
      consumed: groups pulled so far.
      next_group_id: the next group id to assign.
      version, checkpoint_path: the weights last installed by UpdateWeights ("" = none yet).
      epoch_version, epoch_used: where the current admission epoch began: the weights version and
        the groups dispatched until then (consumed + queued + running), which admission no
        longer counts (see `rollout.admission_budget`, docs/DESIGN.md §6).
    """

    iterator: dict[str, Any] | None = None
    unfinished: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    consumed: int = 0
    next_group_id: int = 0
    version: int = 0
    checkpoint_path: str = ""
    epoch_version: int = 0
    epoch_used: int = 0


class StateStore:
    """Saves and loads `RolloutState` in `directory` ("" = keep nothing)."""

    def __init__(self, directory: str):
        self.path = pathlib.Path(directory) / _FILE if directory else None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def load(self) -> RolloutState:
        """The saved state, or a fresh one when nothing was saved."""
        if self.path is None or not self.path.exists():
            return RolloutState()
        doc = json.loads(self.path.read_text())
        return RolloutState(**doc)

    def save(self, state: RolloutState) -> None:
        """Replaces the saved state atomically (write, fsync, rename)."""
        if self.path is None:
            return
        tmp = self.path.with_suffix(".tmp")
        with open(tmp, "w") as f:
            json.dump(dataclasses.asdict(state), f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
