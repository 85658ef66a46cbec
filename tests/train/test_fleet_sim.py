"""The simulated fleet (`tests/fleet_sim.py`) under the admission the servers and the pool run
(`rollout_api.admission`, docs/DESIGN.md §6.3): every step checked for exactly-once and no
trained group older than `max_staleness`; stale drops at most 2% of the trained groups in steady
state with 1, 2 and 4 servers, generation faster and slower than a step, servers of equal and
unequal speed and one that slows down mid-run; throughput at least 90% of what the live servers
(or the trainer) can do; liveness through runs of skipped steps; kills,
SIGTERM drains, rejoins, trainer restarts, lost and delayed Pull replies. The "old" rule (a model
of the one before) is run where it shows what changed. `prefetch` runs the trainer as the real
loop does (the next batch pulled while a step runs); with it, one server reaches the overlap the
staleness bound allows (`test_prefetch_reaches_the_overlap_the_bound_allows`).

With the pool's control plane modelled (issue 42: `tests.fleet_sim.BEFORE`, today's serial pushes
and blocking Pulls; `AFTER`, per-server senders, concurrent Pulls and the lagging fence): today's
throttle and live duty figure reproduced, the hand-out order's mutants caught by the per-group
bound W − v_admitted ≤ S or by stale drops, a stopped server, a load that never finishes, and a
rejoin while pushes go on."""

from __future__ import annotations

import pytest

from tests.fleet_sim import (
    FinishOrderAdmission,
    FleetSim,
    NoHoldBackAdmission,
    PrefetchLeadAdmission,
    ReleaseAtLeaseAdmission,
    SimStalled,
    budget_chain_period,
    deaf_figures,
    duty_scenario,
    period_bound,
    pod_scenario,
    spread_scenario,
)

LENGTHS = (50, 150)  # completion tokens, uniform: the longest three times the shortest
STEPS = 120


def _fleet(
    k: int, gen: float, *, rule: str = "new", slow: float = 1.0, shares: str = "measured", **kw
) -> FleetSim:
    """k servers of 8 slots whose group takes `gen` steps to generate (the first one `slow`
    times as long)."""
    speed = sum(LENGTHS) / 2 / gen
    servers = [(speed / (slow if i == 0 else 1.0), 8, LENGTHS) for i in range(k)]
    return FleetSim(servers, rule=rule, shares=shares, max_staleness=2, **kw)


def _bound(sim: FleetSim, figures: dict) -> float:
    """What the live servers together (at their speeds now) or the trainer allow."""
    return min(figures["capacity"], figures["trainer_rate"])


@pytest.mark.parametrize("prefetch", [False, True], ids=["serial", "prefetch"])
@pytest.mark.parametrize("gen", [0.3, 3.0], ids=["gen-faster", "gen-slower"])
@pytest.mark.parametrize("k", [1, 2, 4])
def test_no_waste_in_any_regime(k, gen, prefetch):
    sim = _fleet(k, gen, prefetch=prefetch)
    f = sim.run(STEPS)
    assert f["drops_per_group"] <= 0.02, f
    assert f["groups_per_time"] >= 0.9 * _bound(sim, f), f
    assert f["lag_max"] <= 2


@pytest.mark.parametrize("prefetch", [False, True], ids=["serial", "prefetch"])
@pytest.mark.parametrize("k", [1, 2])
def test_pushes_slower_than_steps_waste_nothing(k, prefetch):
    """The issue's regime (a tiny model's step is shorter than a weight push): the trainer is
    1.5 steps ahead of the servers' weights. The old rule granted (S + 1) batches at every push
    whatever the trainer's version: most of them were stale when pulled. With prefetch the new
    rule is as fast only because a batch in its step holds no place in the next one's budget
    (`ServerAdmission.in_earlier_batch`)."""
    before = _fleet(k, 0.3, rule="old", push_delay=1.5, prefetch=prefetch).run(STEPS)
    after = _fleet(k, 0.3, push_delay=1.5, prefetch=prefetch).run(STEPS)
    assert before["drops_per_group"] > 0.05
    assert after["drops_per_group"] <= 0.02
    assert after["groups_per_time"] >= before["groups_per_time"]


