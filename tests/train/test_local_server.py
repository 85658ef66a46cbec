"""The local server child dies with the trainer: PR_SET_PDEATHSIG survives the exec."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.clock import wait_until

PARENT = """
import subprocess, sys, time
from train.local_server import _EXEC_WITH_PDEATHSIG
child = subprocess.Popen([sys.executable, "-c", _EXEC_WITH_PDEATHSIG, "-c", "import time; time.sleep(120)"])
print(child.pid, flush=True)
time.sleep(120)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split()[2] != "Z"


def _exec_done(pid: int) -> bool:
    """Whether the child runs the exec'd command (its argv is the sleep's alone)."""
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().split(b"\0")[1:3] == [b"-c", b"import time; time.sleep(120)"]


@pytest.mark.parametrize("sigint", ["default", "ignored"])
def test_child_gets_sigint_when_the_parent_is_killed(sigint):
    """Also when the trainer was started with SIGINT ignored (in the background by a shell
    script, or nohup): the child stops all the same."""
    trap = "trap '' INT; " if sigint == "ignored" else ""
    cmd = ["/bin/sh", "-c", f'{trap}exec "$0" -c "$1"', sys.executable, PARENT]
    parent = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    child = None
    try:
        child = int(parent.stdout.readline())
        wait_until(lambda: _exec_done(child))  # PDEATHSIG is set before the exec
        assert _alive(child)
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        deadline = time.monotonic() + 10
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(child)
    finally:
        if parent.poll() is None:
            parent.kill()
        if child is not None and _alive(child):
            os.kill(child, signal.SIGKILL)
