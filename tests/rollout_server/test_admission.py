"""The pure admission module (`rollout_api.admission`, docs/DESIGN.md §6.3): the budget with the
trainer's lead, epochs, replacements that wait for newer weights, the hand-out order, the
fleet's quotas, the capacity measure and the shares that follow it."""

from __future__ import annotations

import pytest

from rollout_api.admission import FleetQuota, RateMeter, ServerAdmission, fleet_shares

B = 4


def _adm(staleness: int = 1, share: float = 1.0, version: int = 1) -> ServerAdmission:
    adm = ServerAdmission(max_staleness=staleness, batch_groups=B, capacity=64)
    adm.install(version, share)
    adm.begin_epoch(version, ())
    return adm


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="max_staleness"):
        ServerAdmission(max_staleness=-1, batch_groups=B, capacity=8)
    with pytest.raises(ValueError, match="capacity"):
        ServerAdmission(max_staleness=1, batch_groups=B, capacity=0)


def test_the_trainers_lead_shrinks_the_run_ahead_instead_of_making_groups_stale():
    """The issue's regime: pushes slower than steps, so the trainer is ahead of the weights a
    server holds. Before, every push granted (S + 1) batches whatever the trainer's version, and
    the last of them were trained S + lead versions after their weights: stale."""
    adm = _adm(staleness=2, version=5)
    assert adm.budget([]) == 3 * B
    adm.saw_trainer(7)  # two versions ahead (its pushes of v6 and v7 are on their way)
    assert adm.lead == 2 and adm.budget([]) == B
    adm.saw_trainer(8)
    assert adm.budget([]) == 0 and not adm.may_admit([])  # nothing v5 makes can be trained
    adm.install(8, 1.0)
    assert adm.lead == 0 and adm.budget([]) == 3 * B
    adm.saw_trainer(3)  # versions only grow
    assert adm.trainer_version == 8


def test_a_share_holds_until_its_lease_and_a_fenced_server_admits_nothing():
    """The share is leased in trainer versions: past `share_until` (heard on a Pull) nothing is
    admitted until a push grants a new lease; a lease that has already ended (a fenced server)
    admits nothing at all; 0 = no lease."""
    adm = ServerAdmission(max_staleness=3, batch_groups=B, capacity=64)
    adm.install(5, 0.5, share_until=7)
    adm.begin_epoch(5, ())
    assert adm.budget([]) == 2 * B and not adm.lease_ended
    adm.saw_trainer(7)
    assert adm.budget([1]) == 2 * 0.5 * B - 1  # the lead shrinks it; the lease still holds
    adm.saw_trainer(8)  # past the lease (the lead alone, 3 = S, would still allow 2)
    assert adm.lease_ended and adm.budget([]) == 0 and not adm.may_admit([])
    assert adm.budget([1, 2]) == -2
    adm.install(8, 0.5, share_until=7)  # fenced: weights, but a lease that has ended
    assert adm.budget([]) == 0
    adm.install(8, 0.5, share_until=11)
    assert adm.budget([]) == 2 * B
    adm.install(9, 0.5)  # an older trainer: no lease
    adm.saw_trainer(12)
    assert adm.share_until == 0 and adm.budget([]) == 0.5 * B


def test_a_replacement_waits_for_weights_newer_than_those_that_made_its_predecessor_stale():
    """The stale-replacement cycle after a rejoin: a group rejected as stale was replaced at
    once with the weights the server held, which the trainer had already passed, so the
    replacement was stale too, and so on."""
    adm = _adm(staleness=1, version=1)
    for i in range(2 * B):
        adm.admit(i)
    adm.lease(range(B))
    adm.saw_trainer(1)
    adm.done(range(B), trained=range(B))  # trained at v1: the trainer is at v2 at least
    outstanding = list(range(B, 2 * B))
    assert adm.trainer_version == 2 and adm.budget(outstanding) == 0
    adm.saw_trainer(3)  # v3 pulls: v1's groups are stale now, and rejected
    adm.done(outstanding)
    assert adm.budget([]) == 0  # no replacement made with v1 weights ...
    adm.install(3, 1.0)
    assert adm.budget([]) == 2 * B  # ... until v3's are in


