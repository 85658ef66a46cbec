"""Trainer processes (docs/DESIGN.md §7.3): in a two-process ``jax.distributed`` run, kill -9 of
one makes the other exit with an error naming the lost process (``train.peers``; JAX's own
heartbeat is set to 600 s in the workers, so nothing else could end it within the test's safety
limit), never a hang; relaunching both resumes from the last checkpoint, and every group is
trained exactly once across the two launches."""

from __future__ import annotations

import json
import pathlib
import signal
import subprocess
import sys

import portpicker
import pytest

from tests import workers
from tests.clock import wait_until
from tests.train import process_kill_worker
from train.peers import PEER_LOST_EXIT

WORKER = pathlib.Path(process_kill_worker.__file__)
SAFETY_S = 300  # generous: only a hang takes this long


def _start(port: int, pid: int, out: pathlib.Path, steps: int, *hold: int) -> subprocess.Popen:
    env = workers.cpu_env("--xla_force_host_platform_device_count=1")
    args = [sys.executable, str(WORKER), str(port), str(pid), str(out), str(steps), *map(str, hold)]
    return subprocess.Popen(
        args, cwd=workers.REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


@pytest.mark.slow
@pytest.mark.parametrize("killed", [1, 0])
def test_a_killed_trainer_process_stops_the_other_naming_it_and_a_relaunch_resumes(
    tmp_path, killed
):
    survivor, hold_at, steps = 1 - killed, 5, 8
    port = portpicker.pick_unused_port()
    procs = [_start(port, pid, tmp_path, steps, hold_at) for pid in range(2)]
    try:
        # Process 0 holds in step 5, after checkpoint 4 is committed by both processes.
        wait_until(
            lambda: (
                ((tmp_path / "holding").exists() and (tmp_path / "ckpt" / "4").is_dir())
                or any(p.poll() is not None for p in procs)
            ),
            timeout_s=SAFETY_S,
            interval_s=0.1,
        )
        assert all(p.poll() is None for p in procs), [p.communicate()[0][-3000:] for p in procs]
        procs[killed].send_signal(signal.SIGKILL)
        procs[killed].wait()
        out = procs[survivor].communicate(timeout=SAFETY_S)[0]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert procs[survivor].returncode == PEER_LOST_EXIT, out[-3000:]
    assert f"trainer process {killed} of 2 (host " in out, out[-3000:]
    assert "relaunch every trainer process to resume from the last checkpoint" in out
    acked_at_kill = json.loads((tmp_path / "acked.json").read_text())
    assert len(acked_at_kill) == 4 * process_kill_worker.B  # steps 1-4; step 5's not trained

    # Relaunch both: they resume from checkpoint 4 and finish.
    port = portpicker.pick_unused_port()
    jobs = [([str(port), str(pid), str(tmp_path), str(steps)], None) for pid in range(2)]
    env = workers.cpu_env("--xla_force_host_platform_device_count=1")
    workers.run_all(WORKER, [(args, env) for args, _ in jobs], SAFETY_S)
    done = [json.loads((tmp_path / f"done-{pid}.json").read_text()) for pid in range(2)]
    assert [d["resumed"] for d in done] == [4, 4] and [d["step"] for d in done] == [8, 8]
    assert done[0]["w"] == done[1]["w"] == [8.0] * 8  # one update per step, none twice
    # Exactly once across both launches: every group handed out was trained once, in order,
    # including step 5's, pulled before the kill and handed out again.
    keys = done[0]["keys"]
    acked = json.loads((tmp_path / "acked.json").read_text())
    assert keys == [f"/{i}" for i in range(steps * process_kill_worker.B)], keys
    assert acked == list(range(steps * process_kill_worker.B)), acked
