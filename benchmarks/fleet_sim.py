"""Admission before and after `rollout_api.admission` (docs/DESIGN.md §6.3, issue 33), on the
deterministic fleet simulator of the tests (`tests/fleet_sim.py`): stale drops per trained group,
trained groups and tokens per unit of time, and the mean completion length of the dropped groups
against the trained ones (the length bias of dropping by the oldest token), for 1, 2 and 4
servers with generation faster and slower than a train step, servers of equal and unequal speed,
weight pushes slower than a step (the issue's regime), a SIGTERM drain and a kill/rejoin; then
the shares alone (issue 33 item 5): equal shares against shares that follow the capacity each
server measures, with servers of equal and unequal speed and one that slows down mid-run.

    PYTHONPATH=$PWD python benchmarks/fleet_sim.py [--steps 200]
    PYTHONPATH=$PWD python benchmarks/fleet_sim.py --control     # issue 42: the control plane
    PYTHONPATH=$PWD python benchmarks/fleet_sim.py --steps 120 --grid-ticks 0.1 0.02 0.01
    PYTHONPATH=$PWD python benchmarks/fleet_sim.py --steps 120 --budget-variants --grid-ticks 0.1 0.01

`--control` runs issue 42's grid instead (`tests.fleet_sim`'s `duty_scenario`, `pod_scenario`,
`spread_scenario`, `deaf_figures`): the pool of today ("before": serial pushes, blocking Pulls)
against per-server senders, concurrent Pulls and the lagging fence ("after"; in the duty table
also with the live pool's constants, `tests.fleet_sim.live_pool`), and the hand-out order's
mutants; every figure against `tests.fleet_sim.period_bound` where it says so. `--grid-ticks`
prints the S grid at each tick, with the bound (its batch term where it applies) and the budget's
chain (`tests.fleet_sim.budget_chain_period`); `--budget-variants` runs the rows below the bound
under the real budget and its two mutants (a seat freed at the lease; the prefetch's lead not
counted).

Units: a train step takes 1; a group of 4 samples of 50–150 tokens (uniform) takes `gen` steps on
a server of 8 slots (the first server twice as long in the "unequal" rows); weights reach the
servers 0.2 steps after the step (1.5 in the "push 1.5" rows); max_staleness 2, 8 groups per
batch. In the first table "before" is `tests.fleet_sim.OldAdmission` (the rule of commit 48471f2
with the pool's plain rotation and equal shares, and no push on a skipped step); "after" is what
the servers and the pool run now. In the second, both run the rule of now, "before" with equal
shares (1/k), "after" with measured ones. Figures are over the steps after the 10th (after the
80th for the fault rows; after the 70th for the "slows down" rows, whose first server drops to
half its speed at step 30). Prints Markdown.
"""

from __future__ import annotations

import argparse
import math

from tests.fleet_sim import (
    FinishOrderAdmission,
    FleetSim,
    NoHoldBackAdmission,
    PrefetchLeadAdmission,
    ReleaseAtLeaseAdmission,
    ServerAdmission,
    SimStalled,
    budget_chain_period,
    deaf_figures,
    duty_scenario,
    period_bound,
    pod_scenario,
    spread_scenario,
)

LENGTHS = (50, 150)


def fleet(k: int, gen: float, rule: str, *, slow: float = 1.0, **kw) -> FleetSim:
    speed = sum(LENGTHS) / 2 / gen
    servers = [(speed / (slow if i == 0 else 1.0), 8, LENGTHS) for i in range(k)]
    # The trainer before issue 33 pulled between steps; the one after prefetches (the real loop).
    return FleetSim(servers, rule=rule, max_staleness=2, prefetch=rule == "new", **kw)


