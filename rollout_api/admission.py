"""Admission: which groups a rollout server starts, in which order it hands finished ones out, and
how the trainer spreads a batch over the fleet (docs/DESIGN.md §6.3). Pure: no threads, no gRPC,
no clock; `rollout_server.rollout.RolloutLoop` and `train.remote.ServerPool` call it, and so does the
fleet simulator of the tests (`tests/fleet_sim.py`).

**The bound.** A group counts as generated at the weights version its server held when it was
*admitted* (dispatched). Its tokens carry that version or newer ones (weights only move forward), so
a group trained at trainer version W ≤ admitted + S (S = `max_staleness`) has no token older than S
versions: the trainer's own check, on the oldest token, then never drops it. Bounding the admission
version rather than the oldest token is what lets admission enforce the bound before any token
exists (AReaL bounds the same quantity, its "head off-policyness").

**The rule, per server** (`ServerAdmission`). With `share` = this server's part of the batch
(its expected fraction of the trainer's consumption), B = `batch_groups`, v = the weights version the
server holds and T ≥ v the trainer's version (learnt from every Pull, `PullRequest.trainer_version`,
and every push), a group is admitted only while

    outstanding < (S + 1 − (T − v)) · share · B

where `outstanding` counts the server's groups not yet acknowledged (running, queued, leased;
those outstanding when an admission epoch began are left out: `begin_epoch`; and so are those
leased to a batch before T, `in_earlier_batch`: a trainer that prefetches pulls for T while the
step of T − 1 still trains them). The trainer takes `share · B` groups from this server per
version, oldest-admitted first, so the last group admitted at v is trained by
T + S − (T − v) = v + S. The share is leased in versions: each push names the last trainer version it holds for
(`share_until`), and once the server hears a trainer version past it (a Pull) the budget is 0
until a push grants a new lease. The trainer grants v + S to a server that keeps up, and a lease
that has already ended to one it fences (its calls overdue: deaf, paused, preempted), so a
server that wakes up after a long pause admits nothing on its old share: no clock is in the
rule. The trainer's lead T − v (a push still in flight, a
skipped step's version, pushes every n steps) shrinks the run-ahead instead of making groups stale;
at a lead above S nothing is admitted until newer weights arrive. A rejected group (stale, invalid,
filtered) leaves `outstanding` at once, so its replacement is admitted under the same rule: when
the weights it would be generated with are already too old for the trainer's version, it waits
for the next push (the stale-replacement cycle of a rejoin cannot happen). Nothing is counted per
version or per epoch, so what the trainer took from a server before leaves no credit or debt.

**Hand-out order** (`hand_out`). Finished groups go out oldest-admitted first. While a group whose
deadline is the trainer's current version (admitted at T − S) is still running, younger finished
groups are held back: handing them out would fill the trainer's batch and push the old group past
its deadline. Held back at most until that group finishes (a group's generation is bounded).

**Shares follow measured rates** (`RateMeter` on each server, `fleet_shares` in the pool). Each
server measures its capacity: the tokens per second it would generate with every slot busy
(tokens generated over slot-seconds of samples holding a slot, times its slots; an exponential
average over windows in which something ran). Normalising by the busy slots keeps the measure
independent of how much admission let the server start, so a server held back by a small share
still measures its speed (a rate of delivered groups would follow the share, not the speed). It
reports it with every Pull reply, and the pool sets each server's share ∝ its capacity: a server
half as fast gets half the work. A server not measured yet counts as the mean of those that are
(equal shares until any is known), and no share falls below `SHARE_FLOOR` of an equal one, so a
server whose measure is too low still admits work and measures again.

**The fleet** (`FleetQuota`, the trainer's side). Shares sum to 1 over the servers up. For each
trainer version the pool pulls a server's share of the batch from it first, and takes more from
the others only once the batch has waited three step periods (a server that is down, draining or
slow must not stall the run); taking a server's groups faster than its share only trains them
earlier.

**Guarantees**, under the assumptions below: (1) no trained token is older than S versions (by the
trainer's check, which drops the rest, and by this rule, which keeps those drops rare); (2) no group
is lost or trained twice (delivery, docs/DESIGN.md §6.2, is independent of admission: nothing here
drops a group); (3) waste: a group goes stale only if it is overtaken after its admission: the
trainer consumed its server slower than its share for longer than the fallback (a server died or
drained), its Pull reply was lost, or the trainer's version jumped (measured by
`tests/train/test_fleet_sim.py`: no stale drop in steady state for 1, 2 and 4 servers, generation
faster and slower than a step); (4) liveness: a run whose steps are skipped keeps admission open,
provided the trainer republishes its weights on skipped steps (`train.main.publish_if_due`).
Assumptions: the trainer trains one batch of B groups per version; it reports on its Pulls the
version it will train the pulled groups at (for one that does not, each group it trains since
the last push takes a place off the budget, the rule of before); versions only grow within an
epoch; a group's generation takes bounded time.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any

# No server's share falls below this fraction of an equal share (`fleet_shares`).
SHARE_FLOOR = 0.2
# Measured rates are rounded to multiples of this fraction of the fastest one (`fleet_shares`).
SHARE_RESOLUTION = 0.05


@dataclasses.dataclass
class ServerAdmission:
    """One server's admission state (mutated in place by its owner, under its owner's lock).
    It owns its persisted part: `get_state` is what the server saves, `set_state` restores it
    after a restart (as grain's iterators do), so no owner copies its fields one by one.

    Args:
      max_staleness: S, the versions a trained group may lag its admission.
      batch_groups: B, groups per trainer step.
      capacity: the most groups outstanding at once (the queue's capacity).
    """

    max_staleness: int
    batch_groups: int
    capacity: int
    share: float = 1.0
    # The last trainer version `share` holds for (the push's lease; 0 = no lease): past it the
    # budget is 0 until a push grants a new one.
    share_until: int = 0
    weights_version: int = 0  # v: the weights the server holds
    trainer_version: int = 0  # T: the newest trainer version seen (Pull or push)
    # Groups admitted and not done yet: id -> the weights version at admission (for the order).
    admitted: dict[int, int] = dataclasses.field(default_factory=dict)
    # Outstanding when the current epoch began: not counted (see `begin_epoch`).
    excluded: set[int] = dataclasses.field(default_factory=set)
    # Handed-out groups: id -> the trainer version known when they went out.
    leased: dict[int, int] = dataclasses.field(default_factory=dict)
    # The last trainer version reported (a Pull, a push, an epoch) and the groups acknowledged as
    # trained since (see `done`).
    reported: int = 0
    trained_since: int = 0
    pulls_report: bool = False  # the trainer's Pulls carry its version

    def __post_init__(self) -> None:
        if self.max_staleness < 0 or self.batch_groups < 1 or self.capacity < 1:
            raise ValueError(
                f"admission needs max_staleness >= 0, batch_groups >= 1 and capacity >= 1 (got "
                f"{self.max_staleness}, {self.batch_groups}, {self.capacity})"
            )

    def get_state(self) -> dict[str, Any]:
        """What a restarted server needs of this state (JSON-able; `set_state` restores it):
        the share and its lease, the trainer's version, the groups trained since it was
        reported, and the groups the epoch does not count. The groups running, queued and
        leased are not in it: a restart re-issues them and admits them again."""
        return {
            "share": self.share,
            "share_until": self.share_until,
            "trainer_version": self.trainer_version,
            "trained_since": self.trained_since,
            "excluded": sorted(self.excluded),
        }

    def set_state(self, state: Mapping[str, Any], weights_version: int) -> None:
        """Restores what `get_state` returned (a missing key keeps its default) at the weights
        `weights_version` the server holds after its restart; the trainer's version is at least
        that."""
        self.weights_version = weights_version
        self.share = state.get("share", 1.0)
        self.share_until = state.get("share_until", 0)
        self.trainer_version = max(state.get("trainer_version", 0), weights_version)
        self.reported = self.trainer_version
        self.trained_since = state.get("trained_since", 0)
        self.excluded = set(state.get("excluded", ()))

    @property
    def lead(self) -> int:
        """T − v: how many versions the trainer is ahead of the weights this server holds."""
        return max(self.trainer_version - self.weights_version, 0)

    def budget(self, outstanding: Collection[int]) -> int:
        """⌊(S + 1 − lead) · share · B⌋ minus the `outstanding` groups (ids of those running,
        queued or leased) that count: how many more groups may start (rounded down: a fraction
        of a group more would be trained a version late). Not counted: the groups outstanding
        when the epoch began, and those leased to an earlier batch than the trainer's version
        (`in_earlier_batch`). Past the share's lease (`lease_ended`) nothing may start."""
        counted = sum(
            1 for i in outstanding if i not in self.excluded and not self.in_earlier_batch(i)
        )
        if self.lease_ended:  # fenced: nothing more until a push grants a new lease
            return -counted
        allowed = (self.max_staleness + 1 - self.lead) * self.share * self.batch_groups
        if not self.pulls_report:  # what it trained since the last push moved it on
            allowed -= self.trained_since
        return math.floor(allowed + 1e-9) - counted

    @property
    def lease_ended(self) -> bool:
        """Whether the trainer's version is past the lease on the share (`share_until`): the
        trainer fenced this server, or has not granted it a share for that long."""
        return 0 < self.share_until < self.trainer_version

    def in_earlier_batch(self, group_id: int) -> bool:
        """Whether `group_id` is leased to a batch the trainer trains before its version T: it
        went out on a Pull that named a version below T (the trainer's Pulls name the version
        they pull for, so it is in that batch: being trained, or dropped and acknowledged soon).
        It holds no place in the batches T..v + S the budget spreads over, so it does not count,
        though it stays outstanding until acknowledged. A lease that ends without an
        acknowledgement (`unlease`: it expired, or its reply was never sent) puts the group back
        among those counted. For a trainer whose Pulls do not name their version, none is."""
        t = self.leased.get(group_id)
        return self.pulls_report and t is not None and t < self.trainer_version

    def may_admit(self, outstanding: Collection[int]) -> bool:
        """Whether one more group may start now (budget and capacity)."""
        return self.budget(outstanding) > 0 and len(outstanding) < self.capacity

    def admit(self, group_id: int) -> None:
        """Records `group_id` as started now, at the weights the server holds."""
        self.admitted[group_id] = self.weights_version

    def done(self, group_ids: Iterable[int], trained: Collection[int] = ()) -> None:
        """Forgets groups that left the server: acknowledged (trained or rejected) or dropped.

        Groups acknowledged as `trained` move the trainer on, so that their places free only
        for groups of weights that can still make the bound (in sync mode, none before the next
        version): one that went out when the trainer reported version t was trained at t or
        later, so the trainer is past t. For a trainer whose Pulls do not report its version (an
        older one, or a client of a server without a trainer) each group trained since the last
        push takes one group off the budget instead (`budget`), the rule of before.
        """
        for i in group_ids:
            self.admitted.pop(i, None)
            self.excluded.discard(i)
            t = self.leased.pop(i, None)
            if i in trained:
                self.trained_since += 1
                if t is not None and self.pulls_report:
                    self.trainer_version = max(self.trainer_version, t + 1)

    def lease(self, group_ids: Iterable[int]) -> None:
        """The groups went out to the trainer now, for the batch of its version (see `done` and
        `in_earlier_batch`)."""
        for i in group_ids:
            self.leased[i] = self.trainer_version

    def unlease(self, group_ids: Iterable[int]) -> None:
        """The leases of `group_ids` ended without an acknowledgement (expired, or their Pull's
        reply was never sent): they are queued again and count again."""
        for i in group_ids:
            self.leased.pop(i, None)

    def saw_trainer(self, version: int) -> None:
        """The trainer reported `version` (a Pull); 0 = not reported (an older trainer)."""
        if version > 0:
            self.pulls_report = True
            self._report(version)

    def _report(self, version: int) -> None:
        self.trainer_version = max(self.trainer_version, version)
        if version > self.reported:
            self.reported, self.trained_since = version, 0

    def install(self, version: int, share: float, share_until: int = 0) -> None:
        """New weights `version`, the server's `share` (0 = unset = 1) and its lease
        (`share_until`, 0 = none). The trainer pushes only versions it has reached, so
        T ≥ `version` from now on."""
        self.weights_version = version
        self.share = share if share > 0 else 1.0
        self.share_until = max(share_until, 0)
        self._report(version)

    def begin_epoch(self, version: int, outstanding: Iterable[int]) -> None:
        """A new admission epoch at `version` (a trainer started or resumed): the trainer's
        version is `version` again, and the groups `outstanding` now are not counted. Those were
        generated for weights the trainer may have lost; it drops most of them, and one it
        rejects must buy no replacement beyond the epoch's budget (that surplus would keep the
        server ahead of the trainer for good). One it trains took a place in a batch and leaves
        like any other."""
        self.trainer_version = self.reported = version
        self.trained_since = 0
        self.excluded = set(outstanding)

    def hand_out(self, queued: Sequence[int], running: Iterable[int], n: int) -> list[int]:
        """Which of the finished `queued` groups to hand out now, at most `n`, in order: oldest
        admitted first, none younger than a `running` group whose deadline is the trainer's
        version (see the module docstring). Groups this state does not know count as the
        oldest."""
        if n <= 0 or not queued:
            return []
        admitted = self.admitted
        order = sorted(queued, key=lambda i: (admitted.get(i, -1), i))
        deadline = self.trainer_version - self.max_staleness
        if any(admitted.get(i) == deadline for i in running):
            order = [i for i in order if admitted.get(i, -1) <= deadline]
        return order[:n]


@dataclasses.dataclass
class FleetQuota:
    """The trainer's spread of its batches over the servers (see the module docstring).

    Every trainer version gives each server a credit of share · B groups, plus the fraction of a
    group left of its last one (what a whole number of groups could not take, so that over the
    versions each server is consumed at its share, fractions included). A debt, or a whole group
    the server did not deliver, is not carried: credits would then sum to more than the batch,
    the most owed server would fill it, and the next batch would owe the one it left out, each
    batch taking the servers in turn with a version's delay between them (a stale drop a batch
    at S = 1, seen live with two equal servers).
    The pool takes from each server its whole groups of credit first, the most owed first; once
    a batch has waited `fallback_periods` trainer step periods (measured between versions, at
    least `min_fallback_s`) it takes from any server: a server that is slow or stopped admitting
    must not stall the run, but a fallback that comes too soon takes younger groups in place of
    a server's older ones (3 periods: at most 0.1% stale drops in `tests/train/test_fleet_sim.py`
    with 4 servers, against 2% at 1 period).

    Args:
      batch_groups: B.
      min_fallback_s: the least a batch waits for the quotas.
      fallback_periods: how many step periods a batch waits for the quotas.
    """

    batch_groups: int
    min_fallback_s: float
    fallback_periods: float = 3.0
    version: int = -1  # the trainer version whose batch is being pulled
    since: float = 0.0  # when its pulling began
    period: float | None = None  # the trainer's step period (an exponential average)
    credit: dict[str, float] = dataclasses.field(default_factory=dict)

    @property
    def fallback_s(self) -> float:
        """How long a batch waits for the quotas now."""
        return max(self.fallback_periods * (self.period or 0.0), self.min_fallback_s)

    def start(self, version: int, shares: Mapping[str, float], now: float) -> None:
        """Pulling for trainer `version` with these `shares` (each new version adds them)."""
        if version == self.version:
            return
        if 0 <= self.version < version:
            gap = (now - self.since) / (version - self.version)
            self.period = gap if self.period is None else 0.8 * self.period + 0.2 * gap
        b = self.batch_groups
        self.credit = {
            name: _fraction(self.credit.get(name, 0.0)) + share * b
            for name, share in shares.items()
        }
        self.version, self.since = version, now

    def quota(self, server: str) -> int:
        """The groups still expected from `server` for this batch."""
        return max(math.floor(self.credit.get(server, 0.0) + 1e-9), 0)

    def order(
        self, servers: Sequence[str], now: float, *, fallback: bool = True
    ) -> list[tuple[str, int | None]]:
        """The servers to pull next, in order, each with the most groups to take from it
        (None = no limit but the batch's), the most owed first: each server's whole groups of
        credit, then one group from each by the largest remainder, and, after `fallback_s`
        (unless `fallback` is False: the caller holds it), any number from every server."""
        ranked = sorted(servers, key=lambda name: -self.credit.get(name, 0.0))
        out: list[tuple[str, int | None]] = [
            (name, self.quota(name)) for name in ranked if self.quota(name) > 0
        ]
        if not out:
            out = [(name, 1) for name in ranked]
        if fallback and now - self.since >= self.fallback_s:
            out += [(name, None) for name in ranked]
        return out

    def took(self, server: str, n: int) -> None:
        """`n` groups of this batch came from `server`."""
        self.credit[server] = self.credit.get(server, 0.0) - n

    def reassign(self, server: str, shares: Mapping[str, float]) -> None:
        """`server` will not deliver what it is owed (the trainer fenced it): its credit goes to
        the servers of `shares`, in proportion, so the batch need not wait for the fallback."""
        owed = max(self.credit.pop(server, 0.0), 0.0)
        total = sum(shares.values())
        if owed <= 0 or total <= 0:
            return
        for name, share in shares.items():
            if name != server:
                self.credit[name] = self.credit.get(name, 0.0) + owed * share / total


def _fraction(credit: float) -> float:
    """What a server's credit carries into the next batch: the fraction of a group its share
    could not take in whole groups (a debt, or a whole group it did not deliver, is dropped)."""
    credit = max(credit, 0.0)
    return max(credit - math.floor(credit + 1e-9), 0.0)


@dataclasses.dataclass
class RateMeter:
    """A server's generation capacity: tokens per second with every slot busy (see the module
    docstring). The owner calls `observe` on every turn of its loop with its clock, the engine's
    running token count and the slots busy now; the interval since the last call is credited to
    the slots busy at that call. Every `window_s` of time in which something ran, the window's
    tokens over its slot-seconds, times `slots`, enter an exponential average (`weight` for the
    new window). Time in which nothing ran is not counted, so an idle server keeps its measure.

    Assumes a decode step takes about as long with few slots busy as with all of them (decoding
    is memory-bound); where it is not, a lightly loaded server is measured a little fast, and the
    measure settles as its load grows.

    Args:
      slots: the server's concurrent decodes.
      window_s: the busy time one measurement spans.
      weight: the exponential average's weight of a new window, in (0, 1].
    """

    slots: int
    window_s: float = 5.0
    weight: float = 0.5
    rate: float = 0.0  # tokens per second at full load; 0 = not measured yet
    _last: tuple[float, float, int] | None = None  # (time, tokens, busy slots) of the last call
    _tokens: float = 0.0
    _slot_s: float = 0.0
    _span: float = 0.0

    def __post_init__(self) -> None:
        if self.slots < 1 or self.window_s <= 0 or not 0 < self.weight <= 1:
            raise ValueError(
                f"RateMeter needs slots >= 1, window_s > 0 and weight in (0, 1] (got "
                f"{self.slots}, {self.window_s}, {self.weight})"
            )

    def observe(self, now: float, tokens: float, busy: int) -> None:
        """At time `now` the engine has generated `tokens` in all (a running count) and `busy`
        samples hold a slot (at most `slots` count)."""
        busy = min(max(busy, 0), self.slots)
        last, self._last = self._last, (now, tokens, busy)
        if last is None:
            return
        then, before, was_busy = last
        dt, made = now - then, tokens - before
        if dt <= 0 or made < 0 or not was_busy:  # a clock or counter reset, or idle
            return
        self._tokens += made
        self._slot_s += was_busy * dt
        self._span += dt
        if self._span < self.window_s:
            return
        sample = self.slots * self._tokens / self._slot_s
        w = 1.0 if self.rate <= 0 else self.weight
        self.rate = (1 - w) * self.rate + w * sample
        self._tokens = self._slot_s = self._span = 0.0


def fleet_shares(
    rates: Mapping[str, float],
    *,
    seats: int = 0,
    floor: float = SHARE_FLOOR,
    resolution: float = SHARE_RESOLUTION,
) -> dict[str, float]:
    """Each server's share of a batch, ∝ its measured capacity (`rates`, 0 = not measured): an
    unmeasured server counts as the mean of the measured ones (all equal while none is); the
    rates are rounded to multiples of `resolution` times the fastest, so that servers of one
    speed, whose measures differ by noise, get exactly equal shares (a share a hair under 1/k
    would round each of their budgets down by a group: `ServerAdmission.budget`); and no share
    is below `floor` of an equal one. With `seats` (the fleet's budget, (S + 1) · B groups) of
    at least one per server, the shares are whole numbers of seats (largest remainders): each
    server's budget is then a whole number of groups, and the budgets add up to the fleet's
    instead of losing up to a group each to rounding down. The shares sum to 1 (empty for no
    server).

    Raises:
      ValueError: a negative or non-finite rate, or a floor outside [0, 1].
    """
    if not 0 <= floor <= 1 or not 0 <= resolution <= 1 or seats < 0:
        raise ValueError(
            f"fleet_shares needs floor and resolution in [0, 1] and seats >= 0 (got {floor}, "
            f"{resolution}, {seats})"
        )
    for name, rate in rates.items():
        if not math.isfinite(rate) or rate < 0:
            raise ValueError(f"server {name!r}: rate {rate} is not a finite rate >= 0")
    if not rates:
        return {}
    known = [r for r in rates.values() if r > 0]
    mean = sum(known) / len(known) if known else 1.0
    weights = {name: rate if rate > 0 else mean for name, rate in rates.items()}
    if resolution > 0:
        top = max(weights.values())
        weights = {n: max(round(w / top / resolution), 1) * resolution for n, w in weights.items()}
    k = len(weights)
    least = floor / k
    # Servers under the floor get it; the rest share what is left in proportion (repeated:
    # lowering the others' shares can bring one more under the floor).
    pinned: set[str] = set()
    while True:
        free = {n: w for n, w in weights.items() if n not in pinned}
        if not free:
            break
        left = 1.0 - least * len(pinned)
        total = sum(free.values())
        shares = {n: left * w / total for n, w in free.items()}
        under = {n for n, s in shares.items() if s < least}
        if not under:
            break
        pinned |= under
    shares.update({n: least for n in pinned})
    if seats >= k:
        shares = _apportion(shares, seats)
    return {name: shares[name] for name in rates}


def _apportion(shares: Mapping[str, float], seats: int) -> dict[str, float]:
    """`shares` as whole numbers of 1/`seats` (at least one each; largest remainders)."""
    exact = {n: s * seats for n, s in shares.items()}
    whole = {n: max(math.floor(x + 1e-9), 1) for n, x in exact.items()}
    left = seats - sum(whole.values())
    for n in sorted(exact, key=lambda n: (whole[n] - exact[n], n))[: max(left, 0)]:
        whole[n] += 1
    while sum(whole.values()) > seats:  # the minimum of one took too many: from the largest
        n = max(whole, key=lambda n: (whole[n] - exact[n], whole[n], n))
        whole[n] -= 1
    return {n: w / seats for n, w in whole.items()}
