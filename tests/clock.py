"""Tests without the wall clock: a fake monotonic clock to inject, and a wait for an event.

A test that sleeps so that a lease expires, or so that a wrong result gets "a chance" to show, is
either slow or racy on a loaded machine. Code that measures time takes a clock (and a sleep)
argument; tests pass a `FakeClock` and move it. Where a test must wait for another thread or
process, it waits for the observable event with `wait_until` and a generous limit, never for a
fixed time.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class FakeClock:
    """A monotonic clock that moves only when told to.

    Call it for the time (as `time.monotonic`); `advance` moves it; `sleep` (pass it where the
    code under test would call `time.sleep`) moves it at once and records the wait.
    """

    def __init__(self, start: float = 1000.0):
        self.now = start
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        """Moves the clock forward by `seconds`."""
        self.now += seconds

    def sleep(self, seconds: float) -> None:
        """Returns at once, `seconds` later on this clock."""
        self.sleeps.append(seconds)
        self.now += seconds


def wait_until(predicate: Callable[[], T], timeout_s: float = 60, interval_s: float = 0.01) -> T:
    """Polls `predicate` until it returns a true value, and returns that value.

    Raises:
      AssertionError: not true within `timeout_s` (generous: only a broken test waits that long).
    """
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout_s}s")
        time.sleep(interval_s)
