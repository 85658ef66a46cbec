"""A deterministic simulator of a rollout fleet and its trainer (docs/DESIGN.md §6.3, §6.5): fake
clock, scripted servers of given speeds (which may change mid-run) and completion-length spreads,
each measuring its capacity as the real server does (`RateMeter`) for the pool's shares, kills,
SIGTERM drains, rejoins, trainer restarts, delayed and lost Pull replies. It drives the admission module the real
server and pool use (`rollout_api.admission`), or `OldAdmission`, a model of the rule before it
(for the "before" figures), and checks at every step: exactly-once, no trained group older than
`max_staleness`, and that every group is accounted for.

Time is in arbitrary units (a step takes `step_time`); a sample of L tokens takes L / `speed` once
it holds one of its server's `slots`. A group's oldest token is generated with the weights its
server held when its first sample got a slot. Nothing here sleeps or reads a clock.

With `prefetch` the trainer is the real loop's (docs/DESIGN.md §7.1): it pulls the batch of
version T + 1 while the step of version T runs (its Pulls report T + 1), and the acknowledgements of
a step's batch leave with the first Pull that starts after the step (a Pull waiting on a server
carries none: one Pull at a time per server; a push carries none either). Without it the trainer
pulls only
between steps (the serial loop the admission rule was first simulated with; the async trainer always
prefetches, so every scenario runs the real loop's timing unless it says otherwise).

With `push_cost` or `pulls` the pool's control plane is modelled too (`FleetSim`'s arguments):
weight loads that take time, serial or per-server senders, one or several trainer processes,
blocking or concurrent Pulls with the pool's waits, deaf (SIGSTOPped) servers, the lagging fence
and version leases; `BEFORE` and `AFTER` are today's pool and issue 42's (`live_pool`: the live
pool's own waits and fence floors, which `AFTER` leaves out). Every trained group is
checked against the admission bound W − v_admitted ≤ S (v_admitted: its server's weights when it
was admitted), outside a stated fault window (`FleetSim._exempt`).
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
import math
import random

from rollout_api.admission import FleetQuota, RateMeter, ServerAdmission, fleet_shares
from train import fleet_weights, membership, pull_scheduler, pulls


class SimStalled(RuntimeError):
    """No step finished for `stall_after` time units (the run would die of
    `train.client.wait_s`)."""


class OldAdmission:
    """The rule before `rollout_api.admission` (commit 48471f2): the budget
    (S + v − epoch_version + 1) · share · B − (consumed + outstanding − epoch_used), rebased at every
    new version or share, a rejected group replaced at once, finished groups handed out in the
    order they finished, the trainer's version unknown to the server."""

    def __init__(self, max_staleness: int, batch_groups: int, capacity: int):
        self.s, self.b, self.capacity = max_staleness, batch_groups, capacity
        self.share, self.version, self.epoch_version = 1.0, 0, 0
        self.consumed, self.used = 0, 0
        self.admitted: dict[int, int] = {}
        self.excluded: set[int] = set()

    def may_admit(self, outstanding) -> bool:
        versions = self.s + self.version - self.epoch_version + 1
        budget = versions * self.share * self.b - (self.consumed + len(self.admitted) - self.used)
        return budget > 0 and len(self.admitted) < self.capacity

    def admit(self, group_id: int) -> None:
        self.admitted[group_id] = self.version

    def done(self, group_ids, rejected=()) -> None:
        for i in group_ids:
            if self.admitted.pop(i, None) is None:
                continue
            self.consumed += 1
            self.used += (i in rejected) - (i in self.excluded)
            self.excluded.discard(i)

    def saw_trainer(self, version: int) -> None:
        pass  # the old protocol did not carry it

    def install(self, version: int, share: float) -> None:
        if share != self.share or version != self.version:
            self.excluded &= set(self.admitted)
            self.epoch_version, self.used = version, self.consumed + len(self.excluded)
        self.version, self.share = version, share

    def begin_epoch(self, version: int, outstanding) -> None:
        self.epoch_version, self.version = version, version
        self.used = self.consumed + len(self.admitted)
        self.excluded = set(self.admitted)

    def hand_out(self, queued, running, n):
        return list(queued)[:n]  # finish order


class FinishOrderAdmission(ServerAdmission):
    """A mutant of `ServerAdmission`: finished groups handed out in the order they finished."""

    def hand_out(self, queued, running, n):
        return list(queued)[: max(n, 0)]


class NoHoldBackAdmission(ServerAdmission):
    """A mutant of `ServerAdmission`: oldest admitted first, but younger finished groups are not
    held back while a group whose deadline is the trainer's version still runs."""

    def hand_out(self, queued, running, n):
        if n <= 0:
            return []
        return sorted(queued, key=lambda i: (self.admitted.get(i, -1), i))[:n]


class ReleaseAtLeaseAdmission(ServerAdmission):
    """A mutant of `ServerAdmission`'s budget: a group's seat frees when it is leased to the
    batch of the trainer's version T (its own T is then fixed, T ≤ v + S), not once the trainer
    has moved past T. The batch of T may still take more of this server's groups: the seat
    freed goes to a group whose place is a batch later."""

    def in_earlier_batch(self, group_id: int) -> bool:
        t = self.leased.get(group_id)
        return self.pulls_report and t is not None and t <= self.trainer_version


class PrefetchLeadAdmission(ServerAdmission):
    """A mutant of `ServerAdmission`'s budget: the lead of 1 a prefetching trainer has while a
    step runs (its Pulls name W + 1, the servers hold W) is not counted."""

    @property
    def lead(self) -> int:
        return max(self.trainer_version - self.weights_version - 1, 0)


@dataclasses.dataclass
class SimGroup:
    gid: int
    server: str
    admitted: int  # weights version at admission
    first: int | None = None  # weights version of its oldest token
    left: int = 0  # samples not finished
    length: float = 0.0  # mean completion length
    tokens: float = 0.0
    born: float = 0.0  # when it was admitted

    @property
    def key(self) -> tuple[str, int]:
        return (self.server, self.gid)


