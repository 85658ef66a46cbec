"""Soak: a rollout server and the trainer on the tiny setup for minutes, their memory sampled.

    python benchmarks/soak.py [--minutes 10] [--interval 10] [--warmup-minutes 2] [--out runs/soak]
                              [--config configs/arith_tiny.yaml] [--smoke] [k=v ...]

Starts ``python -m rollout_server`` (``train.local_server.LocalServer``) and ``python -m train``
against it (random initial weights: no supervised warm-up, no evaluation, ``train.steps`` far
beyond what the soak reaches, checkpoints and weight pushes as configured), both on the CPU with
one device. The soak clock starts at the trainer's first step (startup and compilation are not
timed); from then on both run for ``--minutes``. Every ``--interval`` seconds, from the start,
it samples the resident set size (``VmRSS`` of ``/proc/PID/status``) of both processes and the
trainer's step, then stops them (SIGTERM) and writes ``OUT/samples.csv`` and
``OUT/summary.json``.

Growth is measured after warm-up (the first ``--warmup-minutes`` of the soak): for each process,
``growth_pct`` = (RSS at the end − RSS at the first sample after warm-up) / that first RSS, and
``slope_mb_per_min``, a least-squares line over the samples after warm-up. The target is growth
below ``TARGET_PCT`` (10%) for both; the summary says whether it was met. A process that exits
early fails the soak (exit 1, with its log's tail). ``--smoke``: a 12-second soak, samples every
1.5 s, a 4-second warm-up (the test's mode; its growth figures mean little).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import os
import pathlib
import shutil
import signal
import statistics
import subprocess
import sys
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # `python benchmarks/soak.py` from anywhere
    sys.path.insert(0, str(REPO))

from train.local_server import LocalServer  # noqa: E402
from train.metrics import read_jsonl  # noqa: E402

TARGET_PCT = 10.0
SERVER_START_S = 600  # a loaded machine compiles the server's engine slowly
FIRST_STEP_S = 900  # the trainer's startup: init, compilation, the first batch
STOP_S = 30


@dataclasses.dataclass(frozen=True)
class Sample:
    """One sample: seconds since both processes started and since the trainer's first step (None
    before it), RSS in MiB."""

    elapsed_s: float
    soak_s: float | None
    phase: str  # "startup" (before the first step), "warmup" or "soak"
    server_rss_mb: float
    trainer_rss_mb: float
    trainer_step: int


def rss_mb(pid: int) -> float:
    """The resident set size of process ``pid`` in MiB (Linux ``/proc``)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"process {pid} has no VmRSS (exited?)")


def trainer_step(metrics_path: pathlib.Path) -> int:
    """The last step the trainer logged, 0 before its first."""
    if not metrics_path.exists():
        return 0
    return max((r["step"] for r in read_jsonl(str(metrics_path)) if "lag_max" in r), default=0)


def tail(path: pathlib.Path, lines: int = 20) -> str:
    """The last ``lines`` lines of a log file."""
    return "".join(path.read_text(errors="replace").splitlines(keepends=True)[-lines:])