def test_runs_of_skipped_steps_keep_admission_open():
    """Every step from 20 to 60 skipped (nothing active): the version moves on and the
    trainer republishes its weights; before, it pushed nothing and the servers' admission
    closed for good."""
    sim = _fleet(2, 0.3, push_delay=0.2)
    sim.skip = set(range(20, 61))
    f = sim.run(STEPS)
    assert f["drops_per_group"] <= 0.02
    old = _fleet(2, 0.3, rule="old", stall_after=50.0)
    old.skip = set(range(20, 61))
    with pytest.raises(SimStalled):
        old.run(STEPS)


@pytest.mark.parametrize("gen", [0.3, 3.0], ids=["gen-faster", "gen-slower"])
def test_a_kill_and_a_rejoin_lose_nothing_and_waste_returns_to_zero(gen):
    sim = _fleet(2, gen)
    sim.run(30)
    sim.kill("s1")
    sim.run(60)
    sim.rejoin("s1")
    f = sim.run(180, warmup=80)  # from 20 steps after the rejoin
    assert f["drops_per_group"] <= 0.02, f
    assert f["groups_per_time"] >= 0.9 * _bound(sim, f), f


def test_a_sigterm_drain_then_a_rejoin():
    sim = _fleet(2, 3.0)
    sim.run(20)
    sim.sigterm("s1")
    sim.run(50)
    assert "s1" in sim.down  # drained and gone, nothing left behind
    sim.rejoin("s1")
    f = sim.run(120, warmup=70)
    assert f["drops_per_group"] <= 0.02, f


def test_a_trainer_restart_loses_nothing():
    sim = _fleet(2, 0.3, lease_s=5.0)
    sim.run(30)
    sim.restart_trainer()  # its pending acknowledgements are lost; leases bring groups back
    f = sim.run(120, warmup=50)
    assert f["drops_per_group"] <= 0.02, f


def test_delayed_pull_replies_waste_nothing():
    f = _fleet(2, 0.3, pull_delay=0.1).run(STEPS)
    assert f["drops_per_group"] <= 0.02, f


def test_lost_pull_replies_lose_nothing():
    """A lost reply's groups come back when their lease ends, too late for their versions: they
    are dropped (and, while they held their server's places, its next groups were admitted
    later: at most as many again), never lost or trained twice."""
    sim = _fleet(2, 0.3, lost_pulls=0.05, lease_s=3.0)
    f = sim.run(STEPS)
    assert f["lost"] > 0 and f["dropped"] <= 2 * f["lost"], f


@pytest.mark.parametrize("gen", [0.3, 3.0], ids=["gen-faster", "gen-slower"])
@pytest.mark.parametrize("k", [2, 4])
def test_a_server_half_as_fast_gets_half_the_work(k, gen):
    """Shares ∝ the capacity each server measures and reports (docs/DESIGN.md §6.3): the fleet
    runs at the sum of its servers (or at the trainer's rate), with no stale drops. With equal
    shares, while generation is the bottleneck, it ran at k times its slowest server."""
    sim = _fleet(k, gen, slow=2.0)
    f = sim.run(STEPS)
    assert f["drops_per_group"] <= 0.02, f
    assert f["groups_per_time"] >= 0.9 * _bound(sim, f), f
    shares = sim.shares()
    assert shares["s1"] == pytest.approx(2 * shares["s0"], rel=0.2), shares
    if gen > 1:
        equal = _fleet(k, gen, slow=2.0, shares="equal")
        e = equal.run(STEPS)
        assert e["groups_per_time"] < 0.7 * _bound(equal, e), e


@pytest.mark.parametrize("gen", [0.3, 3.0], ids=["gen-faster", "gen-slower"])
@pytest.mark.parametrize("k", [1, 2, 4])
def test_a_server_that_slows_down_mid_run_gets_less(k, gen):
    """The first server drops to half its speed at step 30: its measure follows within a few
    windows, its share with the next push, and from step 70 on the fleet again runs at the sum
    of its servers with no stale drops."""
    sim = _fleet(k, gen)
    sim.run(30)
    sim.set_speed("s0", sim.servers[0].speed / 2)
    f = sim.run(STEPS + 40, warmup=70)
    assert f["drops_per_group"] <= 0.02, f
    assert f["groups_per_time"] >= 0.9 * _bound(sim, f), f
    if k > 1:
        shares = sim.shares()
        assert shares["s1"] == pytest.approx(2 * shares["s0"], rel=0.2), shares


