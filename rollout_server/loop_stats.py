"""The rollout server's busy-time accounting (docs/DESIGN.md §4): decode seconds, slot-seconds idle
while admission is closed, and the process's CPU and the machine's steal seconds.

- `DecodeClock`: the engine notes each generate step when it dispatches it (`dispatched`) and the
  driver's detokenize thread when its output is on the host (`ready`); a step is busy from the
  later of its dispatch and the previous step's readiness to its own readiness, so steps queued
  behind each other are counted once and the waits for a prefill (no step dispatched) not at all.
- `IdleMeter`: samples, every `period_s`, whether admission is open and how many slots are free;
  while admission is closed, free slots × the time since the last sample is idle capacity the
  admission rule (not the trainer's demand for work) left unused.
- `LoopAccounting`: both, and the CPU / steal seconds since the server started
  (`sat_jax.cpu_clock`), as the `StatsResponse` fields and Prometheus gauges they feed.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from typing import Any

from sat_jax.cpu_clock import cpu_seconds, steal_seconds


class DecodeClock:
    """Seconds the engine spent on generate steps, and the steps; see the module docstring.

    `dispatched` and `ready` come in the same order, one `ready` per `dispatched` (JetStream hands
    every step's output to the detokenize thread in dispatch order). Thread-safe for one thread
    calling `dispatched` and another calling `ready`.

    Args:
      clock: monotonic seconds (tests pass a fake one).
    """

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self._clock = clock
        self._pending: collections.deque[float] = collections.deque()
        self._last_ready = float("-inf")
        self.seconds = 0.0
        self.steps = 0

    def dispatched(self) -> None:
        """A generate step was dispatched now."""
        self._pending.append(self._clock())

    def ready(self) -> None:
        """The oldest dispatched step's output is on the host now."""
        now = self._clock()
        try:
            start = self._pending.popleft()
        except IndexError:  # a step this clock did not see dispatched: count from the last one
            start = self._last_ready
        self.seconds += max(0.0, now - max(start, self._last_ready))
        self._last_ready = now
        self.steps += 1


class IdleMeter:
    """Integrates free slots over the time admission is closed, sampled every `period_s`.

    Args:
      admission_open: whether admission lets a new group start now.
      free_slots: the engine's slots holding no request now.
      clock: monotonic seconds.
    """

    def __init__(
        self,
        admission_open: Callable[[], bool],
        free_slots: Callable[[], int],
        clock: Callable[[], float] = time.monotonic,
    ):
        self._open, self._free, self._clock = admission_open, free_slots, clock
        self._last: tuple[float, bool, int] | None = None
        self.slot_seconds = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def sample(self) -> None:
        """One observation: the interval since the last one counts with the last one's state (the
        state held over it), as idle slot-seconds if admission was closed then."""
        now, is_open, free = self._clock(), bool(self._open()), int(self._free())
        if self._last is not None:
            then, was_open, was_free = self._last
            if not was_open:
                self.slot_seconds += max(0.0, now - then) * was_free
        self._last = (now, is_open, free)

    def start(self, period_s: float = 0.01) -> None:
        """Samples every `period_s` on a daemon thread until `stop`."""

        def run() -> None:
            while not self._stop.wait(period_s):
                try:
                    self.sample()
                except Exception:  # a sample during shutdown: the figure just stops growing
                    return

        self._thread = threading.Thread(target=run, name="idle-meter", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=1)


class LoopAccounting:
    """The server's accounting as `StatsResponse` fields (`stats`).

    Args:
      decode: the engine's `DecodeClock`.
      idle: the `IdleMeter` over the rollout loop's admission and the driver's slots.
      stat_path: the ``/proc/stat`` steal is read from.
    """

    def __init__(self, decode: DecodeClock, idle: IdleMeter, stat_path: str = "/proc/stat"):
        self.decode, self.idle, self._stat_path = decode, idle, stat_path
        self._cpu0 = cpu_seconds()
        self._steal0 = steal_seconds(stat_path)

    def stats(self) -> dict[str, Any]:
        """``decode_seconds``, ``decode_steps``, ``admission_idle_slot_seconds``,
        ``cpu_seconds`` (this process since the accounting began) and ``steal_seconds`` (the
        machine's over the same time; left out, so unset in the proto, when not reported)."""
        out: dict[str, Any] = {
            "decode_seconds": self.decode.seconds,
            "decode_steps": self.decode.steps,
            "admission_idle_slot_seconds": self.idle.slot_seconds,
            "cpu_seconds": cpu_seconds() - self._cpu0,
        }
        steal = steal_seconds(self._stat_path)
        if steal is not None and self._steal0 is not None:
            out["steal_seconds"] = steal - self._steal0
        return out