class Soak:
    """The two processes of one soak and their samples; ``run`` drives it, ``stop`` ends both."""

    def __init__(self, args: argparse.Namespace, work: pathlib.Path):
        self.args, self.work = args, work
        self.metrics = work / "run" / "logs" / "metrics.jsonl"
        self.trainer_log = work / "trainer.log"
        self.server: LocalServer | None = None
        self.trainer: subprocess.Popen | None = None
        self.samples: list[Sample] = []
        self.started = time.monotonic()  # the server's start

    def overrides(self) -> list[str]:
        """The config overrides both processes share (paths inside ``work``)."""
        return [
            f"server.checkpoint_root={self.work}",
            f"server.state_dir={self.work / 'server'}",
            *self.args.overrides,
        ]

    def start(self) -> None:
        """Starts the server, waits for it, then starts the trainer against it."""
        overrides = self.overrides()
        self.started = time.monotonic()
        self.server = LocalServer(self.args.config, overrides, str(self.work / "server.log"))
        self.server.wait_ready(timeout_s=SERVER_START_S)
        cmd = [sys.executable, "-m", "train", "--config", self.args.config, *overrides]
        cmd += [
            f"train.client.servers=[{self.server.address}]",
            f"train.run_dir={self.work / 'run'}",
            "train.steps=100000000",
            "train.warmup.steps=0",
            "train.eval.problems=0",
        ]
        env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # one CPU device
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
        with open(self.trainer_log, "w") as log:
            self.trainer = subprocess.Popen(
                cmd, cwd=self.work, env=env, stdout=log, stderr=subprocess.STDOUT
            )
        print(f"# soak: trainer {' '.join(cmd[3:])}", file=sys.stderr, flush=True)

    def check_alive(self) -> None:
        """Raises RuntimeError (with the log's tail) if either process has exited."""
        self.server.check_alive()
        if self.trainer.poll() is not None:
            raise RuntimeError(
                f"the trainer exited with {self.trainer.returncode}; see {self.trainer_log}:\n"
                f"{tail(self.trainer_log)}"
            )

    def sample(self, t0: float | None) -> Sample | None:
        """Takes one sample (``t0``: monotonic time of the first step, None before it); None
        while a process reports no resident memory yet (a child between fork and exec)."""
        self.check_alive()
        now = time.monotonic()
        soak_s = None if t0 is None else round(now - t0, 1)
        warmup_s = 60 * self.args.warmup_minutes
        phase = "startup" if t0 is None else ("warmup" if soak_s < warmup_s else "soak")
        got = Sample(
            round(now - self.started, 1),
            soak_s,
            phase,
            round(rss_mb(self.server.proc.pid), 1),
            round(rss_mb(self.trainer.pid), 1),
            trainer_step(self.metrics),
        )
        if not (got.server_rss_mb > 0 and got.trainer_rss_mb > 0):
            return None
        self.samples.append(got)
        return got

    def run(self) -> None:
        """Samples every interval from the trainer's start until ``--minutes`` after its first
        step."""
        started = time.monotonic()
        t0 = None
        while True:
            tick = time.monotonic()
            if t0 is None and trainer_step(self.metrics) > 0:
                t0 = tick
            got = self.sample(t0)
            if got is not None:
                print(f"# {dataclasses.asdict(got)}", file=sys.stderr, flush=True)
            if t0 is None and tick - started > FIRST_STEP_S:
                raise RuntimeError(f"no trainer step after {FIRST_STEP_S}s: see {self.trainer_log}")
            if t0 is not None and tick - t0 >= 60 * self.args.minutes:
                return
            time.sleep(max(0.0, self.args.interval - (time.monotonic() - tick)))

    def stop(self) -> None:
        """Ends the trainer, then the server (each SIGTERM, SIGKILL after ``STOP_S``)."""
        if self.trainer is not None and self.trainer.poll() is None:
            self.trainer.send_signal(signal.SIGTERM)
            try:
                self.trainer.wait(STOP_S)
            except subprocess.TimeoutExpired:
                self.trainer.kill()
                self.trainer.wait()
        if self.server is not None:
            self.server.stop()


def growth(samples: list[Sample], field: str) -> dict[str, float]:
    """RSS figures of one process over the samples after warm-up (``field`` of `Sample`)."""
    after = [s for s in samples if s.phase == "soak"]
    if len(after) < 2:
        raise RuntimeError("fewer than 2 samples after warm-up: lengthen --minutes")
    first, last = getattr(after[0], field), getattr(after[-1], field)
    t = [s.soak_s / 60 for s in after]
    slope = statistics.linear_regression(t, [getattr(s, field) for s in after]).slope
    return {
        "rss_first_step_mb": next(getattr(s, field) for s in samples if s.phase != "startup"),
        "rss_after_warmup_mb": first,
        "rss_end_mb": last,
        "rss_max_mb": max(getattr(s, field) for s in after),
        "growth_pct": round(100 * (last - first) / first, 2),
        "slope_mb_per_min": round(slope, 3),
    }


