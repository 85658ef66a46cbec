"""Two trainer processes (jax.distributed, gloo, one CPU device each): process 0 alone pulls from the
servers and calls UpdateWeights; every process gets the same batch (host to host, never through
the devices), stats and synced version, trains the same batches in the prefetching loop from its
own shards, and writes its own half of the weights (no gather)."""

from __future__ import annotations

import json
import pathlib

import jax
import numpy as np
import portpicker
import pytest

from tests import workers
from tests.train import multihost_worker

REPO = pathlib.Path(__file__).resolve().parents[2]
WORKER = pathlib.Path(multihost_worker.__file__)
PUSH_WORKER = WORKER.with_name("multihost_push_worker.py")
TIMEOUT_S = 180


@pytest.mark.slow
def test_process_0_pulls_and_broadcasts_the_batch(tmp_path: pathlib.Path) -> None:
    port = portpicker.pick_unused_port()
    env = workers.cpu_env("--xla_force_host_platform_device_count=1")
    jobs = [([str(port), str(pid), str(tmp_path)], env) for pid in range(2)]
    workers.run_all(WORKER, jobs, TIMEOUT_S)

    facts = [json.loads((tmp_path / f"p{pid}.json").read_text()) for pid in range(2)]
    arrays = [dict(np.load(tmp_path / f"p{pid}.npz")) for pid in range(2)]
    for round_, (want_arrays, want_facts) in enumerate(multihost_worker.reference()):
        assert want_facts["groups"] == 3 and want_facts["stale_dropped"] == 1
        assert want_facts["duplicates"] == 1 and "routing" in want_arrays
        for pid in range(2):
            assert facts[pid][str(round_)] == json.loads(json.dumps(want_facts)), (pid, round_)
            for key, value in want_arrays.items():
                got = arrays[pid][f"{round_}/{key}"]
                assert got.dtype == value.dtype, (pid, key)
                np.testing.assert_array_equal(got, value, err_msg=f"process {pid} {key}")
    # The loop, with prefetch: both processes trained the same two batches, the ones one process
    # makes, and each put only its own rows on its device.
    for n, want in enumerate(multihost_worker.reference_loop()):
        own = []
        for pid in range(2):
            np.testing.assert_array_equal(arrays[pid][f"loop/{n}/tokens"], want)
            rows = arrays[pid][f"loop/{n}/own_rows"]
            np.testing.assert_array_equal(arrays[pid][f"loop/{n}/own"], want[rows])
            own.append(rows)
        assert sorted(np.concatenate(own).tolist()) == list(range(want.shape[0])), own
        # Process 1 was sent only its own rows of the per-token fields, the [B] ones whole; the
        # host batch it made holds them, and 0s in process 0's rows.
        got, rows = arrays[1], own[1]
        assert got[f"recv/{n}/tokens_rows_sent"] == got[f"recv/{n}/routing_rows_sent"] == len(rows)
        assert got[f"recv/{n}/rewards_rows_sent"] == want.shape[0]
        np.testing.assert_array_equal(got[f"recv/{n}/tokens"][rows], want[rows])
        assert (
            not got[f"recv/{n}/tokens"][own[0]].any() and not got[f"recv/{n}/routing"][own[0]].any()
        )
    # Process 0's pull failed: it raised the pool's error, and process 1 raised it too (no hang).
    assert facts[0]["failure"] == "ConnectionError: server gone mid-Pull"
    assert facts[1]["failure"].startswith("RuntimeError: process 0 failed to make the batch")
    assert facts[1]["failure"].endswith("ConnectionError: server gone mid-Pull")
    # Four batches were sent; those every reader had marked read were deleted as later ones went.
    assert 1 <= len(facts[0]["batches_left"]) <= 2, facts[0]["batches_left"]
    # Process 0 found its server at version 7 and pushed version 8 (new admission epoch); both
    # processes continue at version 8.
    assert facts[0]["synced"] == facts[1]["synced"] == [8, 8]
    [(version, path, new_epoch)] = facts[0]["pushes"]
    assert (version, new_epoch) == (8, True) and path.endswith("weights/v8")
    assert "pushes" not in facts[1]
    # Each process copied only its half to host, in bfloat16, and wrote about half of the bytes.
    half = multihost_worker.W_SIZE // 2 * 2
    assert facts[0]["host_bytes"] == facts[1]["host_bytes"] == [half]
    # Each process wrote its own half of the bytes in its own part (sharded weights), and process
    # 0's index names both parts.
    written = [_bytes_under_glob(pathlib.Path(path), f"shards-p{pid}-*.bin") for pid in range(2)]
    assert written == [half, half], written
    assert sum(written) >= 0.9 * _bytes_under(pathlib.Path(path)), written
    from sat_jax import params_io

    like = {"w": jax.numpy.zeros(multihost_worker.W_SIZE, jax.numpy.bfloat16)}
    back = params_io.load_params(pathlib.Path(path), like)
    want = multihost_worker.weights().astype(jax.numpy.bfloat16)
    np.testing.assert_array_equal(np.asarray(back["w"]), want)


def _bytes_under(root: pathlib.Path) -> int:
    return sum(f.stat().st_size for f in root.rglob("*") if f.is_file())


def _bytes_under_glob(root: pathlib.Path, pattern: str) -> int:
    return sum(f.stat().st_size for f in root.glob(pattern) if f.is_file())


@pytest.mark.slow
def test_pushes_go_on_while_a_checkpoint_commit_is_held(tmp_path: pathlib.Path) -> None:
    """Two processes, a push after every step, one background checkpoint (step 4, version v)
    whose commit is held open until the server has been told version v + 3: the loop keeps
    stepping and both processes keep saving, so the run ends; v + 3 and the last version are
    announced complete (both halves written) before the checkpoint commits, which it then does."""
    port = portpicker.pick_unused_port()
    env = workers.cpu_env("--xla_force_host_platform_device_count=1")
    jobs = [([str(port), str(pid), str(tmp_path), "event"], env) for pid in range(2)]
    workers.run_all(PUSH_WORKER, jobs, TIMEOUT_S)

    facts = [json.loads((tmp_path / f"push{pid}.json").read_text()) for pid in range(2)]
    v = facts[0]["ckpt_version"]
    assert facts[1]["ckpt_version"] == v and facts[0]["ckpt_step"] == 4
    for f in facts:  # held while v + 3 was made and pushed; committed afterwards
        assert f["steps_during_hold"] >= 3 and f["orbax_lock_held_at_release"], f
        assert f["committed"] == [4], f
    during = facts[0]["announced_during_hold"]
    assert during and max(during) >= v + 3 and during == sorted(set(during)), during
    announced = facts[0]["announced"]
    assert announced == sorted(set(announced)) and announced[-1] == facts[0]["final_version"]
    # The last announced version holds the params after its steps, both halves of them.
    assert facts[0]["last_announced_values"] == [announced[-1] - 1]