@pytest.mark.parametrize(
    ("gen", "push", "staleness"),
    [(1.3, 1.0, 1), (0.5, 0.2, 1), (0.5, 1.0, 1), (1.3, 1.5, 1), (0.5, 1.5, 2), (1.3, 0.2, 1)],
)
def test_prefetch_reaches_the_overlap_the_bound_allows(gen, push, staleness):
    """One server, the real loop's timing (the next batch pulled while a step runs), a batch
    that takes `gen` steps to generate and a push that lands `push` steps after its step.

    Batch T may hold only groups admitted at weights T − S or newer, which the step of version
    T − S − 1 makes; they land `push` after it, then the batch is generated and trained: S + 1
    steps take at least push + gen + step, so the period is at least
    max(step, gen, (push + gen + step) / (S + 1)) (the first case is benchmarks/async_vs_sync.py's
    n = 1: a push of about a step, a batch of 1.3). The simulated period meets that bound within
    a tick, nothing is dropped and no trained group is older than S. Before, a batch in its step
    held the places of the next one until acknowledged, so the period was gen + step (2.3 in the
    first case, against 1.65)."""
    step = 1.0
    speed = 4 * 100 / gen  # 8 groups x 4 samples on 8 slots: 4 waves of 100-token samples
    sim = FleetSim(
        [(speed, 8, (100, 100))],
        max_staleness=staleness,
        batch_groups=8,
        group_size=4,
        step_time=step,
        push_delay=push,
        prefetch=True,
        dt=0.01,
    )
    f = sim.run(60, warmup=20)
    period = f["elapsed"] * sim.batch_groups / f["trained"]
    bound = max(step, gen, (push + gen + step) / (staleness + 1))
    assert bound - 0.01 <= period <= bound + 0.05, (period, bound)
    assert f["dropped"] == 0 and f["lag_max"] <= staleness, f


# Issue 42: the control plane (`tests.fleet_sim`'s `control` options), before and after.


def test_serial_pushes_with_several_processes_throttle_the_trainer():
    """Today's pool: 8 servers whose load takes 1–3 steps, pushed one after another, and with
    several trainer processes no version skipped: the trainer's period is 8–24 times its step.
    Per-server senders take the loads off the loop."""
    before = pod_scenario("before", processes=4).run(16, warmup=6)
    assert 8 <= before["period"] <= 24, before
    after = pod_scenario("after", processes=4).run(16, warmup=6)
    assert after["period"] < before["period"] / 4, after


def test_before_reproduces_the_live_duty_figure():
    """`benchmarks/fleet.py --servers 2 --step-s 0 --duty 0.5` measured 45% of two full servers'
    tokens/s (benchmarks/RESULTS.md); today's pool, simulated, is within 10 points of it."""
    full = duty_scenario("before", duty=False).run(120, warmup=20)
    half = duty_scenario("before").run(120, warmup=20)
    assert 0.35 <= half["tokens_per_time"] / full["tokens_per_time"] <= 0.55, (full, half)


@pytest.mark.parametrize("mutant", [FinishOrderAdmission, NoHoldBackAdmission])
def test_hand_out_mutants_fail_a_long_tail_scenario(mutant):
    """Completions of 10–1000 tokens, S = 2: the real hand-out order (oldest admitted first,
    younger ones held back behind a group at its deadline) trains every group within S of its
    admission (strict: a violation raises) and drops none; handing out in finish order, or
    without the hold-back, trains groups past v + S with two servers and drops more than 2% of
    the groups with four."""
    for k in (2, 4):
        real = spread_scenario("after", k, (10, 1000), 2).run(80, warmup=20)
        assert real["violations"] == 0 and real["drops_per_group"] == 0, real
    with pytest.raises(AssertionError, match="> v \\+ S"):
        spread_scenario("after", 2, (10, 1000), 2, admission=mutant).run(80, warmup=20)
    bad = spread_scenario("after", 4, (10, 1000), 2, admission=mutant, strict=False)
    assert bad.run(80, warmup=20)["drops_per_group"] > 0.02


