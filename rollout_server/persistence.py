"""The rollout loop's durable state: prompt position, counters, and prompts not yet acknowledged.

One small JSON file, replaced atomically (write to a unique temporary name, fsync, rename, fsync
the directory), so a killed server restarts at the same prompt position and re-issues every prompt
whose group the trainer has not acknowledged. The directory is locked (`fcntl.flock`) while a
server uses it: a second server on the same `state_dir` is refused (`StateDirLockedError`).

**Group commit** (docs/DESIGN.md §6.4). The loop never writes under its lock: it hands every state
change to `StateStore.submit` (a shallow snapshot, numbered), and one writer thread writes the
newest snapshot not yet written, serializing and fsyncing outside every lock the RPCs take. At most
one write is in flight; changes that arrive while it runs go together into the next one (only the
newest snapshot is written: each covers every change numbered up to it). An RPC whose reply
depends on a change waits, outside the loop's lock, for the write that covers it
(`StateStore.wait`); changes no reply has revealed yet are written when the writer gets to them.
What must be on disk before which reply, for exactly-once across kill -9:

- **Ack, and a Pull that carries acknowledgements**: the acknowledgement. The trainer forgets an
  acknowledgement once a reply confirms it; lost in a crash, the restarted server would re-issue a
  group the trainer trained, and count it once more (consumed, and a place in admission's budget
  when the trainer rejects the repeat).
- **A Pull that returns groups**: the dispatch of each group (its `group_id`, its prompt, the prompt
  position after it, and the `server_id` the reply names it by). Lost, a restarted server would
  draw that prompt again, and under a fresh `server_id` (none saved yet) deliver it as a new group.
  A group finishes long after its dispatch, so that write is almost always done: a Pull waits for
  nothing in practice.
- **UpdateWeights**: the installed version, path and admission epoch, so a restarted server reloads
  the weights the trainer was told it holds.
- **A dispatch, a skipped prompt, a dropped group**: nothing waits. Until a reply reveals them they
  can be lost: a restart re-draws the same prompts from the saved position under the same group
  ids (or re-issues the dropped group), as if the server had been killed just before them.

A failed write (a full disk) changes nothing in memory: it is logged, the RPCs waiting for it are
answered as the synchronous save did (the state stays in memory, the reply goes out), and the
newest snapshot is written again at the next change, at every `retry` (each turn of the loop) and
at shutdown (`RolloutLoop.stop` submits the state once more and waits for it).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import fcntl
import json
import logging
import os
import pathlib
import tempfile
import threading
import uuid
from typing import Any

log = logging.getLogger(__name__)

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
      epoch_version: the weights version at which the current admission epoch began.
      admission: `rollout_api.admission.ServerAdmission.get_state` at the last save (the
        share and its lease, the trainer's version, the groups the epoch does not count, ...;
        `ServerAdmission.set_state` restores it; docs/DESIGN.md §6.3).
      server_id: a random id of this state (drawn by `new_server_id` when the first group is
        dispatched), on every group: the trainer names groups by (server_id, group_id).
      run_id: the trainer run attached (the last one that started an admission epoch).
    """

    iterator: dict[str, Any] | None = None
    unfinished: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    consumed: int = 0
    next_group_id: int = 0
    version: int = 0
    checkpoint_path: str = ""
    base_path: str = ""
    epoch_version: int = 0
    admission: dict[str, Any] = dataclasses.field(default_factory=dict)
    server_id: str = ""
    run_id: str = ""

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> RolloutState:
        """The state of a saved document, this version's or an older one's: older servers
        saved admission's fields at the top level (folded into `admission` here) and a count
        no longer kept (`epoch_used`, ignored), so a server restarted on an old `state_dir`
        starts where that one stopped."""
        doc = dict(doc)
        doc.pop("epoch_used", None)
        admission = dict(doc.pop("admission", None) or {})
        for old, new in _LEGACY_ADMISSION.items():
            if old in doc:
                admission.setdefault(new, doc.pop(old))
        return cls(**doc, admission=admission)


# Admission's fields as servers before `RolloutState.admission` saved them: old key -> new key.
_LEGACY_ADMISSION = {
    "share": "share",
    "share_until": "share_until",
    "trainer_version": "trainer_version",
    "trained_since": "trained_since",
    "epoch_excluded": "excluded",
}


