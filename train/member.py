"""One rollout server as the trainer's pool sees it (docs/DESIGN.md §6.5): a ``Member`` record,
shared by the pool's parts (``train.remote``), each of which keeps its own group of fields:
the fleet (``train.membership``: up, down, draining, joining, lagging), the pushes
(``train.fleet_weights``: the shares granted), the Pulls (``train.pulls``: the one in flight, the
measured overhead and capacity) and the leases (``train.leases``: acknowledgements not yet sent).
(A server that comes back as another, a new ``server_id``, has its acknowledgements and capacity
cleared by the fleet.) Every field is guarded by the fleet's lock.
"""

from __future__ import annotations

import dataclasses

import grpc

FIRST_BACKOFF_S = 0.5  # the first wait before a retry, or a probe of a down server


@dataclasses.dataclass(eq=False)
class Member:
    """One rollout server as the pool sees it (mutable; guarded by the fleet's lock). Each group
    of fields belongs to one part of the pool."""

    address: str
    index: int  # stable for the pool's life: its metric is pulled_<index>
    channel: grpc.Channel
    stub: object
    # The fleet's (``Membership``).
    from_file: bool = False
    up: bool = True
    failing_since: float | None = None  # first failure of the current streak, while up
    next_probe: float = 0.0
    backoff: float = FIRST_BACKOFF_S
    reason: str = ""  # why it is down (logged when it changes)
    draining: bool = False  # it drains (SIGTERM): no weights, no share; probes quiet until back
    joining: bool = False  # answered a probe: its sender brings it up to date, then it joins
    lagging: bool = False  # its calls are overdue (deaf): fenced, no share, still pulled
    server_id: str = ""
    # The pushes' (``train.fleet_weights``): the shares it was granted, (share, until).
    grants: list[tuple[float, int]] = dataclasses.field(default_factory=list)
    # The Pulls' (``train.pulls``).
    pull_overhead_s: float | None = None  # a Pull's time beyond its wait (an average)
    pulling: bool = False  # a launched Pull is in flight (``Pulls.launch``)
    pull_result: str = ""  # how the last launched Pull ended: "ok", "failed" or "deaf"
    pull_asked: int = 0  # the groups the launched Pull asked for, and its batch's version
    pull_for: int = 0
    pull_started: float = 0.0  # when the launched Pull started, its wait and deadline (s)
    pull_wait: float = 0.0
    pull_deadline: float = 0.0
    pulled: int = 0
    rate: float = 0.0  # its capacity, as its last Pull reply said (0 = not known)
    # The leases' (``train.leases``). Not yet sent: (server_id, group_id) to acknowledge, and
    # to acknowledge as rejected; of leased groups to hand back unleased.
    acks: list[tuple[str, int]] = dataclasses.field(default_factory=list)
    rejects: list[tuple[str, int]] = dataclasses.field(default_factory=list)
    returns: list[tuple[str, int]] = dataclasses.field(default_factory=list)
