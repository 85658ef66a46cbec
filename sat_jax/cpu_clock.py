"""CPU seconds a process spent and the machine's steal time, for per-step accounting.

`cpu_seconds` is the process's own accounting (user + system, every thread, from the kernel via
`os.times`); `steal_seconds` is the machine's steal column of ``/proc/stat`` (time a hypervisor
ran something else while a vCPU of this machine wanted to run), summed over its CPUs, or None
where the kernel does not report it (another OS, a kernel without the column): a missing figure
is reported as missing, never as 0. `CpuWindow` takes both over consecutive windows (the
trainer's steps, the rollout server's Stats), docs/DESIGN.md §4.
"""

from __future__ import annotations

import os

PROC_STAT = "/proc/stat"
_STEAL_FIELD = 8  # "cpu user nice system idle iowait irq softirq steal ...": the 8th number


def cpu_seconds() -> float:
    """User + system CPU seconds of this process so far (all its threads)."""
    t = os.times()
    return t.user + t.system


def steal_seconds(path: str = PROC_STAT) -> float | None:
    """The machine's steal time so far, in seconds (all CPUs), or None when `path` is missing or
    its aggregate ``cpu`` line has no steal column."""
    try:
        with open(path) as f:
            first = f.readline().split()
    except OSError:
        return None
    if not first or first[0] != "cpu" or len(first) <= _STEAL_FIELD:
        return None
    try:
        ticks = int(first[_STEAL_FIELD])
    except ValueError:
        return None
    return ticks / os.sysconf("SC_CLK_TCK")


class CpuWindow:
    """CPU and steal seconds over consecutive windows: `lap()` returns those since the last
    `lap()` (or since construction) and starts the next window.

    Args:
      stat_path: the ``/proc/stat`` to read steal from (tests pass a file of their own).
    """

    def __init__(self, stat_path: str = PROC_STAT):
        self._path = stat_path
        self._cpu = cpu_seconds()
        self._steal = steal_seconds(stat_path)

    def lap(self) -> tuple[float, float | None]:
        """(CPU seconds of this process, the machine's steal seconds or None) since the last
        lap."""
        cpu, steal = cpu_seconds(), steal_seconds(self._path)
        d_cpu = cpu - self._cpu
        d_steal = None if steal is None or self._steal is None else steal - self._steal
        self._cpu, self._steal = cpu, steal
        return d_cpu, d_steal
