"""Async vs synchronous end-to-end throughput of the trainer + one local rollout server (docs/DESIGN.md §9).

    python benchmarks/async_vs_sync.py [--steps 40] [--config configs/arith_main.yaml] [--no-pin] [--repeats 3] [--stand-in] [k=v ...]

Runs the same experiment (by default the main job's, `configs/arith_main.yaml`, without its
warm-up and evaluation) three times — synchronous (generation waits for every new version), async
with weight_sync_interval n = 1 and async with n = 8 — each as `python -m train` with its own
rollout server, and reads the runs' metrics logs. With two or more cores the server and the
trainer are pinned to one core each in every mode (``--no-pin`` lets them share): the isolated
timings then measure what each side has while they overlap, so the ideal below is reachable.
Prints a Markdown table:

- trained tokens/s: completion tokens trained per second of loop wall time (first steps, which
  compile, left out);
- T_rollout, T_train: isolated per-batch timings from the synchronous run, where they do not
  overlap (the wait for a batch, and the step + weight push);
- ideal overlap = (T_rollout + T_train) / max(T_rollout, T_train), the best speed-up over sync;
- achieved = tokens/s ÷ sync tokens/s, and achieved / ideal (target ≥ 90%); every number is a
  median over `--repeats` interleaved repeats (each repeat's ratios against its own sync run).

A second table shows where each mode's time goes (loop period, the trainer's wait for a batch,
its step, the push, the server's install of a version and installs per step) and the bound on the
share of the ideal that two things put: installs in series with generation (``serial_bound``), and
the staleness bound itself (``staleness_bound``: with ``max_staleness`` S, S + 1 steps take at
least a push, a batch's generation and a step).

A third table (`loop_figures`, from the server's Stats polled during each run and the trainer's
``cpu_s``) separates the loop's design from the machine's contention: per mode, each side's busy
time per batch, the loop efficiency max(server busy, trainer busy) ÷ period, CPU seconds per batch
of each process and their ratio to the sync run's (contention), slot-seconds idle while admission
was closed, steal, the CPU loop efficiency max(server CPU, trainer CPU) ÷ period, the trainer's
`batch_host_s`, and the fleet simulator's period for the run's own component times
(`sim_predict`, with the server's CPU per batch and the trainer's batch host time) beside the
measured one, and its error without those two host costs ("decode-only"). ``--stand-in`` adds, per repeat, each async mode again
with the train step a sleep of the sync run's step (without its push) and the server's engine
`rollout_server.stand_in` sleeping the sync run's seconds per generate step: both leave the CPU
idle, so their share of the sync ideal (by period) is the design's. The output ends with one line
per async mode (the stand-in's with ``--stand-in``): ``n=1: 97.3% of ideal, loop efficiency 98.1%``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import re
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from loop_figures import StatsPoller, loop_figures
from sim_predict import Components, predict_period

from sat_jax.experiment import load_config
from train.local_server import LocalServer

REPO = pathlib.Path(__file__).resolve().parents[1]
SKIP = 5  # first steps: compilation and queue fill
SERVER_START_S = 600  # a loaded machine compiles the server's engine slowly
# The server's log line for each installed weights version (rollout_server/service.py).
SWAP_LINE = re.compile(r"weights swapped: .*\(load ([0-9.]+)s, swap ([0-9.]+)s\)")


@dataclasses.dataclass
class Run:
    """One mode's run: the trainer's metrics records and the server's install seconds; its Stats
    polled while it trained ((wall time, busy-time fields), `loop_figures.StatsPoller`) and the
    round trips of those Stats calls."""

    records: list[dict]
    installs_s: list[float]
    polls: list[tuple[float, dict]] = dataclasses.field(default_factory=list)
    rpc_s: list[float] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class StandIn:
    """The stand-in of a run (``--stand-in``): the trainer's step a sleep of `step_s`, the
    server's engine `rollout_server.stand_in` at `token_s` per generate step and `tokens` per
    sample, all measured in the same repeat's sync run."""

    step_s: float
    token_s: float
    tokens: float