@pytest.mark.parametrize("mutant", [ReleaseAtLeaseAdmission, PrefetchLeadAdmission])
@pytest.mark.parametrize(("servers", "staleness"), [(2, 1), (4, 2)])
def test_the_budget_has_no_seat_to_spare(mutant, servers, staleness):
    """The two S-grid rows furthest below `period_bound` (10–1000 tokens), where the budget is
    nearly always full: a seat freed when its group is leased to the current batch, or the
    prefetch's lead of 1 not counted, trains groups past v + S (strict: a violation raises);
    the real budget trains none."""
    real = spread_scenario("after", servers, (10, 1000), staleness).run(60, warmup=20)
    assert real["violations"] == 0 and real["drops_per_group"] == 0, real
    with pytest.raises(AssertionError, match="> v \\+ S"):
        spread_scenario("after", servers, (10, 1000), staleness, admission=mutant).run(60, 20)


def test_a_deaf_server_stops_the_run_before_and_not_after():
    """One of two servers stopped for 30 of the trainer's periods: today's pool makes one step
    meanwhile (its serial push and its Pull wait on the stopped server, until the Pull's
    deadline, 30 steps past its wait, fails it once); after, the other server's share goes on
    (its seats move once the stopped one is lagging), nothing it admits after the stop goes stale,
    and it is current again within S + 2 steps of resuming."""
    before = deaf_figures(spread_scenario("before", 2, (10, 1000), 2, strict=False))
    assert before["rate_deaf"] <= 0.05 * before["rate_before"], before
    after = deaf_figures(spread_scenario("after", 2, (10, 1000), 2))  # strict
    assert after["rate_deaf"] >= 0.4 * after["rate_before"], after
    assert after["burst_admitted_after_stop"] == 0, after
    assert after["steps_to_current"] is not None and after["steps_to_current"] <= 4, after


def test_after_a_half_deaf_server_keeps_the_fleet_near_its_capacity():
    """The live duty scenario after, with the simulator's fence (overdue after three step
    periods; the live pool's floors react only after the stop, the test below): the
    stopped-half-the-time server is fenced at each stop and current again soon
    after each resume; the pair trains at least 90% of the 75% of two full servers that its
    capacity allows (today 58%), no group past v + S. (Its stale drops, the groups in flight at
    each stop, are 1.5–2.5% of those trained: a stop lasts 12 steps, S is 1.)"""
    full = duty_scenario("after", duty=False).run(120, warmup=20)
    half = duty_scenario("after", strict=True).run(120, warmup=20)
    assert half["tokens_per_time"] >= 0.9 * 0.75 * full["tokens_per_time"], (full, half)
    assert half["violations"] == 0


def test_the_live_pool_reproduces_the_live_duty_figure():
    """The "after" pool with the live pool's own constants (`tests.fleet_sim.live_pool`: a Pull
    waits 0.5 s, its deadline at least 2 s past that, an UpdateWeights overdue after at least
    5 s, the fence checked every 0.2 s) trains 41–50% of two full servers with one stopped half
    of every 1 s, as `benchmarks/fleet.py --servers 2 --step-s 0 --duty 0.5` measured live
    (benchmarks/RESULTS.md, issue 42): within 10 points, where the fence that reacts within
    three step periods ("after") reaches 72–75%. Nothing reacts within a 0.5 s stop, so the
    trainer waits for the stopped server's group: no group goes stale past the warm-up."""
    full = duty_scenario("live", duty=False).run(120, warmup=20)
    half = duty_scenario("live", strict=True).run(120, warmup=20)
    assert 0.35 <= half["tokens_per_time"] / full["tokens_per_time"] <= 0.60, (full, half)
    assert half["violations"] == 0 and half["drops_per_group"] <= 0.02, half
    fast = duty_scenario("after").run(120, warmup=20)
    assert fast["tokens_per_time"] >= 1.4 * half["tokens_per_time"], (fast, half)