def scenario(name: str, rule: str, steps: int, shares: str = "measured") -> dict:
    """One row's figures (`rule` "old" or "new"; `shares` "equal" or "measured")."""
    kind, _, rest = name.partition(":")
    k, gen = int(rest.split(",")[0]), float(rest.split(",")[1])
    if kind == "equal":
        return fleet(k, gen, rule, shares=shares).run(steps)
    if kind == "unequal":
        return fleet(k, gen, rule, slow=2.0, shares=shares).run(steps)
    if kind == "push 1.5":
        return fleet(k, gen, rule, push_delay=1.5, shares=shares).run(steps)
    sim = fleet(k, gen, rule, shares=shares)
    if kind == "slows down":
        sim.run(30)
        sim.set_speed("s0", sim.servers[0].speed / 2)
        return sim.run(steps + 60, warmup=70)
    if kind == "kill/rejoin":
        sim.run(30)
        sim.kill("s1")
        sim.run(60)
        sim.rejoin("s1")
    elif kind == "sigterm/rejoin":
        sim.run(30)
        sim.sigterm("s1")
        sim.run(60)
        sim.rejoin("s1")
    elif kind == "skipped 20-60":
        sim.skip = set(range(20, 61))
        sim.stall_after = 100.0
        return sim.run(steps)
    return sim.run(steps + 70, warmup=80)


ROWS = [
    *(f"equal:{k},{gen}" for gen in (0.3, 3.0) for k in (1, 2, 4)),
    *(f"unequal:{k},{gen}" for gen in (0.3, 3.0) for k in (2, 4)),
    *(f"push 1.5:{k},0.3" for k in (1, 2, 4)),
    "kill/rejoin:2,0.3",
    "kill/rejoin:2,3.0",
    "sigterm/rejoin:2,3.0",
    "skipped 20-60:2,0.3",
]

SHARE_ROWS = [
    *(f"{kind}:{k},{gen}" for kind in ("equal", "unequal") for gen in (0.3, 3.0) for k in (2, 4)),
    *(f"slows down:{k},{gen}" for gen in (0.3, 3.0) for k in (1, 2, 4)),
]


def _fmt(x: float, digits: int = 3) -> str:
    return "–" if isinstance(x, float) and math.isnan(x) else f"{x:.{digits}f}"


def shares_table(steps: int) -> None:
    """Equal shares against measured ones, under the admission rule of now."""
    print(
        "| scenario (servers, gen / step) | stale drops / trained group, equal → measured | "
        "trained tokens / unit, equal → measured | of the bound, equal → measured | "
        "first server's share, measured |"
    )
    print("| --- | --- | --- | --- | --- |")
    for name in SHARE_ROWS:
        b = scenario(name, "new", steps, shares="equal")
        a = scenario(name, "new", steps)
        bound = min(a["capacity"], a["trainer_rate"])
        print(
            f"| {name} | {_fmt(b['drops_per_group'])} → {_fmt(a['drops_per_group'])} | "
            f"{_fmt(b['tokens_per_time'], 0)} → {_fmt(a['tokens_per_time'], 0)} | "
            f"{b['groups_per_time'] / bound:.0%} → {a['groups_per_time'] / bound:.0%} | "
            f"{a['share_s0']:.3f} |",
            flush=True,
        )


