"""Worker processes of a benchmark (`grid.py`, `frontier.py`, `weight_push.py`): each started in
its own process group, and all of them ended and reaped when the block exits, however it exits.

    with worker_group.WorkerGroup() as group:
        for w in range(n):
            group.start([sys.executable, __file__, "--worker", f"{w}/{n}"], env=env)
        codes = group.wait()

Ending is SIGTERM to each worker's process group (what it started goes too), then SIGKILL to the
groups still alive after `grace_s`; every worker is waited for, so none is left a zombie. A
Ctrl-C reaches only the parent (the workers sit in their own sessions), which then ends them
this way.

Imported by path like the other benchmarks (`sys.path` holds `benchmarks/`), never as a package.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Sequence
from typing import Any


def single_core_env() -> dict[str, str]:
    """`os.environ` with XLA's CPU thread pool off: one core per worker, so n workers do not
    oversubscribe an n-core machine."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = (
        env.get("XLA_FLAGS", "")
        + " --xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
    ).strip()
    return env


class WorkerGroup:
    """Worker processes started by `start`, ended by `stop` (on leaving the `with` block).

    Args:
      grace_s: how long workers may take to exit after SIGTERM before they are killed.
    """

    def __init__(self, *, grace_s: float = 10.0):
        self.grace_s = grace_s
        self.procs: list[subprocess.Popen] = []

    def start(self, cmd: Sequence[str], **popen_kwargs: Any) -> subprocess.Popen:
        """Starts `cmd` (`subprocess.Popen` arguments besides) as the leader of a new process
        group."""
        proc = subprocess.Popen(list(cmd), start_new_session=True, **popen_kwargs)
        self.procs.append(proc)
        return proc

    def wait(self) -> list[int]:
        """Waits for every worker; returns their exit codes in start order."""
        return [p.wait() for p in self.procs]

    def stop(self) -> None:
        """SIGTERM to the groups of the workers still running, SIGKILL to those left after
        `grace_s`, and every worker reaped."""
        running = [p for p in self.procs if p.poll() is None]
        for p in running:
            _signal_group(p, signal.SIGTERM)
        deadline = time.monotonic() + self.grace_s
        for p in running:
            try:
                p.wait(timeout=max(deadline - time.monotonic(), 0.0))
            except subprocess.TimeoutExpired:
                _signal_group(p, signal.SIGKILL)
                p.wait()
        for p in self.procs:
            p.wait()  # the ones that had exited: reaped already, returns at once

    def __enter__(self) -> WorkerGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _signal_group(proc: subprocess.Popen, sig: signal.Signals) -> None:
    try:
        os.killpg(proc.pid, sig)  # the worker leads its group: its pgid is its pid
    except ProcessLookupError:  # the whole group exited meanwhile
        pass