def test_groups_leased_to_an_earlier_batch_hold_no_place():
    """With prefetch the trainer pulls the batch of version T + 1 while the step of T runs: the
    groups of batch T stay leased until that step is done, but they fill batch T, not one of
    T + 1 .. v + S. Counting them held a whole batch of places too many: at S = 1 the server
    could not start batch T + 1 before batch T was acknowledged, so generation and the step
    ran in series (benchmarks/async_vs_sync.py, n = 1)."""
    adm = _adm(staleness=1, version=1)
    batch = range(B)
    for i in batch:
        adm.admit(i)
    adm.saw_trainer(1)
    adm.lease(batch)  # the batch of version 1, in its step now
    assert adm.budget(batch) == B
    adm.install(2, 1.0)
    adm.saw_trainer(3)  # the prefetching Pull for version 3; the weights of v2 are in
    assert adm.lead == 1 and adm.budget(batch) == B  # before: B − B = 0
    adm.unlease([0])  # its lease expired: queued again, it fills a later batch
    assert adm.budget(batch) == B - 1
    adm.done(batch, trained=batch)
    assert adm.budget([]) == B


def test_without_versions_on_pulls_leased_groups_count_until_acknowledged():
    adm = _adm(staleness=1, version=1)
    for i in range(B):
        adm.admit(i)
    adm.lease(range(B))
    adm.install(2, 1.0)  # pushes alone move the trainer's version
    assert adm.budget(range(B)) == 2 * B - B


def test_a_filtered_group_is_replaced_at_once():
    adm = _adm(staleness=0)
    for i in range(B):
        adm.admit(i)
    adm.lease(range(B))
    adm.done([0, 1])  # rejected (all-equal rewards) while the batch of v1 is being filled
    assert adm.budget([2, 3]) == 2


def test_an_epoch_leaves_the_groups_outstanding_at_its_start_out_of_the_count():
    adm = _adm(staleness=1)
    for i in range(5):
        adm.admit(i)
    adm.install(9, 1.0)
    adm.begin_epoch(9, range(5))
    assert adm.budget(range(5)) == 2 * B
    adm.done([0, 1])  # rejected: no replacement
    assert adm.budget(range(2, 5)) == 2 * B and adm.excluded == {2, 3, 4}


def test_shares_scale_the_budget_rounded_down():
    assert _adm(staleness=1, share=0.5).budget([]) == B
    assert _adm(staleness=1, share=1 / 3).budget([]) == 2  # ⌊8 / 3⌋
    adm = _adm(staleness=1, share=0.0)  # unset: 1
    assert adm.share == 1.0


def test_capacity_bounds_admission():
    adm = ServerAdmission(max_staleness=8, batch_groups=B, capacity=3)
    adm.install(1, 1.0)
    assert adm.may_admit([0, 1]) and not adm.may_admit([0, 1, 2])


def test_hand_out_is_oldest_admitted_first_and_holds_back_for_a_group_at_its_deadline():
    adm = _adm(staleness=1, version=1)
    adm.admit(0)  # admitted at v1
    adm.install(2, 1.0)
    for i in (1, 2, 3):
        adm.admit(i)  # at v2
    adm.saw_trainer(2)  # group 0 must be trained at v2 at the latest
    assert adm.hand_out([3, 1, 2], running=[0], n=8) == []  # held for group 0
    assert adm.hand_out([3, 0, 1], running=[2], n=2) == [0, 1]
    adm.saw_trainer(3)  # too late for group 0 anyway: it holds nothing back
    assert adm.hand_out([3, 1, 2], running=[0], n=8) == [1, 2, 3]
    assert adm.hand_out([7, 3], running=[], n=8) == [7, 3]  # unknown ids count as the oldest


def test_the_fleet_quota_follows_the_shares_then_falls_back():
    q = FleetQuota(batch_groups=8, min_fallback_s=2.0)
    shares = {"a": 0.25, "b": 0.75}
    q.start(1, shares, now=0.0)
    assert q.order(["a", "b"], now=0.0) == [("b", 6), ("a", 2)]
    q.took("b", 6)
    q.took("a", 1)
    assert q.order(["a", "b"], now=1.0) == [("a", 1)]
    assert q.order(["a", "b"], now=2.0) == [("a", 1), ("a", None), ("b", None)]
    q.took("b", 1)  # from the fallback
    q.start(2, shares, now=3.0)
    # Neither a's undelivered group nor b's debt is carried: the credits make one batch.
    assert q.credit == {"a": 2.0, "b": 6.0}
    assert q.period == 3.0 and q.fallback_s == 9.0  # three step periods


def test_a_batch_one_server_filled_leaves_the_next_one_to_the_shares():
    """Two equal servers, B = 2: the fallback took both groups of a batch from a. The next batch
    asks each for one, its share. Carrying b's undelivered group made b owe two: b filled that
    batch, a owed two in the next, and so on, the servers taken in turn, each one's groups a
    version late (at S = 1 a stale drop a batch, seen live)."""
    q = FleetQuota(batch_groups=2, min_fallback_s=1.0)
    shares = {"a": 0.5, "b": 0.5}
    q.start(1, shares, now=0.0)
    assert q.order(["a", "b"], now=0.0) == [("a", 1), ("b", 1)]
    q.took("a", 1)
    q.took("a", 1)  # the fallback: b had nothing yet
    for v in (2, 3, 4):
        q.start(v, shares, now=float(v))
        assert sorted(q.order(["a", "b"], now=float(v))) == [("a", 1), ("b", 1)], v
        q.took("a", 1)
        q.took("b", 1)