@pytest.mark.parametrize("lengths", [(10, 1000), (200, 8192)], ids=["10-1000", "200-8192"])
def test_no_grid_row_beats_the_period_bound(lengths):
    """The S grid (1, 2 and 4 servers, S = 1 and 2): `period_bound` is a lower bound on the
    trainer's mean period, so no row's period is below it (a tick only slows the simulator
    down), with its batch term where it applies (every group trained at exactly v + S: the
    four-server rows at S = 1 lie above the other terms' bound and near this one), and every
    row trains each group within S of its admission."""
    for k in (1, 2, 4):
        for staleness in (1, 2):
            sim = spread_scenario("after", k, lengths, staleness)
            f = sim.run(60, warmup=20)
            bound = period_bound(sim, f)
            assert f["period"] >= bound, (k, staleness, f["period"], bound)
            assert f["violations"] == 0 and f["drops_per_group"] == 0, (k, staleness, f)
            if k == 4 and staleness == 1:
                assert f["admitted_lags"] == {1: f["trained"]}, f
                assert bound > period_bound(sim) and f["period"] <= 1.1 * bound, (f, bound)


@pytest.mark.parametrize(("staleness", "period"), [(0, 3.2), (1, 2.0), (2, 2.0)])
def test_the_budget_chain_with_equal_lengths(staleness, period):
    """Samples that all take 1, two servers of 8 slots, 4 groups of 4 each a batch: each
    server's part of a batch is two rounds of its slots. At S = 0 it starts only when the last
    step's weights land (step 1 + save 0.1 + load 0.1), so the period is 1.2 + 2; from S = 1
    the landing overlaps the older batch and the slots bind (16 samples on 8 slots: 2)."""
    sim = spread_scenario("after", 2, (500, 500), staleness)
    assert budget_chain_period(sim, batches=200, warmup=50) == pytest.approx(period)


@pytest.mark.parametrize("lengths", [(10, 1000), (200, 8192)], ids=["10-1000", "200-8192"])
def test_the_budget_chain_counts_the_wait_for_a_batch(lengths):
    """Two servers at S = 1, every group trained at exactly v + S: the budget's chain (a finished
    group keeps its seat until its batch's last sample ends) lies at least 5% above
    `period_bound` (the slots' capacity), and the simulated pool's period is not below it."""
    sim = spread_scenario("after", 2, lengths, 1)
    f = sim.run(60, warmup=20)
    chain = budget_chain_period(sim)
    assert f["admitted_lags"] == {1: f["trained"]}, f
    assert chain >= 1.05 * period_bound(sim, f), (chain, period_bound(sim, f))
    assert f["period"] >= chain, (f["period"], chain)


@pytest.mark.parametrize("lengths", [(10, 1000), (200, 8192)], ids=["10-1000", "200-8192"])
@pytest.mark.parametrize("staleness", [1, 2])
def test_after_long_tails_train_every_group_within_s(staleness, lengths):
    """Two servers, per-server senders, concurrent Pulls, the fence: every trained group within
    S of its admission (strict), stale drops at most 2%."""
    f = spread_scenario("after", 2, lengths, staleness).run(60, warmup=20)
    assert f["violations"] == 0 and f["drops_per_group"] <= 0.02, f


def test_a_server_that_never_finishes_its_load_delays_no_other_install():
    """Per-server senders: a server stopped for the whole run holds one load in flight; the other
    server installs every version on time and the trainer steps on."""
    sim = spread_scenario("after", 2, (50, 150), 2, strict=False)
    sim.deafen("s1", 0.0, 1e9)
    f = sim.run(30, warmup=10)
    assert f["steps_done"] == 20
    assert sim.servers[0].version >= sim.version - 1
    assert sim.servers[1].version == 1 and "s1" in sim.lagging


@pytest.mark.parametrize("mode", ["before", "after"])
def test_a_rejoin_while_pushes_go_on(mode):
    """A killed server rejoins while the trainer pushes every few steps and the server's load takes 6:
    today's `_rejoin` loads again whenever a newer push landed meanwhile and never joins while
    pushing goes on; the per-server sender joins it after at most 2 loads."""
    sim = spread_scenario(mode, 2, (50, 150), 2, strict=False)
    sim.cost = {"s0": 0.1, "s1": 6.0}
    sim.run(15)
    sim.kill("s1")
    sim.run(20)
    loads = sim.loads["s1"]
    sim.rejoin("s1")
    sim.run(40, warmup=20)
    if mode == "before":
        assert "s1" in sim.down and sim.loads["s1"] - loads >= 5, sim.loads
    else:
        assert "s1" not in sim.down and sim.rejoin_loads["s1"] <= 2, sim.rejoin_loads
