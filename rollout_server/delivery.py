"""Delivery of finished groups (docs/DESIGN.md §6.2): the queue of finished groups and the leases
of those handed out.

`pull` leases groups; only an acknowledgement removes them for good. A lease not acknowledged
within `lease_s` (a Pull abandoned by its client, a trainer killed before acknowledging) puts the
groups back at the front of the queue, so every group reaches the trainer at least once; the
trainer drops repeats by (server_id, group_id). Leased groups count as queued for admission and
for the queue's capacity.

`Deliveries` is a component of `rollout_server.rollout.RolloutLoop`, which calls it under its lock
(it takes none of its own), so choosing groups, taking them off the queue and leasing them is one
step that admission never sees halfway.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence

from rollout_api.admission import ServerAdmission
from rollout_api.proto import rollout_pb2
from rollout_server.group_queue import GroupQueue

log = logging.getLogger(__name__)


class Deliveries:
    """The finished groups: queued, or leased to the trainer until acknowledged.

    Args:
      capacity: the most groups queued (`GroupQueue`).
      admission: the server's admission state, told what is leased (`lease`, `unlease`) and
        asked in which order to hand groups out (`hand_out`).
      lease_s: how long a pulled group waits for its acknowledgement before it is queued again.
      max_response_bytes: a hand-out returns fewer groups rather than exceed this many bytes
        (a single larger group is still returned).
      clock: the loop's monotonic clock, in seconds, that leases are measured with.
    """

    def __init__(
        self,
        *,
        capacity: int,
        admission: ServerAdmission,
        lease_s: float,
        max_response_bytes: int,
        clock: Callable[[], float],
    ):
        self.queue = GroupQueue(capacity)
        self._admission = admission
        self._lease_s = lease_s
        self._max_response_bytes = max_response_bytes
        self._clock = clock
        # group id -> (the group, when its lease ends), in lease order.
        self.leased: dict[int, tuple[rollout_pb2.Group, float]] = {}
        # Queued groups whose dispatch was not on disk yet when they finished: id -> snapshot.
        self._undurable: dict[int, int] = {}

    def ids(self) -> set[int]:
        """Ids of the groups queued or leased."""
        return {g.group_id for g in self.queue.snapshot()} | set(self.leased)

    def put(self, message: rollout_pb2.Group, seq: int, durable: int) -> None:
        """Queues a finished group whose dispatch is in state snapshot `seq` (`durable`: the
        newest snapshot on disk); a Pull that hands it out before `seq` is on disk waits for it."""
        self._undurable = {i: s for i, s in self._undurable.items() if s > durable}
        if seq > durable:
            self._undurable[message.group_id] = seq
        self.queue.put(message)

    def hand_out(self, running: Iterable[int], max_groups: int) -> tuple[list, int]:
        """Leases what `ServerAdmission.hand_out` picks, in its order, within the response size
        limit: (the groups, the state snapshot their reply must wait for; 0 = none)."""
        queued = {g.group_id: g for g in self.queue.snapshot()}
        ids = self._admission.hand_out(list(queued), running, max_groups)
        # Keep the response under the gRPC message limit; the rest stays queued.
        total, keep = 0, 0
        for i in ids:
            total += queued[i].ByteSize() + 16
            if keep and total > self._max_response_bytes:
                break
            keep += 1
        chosen = set(ids[:keep])
        self.queue.remove_if(lambda g: g.group_id in chosen)
        groups = [queued[i] for i in ids[:keep]]
        until = self._clock() + self._lease_s
        for g in groups:
            self.leased[g.group_id] = (g, until)
        self._admission.lease(g.group_id for g in groups)
        seq = max((self._undurable.pop(g.group_id, 0) for g in groups), default=0)
        return groups, seq

    def give_back(self, group_ids: Sequence[int]) -> bool:
        """Ends the leases of `group_ids` (unknown or not leased ones are ignored): queued again
        at the front. Whether any was."""
        back = [self.leased.pop(i)[0] for i in dict.fromkeys(group_ids) if i in self.leased]
        self._requeue(back)
        return bool(back)

    def release(self, groups: Sequence[rollout_pb2.Group]) -> None:
        """Ends the leases of `groups` now (their Pull's reply was never sent): queued again, at
        the front, in order."""
        self._requeue([g for g in groups if self.leased.pop(g.group_id, None) is not None])

    def expire(self) -> int:
        """Queues again, at the front, the groups whose lease has ended; how many."""
        now = self._clock()
        expired = [g for g, until in self.leased.values() if until <= now]
        for g in expired:
            del self.leased[g.group_id]
        self._requeue(expired)
        return len(expired)

    def remove(self, group_ids: set[int]) -> list[int]:
        """Removes the groups `group_ids` for good, leased or queued (again); the ids removed."""
        done = [i for i in group_ids if self.leased.pop(i, None) is not None]
        done += [g.group_id for g in self.queue.remove_if(lambda g: g.group_id in group_ids)]
        return done

    def _requeue(self, groups: list[rollout_pb2.Group]) -> None:
        if groups:
            self.queue.unget(groups)
            self._admission.unlease(g.group_id for g in groups)
