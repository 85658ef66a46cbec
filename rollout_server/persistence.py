"""The rollout loop's durable state: prompt position, counters, and prompts not yet acknowledged.

One small JSON file, replaced atomically (write to a unique temporary name, fsync, rename, fsync
the directory), so a killed server restarts at the same prompt position and re-issues every prompt
whose group the trainer has not acknowledged. The directory is locked (`fcntl.flock`) while a
server uses it: a second server on the same `state_dir` is refused (`StateDirLockedError`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import pathlib
import tempfile
import uuid
from typing import Any

_FILE = "rollout_state.json"
_LOCK = "lock"


class StateDirLockedError(RuntimeError):
    """Another process (another server) holds the state directory."""


@dataclasses.dataclass(kw_only=True)
class RolloutState:
    """The persisted counters and positions of the rollout loop.

    Attributes:
      iterator: the grain iterator state after the last prompt drawn.
      unfinished: dispatched prompts whose groups are not acknowledged yet, in dispatch order,
        each {"group_id", "id", "text", "answer"}.
      consumed: groups acknowledged so far.
      next_group_id: the next group id to assign.
      version, checkpoint_path: the weights last installed by UpdateWeights ("" = none yet).
      base_path: under LoRA, the base that `checkpoint_path`'s adapters apply to ("" = the
        checkpoint holds whole params).
      epoch_version, epoch_used: where the current admission epoch began: the weights version and
        the groups dispatched until then (consumed + queued + running), plus the groups the
        trainer rejected since, which admission no longer counts (see
        `rollout.admission_budget`, docs/DESIGN.md §6).
      epoch_excluded: ids of the groups outstanding (queued, leased or running) when the epoch
        began, which `epoch_used` leaves out of the count: one of them rejected stays out of it
        (no replacement), one acknowledged as trained counts (the trainer spent a batch place
        on it, so the epoch owes one group fewer).
      share: this server's share of the fleet's admission (the trainer sends 1/k with k servers
        up): admission allows `share` · batch_groups groups per version (docs/DESIGN.md §6.3).
      server_id: a random id of this state (drawn by `new_server_id` when the first group is
        dispatched), on every group: the trainer names groups by (server_id, group_id).
      run_id: the trainer run attached (the last one that started an admission epoch).
      trainer_version: the newest trainer version the server has seen (`rollout_api.admission`:
        admission shrinks the run-ahead by how far it is ahead of `version`).
      trained_since: groups acknowledged as trained since that version was reported (they count
        against the budget of a trainer whose Pulls do not carry its version).
    """

    iterator: dict[str, Any] | None = None
    unfinished: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    consumed: int = 0
    next_group_id: int = 0
    version: int = 0
    checkpoint_path: str = ""
    base_path: str = ""
    epoch_version: int = 0
    epoch_used: int = 0
    epoch_excluded: list[int] = dataclasses.field(default_factory=list)
    share: float = 1.0
    server_id: str = ""
    run_id: str = ""
    trainer_version: int = 0
    trained_since: int = 0


class StateStore:
    """Saves and loads `RolloutState` in `directory` ("" = keep nothing), holding the directory's
    lock until `close` (or the process's exit).

    Raises:
      StateDirLockedError: another process holds `directory`.
    """

    def __init__(self, directory: str):
        self.path = pathlib.Path(directory) / _FILE if directory else None
        self._lock_fd: int | None = None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._lock_fd = _lock(self.path.parent / _LOCK)

    def close(self) -> None:
        """Releases the directory's lock."""
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def load(self) -> RolloutState:
        """The saved state, or a fresh one when nothing was saved."""
        if self.path is None or not self.path.exists():
            return RolloutState()
        doc = json.loads(self.path.read_text())
        return RolloutState(**doc)

    def save(self, state: RolloutState) -> None:
        """Replaces the saved state atomically (unique temporary file, fsync, rename, fsync of
        the directory).

        Raises:
          OSError: the write failed (e.g. ENOSPC); the saved state is the previous one.
        """
        if self.path is None:
            return
        fd, tmp = tempfile.mkstemp(prefix=f".{_FILE}.", suffix=".tmp", dir=self.path.parent)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(dataclasses.asdict(state), f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        directory = os.open(self.path.parent, os.O_RDONLY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)


def new_server_id() -> str:
    """A fresh random `RolloutState.server_id`."""
    return uuid.uuid4().hex[:16]


def _lock(path: pathlib.Path) -> int:
    """An open descriptor of `path` holding an exclusive `flock`.

    Raises:
      StateDirLockedError: another process holds it (its pid, when it wrote one, in the message).
    """
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 32).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise StateDirLockedError(
            f"state_dir {str(path.parent)!r} is in use by another server (pid {holder})"
        ) from None
    os.ftruncate(fd, 0)
    os.write(fd, str(os.getpid()).encode())
    return fd