class SimServer:
    """One rollout server: admission, a FIFO of samples waiting for slots, the slots, the
    finished queue and the leases (ids persist across a kill, as `state_dir` does)."""

    def __init__(self, name, sim, *, speed, slots, lengths):
        self.name, self.sim = name, sim
        self.speed, self.slots, self.lengths = speed, slots, lengths
        self.up = True
        self.draining = False
        self.next_id = 0
        self.incarnation = 0
        self.deaf: list[tuple[float, float]] = []  # (from, to): stopped (SIGSTOP) meanwhile
        self.cycle: tuple[float, float] | None = None  # (stopped, period): a duty cycle
        self._reset()

    def deaf_at(self, t: float) -> bool:
        """Whether it is stopped at time `t` (a deaf window or its duty cycle holds it)."""
        if self.cycle is not None:
            stopped, period = self.cycle
            if t % period < stopped:
                return True
        return any(a <= t < b for a, b in self.deaf)

    def _reset(self) -> None:
        cfg = self.sim
        if cfg.rule == "old":
            self.adm = OldAdmission(cfg.max_staleness, cfg.batch_groups, cfg.capacity)
        else:
            self.adm = cfg.admission(
                max_staleness=cfg.max_staleness,
                batch_groups=cfg.batch_groups,
                capacity=cfg.capacity,
            )
        self.groups: dict[int, SimGroup] = {}
        self.waiting: collections.deque = collections.deque()  # (gid, length)
        self.active: list[list] = []  # [gid, tokens left]
        self.queue: list[int] = []  # finished, in finish order
        self.leased: dict[int, float] = {}  # gid -> lease end
        self.version = 0
        self.ready = False  # holds trainer weights
        # The control plane's lease (`FleetSim(fence=True)`): the last trainer version its share is
        # valid for (None = no lease), and whether its share is 0 (lagging).
        self.share_until: int | None = None
        self.fenced = False
        self.unacked: list[int] = []  # persisted: dispatched, not acknowledged
        # Its capacity measure (a process's: a restart measures again), reported on every Pull.
        self.meter = RateMeter(self.slots, window_s=self.sim.rate_window)
        self.tokens = 0.0  # generated so far (the engine's counter)
        self.slot_time, self.idle = 0.0, {}  # slot time, and idle slot time by cause (`tick`)

    def install(
        self, version: int, share: float, new_epoch: bool, share_until: int | None = None
    ) -> None:
        """New weights `version` with its `share` (0: it admits nothing, lagging) and its lease
        (`share_until`; None: none)."""
        self.version = max(self.version, version)
        self.fenced = share <= 0
        self.share_until = share_until
        self.adm.install(version, share if share > 0 else 1.0)
        if new_epoch or not self.ready:
            self.adm.begin_epoch(version, set(self.groups))
        self.ready = True

    def admitting(self) -> bool:
        """Admission open: weights held, not draining, a share, and its lease not run out (the
        trainer's version it knows is within `share_until`)."""
        if not self.ready or self.draining or self.fenced:
            return False
        known = getattr(self.adm, "trainer_version", 0)
        return self.share_until is None or known <= self.share_until

    def kill(self) -> None:
        self.up = False
        self.incarnation += 1

    def restart(self) -> None:
        """Back on its state: every group not acknowledged is generated again."""
        again = sorted(set(self.unacked))
        self._reset()
        self.up = True
        self.draining = False
        self.unacked = again
        self._reissue = collections.deque(again)

    def _dispatch(self, gid: int) -> None:
        g = SimGroup(gid, self.name, self.version, left=self.sim.group_size, born=self.sim.now)
        self.groups[gid] = g
        self.sim.dispatched.add(g.key)
        self.adm.admit(gid)
        if gid not in self.unacked:
            self.unacked.append(gid)
        for _ in range(self.sim.group_size):
            self.waiting.append((gid, self.sim.rng.uniform(*self.lengths)))

    def tick(self, dt: float) -> None:
        if not self.up or self.deaf_at(self.sim.now):
            return
        if self.draining and not self.groups:  # drained: it exits, nothing left to hand back
            self.kill()
            self.sim.down.add(self.name)
            return
        reissue = getattr(self, "_reissue", None)
        while self.admitting() and self.adm.may_admit(self.groups.keys()):
            if reissue:
                self._dispatch(reissue.popleft())
            else:
                self._dispatch(self.next_id)
                self.next_id += 1
        while self.waiting and len(self.active) < self.slots:
            gid, length = self.waiting.popleft()
            g = self.groups[gid]
            g.first = self.version if g.first is None else g.first
            g.length += length / self.sim.group_size
            self.active.append([gid, length])
        self.meter.observe(self.sim.now, self.tokens, len(self.active))
        self._count_idle(dt)
        still = []
        for a in self.active:
            self.tokens += min(self.speed * dt, a[1])
            a[1] -= self.speed * dt
            if a[1] > 0:
                still.append(a)
                continue
            g = self.groups[a[0]]
            g.left -= 1
            if g.left == 0:
                self.queue.append(g.gid)
        self.active = still
        now = self.sim.now
        for gid, until in list(self.leased.items()):
            if until <= now:  # lease expired: queued again, in front
                del self.leased[gid]
                self.queue.insert(0, gid)
                if not isinstance(self.adm, OldAdmission):
                    self.adm.unlease([gid])

    def _count_idle(self, dt: float) -> None:
        """Adds this tick's slot time to `slot_time`, and its idle slot time with no sample
        waiting to `idle` by why nothing was admitted: "closed" (no weights, draining, fenced,
        lease ended), "budget" (`budget` ≤ 0: the outstanding groups fill it) or "capacity"."""
        self.slot_time += self.slots * dt
        idle = self.slots - len(self.active)
        if idle <= 0 or self.waiting:
            return
        if not self.admitting():
            why = "closed"
        elif not self.adm.may_admit(self.groups.keys()):
            why = "budget" if len(self.groups) < self.adm.capacity else "capacity"
        else:
            return
        self.idle[why] = self.idle.get(why, 0.0) + idle * dt

    def pull(self, n: int, trainer_version: int, acks, rejects) -> list[SimGroup]:
        self.ack(acks, rejects)
        self.adm.saw_trainer(trainer_version)
        return self.hand_out(n)

    def hand_out(self, n: int) -> list[SimGroup]:
        """Up to `n` finished groups, in its admission's order, leased."""
        running = {g for g in self.groups if g not in self.queue and g not in self.leased}
        ids = self.adm.hand_out(self.queue, running, n)
        for gid in ids:
            self.queue.remove(gid)
            self.leased[gid] = self.sim.now + self.sim.lease_s
        if not isinstance(self.adm, OldAdmission):
            self.adm.lease(ids)
        return [self.groups[i] for i in ids]

    def hand_back(self, groups) -> None:
        """Groups a Pull took that overflowed the batch: queued again in front, unleased."""
        ids = [g.gid for g in groups if g.gid in self.leased]
        for gid in reversed(ids):
            del self.leased[gid]
            self.queue.insert(0, gid)
        if not isinstance(self.adm, OldAdmission):
            self.adm.unlease(ids)

    def ack(self, acks, rejects) -> None:
        ids = [i for i in list(acks) + list(rejects) if i in self.groups]
        for i in ids:
            self.leased.pop(i, None)
            if i in self.queue:
                self.queue.remove(i)
            if i in self.unacked:
                self.unacked.remove(i)
        if isinstance(self.adm, OldAdmission):
            self.adm.done(ids, set(rejects))
        else:
            self.adm.done(ids, trained=set(acks))
        gone = set(ids)  # a running one (re-issued after a restart, trained before) stops
        self.waiting = collections.deque(w for w in self.waiting if w[0] not in gone)
        self.active = [a for a in self.active if a[0] not in gone]
        for i in ids:
            self.groups.pop(i, None)

    @property
    def capacity_rate(self) -> float:
        """Groups per unit time at full load (at its speed now)."""
        mean = sum(self.lengths) / 2
        return self.slots * self.speed / (mean * self.sim.group_size)


@dataclasses.dataclass
class Stats:
    trained: int = 0
    dropped: int = 0
    tokens: float = 0.0
    trained_len: list = dataclasses.field(default_factory=list)
    dropped_len: list = dataclasses.field(default_factory=list)
    lag_max: int = 0
    lost: int = 0  # groups in lost Pull replies
    violations: int = 0  # trained at W > v_admitted + S
    violations_exempt: int = 0  # of those, inside a fault's stated window (`FleetSim._exempt`)
    # W − v_admitted of every trained group, in order (`period_bound`'s batch term reads them).
    admitted_lag: list = dataclasses.field(default_factory=list)


