"""The elastic rollout fleet, live (docs/DESIGN.md §6.3, §6.5): stale drops per trained group and
trained completion tokens/s with k rollout server processes, generation faster or slower than
training, servers of equal or unequal speed, a SIGTERM drain and a kill/rejoin.

    PYTHONPATH=$PWD python benchmarks/fleet.py --servers 1 2 4 --steps 40 --step-s 0.5
    PYTHONPATH=$PWD python benchmarks/fleet.py --servers 2 --steps 40 --step-s 0 --duty 0.5
    PYTHONPATH=$PWD python benchmarks/fleet.py --servers 2 --steps 60 --sigterm    # or --kill
    PYTHONPATH=$PWD python benchmarks/fleet.py --servers 1 2 4 --steps 20 --compare-per-server

The trainer's loop runs in this process against ``--servers`` rollout server processes
(configs/arith_tiny.yaml: ``--staleness`` (max_staleness, default 1), ``--batch-groups`` groups of
``--group-size`` per batch, ``--max-new-tokens``) with a stand-in step that only takes
``--step-s`` seconds, dispatched at once like a jitted step (the loop pulls the next batch while
it runs, ``train.prefetch``, and waits for it when it reads the step's metrics): 0.5 s outpaces nothing (generation faster than training, admission alone
bounds staleness), 0 makes every group take longer than a step (the regime of issue 33, and of a
pod: a group spans several versions).

- ``--duty F``: the first server is stopped (SIGSTOP) for (1 − F) of every ``--duty-period``
  seconds and continued (SIGCONT) for the rest: a server about F times as fast as the others.
- ``--kill``: the second server is SIGKILLed after a quarter of the steps and restarted (same
  port and state_dir) at half of them; the loop waits at the next step for it to rejoin.
- ``--sigterm``: the same, with SIGTERM (a preemption notice: the server drains, exits 0) in place
  of the SIGKILL; reports its exit status and the seconds from the SIGTERM to its exit.
- ``--pause S``: the second server is stopped (SIGSTOP) for S seconds after a third of the steps,
  then continued (a preempted VM, a GC pause, a stuck disk); reports the steps/s before and while
  it is stopped, the stale drops in the 10 s after it resumes, and the steps from its resume until
  the pool counts it current again.
- ``--compare-per-server``: also runs each k with every server sent a share of 1 (each counting
  only its own groups: what servers did before ``admission_share``, issue 21).

The pool is the trainer's own (``train.setup.connect``: its quotas, seats and leases).

Per run: stale drops per trained group over the whole run and after the first ``WARMUP`` steps
(the servers' first compilations), the largest lag trained, trained completion tokens/s from the
third step on (with ``--kill``/``--sigterm`` per phase: two servers, one gone (from the 3rd step
after it), after it rejoined (from the 3rd step after its first group pulled)), and the 1-minute
load average at the end. Prints a Markdown table row per run.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import pathlib
import signal
import sys
import tempfile
import threading
import time

import jax
import numpy as np
from flax import nnx

from sat_jax import sharding
from sat_jax.experiment import load_config
from sat_jax.model import placement
from sat_jax.step import TrainState
from train import checkpointing, main, metrics, remote, setup, weight_sync
from train.local_server import LocalServer

REPO = pathlib.Path(__file__).resolve().parents[1]
CONFIG = str(REPO / "configs" / "arith_tiny.yaml")
WARMUP = 5  # steps left out of the "after warm-up" drops: the servers' first compilations


def _overrides(tmp: pathlib.Path, args: argparse.Namespace) -> list[str]:
    return [
        f"rollout.max_staleness={args.staleness}",
        f"rollout.batch_groups={args.batch_groups}",
        f"rollout.group_size={args.group_size}",
        f"rollout.max_new_tokens={args.max_new_tokens}",
        "server.slots=4",
        f"server.checkpoint_root={tmp}",
        "train.checkpoint.every=1000",
        "train.eval.problems=0",
        "train.client.grace_s=2",
        "train.client.wait_s=300",
        f"train.run_dir={tmp / 'run'}",
    ]


def _params(cfg) -> dict:
    abstract = nnx.to_pure_dict(placement.abstract_model(cfg.model)[1])
    rng = np.random.default_rng(0)
    return jax.tree.map(
        lambda x: jax.device_put((0.1 * rng.standard_normal(x.shape)).astype(x.dtype)), abstract
    )


class _Done:
    """A stand-in step's ``step_skipped``: reading it (``jax.device_get`` in the loop's
    ``finish_step``) waits until the step's time is up, as reading a dispatched step's metrics
    waits for the device; records (time, completion tokens) of its batch in ``trained`` then."""

    def __init__(self, end: float, tokens: int, trained: list):
        self._end, self._tokens, self._trained = end, tokens, trained

    def __array__(self, dtype=None, copy=None):
        left = self._end - time.monotonic()
        if left > 0:
            time.sleep(left)
        if self._trained is not None:
            self._trained.append((time.monotonic(), self._tokens))
            self._trained = None
        return np.asarray(False, dtype=dtype)


def _step(seconds: float, hooks: dict, trained: list):
    """A stand-in train step: runs ``hooks[k]`` before the k-th call and takes ``seconds``.
    Like a jitted step it returns at once (dispatched): the loop starts the next batch's pull
    (``train.prefetch``) and then waits for the step by reading its metrics (``_Done``)."""
    calls = [0]

    def step(state: TrainState, batch):
        calls[0] += 1
        if calls[0] in hooks:
            hooks[calls[0]]()
        tokens = int(np.asarray(batch.loss_mask).sum())
        done = _Done(time.monotonic() + seconds, tokens, trained)
        return state.replace(step=state.step + 1), {"step_skipped": done}

    return step


class _PerServerPool(remote.ServerPool):
    """Sends every server a share of 1: each counts only its own groups (before issue 21)."""

    def _update_request(self, version, path, new_epoch, share, base_path=""):
        return super()._update_request(version, path, new_epoch, 1.0, base_path)


class _DutyCycle:
    """Stops ``proc`` (SIGSTOP) for (1 − duty) of every ``period_s`` and continues it for the
    rest, on a thread, until closed (which continues it)."""

    def __init__(self, proc, duty: float, period_s: float):
        self._proc, self._duty, self._period = proc, duty, period_s
        self.stops: list[float] = []  # when each SIGSTOP was sent
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _signal(self, sig: int) -> None:
        if self._proc.poll() is None:
            os.kill(self._proc.pid, sig)

    def _run(self) -> None:
        while not self._closed.is_set():
            self._signal(signal.SIGSTOP)
            self.stops.append(time.monotonic())
            if self._closed.wait((1 - self._duty) * self._period):
                break
            self._signal(signal.SIGCONT)
            self._closed.wait(self._duty * self._period)
        self._signal(signal.SIGCONT)

    def close(self) -> None:
        self._closed.set()
        self._thread.join()
        self._signal(signal.SIGCONT)


def _rate(trained: list[tuple[float, int]], lo: float, hi: float) -> float:
    """Trained completion tokens/s over the steps that ended in [lo, hi) (the first one's
    tokens left out: it marks the window's start)."""
    sel = [(t, n) for t, n in trained if lo <= t < hi]
    if len(sel) < 2:
        return float("nan")
    return sum(n for _, n in sel[1:]) / (sel[-1][0] - sel[0][0])


class _Fault:
    """SIGKILLs (``kind`` "kill") or SIGTERMs ("sigterm") the second server after a quarter of
    the steps, restarts it (same port and state_dir) at half of them and waits at the next step
    for it to rejoin (its start-up takes longer than the steps left on a loaded machine); times
    its exit and its first group pulled after the restart, and the tokens/s of each phase."""

    def __init__(self, kind: str, servers: list[LocalServer], steps: int):
        self.kind, self.server = kind, servers[1]
        self.pool: remote.ServerPool | None = None
        self.marks: dict[str, float] = {}
        self._exit: threading.Thread | None = None
        self.hooks = {steps // 4: self._take_out, steps // 2: self._restart}
        self.hooks[steps // 2 + 1] = self._wait_for_rejoin

    def _take_out(self) -> None:
        self.marks["out"] = time.monotonic()
        if self.kind == "kill":
            self.server.proc.kill()
        else:
            self.server.proc.send_signal(signal.SIGTERM)
        self._exit = threading.Thread(target=self._watch_exit, args=(self.server.proc,))
        self._exit.start()

    def _watch_exit(self, proc) -> None:
        self.marks["returncode"] = proc.wait()
        self.marks["exited_after_s"] = time.monotonic() - self.marks["out"]

    def _restart(self) -> None:
        self._exit.join()
        self.server.restart_if_exited()
        self.marks["restarted"] = time.monotonic()
        self.marks["pulled_before"] = self.pool.metrics()["pulled_1"]

    def _wait_for_rejoin(self) -> None:
        while self.pool.metrics()["servers_up"] < 2:
            time.sleep(0.1)

    def watch(self, pool: remote.ServerPool) -> None:
        """Wraps ``pool.pull`` to note when the restarted server's first group is pulled."""
        self.pool, real_pull = pool, pool.pull

        def pull(*args, **kwargs):
            got = real_pull(*args, **kwargs)
            m = self.marks
            if "restarted" in m and "first" not in m:
                if pool.metrics()["pulled_1"] > m["pulled_before"]:
                    m["first"] = time.monotonic()
            return got

        pool.pull = pull

    def figures(self, trained: list[tuple[float, int]]) -> dict:
        m = self.marks
        start = trained[2][0] if len(trained) > 2 else 0  # the first, compiling steps left out
        after_out = [t for t, _ in trained if t >= m["out"]][3:4]  # the grace is over
        rejoined = m.get("first", float("nan"))
        settled = [t for t, _ in trained if t >= rejoined][3:4]  # 3 steps after its first group
        return {
            "two_up": _rate(trained, start, m["out"]),
            "one_up": _rate(trained, after_out[0], m["restarted"]) if after_out else np.nan,
            "rejoined": _rate(trained, settled[0], float("inf")) if settled else np.nan,
            "restart_to_first_group_s": rejoined - m["restarted"],
            "returncode": m["returncode"],
            "exited_after_s": m["exited_after_s"],
        }


class _Pause:
    """SIGSTOPs the second server at step ``steps // 3`` for ``seconds``, then SIGCONTs it, on a
    thread; notes when the pool counts it current again (no server lagging) after the resume."""

    def __init__(self, servers: list[LocalServer], steps: int, seconds: float):
        self.server, self.seconds = servers[1], seconds
        self.pool: remote.ServerPool | None = None
        self.marks: dict[str, float] = {}
        self.hooks = {steps // 3: self._stop}
        self._thread: threading.Thread | None = None

    def _stop(self) -> None:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        os.kill(self.server.proc.pid, signal.SIGSTOP)
        self.marks["stopped"] = time.monotonic()
        time.sleep(self.seconds)
        os.kill(self.server.proc.pid, signal.SIGCONT)
        self.marks["resumed"] = time.monotonic()
        while self.pool.metrics().get("servers_lagging", 0):
            time.sleep(0.01)
        self.marks["current"] = time.monotonic()

    def close(self) -> None:
        if self.server.proc.poll() is None:
            os.kill(self.server.proc.pid, signal.SIGCONT)
        if self._thread is not None:
            self._thread.join(timeout=60)

    def figures(self, trained: list[tuple[float, int]], records: list[dict]) -> dict:
        m = self.marks
        times = [t for t, _ in trained]
        stopped, resumed = m.get("stopped", np.nan), m.get("resumed", np.nan)
        start = times[2] if len(times) > 2 else np.nan
        before = [t for t in times if start <= t < stopped]
        during = [t for t in times if stopped <= t < resumed]
        # stale_dropped is cumulative and logged per step, in the order of `trained`.
        drops = [(t, r["stale_dropped"]) for t, r in zip(times, records, strict=False)]
        prior = max((d for t, d in drops if t < resumed), default=0)
        after = max((d for t, d in drops if t < resumed + 10.0), default=prior)
        current = m.get("current", np.nan)
        return {
            "steps_per_s_before": (len(before) - 1) / (before[-1] - before[0])
            if len(before) > 1
            else np.nan,
            "steps_per_s_stopped": len(during) / (resumed - stopped),
            "drops_10s_after_resume": after - prior,
            "steps_to_current": sum(resumed <= t < current for t in times),
        }


def _figures(k: int, records: list[dict], progress, trained: list[tuple[float, int]]) -> dict:
    """A run's figures from its metrics records, final progress and trained steps."""
    drops = [r["stale_dropped"] for r in records]
    late_drops = drops[-1] - drops[min(WARMUP, len(drops)) - 1]
    late_groups = sum(r["groups"] for r in records[WARMUP:])
    late = [t for t, _ in trained[WARMUP:]]
    return {
        "k": k,
        "late_window": (late[0], late[-1]) if len(late) > 1 else (np.nan, np.nan),
        "late_drops": late_drops,
        "late_groups": late_groups,
        # the groups of the steps that ended after the window's first (it marks the start)
        "window_groups": sum(r["groups"] for r in records[WARMUP + 1 :]),
        "drops_per_group": progress.stale_dropped / max(progress.groups_trained, 1),
        "late_drops_per_group": late_drops / max(late_groups, 1),
        "lag_max": max(r["lag_max"] for r in records),
        "tokens_per_s": _rate(trained, trained[2][0], float("inf")),
        "load": os.getloadavg()[0],
    }


def run(k: int, args: argparse.Namespace, *, fleet_budget: bool = True, fault: str = "") -> dict:
    """One run of ``args.steps`` steps against ``k`` fresh servers; ``fault``: "", "kill" or
    "sigterm" (of the second server, ``_Fault``). Returns the figures of the module docstring."""
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="fleet-"))
    overrides = _overrides(tmp, args)
    servers = [
        LocalServer(
            CONFIG, [*overrides, f"server.state_dir={tmp / f'state-{i}'}"], str(tmp / f"s{i}.log")
        )
        for i in range(k)
    ]
    trained: list[tuple[float, int]] = []
    faulted = _Fault(fault, servers, args.steps) if fault in ("kill", "sigterm") else None
    paused = _Pause(servers, args.steps, args.pause) if fault == "pause" else None
    hooks = faulted.hooks if faulted else paused.hooks if paused else {}
    duty = None
    try:
        for s in servers:
            s.wait_ready(timeout_s=300)
        addresses = ",".join(s.address for s in servers)
        cfg = load_config(
            CONFIG, [*overrides, f"train.client.servers=[{addresses}]", f"train.steps={args.steps}"]
        )
        if fleet_budget:  # the trainer's own pool
            pool = setup.connect(cfg, None, run="fleet-benchmark")
        else:
            pool = _PerServerPool(
                cfg.train.client.servers,
                background=True,
                batch_groups=cfg.rollout.batch_groups,
                **vars(setup.connection(cfg)),  # ServerPool's keyword arguments
            )
        _, _, weights_dir = setup.run_paths(cfg)
        state = TrainState(params=_params(cfg), opt_state=(), step=np.int32(0))
        progress = checkpointing.Progress(version=1, min_version=1, rng_key=(0, 0))
        writer = metrics.MetricsWriter(str(tmp / "logs"), total_steps=args.steps, console=None)
        push = lambda v, p: weight_sync.push_weights(pool, p, v, weights_dir)
        with pool, writer, weight_sync.WeightPusher(push) as pusher:
            progress = main.sync_weights(pool, state, progress, weights_dir)
            parts = main.LoopParts(
                pool=pool, pusher=pusher, ckpt=None, writer=writer, graphdef=None,
                step_fn=_step(args.step_s, hooks, trained),
                mesh=sharding.make_mesh(cfg.train.mesh, jax.devices()[:1]),
                spec=setup.batch_spec(cfg),
            )  # fmt: skip
            if faulted:
                faulted.watch(pool)
            if paused:
                paused.pool = pool
            if args.duty is not None:
                duty = _DutyCycle(servers[0].proc, args.duty, args.duty_period)
            _, progress = main.train_loop(cfg, parts, state, progress)
        records = metrics.read_jsonl(writer.jsonl_path)
    finally:
        if duty is not None:
            duty.close()
        if paused is not None:
            paused.close()
        for s in servers:
            s.stop()
    out = _figures(k, records, progress, trained)
    if duty is not None:
        lo, hi = out["late_window"]
        out["stops"] = sum(lo <= t < hi for t in duty.stops)
    if faulted:
        out.update(faulted.figures(trained))
    if paused:
        out.update(paused.figures(trained, records))
    return out


def _row(scenario: str, r: dict, args: argparse.Namespace) -> str:
    return (
        f"| {scenario} | {r['k']} | {args.step_s:g} | {args.staleness} | {args.steps} | "
        f"{r['drops_per_group']:.3f} | {r['late_drops_per_group']:.3f} | {r['lag_max']:.0f} | "
        f"{r['tokens_per_s']:.1f} | {r['load']:.1f} |"
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--servers", type=int, nargs="*", default=[1, 2])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--step-s", type=float, default=0.5)
    parser.add_argument("--staleness", type=int, default=1)
    parser.add_argument("--batch-groups", type=int, default=2)
    parser.add_argument("--group-size", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=6)
    parser.add_argument("--duty", type=float, help="the first server's duty cycle, in (0, 1)")
    parser.add_argument("--duty-period", type=float, default=1.0)
    faults = parser.add_mutually_exclusive_group()
    faults.add_argument("--kill", action="store_true", help="SIGKILL and restart the second")
    faults.add_argument("--sigterm", action="store_true", help="SIGTERM and restart the second")
    faults.add_argument(
        "--pause", type=float, help="SIGSTOP the second for this many seconds, then SIGCONT"
    )
    parser.add_argument("--compare-per-server", action="store_true")
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, checked; a bad value exits with code 2 naming its flag."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.steps < 2 * WARMUP:
        parser.error(f"--steps must be at least {2 * WARMUP}, got {args.steps}")
    if any(k < 1 for k in args.servers):
        parser.error(f"--servers must be >= 1, got {args.servers}")
    for flag, value in (("--step-s", args.step_s), ("--staleness", args.staleness)):
        if value < 0:
            parser.error(f"{flag} must be >= 0, got {value}")
    if args.duty is not None and not 0 < args.duty < 1:
        parser.error(f"--duty must be in (0, 1), got {args.duty}")
    if args.duty_period <= 0:
        parser.error(f"--duty-period must be > 0, got {args.duty_period}")
    if (args.kill or args.sigterm or args.pause is not None) and args.servers != [2]:
        parser.error(f"--kill, --sigterm and --pause need --servers 2, got {args.servers}")
    if args.pause is not None and args.pause <= 0:
        parser.error(f"--pause must be > 0, got {args.pause}")
    return args


def cli(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    fault = "kill" if args.kill else "sigterm" if args.sigterm else ""
    fault = "pause" if args.pause is not None else fault
    scenario = fault or (f"duty {args.duty:g}" if args.duty is not None else "equal")
    print(
        "| scenario | servers | step (s) | max_staleness | steps | stale drops / trained group |"
        f" after step {WARMUP} | max lag | trained tokens/s | load (1 min) |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    results = []
    for k in args.servers:
        if args.compare_per_server:
            print(_row("per-server budgets", run(k, args, fleet_budget=False), args), flush=True)
        results.append(run(k, args, fault=fault))
        print(_row(scenario, results[-1], args), flush=True)
    if args.duty is not None:
        r = results[-1]
        lo, hi = r["late_window"]
        print()
        print(f"| after step {WARMUP}: seconds | groups trained | groups / s | stops | stale drops |"
              " stale drops per stop |")  # fmt: skip
        print("| --- | --- | --- | --- | --- | --- |")
        print(f"| {hi - lo:.2f} | {r['window_groups']} | {r['window_groups'] / (hi - lo):.1f} | "
              f"{r['stops']} | {r['late_drops']} | {r['late_drops'] / max(r['stops'], 1):.2f} |")  # fmt: skip
    if fault == "pause":
        r = results[-1]
        print()
        print("| steps/s before | steps/s while stopped | of before | stale drops, 10 s after"
              " the resume | steps from the resume to current |")  # fmt: skip
        print("| --- | --- | --- | --- | --- |")
        print(f"| {r['steps_per_s_before']:.2f} | {r['steps_per_s_stopped']:.2f} | "
              f"{r['steps_per_s_stopped'] / r['steps_per_s_before']:.0%} | "
              f"{r['drops_10s_after_resume']} | {r['steps_to_current']} |")  # fmt: skip
    elif fault:
        r = results[-1]
        print()
        print("| trained tokens/s: two servers | one gone | after it rejoined |"
              " restart → first group pulled (s) | exit status | exited after (s) |")  # fmt: skip
        print("| --- | --- | --- | --- | --- | --- |")
        print(f"| {r['two_up']:.1f} | {r['one_up']:.1f} | {r['rejoined']:.1f} | "
              f"{r['restart_to_first_group_s']:.1f} | {r['returncode']} | "
              f"{r['exited_after_s']:.1f} |")  # fmt: skip
    sys.stdout.flush()


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        cli()
