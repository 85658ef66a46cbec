"""sat_jax.cpu_clock: the process's CPU seconds against its own accounting, and steal from
/proc/stat (None where it is not reported)."""

from __future__ import annotations

import os
import time

import pytest

from sat_jax import cpu_clock

TICK = 1 / os.sysconf("SC_CLK_TCK")


def _busy(cpu_s: float) -> float:
    """Spins until this process has used `cpu_s` more CPU seconds by `time.process_time`;
    returns the CPU seconds that clock counted (the loop's length is CPU work, not wall time)."""
    start = time.process_time()
    x = 0
    while time.process_time() - start < cpu_s:
        x += 1
    return time.process_time() - start


def test_cpu_seconds_counts_a_busy_loop_as_process_time_does():
    window = cpu_clock.CpuWindow()
    counted = _busy(0.3)
    cpu, _ = window.lap()
    # os.times counts in clock ticks; process_time to the nanosecond: a few ticks apart at most.
    assert cpu == pytest.approx(counted, abs=3 * TICK)
    again, _ = window.lap()  # a new window: the loop is not counted twice
    assert again < counted / 2


def _stat(tmp_path, first_line: str):
    path = tmp_path / "stat"
    path.write_text(first_line + "\ncpu0 1 2 3 4 5 6 7 8 9 10\n")
    return str(path)


def test_steal_seconds_reads_the_eighth_column(tmp_path):
    ticks = os.sysconf("SC_CLK_TCK")
    path = _stat(tmp_path, f"cpu  10 0 5 100 0 0 0 {3 * ticks} 0 0")
    assert cpu_clock.steal_seconds(path) == pytest.approx(3.0)


@pytest.mark.parametrize("line", ["cpu  10 0 5 100 0 0 0", "intr 5", ""])
def test_steal_seconds_is_none_when_not_reported(tmp_path, line):
    assert cpu_clock.steal_seconds(_stat(tmp_path, line)) is None


def test_steal_seconds_is_none_without_the_file(tmp_path):
    assert cpu_clock.steal_seconds(str(tmp_path / "missing")) is None


def test_window_steal_is_the_difference_or_none(tmp_path):
    ticks = os.sysconf("SC_CLK_TCK")
    path = tmp_path / "stat"
    path.write_text(f"cpu  1 0 1 1 0 0 0 {ticks} 0 0\n")
    window = cpu_clock.CpuWindow(str(path))
    path.write_text(f"cpu  1 0 1 1 0 0 0 {4 * ticks} 0 0\n")
    assert window.lap()[1] == pytest.approx(3.0)
    path.write_text("cpu  1 0 1 1 0 0 0\n")  # the column gone: None, not 0
    assert window.lap()[1] is None