class FleetSim:
    """A fleet of `SimServer`s and one trainer; `run(steps, events)` runs it.

    Args:
      servers: (speed, slots, (min, max) completion length) per server.
      rule: "new" (`rollout_api.admission`) or "old" (`OldAdmission` and the pool of before).
      shares: "measured" (∝ the capacity each server reports on its Pull replies,
        `rollout_api.admission.fleet_shares`, what `ServerPool` sends) or "equal" (1/k, the pool
        of before); the "old" rule always has equal ones.
      rate_window: each server's `RateMeter` window.
      step_time: one train step; push_delay: from the step's end to the servers holding its
        weights; skip: versions whose steps are skipped (nothing trained, version still +1).
      lost_pulls: Pull replies lost (the trainer gets nothing, the server's lease runs out);
        pull_delay: every Pull reply's delay.
      batch_host: the trainer's host work on a batch once its last group is in (assembly, the
        host→device copy): a step starts no earlier than that after its batch filled up (a
        batch prefetched during the step before is ready meanwhile). 0: ready at once.
      prefetch: the real loop's timing (the default; see the module docstring); False: pulls
        only between steps, and acknowledgements leave only with Pulls.
      admission: the servers' admission class (`ServerAdmission`, or a mutant of its hand-out
        order: `FinishOrderAdmission`, `NoHoldBackAdmission`).
      strict: raise at a trained group with W − v_admitted > S outside its server's fault window
        (`_exempt`); False: count it only (`violations`). None: strict for the "new" rule with
        the control plane modelled (the old rule did not bound the admission version; the
        scenarios without the control plane count theirs: a share that shrinks after admission
        trains a few groups a version late).

    The control plane (the pool's pushes and Pulls, `train/remote.py`), modelled when `push_cost`
    or `pulls` is given (otherwise pushes land `push_delay` after the step everywhere at once and
    a pull round is instantaneous, as the scenarios above were written):
      push_cost: a server's weight load, in time units: a number, a (min, max) drawn per load,
        or a list of either per server. A load runs only while its server is not deaf.
      senders: "serial" (today's `WeightPusher` and `ServerPool.update_weights`: one thread saves
        (`push_delay`) then loads the servers one after another, each waited for; a newer version
        submitted meanwhile replaces the waiting one) or "per_server" (each server has one
        `UpdateWeights` at most in flight and is sent the newest version announced when it
        finishes; the loop never waits).
      processes: trainer processes. With "serial" and more than one, no version is skipped:
        the loop's `submit` waits while a version is still waiting (`supersede=False`). With
        "per_server" process 0 announces the newest saved version only.
      pulls: "blocking" (today's `ServerPool.pull`: one Pull at a time on the loop's thread, to
        the servers in `FleetQuota.order` in turn, each waiting up to `pull_timeout`, or
        min(`pull_timeout`, `pull_wait`) with several servers up, for its first group) or
        "concurrent" (one Pull outstanding per server, all at once, each for that server's
        quota; replies fill the batch in the order they come; what overflows it is handed back
        unleased). A deaf server answers when it resumes, or fails at wait + `pull_slack`.
      fence: the lagging fence and version leases: a server whose `UpdateWeights` or Pull is
        overdue (by max(`fence_factor` × its measured load time, `fence_periods` × the step
        period), at least `fence_floor`; a Pull's at least `pull_slack_floor` past its wait) is
        lagging: share 0 at its next push, its seats to the others, still pulled;
        every push grants a share until version + S, and a server that knows a trainer version
        past it admits nothing; it is current again once it installs a version within S of the
        trainer's. A rejoining server joins once it holds a version within S of the next batch's
        (`rejoin`). The pool checks for an overdue load every `fence_turn` (its background
        thread's turn; 0 = every tick).
      fallback_min: `FleetQuota.min_fallback_s` (today's pool: 1 s).
    """

    def __init__(
        self,
        servers,
        *,
        rule="new",
        shares="measured",
        rate_window=1.0,
        max_staleness=2,
        batch_groups=8,
        group_size=4,
        capacity=64,
        step_time=1.0,
        push_delay=0.2,
        lease_s=20.0,
        lost_pulls=0.0,
        pull_delay=0.0,
        seed=0,
        dt=None,
        stall_after=200.0,
        prefetch=True,
        admission=ServerAdmission,
        strict=None,
        push_cost=None,
        senders="serial",
        processes=1,
        pulls=None,
        pull_timeout=None,
        pull_wait=None,
        pull_slack=None,
        fence=False,
        fence_factor=3.0,
        fence_periods=3.0,
        fence_floor=0.0,
        pull_slack_floor=0.0,
        fence_turn=0.0,
        fallback_min=None,
        batch_host=0.0,
    ):
        if shares not in ("measured", "equal"):
            raise ValueError(f"shares must be 'measured' or 'equal' (got {shares!r})")
        if senders not in ("serial", "per_server"):
            raise ValueError(f"senders must be 'serial' or 'per_server' (got {senders!r})")
        if pulls not in (None, "blocking", "concurrent"):
            raise ValueError(f"pulls must be 'blocking' or 'concurrent' (got {pulls!r})")
        self.stall_after = stall_after
        self.admission = admission
        self.control = push_cost is not None or pulls is not None
        self.strict = rule == "new" and self.control if strict is None else strict
        self.senders, self.processes = senders, processes
        self.pulls = pulls or "blocking"
        self.pull_timeout = step_time if pull_timeout is None else pull_timeout
        self.pull_wait = step_time if pull_wait is None else pull_wait
        self.pull_slack = 30 * step_time if pull_slack is None else pull_slack
        self.fence, self.fence_factor, self.fence_periods = fence, fence_factor, fence_periods
        self.fence_floor, self.pull_slack_floor = fence_floor, pull_slack_floor
        self.fence_turn, self._fence_at = fence_turn, 0.0
        self.measured = shares == "measured" and rule == "new"
        self.rate_window = rate_window
        self.rates: dict[str, float] = {}  # the capacity each server reported last (pool side)
        self.prefetch = prefetch
        self.ahead: list[tuple[SimServer, SimGroup]] = []  # the next batch, pulled during a step
        self.batch_host, self.full_at = batch_host, None  # when `ahead` filled up (prefetch)
        self.parked: dict[str, bool] = {}  # a Pull waits on that server (prefetch: no acks)
        self.busy_time = 0.0  # the trainer's steps, in time units
        self.rule, self.max_staleness, self.batch_groups = rule, max_staleness, batch_groups
        self.group_size, self.capacity, self.step_time = group_size, capacity, step_time
        self.push_delay, self.lease_s = push_delay, lease_s
        self.lost_pulls, self.pull_delay = lost_pulls, pull_delay
        self.rng = random.Random(seed)
        self.now = 0.0
        self.servers = [
            SimServer(f"s{i}", self, speed=sp, slots=sl, lengths=ln)
            for i, (sp, sl, ln) in enumerate(servers)
        ]
        gen = min(sum(s.lengths) / 2 / s.speed for s in self.servers)
        self.dt = dt or min(step_time, gen) / 10
        self.version = 1
        self.step = 0
        self.kept: list[tuple[SimServer, SimGroup]] = []
        self.busy_until: float | None = None
        self.last_step = 0.0
        self.skip: set[int] = set()
        self.stats = Stats()
        self.trained_keys: set[tuple[str, int]] = set()
        self.rejected_keys: set[tuple[str, int]] = set()
        self.dispatched: set[tuple[str, int]] = set()
        self.pending: dict[str, tuple[list, list]] = {s.name: ([], []) for s in self.servers}
        self.pushes: list[tuple[float, str, int, bool]] = []  # (when, server, version, epoch)
        self.down: set[str] = set()  # servers the trainer's pool has out of its rotation
        self.quota = FleetQuota(
            batch_groups, min_fallback_s=step_time if fallback_min is None else fallback_min
        )
        self._rot = 0
        self.faults: dict[str, list[tuple[float, float]]] = {}  # server -> (from, to) windows
        self.step_ends: list[float] = []  # when each step finished
        self.drop_log: list[tuple[float, str, float]] = []  # (when, server, admitted at)
        if not self.control:
            self._push_all(new_epoch=True, delay=0.0)
            return
        costs = push_cost if isinstance(push_cost, list) else [push_cost] * len(self.servers)
        self.cost = {s.name: c or 0.0 for s, c in zip(self.servers, costs, strict=True)}
        self.outstanding: dict[str, dict] = {}  # server -> its Pull waiting for a reply
        self.pusher: dict | None = None  # the push thread's version in progress
        self.push_waiting: tuple[int, bool] | None = None  # submitted, not started
        self.submit_blocked: tuple[int, bool] | None = None  # the loop waits in `submit`
        self.superseded = 0
        self.announced = 1  # the newest version saved and announced (per-server senders)
        self.pushed = 1  # the newest version a push began with (`ServerPool._weights`)
        self.sender = {s.name: {"want": None, "cur": None} for s in self.servers}
        self.loads = {s.name: 0 for s in self.servers}
        self.load_time: dict[str, float] = {}  # measured, per server
        self.lagging: set[str] = set()
        self.grants: dict[str, dict[int, float]] = {}  # server -> version -> share sent with it
        self.lagging_log: list[tuple[float, str, bool]] = []  # (when, server, lagging)
        self.rejoining: dict[str, int] = {}  # server -> the version its rejoin load is of
        self.rejoin_from: dict[str, int] = {}  # server -> its loads when its rejoin began
        self.rejoin_loads: dict[str, int] = {}  # server -> the loads its last rejoin took
        self.blocked_time = 0.0  # the loop waiting in `submit`
        self._until = 0
        shares = self.shares()
        for server in self.servers:  # the trainer's first sync, before its first step
            server.install(1, shares[server.name], True, self._lease(1))
            if fence:
                self.grants[server.name] = {1: shares[server.name]}

    # The trainer's pool.

    def shares(self, also: str | None = None) -> dict[str, float]:
        """The shares of the servers up (and `also`, one rejoining): ∝ their reported
        capacities (what `ServerPool` sends), or equal; with `fence`, a lagging server's is 0
        and the others share its seats."""
        up = [s.name for s in self.servers if s.name not in self.down or s.name == also]
        if self.control and self.fence:
            current = [n for n in up if n not in self.lagging]
            if current:
                fenced = self._shares(current)
                return {n: fenced.get(n, 0.0) for n in up}
        return self._shares(up)

    def _shares(self, up: list[str]) -> dict[str, float]:
        if not self.measured:
            return {n: 1 / len(up) for n in up} if up else {}
        seats = (self.max_staleness + 1) * self.batch_groups
        return fleet_shares({n: self.rates.get(n, 0.0) for n in up}, seats=seats)

    def _push_all(self, new_epoch: bool, delay: float | None = None) -> None:
        shares = self.shares()
        when = self.now + (self.push_delay if delay is None else delay)
        for name in shares:
            self.pushes.append((when, name, self.version, new_epoch))

    def _deliver_pushes(self) -> None:
        due = [p for p in self.pushes if p[0] <= self.now]
        self.pushes = [p for p in self.pushes if p[0] > self.now]
        shares = self.shares()
        for _, name, version, epoch in due:
            server = self._server(name)
            if not server.up:
                self.down.add(name)  # a failed push: it left
                continue
            server.install(version, shares.get(name, 1.0), epoch)

    def _server(self, name: str) -> SimServer:
        return next(s for s in self.servers if s.name == name)

    def _pull_round(self, need: int, version: int) -> list[tuple[SimServer, SimGroup]]:
        """Pulls up to `need` groups for the batch trained at `version`."""
        up = [s for s in self.servers if s.name not in self.down]
        if self.rule == "old":
            order = [(up[(self._rot + i) % len(up)].name, None) for i in range(len(up))]
            self._rot += 1
        else:
            self.quota.start(version, self.shares(), self.now)
            order = self.quota.order([s.name for s in up], self.now)
        got = []
        for name, limit in order:
            if need <= 0:
                break
            server = self._server(name)
            if not server.up:
                continue
            acks, rejects = [], []
            if not self.parked.get(name):  # a Pull waiting there carried none
                acks, rejects = self.pending[name]
                self.pending[name] = ([], [])
            n = need if limit is None else min(need, limit)
            groups = server.pull(n, version if self.rule == "new" else 0, acks, rejects)
            if self.prefetch:  # an empty Pull waits at the server for its first group
                self.parked[name] = not groups
            if groups and self.rng.random() < self.lost_pulls:
                self.stats.lost += len(groups)  # the reply was lost: the lease brings them back
                continue
            if server.meter.rate > 0:  # the reply carries the server's capacity
                self.rates[name] = server.meter.rate
            if self.rule == "new":
                self.quota.took(name, len(groups))
            got += [(server, g) for g in groups]
            need -= len(groups)
        return got

    # The trainer.

    def run_for(self, span: float) -> dict:
        """Runs the fleet for `span` time units and returns that span's figures (however many
        steps it made, none included)."""
        return self.run(10**9, warmup=0, until_time=self.now + span)

    def run(self, until: int, warmup: int = 10, until_time: float | None = None) -> dict:
        """Runs the trainer until step `until` (counted over every call) and returns the
        figures of the steps from `warmup` on (or from this call's first, if later), every step
        checked (`check_accounting`, and in `_finish_step`).

        Raises:
          SimStalled: no step for `stall_after` time units.
        """
        t0, base = None, None
        if self.step >= warmup:
            t0, base = self.now, dataclasses.replace(self.stats)
        self._base_step = max(self.step, warmup)
        guard, full_at = 0, None
        while self.step < until and (until_time is None or self.now < until_time - 1e-9):
            guard += 1
            if guard > 10_000_000:
                raise RuntimeError("the simulation does not progress")
            self.now += self.dt
            self._until = until
            if self.control:
                self._control_tick()
            else:
                self._deliver_pushes()
            for s in self.servers:
                s.tick(self.dt)
            if self.control:
                self._send_pulls()
            if self.busy_until is not None:
                if self.now < self.busy_until:
                    if self.prefetch and self.step + 1 < until and not self.control:
                        self._fill(self.ahead, self.version + 1, also=self.kept)
                        if self.full_at is None and len(self.ahead) >= self.batch_groups:
                            self.full_at = self.now
                    continue
                self.busy_until = None
                self.busy_time += self.step_time
                self._finish_step(self.kept)
                self.kept, self.ahead, self.last_step = self.ahead, [], self.now
                full_at, self.full_at = self.full_at, None
                if self.step == warmup:
                    t0, base = self.now, dataclasses.replace(self.stats)
                self.check_accounting()
                continue
            if self.control and self.submit_blocked is not None:
                self.blocked_time += self.dt
                continue
            if not self.control:
                self._fill(self.kept, self.version)
            if self.now - self.last_step > self.stall_after:
                raise SimStalled(f"no step for {self.stall_after} time units at {self.step}")
            if len(self.kept) >= self.batch_groups:
                ready = self.now + self.batch_host  # filled now, or by the step before:
                if full_at is not None:
                    ready = max(self.now, full_at + self.batch_host)
                self.busy_until = ready + self.pull_delay + self.step_time
                full_at = None
        return self._figures(t0, base)

    def _fill(self, batch: list, version: int, also: list = ()) -> None:
        """One pull round for `batch` (trained at `version`); `also`: the batch in the step,
        whose groups count as trained for the duplicate check."""
        if len(batch) >= self.batch_groups:
            return
        for server, g in self._pull_round(self.batch_groups - len(batch), version):
            if any(g.key == h.key for _, h in [*batch, *also]):  # re-delivered
                continue
            if self._select(server, g, version):
                batch.append((server, g))

    def _select(self, server: SimServer, g: SimGroup, version: int) -> bool:
        rejects = self.pending[server.name][1]
        if g.key in self.trained_keys:
            rejects.append(g.gid)  # a re-delivery of a group trained already
            return False
        self.rejected_keys.discard(g.key)
        lag = version - g.first
        if lag > self.max_staleness:
            self.stats.dropped += 1
            self.stats.dropped_len.append(g.length)
            self.drop_log.append((self.now, server.name, g.born))
            self.rejected_keys.add(g.key)
            rejects.append(g.gid)
            return False
        return True

    def _finish_step(self, kept) -> None:
        skipped = self.version in self.skip
        for server, g in kept:
            key = g.key
            if key in self.trained_keys:
                raise AssertionError(f"group {key} trained twice")
            self.trained_keys.add(key)
            lag = self.version - g.first
            if lag > self.max_staleness:
                raise AssertionError(f"group {key} trained at lag {lag}")
            if self.version - g.admitted > self.max_staleness:
                self.stats.violations += 1
                if self._exempt(server.name, g):
                    self.stats.violations_exempt += 1
                elif self.strict:
                    raise AssertionError(
                        f"group {key} admitted at v{g.admitted} trained at W = {self.version} "
                        f"> v + S ({self.max_staleness})"
                    )
            self.stats.lag_max = max(self.stats.lag_max, lag)
            self.stats.trained += 1
            self.stats.tokens += g.length * self.group_size
            self.stats.trained_len.append(g.length)
            self.stats.admitted_lag.append(self.version - g.admitted)
            self.pending[server.name][0].append(g.gid)
        self.version += 1
        self.step_ends.append(self.now)
        if self.control:
            self._submit(self.version)
        elif not skipped or self.rule == "new":  # the old trainer pushed nothing on a skipped step
            self._push_all(new_epoch=False)
        self.step += 1

    def _exempt(self, name: str, g: SimGroup) -> bool:
        """The stated fault window: a group its server admitted before the end of one of its
        kill/rejoin or deaf windows, trained within S + 2 steps of that end."""
        for _, end in self.faults.get(name, ()):
            after = sum(1 for t in self.step_ends if t >= end)
            if g.born < end and after <= self.max_staleness + 2:
                return True
        return False

    def check_accounting(self) -> None:
        """Exactly once: every group ever dispatched was trained once, rejected, or is still
        outstanding on its server (it reaches the trainer later)."""
        outstanding = {(s.name, i) for s in self.servers for i in s.unacked}
        lost = self.dispatched - self.trained_keys - self.rejected_keys - outstanding
        if lost:
            raise AssertionError(f"groups lost: {sorted(lost)[:5]}")

    def _figures(self, t0, base) -> dict:
        st = self.stats
        trained = st.trained - base.trained
        dropped = st.dropped - base.dropped
        elapsed = max(self.now - t0, 1e-9)
        mean = lambda xs: sum(xs) / len(xs) if xs else math.nan
        return {
            "trained": trained,
            "dropped": dropped,
            "drops_per_group": dropped / max(trained, 1),
            "groups_per_time": trained / elapsed,
            "tokens_per_time": (st.tokens - base.tokens) / elapsed,
            "len_trained": mean(st.trained_len[base.trained :]),
            "len_dropped": mean(st.dropped_len[base.dropped :]),
            "lag_max": st.lag_max,
            "lost": st.lost - base.lost,
            "violations": st.violations - base.violations,
            "admitted_lags": dict(collections.Counter(st.admitted_lag[base.trained :])),
            "violations_exempt": st.violations_exempt - base.violations_exempt,
            "steps_done": self.step - self._base_step,
            "period": elapsed / max(self.step - self._base_step, 1),
            "capacity": sum(s.capacity_rate for s in self.servers if s.up),
            "trainer_rate": self.batch_groups / self.step_time,
            "share_s0": self.shares().get("s0", 0.0),
            "steps": self.step,
            "elapsed": elapsed,
        }

    # The control plane (`control`: `push_cost` or `pulls` given).

    def _lease(self, version: int) -> int | None:
        """The last trainer version a share pushed with `version` is valid for (with `fence`)."""
        return version + self.max_staleness if self.fence else None

    def _draw_cost(self, name: str) -> float:
        """One load's time on `name`."""
        c = self.cost[name]
        return self.rng.uniform(*c) if isinstance(c, tuple) else float(c)

    def _submit(self, version: int) -> None:
        """`WeightPusher.submit` on the loop's thread: with one process (or per-server senders) a
        newer version replaces the waiting one; with several and serial pushes the loop waits
        while one is waiting (`submit_blocked`)."""
        if self.senders == "serial" and self.processes > 1 and self.push_waiting is not None:
            self.submit_blocked = (version, False)
            return
        if self.push_waiting is not None:
            self.superseded += 1
        self.push_waiting = (version, False)

    def _control_tick(self) -> None:
        """One tick of the pool: the push thread, the senders, the fence, the Pull replies."""
        dt = self.dt
        if self.submit_blocked is not None and self.push_waiting is None:
            self.push_waiting, self.submit_blocked = self.submit_blocked, None
        if self.pusher is None and self.push_waiting is not None:
            version, epoch = self.push_waiting
            self.push_waiting = None
            self.pusher = {"version": version, "epoch": epoch, "save": self.push_delay}
            self.pushed = version  # `ServerPool._weights`: what a rejoin gets
        p = self.pusher
        if p is not None and p["save"] > 0:
            p["save"] -= dt
            if p["save"] <= 0 and self.senders == "per_server":
                self.announced = p["version"]  # every sender now wants it
                for name, snd in self.sender.items():
                    if name not in self.down or name in self.rejoining:
                        snd["want"] = p["version"]
                self.pusher = None
            elif p["save"] <= 0:
                p["targets"] = [s.name for s in self.servers if s.name not in self.down]
                p["targets"] = [n for n in p["targets"] if not self._server(n).draining]
                p["shares"], p["cur"] = self.shares(), None
        if self.pusher is not None and self.pusher["save"] <= 0:
            self._serial_push()
        if self.senders == "per_server":
            for name in self.sender:
                self._per_server_send(name)
        if self.rejoining and self.senders == "serial":
            self._serial_rejoins()
        if self.fence and self.now >= self._fence_at:
            self._fence()
            self._fence_at = self.now + self.fence_turn
        self._pull_replies()

    def _load(self, name: str, job: dict) -> bool:
        """Advances a load one tick (only while its server runs); True when it is installed."""
        server = self._server(name)
        if not server.up or server.deaf_at(self.now):
            return False
        job["left"] -= self.dt
        if job["left"] > 0:
            return False
        server.install(job["version"], job["share"], job["epoch"], self._lease(job["version"]))
        if self.rule == "new":  # the push names the trainer's version when it was sent
            server.adm.saw_trainer(job["trainer"])
        self.loads[name] += 1
        took = self.now - job["started"]
        was = self.load_time.get(name)
        self.load_time[name] = took if was is None else 0.7 * was + 0.3 * took
        if self.fence and job["version"] >= self.version - self.max_staleness:
            if name in self.lagging:
                self.lagging.discard(name)
                self.lagging_log.append((self.now, name, False))
        return True

    def _job(self, name: str, version: int, epoch: bool, share: float) -> dict:
        return {
            "version": version,
            "trainer": max(self._next_version(), version),
            "epoch": epoch,
            "share": share,
            "left": self._draw_cost(name),
            "started": self.now,
        }

    def _serial_push(self) -> None:
        """`ServerPool.update_weights`: the servers one after another, each load waited for; a
        server that is gone leaves the rotation."""
        p = self.pusher
        while True:
            if p["cur"] is None:
                if not p["targets"]:
                    self.pusher = None
                    return
                name = p["targets"].pop(0)
                if not self._server(name).up:
                    self.down.add(name)  # a failed push: it left
                    continue
                share = p["shares"].get(name, 1.0)
                p["cur"] = (name, self._job(name, p["version"], p["epoch"], share))
            name, job = p["cur"]
            if not self._server(name).up:
                self.down.add(name)
                p["cur"] = None
                continue
            if not self._load(name, job):
                return
            p["cur"] = None

    def _per_server_send(self, name: str) -> None:
        """One server's sender: its load in flight; when it finishes, the newest wanted version
        if newer than the server holds."""
        server, snd = self._server(name), self.sender[name]
        if snd["cur"] is not None:
            if not server.up:
                snd["cur"] = None
                self.down.add(name)
                return
            if not self._load(name, snd["cur"]):
                return
            snd["cur"] = None
        want = snd["want"]
        if want is None or not server.up:
            return
        epoch = name in self.rejoining and not server.ready
        if want <= server.version and not epoch:
            snd["want"] = None  # it holds it already (a refusal: counted current)
            return
        snd["want"] = None
        snd["cur"] = self._job(name, want, epoch, self._grant(name, want))

    def _serial_rejoins(self) -> None:
        """`ServerPool._rejoin`: the last pushed version, then again while a newer push landed
        meanwhile; it joins once no newer push did."""
        for name in list(self.rejoining):
            snd = self.sender[name]
            if snd["cur"] is None:
                version = self.pushed
                share = self.shares(also=name).get(name, 1.0)
                snd["cur"] = self._job(name, version, True, share)
                self.rejoining[name] = version
            if not self._load(name, snd["cur"]):
                continue
            snd["cur"] = None
            if self.pushed == self.rejoining[name]:
                self._joined(name)

    def _fence(self) -> None:
        """Marks lagging the servers whose load or Pull is overdue; joins the rejoining servers
        that hold a version within S of the next batch's."""
        for server in self.servers:
            name = server.name
            if name in self.rejoining:
                if server.ready and server.version >= self._next_version() - self.max_staleness:
                    self._joined(name)
                continue
            if name in self.down or name in self.lagging:
                continue
            job = self.sender[name]["cur"]
            if job is not None and self.now - job["started"] > self._overdue(name):
                self._lag(name)

    def _overdue(self, name: str) -> float:
        """How late a server's load or Pull reply may be before it is lagging: max(`fence_factor`
        × its measured load time, `fence_periods` × the trainer's step period, `fence_floor`)."""
        period = self.quota.period or self.step_time
        mean = self.cost[name]
        mean = sum(mean) / 2 if isinstance(mean, tuple) else mean
        load = self.fence_factor * self.load_time.get(name, mean)
        return max(load, self.fence_periods * period, self.fence_floor)

    def _grant(self, name: str, version: int) -> float:
        """The share sent to `name` with `version` (with `fence`: a lease on seats until
        version + S). A seat moves from one current server to another only once its lease ran
        out: the grant is the server's share now, at most what the other current servers'
        live grants leave (a lagging server's seats are free at once). Recorded in `grants`."""
        share = self.shares(also=name).get(name, 0.0)
        if self.fence:
            live = sum(
                self._live(other, version)
                for other in self.grants
                if other != name and other not in self.lagging and other not in self.down
            )
            share = max(min(share, 1.0 - live), 0.0)
            self.grants.setdefault(name, {})[version] = share
        return share

    def _live(self, name: str, version: int) -> float:
        """The largest share `name` holds a live lease of at trainer `version` (granted with a
        version within S before it)."""
        grants = self.grants.get(name, {})
        return max((g for p, g in grants.items() if p >= version - self.max_staleness), default=0.0)

    def _quota_shares(self, version: int) -> dict[str, float]:
        """With `fence`, the quotas of the batch of `version`: each current server's largest live
        grant (it may hold groups admitted under it, due by this version), its share now if it
        has none."""
        now = self.shares()
        return {
            n: (0.0 if n in self.lagging else self._live(n, version) or s) for n, s in now.items()
        }

    def _lag(self, name: str) -> None:
        """Marks `name` lagging: its share is 0 from now on, and what the batch being pulled
        still expects from it goes to the others (its quota credit is dropped)."""
        if name not in self.lagging:
            self.lagging.add(name)
            self.lagging_log.append((self.now, name, True))
            self.quota.credit[name] = 0.0

    def _next_version(self) -> int:
        """The version the next pulled groups will be trained at."""
        return self.version + 1 if self.busy_until is not None else self.version

    def _target(self):
        """The batch being filled now and its version: the next one while a step runs (prefetch),
        else the step's own; None while a step runs without prefetch."""
        if self.busy_until is not None:
            if self.prefetch and self.step + 1 < self._until:
                return self.ahead, self.version + 1, self.kept
            return None
        return self.kept, self.version, []

    def _send_pulls(self) -> None:
        """New Pulls for the batch being filled (see `pulls`)."""
        target = self._target()
        if target is None:
            return
        batch, version, _ = target
        need = self.batch_groups - len(batch)
        if need <= 0:
            return
        up = [s.name for s in self.servers if s.name not in self.down]
        if not up:
            return
        shares = self._quota_shares(version) if self.fence else self.shares()
        self.quota.start(version, shares, self.now)
        limits: dict[str, int | None] = {}
        for name, limit in self.quota.order(up, self.now):
            limits.setdefault(name, limit)
        if self.pulls == "blocking":
            if self.outstanding:
                return
            names = list(limits)
            name = names[self._rot % len(names)]
            self._rot += 1
            limit = limits[name]
            wait = self.pull_timeout if len(up) == 1 else min(self.pull_timeout, self.pull_wait)
            self._pull(name, version, need if limit is None else min(need, limit), wait)
            return
        for name in up:
            if name in self.outstanding:
                continue
            if name in limits:
                n = need if limits[name] is None else min(need, limits[name])
            elif name in self.lagging:
                n = need  # still pulled: what it finishes is trained if fresh
            else:
                continue
            if n > 0:
                self._pull(name, version, n, self.pull_timeout)

    def _pull(self, name: str, version: int, n: int, wait: float) -> None:
        """Sends a Pull; its deadline: wait + `pull_slack`, or with `fence` wait + `_overdue`
        (the server's own latency), past which the call fails and the next Pull is sent."""
        acks, rejects = self.pending[name]
        self.pending[name] = ([], [])
        slack = max(self._overdue(name), self.pull_slack_floor) if self.fence else self.pull_slack
        self.outstanding[name] = {
            "version": version,
            "n": n,
            "wait_until": self.now + wait,
            "deadline": self.now + wait + slack,
            "acks": acks,
            "rejects": rejects,
            "arrived": False,
            "sent": self.now,
        }

    def _pull_replies(self) -> None:
        """The Pulls answered this tick: a server that runs takes the Pull's acknowledgements
        and version when it first sees it, and replies with its first finished groups or at the
        Pull's wait; a deaf one replies when it resumes, or the call fails at its deadline
        (`_pull`; a lagging server's next Pull reaches it first when it resumes)."""
        for name, p in list(self.outstanding.items()):
            server = self._server(name)
            failed = not server.up or (server.deaf_at(self.now) and self.now > p["deadline"])
            if failed:
                del self.outstanding[name]
                if self.fence and server.up:
                    self._lag(name)
                if not p["arrived"]:  # not delivered: they wait for the next Pull
                    acks, rejects = self.pending[name]
                    self.pending[name] = (p["acks"] + acks, p["rejects"] + rejects)
                continue
            if server.deaf_at(self.now):
                continue
            if not p["arrived"]:
                server.ack(p["acks"], p["rejects"])
                server.adm.saw_trainer(p["version"] if self.rule == "new" else 0)
                p["arrived"] = True
            groups = server.hand_out(p["n"]) if server.queue else []
            if not groups and self.now < p["wait_until"]:
                continue
            del self.outstanding[name]
            if server.meter.rate > 0:
                self.rates[name] = server.meter.rate
            self.quota.took(name, len(groups))
            self._receive(server, groups, p["version"])

    def _receive(self, server: SimServer, groups: list[SimGroup], pulled_for: int) -> None:
        """A Pull's reply into the batch being filled; what overflows it is handed back (with
        concurrent Pulls the youngest admitted of the batch and the reply), and so is a reply
        for another batch than the one being filled (its server leased it to that batch's
        version: `ServerAdmission.in_earlier_batch` would not count it)."""
        target = self._target()
        if target is not None and target[1] != pulled_for:
            target = None  # a reply for a batch already made: its leases name that batch
        back: list[tuple[SimServer, SimGroup]] = []
        for g in groups:
            if target is None:
                back.append((server, g))
                continue
            batch, version, also = target
            if any(g.key == h.key for _, h in [*batch, *also]):  # re-delivered
                continue
            if len(batch) >= self.batch_groups:
                if self.pulls == "blocking":
                    back.append((server, g))
                    continue
                # Concurrent replies overflow the batch: the youngest admitted goes back.
                young = max(range(len(batch)), key=lambda i: batch[i][1].admitted)
                if batch[young][1].admitted <= g.admitted:
                    back.append((server, g))
                    continue
                back.append(batch.pop(young))
            if self._select(server, g, version):
                batch.append((server, g))
        for owner, g in back:
            self.quota.took(owner.name, -1)
            owner.hand_back([g])

    def deafen(self, name: str, start: float, end: float) -> None:
        """The server is stopped (SIGSTOP) from `start` to `end` (time units), then continued:
        no admission, generation, load or reply meanwhile; what it held resumes."""
        self._server(name).deaf.append((start, end))
        self.faults.setdefault(name, []).append((start, end))

    def duty(self, name: str, stopped: float, period: float) -> None:
        """Stops the server for the first `stopped` of every `period` (the live benchmark's
        `--duty`)."""
        self._server(name).cycle = (stopped, period)

    def _joined(self, name: str) -> None:
        """A rejoining server is back in the rotation; `rejoin_loads`: the loads it took."""
        del self.rejoining[name]
        self.down.discard(name)
        self._end_fault(name)
        self.rejoin_loads[name] = self.loads[name] - self.rejoin_from[name]

    def _end_fault(self, name: str) -> None:
        windows = self.faults.get(name)
        if windows and windows[-1][1] == math.inf:
            windows[-1] = (windows[-1][0], self.now)

    # Scripted faults.

    def set_speed(self, name: str, speed: float) -> None:
        """The server generates at `speed` from now on (it slows down or speeds up)."""
        self._server(name).speed = speed

    def kill(self, name: str) -> None:
        self._server(name).kill()
        self.down.add(name)
        self.faults.setdefault(name, []).append((self.now, math.inf))

    def sigterm(self, name: str) -> None:
        """Stops admitting; the pool stops pulling it once its groups are out (modelled as
        leaving now: what it holds comes back on its restart)."""
        server = self._server(name)
        server.draining = True

    def rejoin(self, name: str) -> None:
        """The server is back (restarted if it was killed): the pool pushes it the current
        weights with a new epoch and puts it back in the rotation (with the control plane: once
        its rejoin load is done, see `senders` and `fence`)."""
        server = self._server(name)
        if not server.up:
            server.restart()
        if self.control:
            server.ready = False
            self.rejoining[name] = self.pushed
            self.rejoin_from[name] = self.loads[name]
            self.sender[name]["cur"] = None
            self.sender[name]["want"] = self.announced if self.senders == "per_server" else None
            return
        self.down.discard(name)
        self.pushes.append((self.now, name, self.version, True))
        self._end_fault(name)

    def restart_trainer(self) -> None:
        """The trainer restarts from its last step (checkpointed every step): leases of what it
        pulled are lost (they expire and come back), every server gets a new epoch."""
        for name in self.pending:
            self.pending[name] = ([], [])
        self.ahead, self.parked, self.full_at = [], {}, None
        self._push_all(new_epoch=True, delay=0.0)