def run_mode(
    name: str,
    config: str,
    extra: list[str],
    steps: int,
    root: pathlib.Path,
    pin: bool,
    stand_in: StandIn | None = None,
) -> Run:
    run_dir = root / name
    run_dir.mkdir(parents=True)
    overrides = [
        f"train.run_dir={run_dir}",
        f"server.checkpoint_root={run_dir}",
        f"server.state_dir={run_dir / 'server'}",
        f"train.steps={steps}",
        "train.warmup.steps=0",
        "train.eval.problems=0",
        f"train.checkpoint.every={steps}",
        *extra,
    ]
    cores = sorted(os.sched_getaffinity(0))
    try:
        # Pinned: the server (and its JAX threads) on one core, the trainer on another, in every
        # mode; so the isolated timings of the sync run are what each side has when they overlap.
        if pin:
            os.sched_setaffinity(0, cores[:1])
        server_args, trainer = [], [sys.executable, "-m", "train"]
        if stand_in is not None:
            server_args = [
                f"stand_in.step_s={stand_in.token_s}",
                f"stand_in.tokens={stand_in.tokens}",
            ]
            trainer = [sys.executable, str(REPO / "benchmarks" / "stand_in_train.py")]
            trainer.append(f"--step-s={stand_in.step_s}")
        module = "rollout_server.stand_in" if stand_in is not None else "rollout_server"
        log_path = str(run_dir / "server.log")
        with LocalServer(config, [*overrides, *server_args], log_path, module=module) as server:
            if pin:
                os.sched_setaffinity(0, cores[1:2])
            server.wait_ready(timeout_s=SERVER_START_S)
            cmd = [*trainer, "--config", config, *overrides]
            cmd.append(f"train.client.servers=[{server.address}]")
            print(f"# {name}: {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
            poller = StatsPoller(server.address).start()
            try:
                subprocess.run(cmd, cwd=REPO, check=True, stdout=subprocess.DEVNULL)
            finally:
                poller.stop()
    finally:
        os.sched_setaffinity(0, cores)
    with open(run_dir / "logs" / "metrics.jsonl") as f:
        records = [r for r in map(json.loads, f) if "active_tokens" in r]
    installs = install_seconds((run_dir / "server.log").read_text())
    return Run(records, installs, poller.samples, poller.rpc_s)


def install_seconds(server_log: str) -> list[float]:
    """Seconds the server spent on each weights install (load + swap), from its log."""
    return [float(load) + float(swap) for load, swap in SWAP_LINE.findall(server_log)]


def breakdown(run: Run) -> dict[str, float]:
    """Medians of where one run's time goes, per trained step (compiling steps left out).

    period: loop wall time per step; pull_wait / step: means of the trainer's ``pull_wait_s``
    and ``step_s`` (the step, the host copy and, in sync mode, the push it waits for), as the
    ideal uses them; push: median ``push_s`` (save + UpdateWeights); install: median of the
    server's load + swap of one version; installs_per_step: versions installed per trained step.
    """
    timed = run.records[SKIP:]
    med = statistics.median
    pushes = [r["push_s"] for r in timed if r.get("push_s") is not None]
    return {
        "period": (timed[-1]["time"] - timed[0]["time"]) / (len(timed) - 1),
        "pull_wait": mean(run.records, "pull_wait_s"),
        "step": mean(run.records, "step_s"),
        "push": med(pushes) if pushes else 0.0,
        "install": med(run.installs_s) if run.installs_s else 0.0,
        "installs_per_step": len(run.installs_s) / len(run.records),
    }


def serial_bound(sync: dict[str, float], mode: dict[str, float]) -> float:
    """The share of the ideal overlap a mode can reach when the server's installs do not overlap.

    In the sync run each install happens inside the trainer's ``step_s`` (it waits for the push),
    so the ideal counts it as overlappable; asynchronously it runs on the server's core between
    decode steps, in series with generation. The server then needs T_rollout + installs per
    batch, and the trainer T_train − install:
    max(T_rollout, T_train) / max(T_rollout + k·install, T_train − install).
    """
    t_rollout, t_train, install = sync["pull_wait"], sync["step"], sync["install"]
    server = t_rollout + mode["installs_per_step"] * install
    return max(t_rollout, t_train) / max(server, t_train - install)


def staleness_bound(sync: dict[str, float], mode: dict[str, float], staleness: int) -> float:
    """The share of the ideal overlap a mode can reach under an exact staleness bound.

    Batch T may hold only groups admitted at weights T − S or newer (docs/DESIGN.md §6.3), which
    the step of version T − S − 1 makes; they reach the server a push later (``push``: save +
    UpdateWeights, which returns once the server has installed them), then the batch is generated
    (T_rollout) and trained (the mode's own ``step``). So S + 1 steps take at least
    push + T_rollout + step, and the period is at least that over S + 1, besides the server's
    generation with its installs and the trainer's step:
    max(T_rollout, T_train) / max(step, T_rollout + k·install, (push + T_rollout + step) / (S + 1)).
    """
    t_rollout, t_train = sync["pull_wait"], sync["step"]
    period = max(
        mode["step"],
        t_rollout + mode["installs_per_step"] * sync["install"],
        (mode["push"] + t_rollout + mode["step"]) / (staleness + 1),
    )
    return max(t_rollout, t_train) / period


def throughput(records: list[dict]) -> float:
    timed = records[SKIP:]
    wall = timed[-1]["time"] - timed[0]["time"]
    return sum(r["active_tokens"] for r in timed[1:]) / wall


def mean(records: list[dict], key: str) -> float:
    timed = records[SKIP:]
    return sum(r[key] for r in timed) / len(timed)


MODES = {
    "sync": ["train.mode=sync", "rollout.max_staleness=0", "train.weight_sync_interval=1"],
    "async n=1": ["rollout.max_staleness=1", "train.weight_sync_interval=1"],
    "async n=8": ["rollout.max_staleness=8", "train.weight_sync_interval=8"],
}


def _option(extra: list[str], key: str) -> int:
    return int(next(o for o in extra if o.startswith(key + "=")).split("=")[1])


STALENESS = {name: _option(extra, "rollout.max_staleness") for name, extra in MODES.items()}
INTERVAL = {name: _option(extra, "train.weight_sync_interval") for name, extra in MODES.items()}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--config", default=str(REPO / "configs" / "arith_main.yaml"))
    parser.add_argument(
        "--no-pin",
        dest="pin",
        action="store_false",
        help="let server and trainer share every core (default: one core each, if there are 2+)",
    )
    parser.add_argument("--repeats", type=int, default=3, help="interleaved repeats (medians)")
    parser.add_argument(
        "--stand-in",
        action="store_true",
        help="also run each async mode with the stand-in step and engine (module docstring)",
    )
    parser.add_argument("--keep", default="", help="save each repeat's run data in this folder")
    parser.add_argument(
        "--from",
        dest="load_from",
        default="",
        help="make the tables from a --keep folder's run data instead of running",
    )
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    args.pin = args.pin and len(os.sched_getaffinity(0)) >= 2
    return args


def run_repeat(args: argparse.Namespace, rep: int) -> dict[str, Run]:
    """One run of every mode, in order (with ``--stand-in``, then the stand-in of each async
    mode, timed from this repeat's sync run); their runs by mode."""
    runs: dict[str, Run] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, extra in MODES.items():
            runs[name] = run_mode(
                f"{name.replace(' ', '_').replace('=', '')}_{rep}",
                args.config,
                [*args.overrides, *extra],
                args.steps,
                pathlib.Path(tmp),
                args.pin,
            )
        if args.stand_in:
            stand_in = measured_stand_in(runs["sync"], args.shape)
            for name, extra in MODES.items():
                if name == "sync":
                    continue
                runs[stand_in_name(name)] = run_mode(
                    f"standin_{name.replace(' ', '_').replace('=', '')}_{rep}",
                    args.config,
                    [*args.overrides, *extra],
                    args.steps,
                    pathlib.Path(tmp),
                    args.pin,
                    stand_in,
                )
    return runs


def repeat_runs(args: argparse.Namespace, rep: int) -> dict[str, Run]:
    """Repeat `rep`'s runs: read from ``--from DIR`` (``runs_<rep>.json``), or run (and, with
    ``--keep DIR``, saved there), so the tables can be made again from a run's data."""
    if args.load_from:
        saved = json.loads((pathlib.Path(args.load_from) / f"runs_{rep}.json").read_text())
        return {name: Run(**run) for name, run in saved.items()}
    runs = run_repeat(args, rep)
    if args.keep:
        path = pathlib.Path(args.keep)
        path.mkdir(parents=True, exist_ok=True)
        saved = {name: dataclasses.asdict(run) for name, run in runs.items()}
        (path / f"runs_{rep}.json").write_text(json.dumps(saved))
    return runs


def stand_in_name(mode: str) -> str:
    return mode.replace("async", "stand-in")


def measured_stand_in(sync: Run, shape: dict[str, int]) -> StandIn:
    """The stand-in's times from a sync run: its step without the push it waited for, the
    server's decode seconds per generate step and its tokens per sample."""
    got = breakdown(sync)
    figures = run_figures(sync, got)
    samples = shape["batch_groups"] * shape["group_size"]
    return StandIn(
        step_s=max(got["step"] - got["push"], 0.0),
        token_s=figures["token_s"],
        tokens=figures["tokens"] / samples,
    )


def run_figures(run: Run, got: dict[str, float]) -> dict[str, float | None]:
    """`loop_figures` of a run whose `breakdown` is `got`."""
    return loop_figures(
        run.records,
        run.polls,
        skip=SKIP,
        install_s=got["install"],
        installs_per_step=got["installs_per_step"],
    )


def prediction(
    run: Run,
    got: dict[str, float],
    fig: dict,
    shape: dict[str, int],
    mode: str,
    *,
    host: bool = True,
) -> float | None:
    """The simulator's period for a run from its own component times (`sim_predict`); without
    ``host``, from the decode times alone (the server's and the trainer's host costs left out,
    as the simulator was fed before)."""
    if not fig["token_s"] or not fig["decode"]:
        return None
    staleness = STALENESS[mode.replace("stand-in", "async")]
    return predict_period(
        Components(
            step_s=got["step"],
            push_s=got["push"],
            install_s=got["install"],
            installs_per_step=got["installs_per_step"],
            token_s=fig["token_s"],
            tokens=fig["tokens"] / (shape["batch_groups"] * shape["group_size"]),
            pull_s=statistics.median(run.rpc_s) if run.rpc_s else 0.0,
            decode_per_batch_s=fig["decode"],
            slots=shape["slots"],
            group_size=shape["group_size"],
            batch_groups=shape["batch_groups"],
            queue_groups=shape["queue_groups"],
            max_staleness=staleness,
            interval=INTERVAL[mode.replace("stand-in", "async")],
            server_cpu_s=(fig["server_cpu"] or 0.0) if host else 0.0,
            batch_host_s=(fig["batch_host"] or 0.0) if host else 0.0,
        )
    )


def run_shape(args: argparse.Namespace) -> dict[str, int]:
    """The run's slots, group size, batch groups and queue capacity (from its config)."""
    cfg = load_config(args.config, args.overrides)
    return {
        "slots": cfg.server.slots,
        "group_size": cfg.rollout.group_size,
        "batch_groups": cfg.rollout.batch_groups,
        "queue_groups": cfg.rollout.queue_groups,
    }


def main() -> None:
    args = parse_args()
    args.shape = run_shape(args)
    # Repeats interleave the modes, so slow phases of a shared machine hit every mode alike; each
    # repeat's ratios use its own sync run, and the table shows medians over repeats.
    rows: dict[str, list[tuple[float, float, float]]] = {name: [] for name in MODES}
    parts: dict[str, list[dict[str, float]]] = {name: [] for name in MODES}
    loops: dict[str, list[dict]] = {}
    ideals, timings = [], []
    for rep in range(args.repeats):
        results = repeat_runs(args, rep)
        sync = breakdown(results["sync"])
        t_rollout, t_train = sync["pull_wait"], sync["step"]
        ideal = (t_rollout + t_train) / max(t_rollout, t_train)
        ideals.append(ideal)
        timings.append((t_rollout, t_train))
        base = throughput(results["sync"].records)
        sync_fig = run_figures(results["sync"], sync)
        for name, run in results.items():
            got = breakdown(run)
            fig = run_figures(run, got)
            if name in MODES:
                tps = throughput(run.records)
                rows[name].append((tps, mean(run.records, "lag_mean"), tps / base / ideal))
                real = name
                bound = min(serial_bound(sync, got), staleness_bound(sync, got, STALENESS[name]))
                parts[name].append({**got, "bound": bound})
            else:
                real = name.replace("stand-in", "async")
            fig["of_ideal"] = sync["period"] / got["period"] / ideal
            fig["contention"] = {
                side: ratio(fig[f"{side}_cpu"], sync_fig[f"{side}_cpu"])
                for side in ("trainer", "server")
            }
            fig["predicted"] = (
                None if name == "sync" else prediction(run, got, fig, args.shape, real)
            )
            fig["predicted_decode"] = (
                None if name == "sync" else prediction(run, got, fig, args.shape, real, host=False)
            )
            loops.setdefault(name, []).append(fig)
        print(
            f"# repeat {rep + 1}: T_rollout {t_rollout:.3f} s, T_train {t_train:.3f} s, ideal "
            f"{ideal:.2f}x; "
            + ", ".join(
                f"{n} {100 * f['of_ideal']:.0f}% of ideal"
                for n, fl in loops.items()
                for f in fl[-1:]
            ),
            file=sys.stderr,
            flush=True,
        )
    print_table(args, rows, ideals, timings)
    print_breakdown(parts)
    print_loop(loops)
    print_summary(loops, stand_in=args.stand_in)


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def print_table(
    args: argparse.Namespace,
    rows: dict[str, list[tuple[float, float, float]]],
    ideals: list[float],
    timings: list[tuple[float, float]],
) -> None:
    """The Markdown table of the module docstring, medians over the repeats."""
    med = statistics.median
    print(
        f"T_rollout = {med(t for t, _ in timings):.3f} s/batch, T_train = "
        f"{med(t for _, t in timings):.3f} s/batch, ideal {med(ideals):.2f}x "
        f"(medians over {args.repeats} repeats)"
    )
    print(
        f"machine: {os.cpu_count()} CPUs, {sys.platform}; "
        + ("server and trainer pinned to one core each" if args.pin else "cores shared")
    )
    print()
    print("| mode | trained tokens/s | lag mean | % of ideal (per repeat) | median % of ideal |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name, got in rows.items():
        per = ", ".join(f"{100 * f:.0f}" for _, _, f in got)
        print(
            f"| {name} | {med(t for t, _, _ in got):.0f} | {med(lag for _, lag, _ in got):.2f} | "
            f"{per} | {100 * med(f for _, _, f in got):.0f}% |"
        )


def print_breakdown(parts: dict[str, list[dict[str, float]]]) -> None:
    """Where each mode's time goes (``breakdown``, medians over the repeats) and the share of
    the ideal it can reach with the server's installs in series (``serial_bound``) and under its
    staleness bound (``staleness_bound``), whichever is lower."""
    med = statistics.median
    print()
    print(
        "| mode | period s | pull wait s | step s | push s | install s | installs/step "
        "| bound, % of ideal |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, got in parts.items():
        cells = [med(g[key] for g in got) for key in ("period", "pull_wait", "step", "push")]
        cells += [med(g["install"] for g in got), med(g["installs_per_step"] for g in got)]
        print(
            f"| {name} | "
            + " | ".join(f"{c:.3f}" for c in cells)
            + (" | — |" if name == "sync" else f" | {100 * med(g['bound'] for g in got):.0f}% |")
        )


def print_loop(loops: dict[str, list[dict]]) -> None:
    """Per mode, medians over the repeats: the period, each side's busy time per batch, the loop
    efficiency, the CPU seconds per batch of each process and their contention (÷ the sync run's),
    admission idle and steal per batch, and the simulator's period with its error."""
    med = statistics.median

    def cell(got: list[dict], key: str, fmt: str, scale: float = 1.0) -> str:
        vals = [g[key] for g in got if g.get(key) is not None]
        return format(scale * med(vals), fmt) if vals else "—"

    def side(got: list[dict], who: str) -> str:
        vals = [g["contention"][who] for g in got if g["contention"][who] is not None]
        return f"{med(vals):.2f}" if vals else "—"

    def err(got: list[dict], key: str) -> str:
        errs = [g[key] / g["period"] for g in got if g.get(key)]
        return f"{med(errs):.3f}" if errs else "—"

    print()
    print(
        "| mode | period s | server busy s | trainer busy s | loop efficiency "
        "| CPU loop efficiency | % of ideal (period) | trainer CPU s | server CPU s "
        "| contention trainer, server | admission idle slot·s | batch host s | steal s "
        "| simulated period s | simulated ÷ measured | decode-only ÷ measured |"
    )
    print("| --- |" + " ---: |" * 15)
    for name, got in loops.items():
        print(
            f"| {name} | {cell(got, 'period', '.3f')} | {cell(got, 'server_busy', '.3f')} "
            f"| {cell(got, 'trainer_busy', '.3f')} | {cell(got, 'efficiency', '.1f', 100)}% "
            f"| {cell(got, 'cpu_efficiency', '.1f', 100)}% "
            f"| {cell(got, 'of_ideal', '.1f', 100)}% | {cell(got, 'trainer_cpu', '.3f')} "
            f"| {cell(got, 'server_cpu', '.3f')} | {side(got, 'trainer')}, {side(got, 'server')} "
            f"| {cell(got, 'admission_idle', '.3f')} | {cell(got, 'batch_host', '.4f')} "
            f"| {cell(got, 'steal', '.4f')} | {cell(got, 'predicted', '.3f')} "
            f"| {err(got, 'predicted')} | {err(got, 'predicted_decode')} |"
        )
    print()
    print(
        "per repeat (loop efficiency / CPU loop efficiency / % of ideal / simulated ÷ measured"
        " / decode-only ÷ measured):"
    )
    for name, got in loops.items():
        print(f"  {name}: " + "; ".join(_repeat_cells(g) for g in got))


def _repeat_cells(g: dict) -> str:
    """One repeat's figures of the per-repeat lines of `print_loop`."""

    def pct(key: str) -> str:
        return "—" if g.get(key) is None else f"{100 * g[key]:.1f}%"

    def err(key: str) -> str:
        return f"{g[key] / g['period']:.3f}" if g.get(key) else "—"

    return " / ".join(
        [
            pct("efficiency"),
            pct("cpu_efficiency"),
            pct("of_ideal"),
            err("predicted"),
            err("predicted_decode"),
        ]
    )


def print_summary(loops: dict[str, list[dict]], *, stand_in: bool) -> None:
    """The closing lines, one per async mode (the stand-in's with ``--stand-in``):
    ``n=1: 97.3% of ideal, loop efficiency 98.1%`` (medians over the repeats)."""
    med = statistics.median
    prefix = "stand-in" if stand_in else "async"
    print()
    for name, got in loops.items():
        if not name.startswith(prefix):
            continue
        n = name.split()[-1]
        of_ideal = med(g["of_ideal"] for g in got)
        eff = med(g["efficiency"] for g in got)
        print(f"{n}: {100 * of_ideal:.1f}% of ideal, loop efficiency {100 * eff:.1f}%")


if __name__ == "__main__":
    main()
