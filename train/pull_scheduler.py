"""Concurrent Pulls with quotas (docs/DESIGN.md §6.5): the pool's pull when it counts quotas
(``batch_groups``) and the pull names the trainer's version.

Each server has at most one Pull in flight (``train.pulls.Pulls.launch``), all at once, each for
that server's remaining quota of the batch (``rollout_api.admission.FleetQuota.order``; after the
fallback, any number); a batch is made from whichever replies first. What overflows the batch, or
comes after it was made, is handed back unleased (``train.leases``), so its server leases it again
for the batch its next Pull names. With several servers a Pull waits at most 0.5 s at its server.

A paused server (a GC pause, SIGSTOP) holds nothing: the quota's fallback opens after three step
periods (at least 1 s) whatever its Pull is doing, and past the Pull's deadline it is fenced and
its part goes to the others. An earlier rule held the fallback until a paused server's deadline,
against stale drops that came from a credit rule since fixed (benchmarks/RESULTS.md, issue 42).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from rollout_api.admission import FleetQuota
from rollout_api.records import Group, GroupLimits, InvalidGroup
from train.leases import Leases
from train.member import Member
from train.membership import Membership
from train.pulls import Pulled, Pulls

_REPLAN_S = 0.1  # a pull waiting on its servers' Pulls re-plans this often (the fallback)
_CONCURRENT_WAIT_S = 0.5  # with several servers, how long a Pull waits at its server


def _oldest(group: Group | InvalidGroup) -> int:
    """The oldest weights version among a group's generated tokens (-1 for an invalid group:
    it goes first, to be rejected)."""
    if not isinstance(group, Group):
        return -1
    versions = [int(t.versions.min()) for t in group.trajectories if t.versions.size]
    return min(versions, default=-1)


class PullScheduler:
    """Which servers to pull, for how many groups, and when a pull has waited enough (see the
    module docstring). Guarded by the fleet's lock.

    Args:
      fleet, leases, pulls: the pool's other parts.
      quota: the fleet's batch quota.
      shares: each server's share of a batch, by address (``FleetWeights.shares``).
    """

    def __init__(
        self,
        fleet: Membership,
        leases: Leases,
        pulls: Pulls,
        quota: FleetQuota,
        shares: Callable[[Sequence[Member]], dict[str, float]],
    ):
        self._fleet, self._leases, self._pulls = fleet, leases, pulls
        self._quota, self._shares = quota, shares

    def pull(
        self, max_groups: int, timeout_s: float, limits: GroupLimits | None, trainer_version: int
    ) -> Pulled:
        """Up to ``max_groups`` groups of the batch of ``trainer_version``: those of whichever
        Pulls reply first (see ``ServerPool.pull``). A lagging server's Pull does not wait for
        groups. Returns [] once every Pull this call started has answered empty (each waited
        ``timeout_s`` at its server), or when none started and the earlier calls' Pulls did
        not answer within a re-plan."""
        fleet = self._fleet
        backoff = fleet.first_backoff()
        launched: list[Member] = []
        while True:
            fleet.raise_background_error()
            if not fleet.background:
                fleet.maintain()
            with fleet.lock:
                out = self.take_carried(max_groups, trainer_version)
                if out:
                    return out
                up = fleet.up()
                current = [s for s in up if not s.lagging] or up
                plan = self.plan(current, trainer_version) if current else []
            if not up:
                fleet.wait_for_a_server()
                continue
            launched += self._launch(
                plan, current, up, max_groups, timeout_s, limits, trainer_version
            )
            ended = self._await(launched, up)
            if ended == "again":
                continue
            if ended == "empty":
                return []
            fleet.check_servers_down()  # every server asked failed: wait a little
            fleet.sleep(backoff)
            backoff = min(2 * backoff, fleet.retry_max_s)
            launched = []

    def _launch(
        self,
        plan: list[tuple[Member, int | None]],
        current: list[Member],
        up: list[Member],
        max_groups: int,
        timeout_s: float,
        limits: GroupLimits | None,
        trainer_version: int,
    ) -> list[Member]:
        """Launches the ``plan``'s Pulls, each for what the batch still needs (no more; past
        the fallback, all of it: the first replies make the batch, the rest go back), and one
        that waits for no group of each lagging server; returns the servers of the former."""
        with self._fleet.lock:
            need = max_groups - sum(
                s.pull_asked for s in current if s.pulling and s.pull_for == trainer_version
            )
        # With several servers a short wait on each: an empty reply comes back soon, and a
        # server that does not answer by its deadline is found out soon.
        wait = timeout_s if len(current) == 1 else min(timeout_s, _CONCURRENT_WAIT_S)
        launched = []
        for server, limit in plan:
            n = max_groups if limit is None else min(max(need, 0), limit)
            if n > 0 and self._pulls.launch(server, n, wait, limits, trainer_version):
                launched.append(server)
                need -= n
        for server in up:
            if server.lagging and server not in current:
                self._pulls.launch(server, max_groups, 0.0, limits, trainer_version)
        return launched

    def _await(self, launched: list[Member], up: list[Member]) -> str:
        """Waits (at most a re-plan) for a reply, of this call's Pulls (``launched``) or, when
        it launched none, of earlier calls' still in flight. Returns "again" (groups came, an
        error, or the Pulls are still out: re-plan), "empty" (they ended without groups, or
        earlier calls' Pulls did not answer) or "failed" (every Pull launched failed)."""
        pulls = self._pulls
        with pulls.replied:
            asked = launched or [s for s in up if s.pulling]
            pulls.replied.wait_for(
                lambda: (
                    pulls.carried
                    or self._fleet.error is not None
                    or not any(s.pulling for s in asked)
                ),
                timeout=_REPLAN_S,
            )
            if pulls.carried or self._fleet.error is not None:
                return "again"
            if not launched:
                return "empty"
            if any(s.pulling for s in launched):
                return "again"
            results = {s.pull_result for s in launched}
        return "failed" if results <= {"failed"} else "empty"

    def quota_shares(self, current: list[Member], trainer_version: int) -> dict[str, float]:
        """Each current server's part of the batch of ``trainer_version``: the largest share it
        was granted whose lease still holds (a server whose share shrank still holds what it
        admitted under the larger one, which must be taken at that rate to stay within the
        bound), else its share now."""
        shares = self._shares(current)
        for s in current:
            live = [share for share, until in s.grants if until >= trainer_version]
            if live:
                shares[s.address] = max(shares[s.address], *live)
        return shares

    def plan(self, current: list[Member], trainer_version: int) -> list[tuple[Member, int | None]]:
        """The servers to pull now, each with the most groups to take (None = no limit but the
        batch's): ``FleetQuota.order`` over ``current``, those with a Pull in flight left out,
        the fallback held by a paused server owed part of the batch (under the lock)."""
        self._leases.begin(trainer_version)
        now = self._fleet.clock()
        self._quota.start(trainer_version, self.quota_shares(current, trainer_version), now)
        by_address = {s.address: s for s in current}
        plan: dict[str, int | None] = {}
        for address, limit in self._quota.order(list(by_address), now):
            if address in plan:
                if limit is None:
                    plan[address] = None
                continue
            plan[address] = limit
        return [(by_address[a], n) for a, n in plan.items() if not by_address[a].pulling]

    def take_carried(self, max_groups: int, trainer_version: int) -> Pulled:
        """Up to ``max_groups`` of the groups pulled and not handed out yet, oldest first (under
        the lock). Those pulled for an earlier batch than ``trainer_version`` (a reply that came
        after its batch was made), and those beyond ``max_groups``, the youngest, are handed
        back unleased: their server leases them again for the batch its next Pull names, so its
        admission counts them where they will be trained (a group kept across batches would
        count in none: ``ServerAdmission.in_earlier_batch``)."""
        carried = self._pulls.carried
        late = [
            g
            for g in carried
            if isinstance(g, Group)
            and self._leases.pulled_for(g, trainer_version) < trainer_version
        ]
        rest = sorted((g for g in carried if g not in late), key=lambda g: (_oldest(g), g.key))
        out, over = rest[:max_groups], rest[max_groups:]
        back = [*late, *(g for g in over if isinstance(g, Group))]
        self._pulls.carried = [g for g in over if not isinstance(g, Group)]
        self._leases.forget(back, "returns")
        return out