# Issue 42's scenarios (the control plane before and after), shared by the tests and
# benchmarks/fleet_sim.py. "before": today's pool (serial pushes, blocking Pulls with the pool's
# per-server wait and fallback); "after": per-server senders, concurrent Pulls, the fence.

BEFORE = {"senders": "serial", "pulls": "blocking"}
AFTER = {"senders": "per_server", "pulls": "concurrent", "fence": True}


def control(mode: str) -> dict:
    """The `FleetSim` options of `mode` ("before" or "after")."""
    return dict(BEFORE if mode == "before" else AFTER)


def period_bound(sim: FleetSim, figures: dict | None = None) -> float:
    """The least mean trainer period (time units per step) the admission rule allows, the
    largest of three lower bounds (docs/POD.md §6):

    - **the step**: `step_time`;
    - **the budget** (capacity through admission's seats): a server runs samples only of the
      groups its budget counts, at most ⌊(S + 1 − lead) · share · B⌋, so at most
      min(slots, G · that) samples at once. While a step runs the lead is at least 1 (the
      prefetch's Pulls name version W + 1; the servers hold W at most), otherwise at least 0.
      With a = the fleet's groups per unit at the lead-1 budget and b = at the lead-0 one
      (speed · min(slots, G · n) / (mean length · G), summed), B groups a period need
      B ≤ a · step + b · (P − step): P ≥ step + (B − a · step) / b. With budgets that fill the
      slots (a = b = C, the fleet's capacity) this is B / C;
    - **the chain**: a group trained at W was admitted at weights W − S or newer; those exist
      once step W − S − 1 has ended and its save and a server's load have run (the mean load,
      counted once: a server whose one sender is busy when the version is announced starts it
      only when its load in progress ends, which adds up to half a load more on average when
      the sender is always busy, less when it idles between versions, so only the load itself
      is certain); the group is then generated (ℓ: its longest of G samples, (lo + G/(G+1) · (hi − lo)) / speed,
      the mean over the servers) and trained in step W: S + 1 periods hold
      save + load + ℓ + step on average over the groups;
    - **the batch** (with `figures` of a run in which every trained group had W − v_admitted = S
      exactly, on servers alike): batch W is then exactly the groups admitted at weights W − S,
      a draw of B · G samples no finish order selected, all admitted after those weights landed
      and all finished before step W starts, so the chain holds with ℓ replaced by the batch's
      span M ≥ max(the longest of B · G samples, B · G · mean length / the fleet's slots) /
      speed: (save + load + M + step) / (S + 1).

    Shares are taken ∝ capacity (`fleet_shares`, as the pool's measured ones converge to). With
    no load the chain is the bound of `test_prefetch_reaches_the_overlap_the_bound_allows`. A
    true lower bound: no simulated row may beat it (`test_no_grid_row_beats_the_period_bound`).
    Where every group is trained at exactly v + S, `budget_chain_period` is tighter: it counts
    the time a finished group keeps its seat until its batch's last sample ends.
    """
    g, s = sim.group_size, sim.max_staleness
    lat = [(lo + g / (g + 1) * (hi - lo)) / x.speed for x in sim.servers for lo, hi in [x.lengths]]
    costs = [c if not isinstance(c, tuple) else sum(c) / 2 for c in sim.cost.values()]
    load = sum(costs) / len(costs)
    chain = sim.push_delay + load + sum(lat) / len(lat) + sim.step_time
    terms = [sim.step_time, budget_bound(sim), chain / (s + 1)]
    alike = len({(x.lengths, x.speed) for x in sim.servers}) == 1
    if figures is not None and set(figures["admitted_lags"]) == {s} and alike:
        (lo, hi), speed, n = sim.servers[0].lengths, sim.servers[0].speed, sim.batch_groups * g
        longest = (lo + n / (n + 1) * (hi - lo)) / speed
        work = n * (lo + hi) / 2 / speed / sum(x.slots for x in sim.servers)
        span = max(longest, work)
        terms.append((sim.push_delay + load + span + sim.step_time) / (s + 1))
    return max(terms)


