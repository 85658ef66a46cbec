"""The "before" side of benchmarks/fleet.py's issue-33 figures: runs an older tree's own
``benchmarks/fleet.py`` (the tree before issue 33, commit e6ffb22, whose ``run(k, steps, step_s,
fleet_budget=True, kill=...)`` has max_staleness 1, 2 groups of 2 per batch, the tiny model and a
stand-in step of ``step_s`` seconds, as today's defaults) and prints the row today's fleet.py
prints: stale drops per trained group (the whole run and after step 5), the largest lag trained,
trained completion tokens/s from the 3rd step on, and the 1-minute load average.

    cd OLD_TREE && PYTHONPATH=$PWD python NEW_TREE/benchmarks/fleet_before.py K STEPS STEP_S \
        [--kill | --sigterm | --duty F]

``--kill``: the old fleet.py's kill/rejoin phase (SIGKILL of the second server after a quarter of
the steps, restarted at half), with its per-phase tokens/s. ``--sigterm``: the same with SIGTERM in
place of SIGKILL (the old server stopped at once on SIGTERM: no drain). ``--duty F``: the first
server is SIGSTOPped for (1 − F) of every second and continued for the rest, from when it is ready.
Only the standard library and the old tree are imported (the old tree's module is loaded from the
working directory's ``benchmarks/fleet.py``).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import signal
import subprocess
import tempfile
import threading
import time

import numpy as np

WARMUP = 5  # as benchmarks/fleet.py


def _old_fleet():
    path = os.path.join(os.getcwd(), "benchmarks", "fleet.py")
    spec = importlib.util.spec_from_file_location("old_fleet", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _record_trained(fleet, trained: list) -> None:
    """Wraps the old module's stand-in step to record (time, completion tokens) per step."""
    real_step = fleet._step

    def step(seconds, hooks, inner_trained):
        inner = real_step(seconds, hooks, inner_trained)

        def wrapped(state, batch):
            out = inner(state, batch)
            trained.append((time.monotonic(), int(np.asarray(batch.loss_mask).sum())))
            return out

        return wrapped

    fleet._step = step


def _duty_cycle(fleet, duty: float) -> None:
    """Makes the first server the old module starts stop for (1 − duty) of every second."""
    cycles: list[tuple[threading.Event, threading.Thread]] = []
    real_ready, real_stop = fleet.LocalServer.wait_ready, fleet.LocalServer.stop

    def wait_ready(self, **kwargs):
        real_ready(self, **kwargs)
        if cycles:
            return
        closed = threading.Event()

        def cycle():
            while not closed.is_set():
                os.kill(self.proc.pid, signal.SIGSTOP)
                if closed.wait(1 - duty):
                    break
                os.kill(self.proc.pid, signal.SIGCONT)
                closed.wait(duty)
            os.kill(self.proc.pid, signal.SIGCONT)

        thread = threading.Thread(target=cycle, daemon=True)
        cycles.append((closed, thread))
        thread.start()

    def stop(self):
        for closed, thread in cycles:
            closed.set()
            thread.join()
        real_stop(self)

    fleet.LocalServer.wait_ready, fleet.LocalServer.stop = wait_ready, stop


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("servers", type=int)
    parser.add_argument("steps", type=int)
    parser.add_argument("step_s", type=float)
    fault = parser.add_mutually_exclusive_group()
    fault.add_argument("--kill", action="store_true")
    fault.add_argument("--sigterm", action="store_true")
    fault.add_argument("--duty", type=float)
    args = parser.parse_args(argv)
    if args.steps < 2 * WARMUP:
        parser.error(f"steps must be at least {2 * WARMUP}, got {args.steps}")
    if args.duty is not None and not 0 < args.duty < 1:
        parser.error(f"--duty must be in (0, 1), got {args.duty}")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    fleet = _old_fleet()
    from train import metrics  # the old tree's

    trained: list[tuple[float, int]] = []
    dirs: list[str] = []
    _record_trained(fleet, trained)
    real_mkdtemp = tempfile.mkdtemp
    fleet.tempfile.mkdtemp = lambda **kw: dirs.append(real_mkdtemp(**kw)) or dirs[-1]
    if args.duty is not None:
        _duty_cycle(fleet, args.duty)
    if args.sigterm:  # the old fleet.py's only Popen.kill during a run is its SIGKILL
        subprocess.Popen.kill = lambda self: self.send_signal(signal.SIGTERM)
    r = fleet.run(
        args.servers, args.steps, args.step_s, fleet_budget=True, kill=args.kill or args.sigterm
    )
    records = metrics.read_jsonl(os.path.join(dirs[0], "logs", "metrics.jsonl"))
    drops = [x["stale_dropped"] for x in records]
    late = (drops[-1] - drops[WARMUP - 1]) / max(sum(x["groups"] for x in records[WARMUP:]), 1)
    sel = [(t, n) for t, n in trained if t >= trained[2][0]]
    rate = sum(n for _, n in sel[1:]) / (sel[-1][0] - sel[0][0])
    label = "kill" if args.kill else "sigterm" if args.sigterm else "equal"
    label = f"duty {args.duty:g}" if args.duty is not None else label
    print(
        f"| before {label} | {args.servers} | {args.step_s:g} | 1 | {args.steps} | "
        f"{r['drops_per_group']:.3f} | {late:.3f} | {max(x['lag_max'] for x in records):.0f} | "
        f"{rate:.1f} | {os.getloadavg()[0]:.1f} |",
        flush=True,
    )
    if args.kill or args.sigterm:
        print(
            f"| before {label} phases | {r['two_up']:.1f} | {r['one_up']:.1f} | "
            f"{r['rejoined']:.1f} | {r['restart_to_first_group_s']:.1f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