def test_fractional_shares_are_met_over_the_versions():
    q = FleetQuota(batch_groups=8, min_fallback_s=1e9)
    shares = {"a": 1 / 7, "b": 6 / 7}
    taken = {"a": 0, "b": 0}
    for v in range(1, 71):
        q.start(v, shares, now=float(v))
        need = 8
        while need:
            name, limit = q.order(["a", "b"], now=float(v))[0]
            n = min(need, limit)
            q.took(name, n)
            taken[name] += n
            need -= n
    assert taken == {"a": 80, "b": 480}


def test_the_rate_meter_measures_capacity_whatever_the_load():
    """Tokens over busy slot-seconds, times the slots: a server that admission keeps at two
    slots of eight measures what it would make with all eight, so a small share cannot hold
    its measure down; idle time is not counted."""
    meter = RateMeter(slots=8, window_s=2.0)
    tokens, now = 0.0, 0.0
    for busy in (2, 2, 0, 0, 8, 8):  # one slot makes 10 tokens per unit of time
        meter.observe(now, tokens, busy)
        now += 1.0
        tokens += 10.0 * busy
    meter.observe(now, tokens, 0)
    assert meter.rate == pytest.approx(80.0)  # 8 slots x 10
    for busy in (8, 8, 8):  # it slows down to half: the average moves halfway per window
        meter.observe(now, tokens, busy)
        now += 1.0
        tokens += 5.0 * busy
    meter.observe(now, tokens, 8)
    assert meter.rate == pytest.approx(60.0)
    meter.observe(now - 5, 0.0, 8)  # a clock or counter going back is skipped
    assert meter.rate == pytest.approx(60.0)
    with pytest.raises(ValueError, match="slots >= 1"):
        RateMeter(slots=0)


def test_fleet_shares_follow_rates_with_a_floor_and_whole_seats():
    assert fleet_shares({}) == {}
    assert fleet_shares({"a": 0.0, "b": 0.0}) == {"a": 0.5, "b": 0.5}  # none known: equal
    assert fleet_shares({"a": 50.0, "b": 100.0}) == pytest.approx({"a": 1 / 3, "b": 2 / 3})
    # Unknown = the mean of the known ones; noise under the resolution makes no difference.
    assert fleet_shares({"a": 100.0, "b": 99.0, "c": 0.0}) == pytest.approx(
        {"a": 1 / 3, "b": 1 / 3, "c": 1 / 3}
    )
    # A server measured far too slow keeps a fifth of an equal share.
    assert fleet_shares({"a": 1.0, "b": 1000.0}) == pytest.approx({"a": 0.1, "b": 0.9})
    # Whole seats of (S + 1) · B = 24: 1/7 and 2/7 would budget 3 + 6 + 6 + 6 = 21 groups.
    shares = fleet_shares({"a": 1.0, "b": 2.0, "c": 2.0, "d": 2.0}, seats=24)
    assert [round(x * 24) for x in shares.values()] == [3, 7, 7, 7]
    assert sum(shares.values()) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="server 'a': rate -1"):
        fleet_shares({"a": -1.0})


def test_get_state_and_set_state_restore_what_a_restart_needs():
    """`ServerAdmission` owns its persisted part: what `get_state` returns, `set_state` restores
    on a fresh state (the groups running, queued and leased are not in it: a restart re-issues
    them); the trainer's version is at least the weights held."""
    adm = _adm(version=3, share=0.5)
    adm.install(3, 0.5, share_until=5)
    adm.saw_trainer(4)
    adm.begin_epoch(4, [7, 8])
    adm.done([9], trained=[9])
    state = adm.get_state()
    assert state == {
        "share": 0.5,
        "share_until": 5,
        "trainer_version": 4,
        "trained_since": 1,
        "excluded": [7, 8],
    }
    again = ServerAdmission(max_staleness=1, batch_groups=B, capacity=64)
    again.set_state(state, weights_version=3)
    assert again.get_state() == state and again.weights_version == 3
    assert again.lead == adm.lead == 1
    behind = ServerAdmission(max_staleness=1, batch_groups=B, capacity=64)
    behind.set_state({}, weights_version=6)  # nothing saved yet: the defaults
    assert (behind.trainer_version, behind.share, behind.excluded) == (6, 1.0, set())