def budget_bound(sim: FleetSim) -> float:
    """`period_bound`'s budget term: step + (B − a · step) / b (see there)."""
    g, b_groups, s, step = sim.group_size, sim.batch_groups, sim.max_staleness, sim.step_time
    caps = {x.name: x.capacity_rate for x in sim.servers}
    shares = fleet_shares(caps, seats=(s + 1) * b_groups)

    def rate(lead: int) -> float:
        total = 0.0
        for x in sim.servers:
            n = math.floor((s + 1 - lead) * shares[x.name] * b_groups + 1e-9)
            total += x.capacity_rate * min(x.slots, g * n) / x.slots
        return total

    a, b = rate(1), rate(0)
    return step + max(b_groups - a * step, 0.0) / b


def budget_chain_period(
    sim: FleetSim, batches: int = 3000, warmup: int = 200, seed: int = 0
) -> float:
    """The mean trainer period of an ideal control plane under the admission budget, where
    every group is trained at exactly v + S (as in every S-grid row: `admitted_lags`): a
    Monte-Carlo estimate (its own draws of the sample lengths; about ±0.3% at the defaults),
    not a closed form.

    With every group trained at exactly v + S, server j's part of batch W is exactly the
    q_j = share_j · B groups it admitted at weights W − S, and the budget admits them the moment
    those weights land (the lead drops by one: q_j more seats), not before: they may start at
    land(W − S) = s(W − S − 1) + step + save + load, s(W) the start of step W. Their G · q_j
    samples take the server's slots in admission order (the server's FIFO; a slot goes to the
    oldest waiting sample), behind the older batches' samples, and the step of W starts once
    the last of them has finished on every server and step W − 1 has ended:

        s(W) = max(s(W − 1) + step, max_j C_j(W)),

    C_j(W) the finish of server j's last sample of batch W. This recursion is evaluated here with
    instantaneous Pulls and hand-outs, loads of their mean and no simulator tick: the period the
    budget allows with nothing lost in the pool. It counts what `period_bound` leaves out: the
    time a finished group keeps its seat while its batch waits for the batch's last sample (on
    its own server or another), during which its server may run only the samples of groups
    admitted at older weights.
    """
    g, b, s = sim.group_size, sim.batch_groups, sim.max_staleness
    shares = fleet_shares({x.name: x.capacity_rate for x in sim.servers}, seats=(s + 1) * b)
    quotas = {x.name: math.floor(shares[x.name] * b + 1e-9) for x in sim.servers}
    costs = [
        c if not isinstance(c, tuple) else sum(c) / 2 for c in getattr(sim, "cost", {}).values()
    ]
    lag = sim.step_time + sim.push_delay + (sum(costs) / len(costs) if costs else 0.0)
    rng = random.Random(seed)
    free = {x.name: [0.0] * x.slots for x in sim.servers}  # when each slot frees (a heap)
    starts: list[float] = []
    for w in range(batches):
        land = starts[w - s - 1] + lag if w > s else 0.0  # the first S + 1 batches: weights 1
        done = starts[-1] + sim.step_time if starts else 0.0
        for x in sim.servers:
            slots = free[x.name]
            for _ in range(quotas[x.name] * g):
                end = max(heapq.heappop(slots), land) + rng.uniform(*x.lengths) / x.speed
                heapq.heappush(slots, end)
                done = max(done, end)
        starts.append(done)
    return (starts[-1] - starts[warmup]) / (batches - 1 - warmup)


