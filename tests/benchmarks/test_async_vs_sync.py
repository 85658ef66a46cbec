"""The async-vs-sync benchmark's accounting: install times from the server log, the per-run
breakdown and the bound that serial installs put on the overlap."""

from __future__ import annotations

import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks"))

import async_vs_sync as bench


def test_install_seconds_reads_every_swap_line():
    log = (
        "INFO:rollout_server.service:weights swapped: version 0 -> 1 from /r/weights/v1 "
        "(load 0.045s, swap 0.006s)\n"
        "INFO:rollout_server.rollout:throughput: 10.0 tokens/s\n"
        "INFO:rollout_server.service:weights swapped: version 1 -> 2 from /r/weights/v2 "
        "(load 0.100s, swap 0.010s)\n"
    )
    assert bench.install_seconds(log) == pytest.approx([0.051, 0.110])
    assert bench.install_seconds("nothing here\n") == []


def _records(n: int, period: float, wait: float, step: float, push: float | None) -> list[dict]:
    return [
        {"time": i * period, "pull_wait_s": wait, "step_s": step, "push_s": push} for i in range(n)
    ]


def test_breakdown_leaves_out_the_compiling_steps():
    records = _records(20, 0.5, 0.2, 0.3, 0.1)
    records[0].update(pull_wait_s=30.0, step_s=60.0, push_s=None)  # compiles
    got = bench.breakdown(bench.Run(records, [0.05] * 10))
    assert got["period"] == pytest.approx(0.5)
    assert got["pull_wait"] == pytest.approx(0.2) and got["step"] == pytest.approx(0.3)
    assert got["push"] == pytest.approx(0.1) and got["install"] == pytest.approx(0.05)
    assert got["installs_per_step"] == pytest.approx(0.5)


def test_serial_bound():
    sync = {"pull_wait": 0.24, "step": 0.22, "install": 0.04}
    # One install per step in series with generation: the server needs 0.28 s per batch.
    assert bench.serial_bound(sync, {"installs_per_step": 1.0}) == pytest.approx(0.24 / 0.28)
    # Installs every 8 steps: 0.245 s per batch.
    assert bench.serial_bound(sync, {"installs_per_step": 0.125}) == pytest.approx(0.24 / 0.245)
    # Trainer-bound: its step without the install it no longer waits for sets the period, and
    # that beats the ideal, which counted the install in the trainer's time.
    slow_train = {"pull_wait": 0.1, "step": 0.4, "install": 0.05}
    assert bench.serial_bound(slow_train, {"installs_per_step": 1.0}) == pytest.approx(0.4 / 0.35)


def test_staleness_bound():
    """The measured n = 1 figures of benchmarks/RESULTS.md (after issues 32 and 33): a push of
    0.100 s, batches of 0.132 s and steps of 0.107 s: two steps take at least 0.339 s."""
    sync = {"pull_wait": 0.132, "step": 0.161, "install": 0.022}
    n1 = {"step": 0.107, "push": 0.100, "installs_per_step": 1.0}
    assert bench.staleness_bound(sync, n1, 1) == pytest.approx(0.161 / (0.339 / 2))
    # At S = 8 the chain is spread over nine steps: the server's generation and installs bound it.
    assert bench.staleness_bound(sync, {**n1, "installs_per_step": 0.125}, 8) == pytest.approx(
        0.161 / (0.132 + 0.125 * 0.022)
    )
    assert bench.STALENESS == {"sync": 0, "async n=1": 1, "async n=8": 8}
