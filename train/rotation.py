"""Pulling the rollout servers in turn (docs/DESIGN.md §6.5): the pool's pull without quotas
(``batch_groups`` 0, or a pull that names no trainer version). Each call pulls the next current
server that answers, on the caller's thread; with several servers a Pull waits at most 1 s at its
server, so one slow server does not stall the others. A lagging (fenced) server is pulled on a
Pull of its own that does not wait for groups (``train.pulls.Pulls.launch``), and what it brought
is handed out first.
"""

from __future__ import annotations

from rollout_api.records import GroupLimits
from train.leases import Leases
from train.member import Member
from train.membership import Membership
from train.pulls import Pulled, Pulls

_SEVERAL_WAIT_S = 1.0  # with several servers, how long a Pull waits at its server


class Rotation:
    """The servers pulled in turn (see the module docstring).

    Args:
      fleet, leases, pulls: the pool's other parts.
    """

    def __init__(self, fleet: Membership, leases: Leases, pulls: Pulls):
        self._fleet, self._leases, self._pulls = fleet, leases, pulls
        self._next = 0  # the turn's position among the current servers

    def pull(
        self, max_groups: int, timeout_s: float, limits: GroupLimits | None, trainer_version: int
    ) -> Pulled:
        """Up to ``max_groups`` groups from the next server up that answers (possibly none); see
        ``ServerPool.pull``. When every current server failed once, waits a backoff (doubling
        up to ``retry_max_s``) before the next round."""
        fleet = self._fleet
        backoff = fleet.first_backoff()
        failed: set[int] = set()
        while True:
            fleet.raise_background_error()
            if not fleet.background:
                fleet.maintain()
            with fleet.lock:
                if self._pulls.carried:  # what the lagging servers' Pulls brought meanwhile
                    out = self._pulls.carried[:max_groups]
                    self._pulls.carried = self._pulls.carried[max_groups:]
                    return out
                up = fleet.up()
                current = [s for s in up if not s.lagging] or up
                lagging = [s for s in up if s not in current and not s.pulling]
                server = self._pick(current, trainer_version)
            for other in lagging:
                self._pulls.launch(other, max_groups, 0.0, limits, trainer_version)
            if server is None:
                fleet.wait_for_a_server()
                continue
            wait = timeout_s if len(current) == 1 else min(timeout_s, _SEVERAL_WAIT_S)
            got = self._pulls.call(server, max_groups, wait, limits, trainer_version)
            if not isinstance(got, str):
                return got
            if got != "failed":  # it drained, or it is deaf (fenced): the next one
                continue
            failed.add(server.index)
            if failed >= {s.index for s in current}:  # every server failed: wait a little
                fleet.check_servers_down()
                fleet.sleep(backoff)
                backoff = min(2 * backoff, fleet.retry_max_s)
                failed.clear()

    def _pick(self, current: list[Member], trainer_version: int) -> Member | None:
        """The next of ``current`` in turn (None: none); a Pull naming a newer trainer version
        starts that batch's tally (under the lock)."""
        if not current:
            return None
        self._leases.begin(trainer_version)
        self._next %= len(current)
        server = current[self._next]
        self._next = (self._next + 1) % len(current)
        return server
