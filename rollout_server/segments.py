"""A session's segments: forks of its history (docs/DESIGN.md §6.6, `server.http_session_fork`).

An agent that trims, summarises or rewrites its context sends a history the session does not
hold. With forks on, that request ends the session's engine request (its trajectory so far is a
finished segment) and starts a new one, prefilled from the new history as a fresh prompt: the
tokens before the divergence are that segment's prompt (no loss), and its turns are generated
and inserted as in any session. Each segment is a whole trajectory of its own (its prompt, its
log-probs, versions and routing: what the engine recorded for it), and the session's reward is
every segment's. A forked session reports a `ForkedSample` holding its segments;
`segments_of` lists any sample's, in order.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from rollout_server.driver import FinishedSample


@dataclasses.dataclass(frozen=True)
class ForkedSample:
    """A forked session's sample: its segments, oldest first, each a `FinishedSample` of its
    own (the last is the segment the session ended in)."""

    segments: tuple[FinishedSample, ...]


def segments_of(sample: FinishedSample | ForkedSample) -> tuple[FinishedSample, ...]:
    """Every trajectory `sample` holds, oldest first: a forked session's segments, or the
    sample itself (one for a sample that never forked)."""
    return sample.segments if isinstance(sample, ForkedSample) else (sample,)


_PENDING = object()


class Segments:
    """The engine requests a session forked away, in order, and their samples as they arrive
    (the driver reports an ended request on its own thread, in no fixed order with the
    session's later requests)."""

    def __init__(self) -> None:
        self._ended: list[list[Any]] = []  # [request, its sample or _PENDING]

    def __len__(self) -> int:
        """The session's segments, the current one included."""
        return len(self._ended) + 1

    def fork(self, request: Any) -> None:
        """`request` (the current segment's) is being ended: its sample becomes a segment."""
        self._ended.append([request, _PENDING])

    def arrived(self, request: Any, sample: FinishedSample | None) -> bool:
        """Records the sample of a forked-away `request`; False when `request` is not one (it
        is the session's current one)."""
        for entry in self._ended:
            if entry[0] is request:
                entry[1] = sample
                return True
        return False

    @property
    def complete(self) -> bool:
        """Every forked-away segment's sample has arrived."""
        return all(entry[1] is not _PENDING for entry in self._ended)

    def sample(self, last: FinishedSample | None) -> FinishedSample | ForkedSample | None:
        """The session's sample given its last segment's: None when any segment failed (the
        sample is generated again), `last` itself when it never forked."""
        if not self._ended:
            return last
        earlier = tuple(entry[1] for entry in self._ended)
        if last is None or any(s is None for s in earlier):
            return None
        return ForkedSample((*earlier, last))