def summarize(args: argparse.Namespace, samples: list[Sample]) -> dict:
    """The summary.json document: settings, per-process growth, steps, the verdict."""
    soak = [s for s in samples if s.phase != "startup"]
    procs = {name: growth(samples, f"{name}_rss_mb") for name in ("server", "trainer")}
    return {
        "minutes": args.minutes,
        "warmup_minutes": args.warmup_minutes,
        "interval_s": args.interval,
        "config": os.path.relpath(args.config, REPO),
        "overrides": args.overrides,
        "machine": f"{os.cpu_count()} CPUs, {sys.platform}",
        "samples": len(samples),
        "steps": [soak[0].trainer_step, soak[-1].trainer_step],
        **procs,
        "target_pct": TARGET_PCT,
        "within_target": all(p["growth_pct"] < TARGET_PCT for p in procs.values()),
    }


def write_outputs(out: pathlib.Path, samples: list[Sample], summary: dict) -> None:
    """``out/samples.csv`` (one row a sample) and ``out/summary.json``."""
    fields = [f.name for f in dataclasses.fields(Sample)]
    with open(out / "samples.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(dataclasses.asdict(s) for s in samples)
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0, help="soak length after step 1")
    parser.add_argument("--interval", type=float, default=10.0, help="seconds between samples")
    parser.add_argument("--warmup-minutes", type=float, default=2.0, help="left out of growth")
    parser.add_argument("--out", default=str(REPO / "runs" / "soak"), help="results directory")
    parser.add_argument("--config", default=str(REPO / "configs" / "arith_tiny.yaml"))
    parser.add_argument("--smoke", action="store_true", help="a 12 s soak (for the test)")
    parser.add_argument("overrides", nargs="*", help="dotted.key=value config overrides")
    args = parser.parse_args(argv)
    if args.smoke:
        args.minutes, args.interval, args.warmup_minutes = 12 / 60, 1.5, 4 / 60
    if args.minutes <= args.warmup_minutes or args.interval <= 0:
        parser.error("need --minutes > --warmup-minutes and --interval > 0")
    args.config = os.path.abspath(args.config)
    return args


def print_row(summary: dict) -> None:
    """The RESULTS.md row of this soak."""
    s, t = summary["server"], summary["trainer"]
    print(
        "| minutes | steps | server RSS after warm-up → end (MiB) | growth | trainer RSS after "
        "warm-up → end (MiB) | growth | < 10% |"
    )
    print("| ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    print(
        f"| {summary['minutes']:.3g} | {summary['steps'][0]}–{summary['steps'][1]} | "
        f"{s['rss_after_warmup_mb']:.0f} → {s['rss_end_mb']:.0f} | {s['growth_pct']:+.1f}% | "
        f"{t['rss_after_warmup_mb']:.0f} → {t['rss_end_mb']:.0f} | {t['growth_pct']:+.1f}% | "
        f"{'yes' if summary['within_target'] else 'no'} |"
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = pathlib.Path(args.out).resolve()
    work = out / "work"
    shutil.rmtree(work, ignore_errors=True)  # a fresh run: no checkpoint to resume from
    work.mkdir(parents=True)
    soak = Soak(args, work)
    try:
        soak.start()
        soak.run()
    except RuntimeError as e:
        print(f"soak failed: {e}", file=sys.stderr)
        return 1
    finally:
        soak.stop()
    summary = summarize(args, soak.samples)
    write_outputs(out, soak.samples, summary)
    print_row(summary)
    print(f"# samples: {out / 'samples.csv'}; summary: {out / 'summary.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
