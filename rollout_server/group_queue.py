"""A bounded, thread-safe FIFO of finished groups with a batched, time-limited `get_many`."""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from typing import Any


class GroupQueue:
    """FIFO of at most `capacity` items; `put` never blocks (callers keep within capacity)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._items: collections.deque[Any] = collections.deque()
        self._cond = threading.Condition()

    def __len__(self) -> int:
        with self._cond:
            return len(self._items)

    def put(self, item: Any) -> None:
        """Appends `item`.

        Raises:
          OverflowError: the queue is full (admission control should prevent it).
        """
        with self._cond:
            if len(self._items) >= self.capacity:
                raise OverflowError(f"group queue is full ({self.capacity})")
            self._items.append(item)
            self._cond.notify_all()

    def snapshot(self) -> list[Any]:
        """The items queued now, in order (a copy)."""
        with self._cond:
            return list(self._items)

    def unget(self, items: list[Any]) -> None:
        """Puts `items` (taken by `get_many`) back at the front, in their order."""
        with self._cond:
            self._items.extendleft(reversed(items))
            self._cond.notify_all()

    def remove_if(self, predicate: Callable[[Any], bool]) -> list[Any]:
        """Takes out (and returns, in order) every item for which `predicate` is true."""
        with self._cond:
            taken = [item for item in self._items if predicate(item)]
            if taken:
                self._items = collections.deque(i for i in self._items if not predicate(i))
            return taken

    def wait(self, timeout_s: float) -> bool:
        """Waits up to `timeout_s` for an item without taking it; True when one is there."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while not self._items:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            return True

    def get_many(self, n: int, timeout_s: float) -> list[Any]:
        """Up to `n` items; waits up to `timeout_s` for the first, never for more."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while not self._items:
                left = deadline - time.monotonic()
                if left <= 0:
                    return []
                self._cond.wait(left)
            return [self._items.popleft() for _ in range(min(n, len(self._items)))]