class StateStore:
    """Saves and loads `RolloutState` in `directory` ("" = keep nothing), holding the directory's
    lock until `close` (or the process's exit).

    `save` writes synchronously. `submit`, `wait` and `retry` commit in groups: one
    writer thread at a time, started when a snapshot waits for it and ended when none does.

    Raises:
      StateDirLockedError: another process holds `directory`.
    """

    def __init__(self, directory: str):
        self.path = pathlib.Path(directory) / _FILE if directory else None
        self._lock_fd: int | None = None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._lock_fd = _lock(self.path.parent / _LOCK)
        self._cond = threading.Condition()
        self._latest: RolloutState | None = None  # the snapshot numbered `_submitted`
        self._submitted = 0  # the number of the newest snapshot
        self._attempted = 0  # the newest one whose write has ended (done or failed)
        self._durable = 0  # the newest one on disk
        self._writing = False  # a writer thread runs
        self.failed = False  # the last write failed
        self.writes = 0  # writes attempted (for benchmarks and logs)

    def close(self) -> None:
        """Waits for the write in flight (if any), then releases the directory's lock."""
        with self._cond:
            self._cond.wait_for(lambda: not self._writing)
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def load(self) -> RolloutState:
        """The saved state, or a fresh one when nothing was saved."""
        if self.path is None or not self.path.exists():
            return RolloutState()
        return RolloutState.from_dict(json.loads(self.path.read_text()))

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

    # Group commit.

    def submit(self, state: RolloutState) -> int:
        """Snapshots `state` for the writer and returns the snapshot's number (for `wait`).

        Cheap (the lists and admission's small dict are copied, not the records): call it under the lock that guards
        `state`, so the snapshot is consistent. The snapshot shares `state`'s records and
        iterator state, which the loop replaces and never mutates.
        """
        snapshot = dataclasses.replace(
            state, unfinished=list(state.unfinished), admission=copy.deepcopy(state.admission)
        )
        with self._cond:
            self._submitted += 1
            self._latest = snapshot
            if self.path is None:  # nothing to write: every snapshot is as durable as it gets
                self._attempted = self._durable = self._submitted
            else:
                self._start_writer_locked()
            return self._submitted

    def wait(self, seq: int) -> bool:
        """Blocks until the write covering snapshot `seq` has ended; whether it is on disk (False:
        that write failed, see the module's docstring). Never call it holding the lock `submit`
        is called under: the writer takes no lock of the caller's, but the caller's RPCs would
        queue behind the disk."""
        with self._cond:
            self._cond.wait_for(lambda: self._attempted >= seq)
            return self._durable >= seq

    @property
    def durable(self) -> int:
        """The number of the newest snapshot on disk (with no directory: the newest)."""
        with self._cond:
            return self._durable

    @property
    def submitted(self) -> int:
        """The number of the newest snapshot (0 = none yet)."""
        with self._cond:
            return self._submitted

    def retry(self) -> int:
        """Writes the newest snapshot again if the last write failed and none is pending;
        returns the number to `wait` for (0 = nothing to retry)."""
        with self._cond:
            if not self.failed or self._latest is None:
                return 0
            if self._submitted == self._attempted:
                self._submitted += 1  # the same snapshot, numbered again
                self._start_writer_locked()
            return self._submitted

    def _start_writer_locked(self) -> None:
        if not self._writing:
            self._writing = True
            threading.Thread(
                target=self._write_all, name="rollout-state-writer", daemon=True
            ).start()

    def _write_all(self) -> None:
        """The writer: writes the newest snapshot until every one submitted has been tried."""
        with self._cond:
            while self._attempted < self._submitted:
                seq, snapshot = self._submitted, self._latest
                self._cond.release()
                error = None
                try:
                    self.save(snapshot)
                except Exception as e:  # OSError (a full disk); anything else is logged alike
                    error = e
                finally:
                    self._cond.acquire()
                self._ended_locked(seq, error)
            self._writing = False
            self._cond.notify_all()

    def _ended_locked(self, seq: int, error: Exception | None) -> None:
        self.writes += 1
        self._attempted = seq
        if error is None:
            if self.failed:
                log.info("the rollout state is saved again")
            self._durable, self.failed = seq, False
        else:
            if not self.failed:
                log.error(
                    "cannot save the rollout state (%s); retrying until it succeeds",
                    error,
                    exc_info=None if isinstance(error, OSError) else error,  # a bug: its trace
                )
            self.failed = True
        self._cond.notify_all()


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
