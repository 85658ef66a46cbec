"""The simulated fleet (`tests/fleet_sim.py`) under the admission the servers and the pool run
(`rollout_api.admission`, docs/DESIGN.md §6.3): every step checked for exactly-once and no
trained group older than `max_staleness`; stale drops at most 2% of the trained groups in steady
state with 1, 2 and 4 servers, generation faster and slower than a step, servers of equal and
unequal speed and one that slows down mid-run; throughput at least 90% of what the live servers
(or the trainer) can do; liveness through runs of skipped steps; kills,
SIGTERM drains, rejoins, trainer restarts, lost and delayed Pull replies. The "old" rule (a model
of the one before) is run where it shows what changed. `prefetch` runs the trainer as the real
loop does (the next batch pulled while a step runs); with it, one server reaches the overlap the
staleness bound allows (`test_prefetch_reaches_the_overlap_the_bound_allows`)."""

from __future__ import annotations

import pytest

from tests.fleet_sim import FleetSim, SimStalled

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