def live_pool() -> dict:
    """The `FleetSim` options that give the "after" pool the live pool's own constants (read from
    `train`, so they cannot drift): a Pull waits 0.5 s at its server with several up
    (`train.pull_scheduler`), its deadline is at least 2 s past that (`train.pulls`), an
    `UpdateWeights` is overdue after at least 5 s (`train.fleet_weights`), and the fence is
    checked once per turn of the fleet's background thread, 0.2 s (`train.membership`)."""
    return {
        "pull_timeout": pull_scheduler._CONCURRENT_WAIT_S,
        "pull_slack_floor": pulls._SLACK_MIN_S,
        "fence_floor": fleet_weights._OVERDUE_MIN_S,
        "fence_turn": membership._MAINTAIN_S,
    }


def duty_scenario(mode: str, duty: bool = True, **kw) -> FleetSim:
    """`benchmarks/fleet.py --servers 2 --step-s 0 --duty 0.5` in seconds: max_staleness 1, 2
    groups of 2 per batch, 4 slots, samples of 4–6 tokens at 100 tokens/s a slot, a 10 ms step,
    a 3 ms save and a 10 ms load; the first server stopped for 0.5 s of every second; the pool's
    per-server Pull wait and fallback 1 s before, Pulls of 50 ms after. `mode` "live": the
    "after" pool with the live pool's constants (`live_pool`): its fence then reacts after the
    0.5 s stop, where "after"'s reacts within three step periods (30 ms)."""
    live = mode == "live"
    opts = control("after" if live else mode)
    opts.update(pull_wait=1.0, fallback_min=1.0, pull_timeout=30.0 if mode == "before" else 0.05)
    opts.update({"strict": False, **(live_pool() if live else {}), **kw})
    sim = FleetSim(
        [(100.0, 4, (4, 6))] * 2,
        max_staleness=1,
        batch_groups=2,
        group_size=2,
        step_time=0.01,
        push_delay=0.003,
        push_cost=0.01,
        rate_window=0.25,
        dt=0.002,
        stall_after=100.0,
        **opts,
    )
    if duty:
        sim.duty("s0", 0.5, 1.0)
    return sim


