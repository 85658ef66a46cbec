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
"""

from __future__ import annotations

import collections
import dataclasses
import math
import random

from rollout_api.admission import FleetQuota, RateMeter, ServerAdmission, fleet_shares


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


@dataclasses.dataclass
class SimGroup:
    gid: int
    server: str
    admitted: int  # weights version at admission
    first: int | None = None  # weights version of its oldest token
    left: int = 0  # samples not finished
    length: float = 0.0  # mean completion length
    tokens: float = 0.0

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
        self._reset()

    def _reset(self) -> None:
        cfg = self.sim
        if cfg.rule == "old":
            self.adm = OldAdmission(cfg.max_staleness, cfg.batch_groups, cfg.capacity)
        else:
            self.adm = ServerAdmission(
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
        self.unacked: list[int] = []  # persisted: dispatched, not acknowledged
        # Its capacity measure (a process's: a restart measures again), reported on every Pull.
        self.meter = RateMeter(self.slots, window_s=self.sim.rate_window)
        self.tokens = 0.0  # generated so far (the engine's counter)

    def install(self, version: int, share: float, new_epoch: bool) -> None:
        self.version = max(self.version, version)
        self.adm.install(version, share)
        if new_epoch or not self.ready:
            self.adm.begin_epoch(version, set(self.groups))
        self.ready = True

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
        g = SimGroup(gid, self.name, self.version, left=self.sim.group_size)
        self.groups[gid] = g
        self.sim.dispatched.add(g.key)
        self.adm.admit(gid)
        if gid not in self.unacked:
            self.unacked.append(gid)
        for _ in range(self.sim.group_size):
            self.waiting.append((gid, self.sim.rng.uniform(*self.lengths)))

    def tick(self, dt: float) -> None:
        if not self.up:
            return
        if self.draining and not self.groups:  # drained: it exits, nothing left to hand back
            self.kill()
            self.sim.down.add(self.name)
            return
        reissue = getattr(self, "_reissue", None)
        while self.ready and not self.draining and self.adm.may_admit(self.groups.keys()):
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

    def pull(self, n: int, trainer_version: int, acks, rejects) -> list[SimGroup]:
        self.ack(acks, rejects)
        self.adm.saw_trainer(trainer_version)
        running = {g for g in self.groups if g not in self.queue and g not in self.leased}
        ids = self.adm.hand_out(self.queue, running, n)
        for gid in ids:
            self.queue.remove(gid)
            self.leased[gid] = self.sim.now + self.sim.lease_s
        if not isinstance(self.adm, OldAdmission):
            self.adm.lease(ids)
        return [self.groups[i] for i in ids]

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
      prefetch: the real loop's timing (the default; see the module docstring); False: pulls
        only between steps, and acknowledgements leave only with Pulls.
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
    ):
        if shares not in ("measured", "equal"):
            raise ValueError(f"shares must be 'measured' or 'equal' (got {shares!r})")
        self.stall_after = stall_after
        self.measured = shares == "measured" and rule == "new"
        self.rate_window = rate_window
        self.rates: dict[str, float] = {}  # the capacity each server reported last (pool side)
        self.prefetch = prefetch
        self.ahead: list[tuple[SimServer, SimGroup]] = []  # the next batch, pulled during a step
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
        self.quota = FleetQuota(batch_groups, min_fallback_s=step_time)
        self._rot = 0
        self._push_all(new_epoch=True, delay=0.0)

    # The trainer's pool.

    def shares(self) -> dict[str, float]:
        """The shares of the servers up: ∝ their reported capacities (what `ServerPool`
        sends), or equal."""
        up = [s.name for s in self.servers if s.name not in self.down]
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

    def run(self, until: int, warmup: int = 10) -> dict:
        """Runs the trainer until step `until` (counted over every call) and returns the
        figures of the steps from `warmup` on (or from this call's first, if later), every step
        checked (`check_accounting`, and in `_finish_step`).

        Raises:
          SimStalled: no step for `stall_after` time units.
        """
        t0, base = None, None
        if self.step >= warmup:
            t0, base = self.now, dataclasses.replace(self.stats)
        guard = 0
        while self.step < until:
            guard += 1
            if guard > 10_000_000:
                raise RuntimeError("the simulation does not progress")
            self.now += self.dt
            self._deliver_pushes()
            for s in self.servers:
                s.tick(self.dt)
            if self.busy_until is not None:
                if self.now < self.busy_until:
                    if self.prefetch and self.step + 1 < until:  # the next batch, meanwhile
                        self._fill(self.ahead, self.version + 1, also=self.kept)
                    continue
                self.busy_until = None
                self.busy_time += self.step_time
                self._finish_step(self.kept)
                self.kept, self.ahead, self.last_step = self.ahead, [], self.now
                if self.step == warmup:
                    t0, base = self.now, dataclasses.replace(self.stats)
                self.check_accounting()
                continue
            self._fill(self.kept, self.version)
            if self.now - self.last_step > self.stall_after:
                raise SimStalled(f"no step for {self.stall_after} time units at {self.step}")
            if len(self.kept) >= self.batch_groups:
                self.busy_until = self.now + self.pull_delay + self.step_time
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
            self.stats.lag_max = max(self.stats.lag_max, lag)
            self.stats.trained += 1
            self.stats.tokens += g.length * self.group_size
            self.stats.trained_len.append(g.length)
            self.pending[server.name][0].append(g.gid)
        self.version += 1
        if not skipped or self.rule == "new":  # the old trainer pushed nothing on a skipped step
            self._push_all(new_epoch=False)
        self.step += 1

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
        elapsed = self.now - t0
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
            "capacity": sum(s.capacity_rate for s in self.servers if s.up),
            "trainer_rate": self.batch_groups / self.step_time,
            "share_s0": self.shares().get("s0", 0.0),
            "steps": self.step,
            "elapsed": elapsed,
        }

    # Scripted faults.

    def set_speed(self, name: str, speed: float) -> None:
        """The server generates at `speed` from now on (it slows down or speeds up)."""
        self._server(name).speed = speed

    def kill(self, name: str) -> None:
        self._server(name).kill()
        self.down.add(name)

    def sigterm(self, name: str) -> None:
        """Stops admitting; the pool stops pulling it once its groups are out (modelled as
        leaving now: what it holds comes back on its restart)."""
        server = self._server(name)
        server.draining = True

    def rejoin(self, name: str) -> None:
        server = self._server(name)
        if not server.up:
            server.restart()
        self.down.discard(name)
        self.pushes.append((self.now, name, self.version, True))

    def restart_trainer(self) -> None:
        """The trainer restarts from its last step (checkpointed every step): leases of what it
        pulled are lost (they expire and come back), every server gets a new epoch."""
        for name in self.pending:
            self.pending[name] = ([], [])
        self.ahead, self.parked = [], {}
        self._push_all(new_epoch=True, delay=0.0)