def control_tables(steps: int) -> None:
    """Issue 42's grid, before → after (see the module docstring)."""
    modes = ("before", "after", "live")
    print("| duty 0.5 (one of two servers stopped half of every second) | before | after "
          "(fence within 3 step periods) | after, the live pool's constants |")  # fmt: skip
    print("| --- | --- | --- | --- |")
    cells = {}
    for mode in modes:
        full = duty_scenario(mode, duty=False).run(steps, warmup=20)
        half = duty_scenario(mode).run(steps, warmup=20)
        cells[mode] = (full, half)
    for label, fn in (
        ("tokens / s, two full servers", lambda f, h: f"{f['tokens_per_time']:.0f}"),
        ("tokens / s, duty 0.5", lambda f, h: f"{h['tokens_per_time']:.0f}"),
        ("of two full servers", lambda f, h: f"{h['tokens_per_time'] / f['tokens_per_time']:.0%}"),
        (
            "of the bound (75% of two full servers)",
            lambda f, h: f"{h['tokens_per_time'] / (0.75 * f['tokens_per_time']):.0%}",
        ),
        ("stale drops / trained group", lambda f, h: f"{h['drops_per_group']:.3f}"),
        ("W − v_admitted > S", lambda f, h: f"{h['violations']}"),
    ):
        print(f"| {label} | {' | '.join(fn(*cells[m]) for m in modes)} |", flush=True)
    print()
    print(
        "| pod: 8 servers × 128 slots, loads 1–3 steps, 200–8192 tokens, S = 4 | processes "
        "| period / step | bound / step | of the bound | stale drops / trained | violations |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for mode in ("before", "after"):
        for processes in (1, 4):
            sim = pod_scenario(mode, processes=processes)
            f = sim.run(40, warmup=10)
            bound = period_bound(sim, f)
            print(
                f"| {mode} | {processes} | {f['period']:.2f} | {bound:.2f} | "
                f"{bound / f['period']:.0%} | {f['drops_per_group']:.3f} | {f['violations']} |",
                flush=True,
            )
    print()
    print(
        "| spread, servers, S | of the bound, before → after | stale drops / trained, "
        "before → after | violations, before → after | after, finish-order mutant: drops / "
        "violations | after, no-hold-back mutant: drops / violations |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for lengths in ((10, 1000), (200, 8192)):
        for k in (1, 2, 4):
            for s in (1, 2):
                row = {}
                for key, mode, adm in (
                    ("before", "before", ServerAdmission),
                    ("after", "after", ServerAdmission),
                    ("finish", "after", FinishOrderAdmission),
                    ("nohold", "after", NoHoldBackAdmission),
                ):
                    sim = spread_scenario(mode, k, lengths, s, admission=adm, strict=False)
                    f = sim.run(steps, warmup=20)
                    bound = period_bound(sim, f)
                    row[key] = (f, f["groups_per_time"] * bound / sim.batch_groups)
                b, a = row["before"], row["after"]
                print(
                    f"| {lengths[0]}–{lengths[1]}, {k}, {s} | {b[1]:.0%} → {a[1]:.0%} | "
                    f"{b[0]['drops_per_group']:.3f} → {a[0]['drops_per_group']:.3f} | "
                    f"{b[0]['violations']} → {a[0]['violations']} | "
                    f"{row['finish'][0]['drops_per_group']:.3f} / {row['finish'][0]['violations']} | "
                    f"{row['nohold'][0]['drops_per_group']:.3f} / {row['nohold'][0]['violations']} |",
                    flush=True,
                )
    print()
    print(
        "| one of two servers stopped for 30 of its periods, S = 2, 10–1000 tokens | before | after |"
    )
    print("| --- | --- | --- |")
    deaf = {m: deaf_figures(spread_scenario(m, 2, (10, 1000), 2, strict=False)) for m in
            ("before", "after")}  # fmt: skip
    for label, fn in (
        ("steps / unit while stopped, of before", lambda d: f"{d['rate_deaf'] / d['rate_before']:.0%}"),
        ("stale drops after it resumes", lambda d: f"{d['burst']}"),
        ("of those, admitted after it stopped", lambda d: f"{d['burst_admitted_after_stop']}"),
        ("steps from its resume to current", lambda d: f"{d['steps_to_current']}"),
        ("W − v_admitted > S (exempt: in the stop's window)",
         lambda d: f"{d['violations']} ({d['violations_exempt']})"),
    ):  # fmt: skip
        print(f"| {label} | {fn(deaf['before'])} | {fn(deaf['after'])} |", flush=True)


def grid_table(steps: int, dts: list[float]) -> None:
    """Issue 42's S grid with the "after" pool at each simulator tick in `dts`: of the bound,
    and (at the last tick) of the budget's chain (`budget_chain_period`: the period of an ideal
    pool under the budget, where every group is trained at exactly v + S), the slot time left
    idle while admission's budget was full, the groups leased, running or queued filling it."""
    heads = " | ".join(f"of the bound, tick {dt:g}" for dt in dts)
    print(f"| spread, servers, S | bound / step (last tick) | {heads} | budget chain / step | "
          f"of the chain, tick {dts[-1]:g} | stale drops / trained | violations | "
          "slot time idle, budget full |")  # fmt: skip
    print("| --- " * (len(dts) + 8) + "|")
    for lengths in ((10, 1000), (200, 8192)):
        for k in (1, 2, 4):
            for s in (1, 2):
                cells = []
                for dt in dts:
                    sim = spread_scenario("after", k, lengths, s, strict=False, dt=dt)
                    f = sim.run(steps, warmup=20)
                    bound = period_bound(sim, f)
                    cells.append(f"{f['groups_per_time'] * bound / sim.batch_groups:.1%}")
                chain = budget_chain_period(sim) if set(f["admitted_lags"]) == {s} else math.nan
                idle = sum(x.idle.get("budget", 0.0) for x in sim.servers)
                slot = sum(x.slot_time for x in sim.servers)
                print(
                    f"| {lengths[0]}–{lengths[1]}, {k}, {s} | {bound:.3f} | {' | '.join(cells)} | "
                    f"{chain:.3f} | {chain / f['period']:.1%} | {f['drops_per_group']:.3f} | "
                    f"{f['violations']} | {idle / slot:.1%} |",
                    flush=True,
                )


def budget_variants_table(steps: int, dts: list[float]) -> None:
    """The S-grid rows furthest below the bound (2 servers at S = 1, 4 at S = 2) under the real
    budget and its two mutants (`ReleaseAtLeaseAdmission`: a seat freed at the lease;
    `PrefetchLeadAdmission`: the prefetch's lead not counted), at each tick in `dts`."""
    print("| budget | spread, servers, S | tick | of the bound | of the budget chain | "
          "stale drops / trained | W − v_admitted > S | W − v_admitted (groups) |")  # fmt: skip
    print("| --- " * 8 + "|")
    variants = (
        ("real", ServerAdmission),
        ("seat freed at the lease", ReleaseAtLeaseAdmission),
        ("prefetch lead not counted", PrefetchLeadAdmission),
    )
    for lengths in ((10, 1000), (200, 8192)):
        for k, s in ((2, 1), (4, 2)):
            for dt in dts:
                bound = None  # the real budget's row's bound (its batch term), for every variant
                for label, admission in variants:
                    sim = spread_scenario(
                        "after", k, lengths, s, strict=False, dt=dt, admission=admission
                    )
                    f = sim.run(steps, warmup=20)
                    bound = bound or period_bound(sim, f)
                    chain = budget_chain_period(sim)
                    lags = ", ".join(f"{n}: {c}" for n, c in sorted(f["admitted_lags"].items()))
                    print(
                        f"| {label} | {lengths[0]}–{lengths[1]}, {k}, {s} | {dt:g} | "
                        f"{bound / f['period']:.1%} | {chain / f['period']:.1%} | "
                        f"{f['drops_per_group']:.3f} | {f['violations']} | {lags} |",
                        flush=True,
                    )


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--control", action="store_true", help="issue 42's grid")
    parser.add_argument(
        "--grid-ticks", type=float, nargs="+", help="issue 42's S grid at these simulator ticks"
    )
    parser.add_argument(
        "--budget-variants",
        action="store_true",
        help="the budget and its mutants on the S grid's rows below the bound (--grid-ticks)",
    )
    args = parser.parse_args()
    if args.budget_variants:
        budget_variants_table(args.steps, args.grid_ticks or [0.1])
        return
    if args.grid_ticks:
        grid_table(args.steps, args.grid_ticks)
        return
    if args.control:
        control_tables(args.steps)
        return
    print(
        "| scenario (servers, gen / step) | stale drops / trained group, before → after | "
        "trained tokens / unit, before → after | of the bound, after | "
        "mean length dropped / trained, before | after |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for name in ROWS:
        try:
            b = scenario(name, "old", args.steps)
        except SimStalled as e:
            b = {"stalled": str(e)}
        a = scenario(name, "new", args.steps)
        bound = min(a["capacity"], a["trainer_rate"])
        if "stalled" in b:
            before_drops, before_tokens, before_len = "stalled", "0", "–"
        else:
            before_drops = _fmt(b["drops_per_group"])
            before_tokens = _fmt(b["tokens_per_time"], 0)
            before_len = f"{_fmt(b['len_dropped'], 0)} / {_fmt(b['len_trained'], 0)}"
        print(
            f"| {name} | {before_drops} → {_fmt(a['drops_per_group'])} | "
            f"{before_tokens} → {_fmt(a['tokens_per_time'], 0)} | "
            f"{a['groups_per_time'] / bound:.0%} | {before_len} | "
            f"{_fmt(a['len_dropped'], 0)} / {_fmt(a['len_trained'], 0)} |",
            flush=True,
        )
    print()
    shares_table(args.steps)


if __name__ == "__main__":
    cli()
