"""Two trainer processes (jax.distributed, gloo, one CPU device each): process 0 alone pulls from the
servers and pushes weights; every process gets the same batch, stats and synced version."""

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
    # Process 0 found its server at version 7 and pushed version 8 (new admission epoch); both
    # processes continue at version 8.
    assert facts[0]["synced"] == facts[1]["synced"] == [8, 8]
    [(version, path, new_epoch)] = facts[0]["pushes"]
    assert (version, new_epoch) == (8, True) and path.endswith("weights/v8")
    from sat_jax import params_io

    back = params_io.load_params(pathlib.Path(path), {"w": jax.numpy.zeros(8, np.float32)})
    np.testing.assert_array_equal(np.asarray(back["w"]), np.arange(8, dtype=np.float32))
