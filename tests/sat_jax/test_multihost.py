"""Two processes × 4 simulated CPU devices (jax.distributed, gloo) == one process × 8 devices.

Every side runs in a child process with the same compile flags; the children are always killed.
"""

from __future__ import annotations

import pathlib

import numpy as np
import portpicker
import pytest

from tests import workers
from tests.sat_jax import multihost_worker

REPO = pathlib.Path(__file__).resolve().parents[2]
WORKER = pathlib.Path(multihost_worker.__file__)
TIMEOUT_S = 180
# Same mesh, same program: only the cross-process collectives differ, so agreement is tight.
RTOL, ATOL = 1e-5, 1e-6
# The two LLVM flags only cut compile time (about 4x for these small programs); they change no
# float semantics, and both sides of the comparison use them.
FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"


def _env(devices: int) -> dict[str, str]:
    return workers.cpu_env(f"--xla_force_host_platform_device_count={devices} {FAST_COMPILE}")


def _run(jobs: list[tuple[list[str], dict[str, str]]]) -> None:
    workers.run_all(WORKER, jobs, TIMEOUT_S)


@pytest.mark.slow
def test_two_processes_match_one(tmp_path: pathlib.Path) -> None:
    port = portpicker.pick_unused_port()
    multi, single = tmp_path / "multi.npz", tmp_path / "single.npz"
    # Sequential: on two cores, three concurrent compiles are slower than two then one.
    _run([([str(port), str(pid), str(multi)], _env(4)) for pid in range(2)])
    _run([(["0", "0", str(single)], _env(8))])
    got, want = dict(np.load(multi)), dict(np.load(single))
    assert sorted(got) == sorted(want)
    assert any(k.startswith("param/layers/0/mlp/w_gate_edf") for k in want)
    for key, expected in want.items():
        np.testing.assert_allclose(got[key], expected, rtol=RTOL, atol=ATOL, err_msg=key)
