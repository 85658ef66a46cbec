"""Which prompts the rollout loop has dispatched and the trainer has not acknowledged, and where it
stands in the prompt stream: what a restarted server re-issues before it draws new prompts
(docs/DESIGN.md §6.4)."""

from __future__ import annotations

import collections
from collections.abc import Collection, Iterable
from typing import Any

import grain

from rollout_server.persistence import RolloutState


class PromptBook:
    """The prompt records of the groups not acknowledged yet, each
    {"group_id", "id", "text", "answer"}, and the prompt stream's position.

    Args:
      prompts: an endless grain pipeline of `sat_jax.tasks.Prompt`.
      state: the saved state: the stream's position (`iterator`, `next_group_id`) and the
        prompts to re-issue (`unfinished`) first.

    Not thread-safe: the rollout loop calls it under its lock.
    """

    def __init__(self, prompts: grain.IterDataset, state: RolloutState):
        self._iter = iter(prompts)
        if state.iterator is not None:
            self._iter.set_state(state.iterator)
        self._position = state.iterator
        self.next_group_id = state.next_group_id
        # Dispatched before a restart and not acknowledged: dispatched again first, in order.
        self.reissue = collections.deque(state.unfinished)
        self._dispatched: dict[int, dict[str, Any]] = {}  # group id -> record, in order
        self.drawn = 0  # prompts drawn from the stream by this process

    def next(self) -> dict[str, Any]:
        """The next prompt to dispatch: one to re-issue, else a new one under a new group id."""
        if self.reissue:
            return self.reissue.popleft()
        prompt = next(self._iter)
        self.drawn += 1
        record = {
            "group_id": self.next_group_id,
            "id": prompt.id,
            "text": prompt.text,
            "answer": prompt.answer,
        }
        self.next_group_id += 1
        self._position = self._iter.get_state()
        return record

    def dispatched(self, record: dict[str, Any]) -> None:
        """`record`'s group started: kept until `settled`."""
        self._dispatched[record["group_id"]] = record

    def settled(self, group_ids: Iterable[int]) -> None:
        """The groups left the server (acknowledged or dropped): not re-issued after a restart."""
        for i in group_ids:
            self._dispatched.pop(i, None)

    def withdraw(self, group_ids: Collection[int]) -> list[int]:
        """Takes the prompts of `group_ids` out of those waiting to be re-issued (the trainer
        acknowledged their groups before this restart re-generated them); the ids taken."""
        again = {r["group_id"] for r in self.reissue} & set(group_ids)
        if again:
            self.reissue = collections.deque(r for r in self.reissue if r["group_id"] not in again)
        return sorted(again)

    def save_to(self, state: RolloutState) -> None:
        """Writes the stream's position and the prompts not acknowledged into `state`."""
        state.iterator, state.next_group_id = self._position, self.next_group_id
        state.unfinished = list(self.reissue) + list(self._dispatched.values())