def pod_scenario(
    mode: str, *, servers: int = 8, processes: int = 4, staleness: int = 4, **kw
) -> FleetSim:
    """A pod: `servers` servers of 128 slots whose generation is 1.2 times the trainer's need, 64
    groups of 8 samples of 200–8192 tokens per batch, S = `staleness`, a step of 1 (~20 s), a save
    of 0.1 and loads of 1–3 steps drawn per load, `processes` trainer processes."""
    b, g, lengths = 64, 8, (200, 8192)
    speed = 1.2 * b * g * sum(lengths) / 2 / (servers * 128)
    opts = control(mode)
    opts.update(kw)
    return FleetSim(
        [(speed, 128, lengths)] * servers,
        max_staleness=staleness,
        batch_groups=b,
        group_size=g,
        capacity=512,
        step_time=1.0,
        push_delay=0.1,
        push_cost=(1.0, 3.0),
        processes=processes,
        pull_timeout=1.0,
        dt=0.05,
        stall_after=1000.0,
        strict=False,
        **opts,
    )


def spread_scenario(mode: str, servers: int, lengths, staleness: int, **kw) -> FleetSim:
    """`servers` servers of 8 slots on which a sample of the mean length takes a step; 8 groups
    of 4 per batch, uniform lengths in `lengths`, a save of 0.1 and a load of 0.1 step."""
    opts = control(mode)
    opts.update(kw)
    return FleetSim(
        [(sum(lengths) / 2, 8, lengths)] * servers,
        max_staleness=staleness,
        batch_groups=8,
        group_size=4,
        step_time=1.0,
        push_delay=0.1,
        push_cost=0.1,
        stall_after=1000.0,
        **opts,
    )


