"""benchmarks/worker_group.py: the benchmarks' worker processes end with their block, however it
exits: SIGTERM to each worker's process group, SIGKILL after the grace, every worker reaped."""

import pathlib
import signal
import subprocess
import sys
import time

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

import worker_group  # noqa: E402

SLEEP = [sys.executable, "-c", "import time; time.sleep(600)"]
# Ignores SIGTERM, says so, then sleeps: only SIGKILL ends it.
STUBBORN = [
    sys.executable,
    "-c",
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True);"
    " time.sleep(600)",
]
# Starts a grandchild (in the worker's process group), prints the grandchild's pid, then sleeps.
PARENT = [
    sys.executable,
    "-c",
    "import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c',"
    " 'import time; time.sleep(600)']); print(p.pid, flush=True); time.sleep(600)",
]


def _ended(pid: int) -> bool:
    """The process is gone, or a zombie (dead; whoever inherited it has not reaped it yet)."""
    try:
        fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return True
    return fields[0] in ("Z", "X")


def test_wait_returns_every_exit_code_in_start_order():
    with worker_group.WorkerGroup() as group:
        group.start([sys.executable, "-c", "raise SystemExit(3)"])
        group.start([sys.executable, "-c", "pass"])
        assert group.wait() == [3, 0]


def test_leaving_the_block_on_an_error_terminates_and_reaps_the_workers():
    with pytest.raises(RuntimeError), worker_group.WorkerGroup() as group:
        procs = [group.start(SLEEP), group.start(SLEEP)]
        raise RuntimeError("the parent failed")
    assert [p.returncode for p in procs] == [-signal.SIGTERM, -signal.SIGTERM]


def test_a_worker_that_ignores_sigterm_is_killed_after_the_grace():
    with worker_group.WorkerGroup(grace_s=0.2) as group:
        proc = group.start(STUBBORN, stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip() == "ready"  # its handler is installed
    proc.stdout.close()
    assert proc.returncode == -signal.SIGKILL


@pytest.mark.skipif(not pathlib.Path("/proc/self/stat").exists(), reason="needs /proc")
def test_what_a_worker_started_ends_with_it():
    with worker_group.WorkerGroup() as group:
        proc = group.start(PARENT, stdout=subprocess.PIPE, text=True)
        grandchild = int(proc.stdout.readline())
    proc.stdout.close()
    assert proc.returncode == -signal.SIGTERM
    deadline = time.monotonic() + 60  # a generous bound on signal delivery, not a timing check
    while not _ended(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _ended(grandchild), "the grandchild outlived its worker's group"