def deaf_figures(sim: FleetSim, *, name: str = "s1", at: int = 40, steps: int = 30) -> dict:
    """Runs `sim` to step `at`, stops server `name` (SIGSTOP) for `steps` of the trainer's
    periods before it, then runs 30 steps more: steps per unit before and while it is stopped,
    the stale drops after it resumes (all, and those of groups admitted after it stopped), and
    the steps from its resume to its being current again (with the fence; None if it never was
    lagging or never came back)."""
    before = sim.run(at, warmup=10)
    t0, span = sim.now, steps * before["period"]
    sim.deafen(name, t0, t0 + span)
    while_deaf = sim.run_for(span)
    sim.run(sim.step + 30, warmup=sim.step)
    burst = [d for d in sim.drop_log if d[0] >= t0 + span]
    back = [t for t, n, lag in getattr(sim, "lagging_log", []) if n == name and not lag]
    back = [t for t in back if t >= t0 + span]
    return {
        "rate_before": 1 / before["period"],
        "rate_deaf": while_deaf["steps_done"] / span,
        "burst": len(burst),
        "burst_admitted_after_stop": sum(1 for d in burst if d[2] >= t0),
        "steps_to_current": (
            sum(1 for t in sim.step_ends if t0 + span <= t <= back[0]) if back else None
        ),
        "violations": sim.stats.violations,
        "violations_exempt": sim.stats.violations_exempt,
    }
