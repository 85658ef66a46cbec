"""benchmarks/gpu_check.sh, the accelerator checks, run end to end at toy sizes (QUICK=1) on
whatever backend the tests have."""

import json
import os
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[2]


def test_gpu_check_script_writes_its_results(tmp_path):
    env = {**os.environ, "QUICK": "1", "PYTHON": sys.executable}
    proc = subprocess.run(
        ["bash", str(REPO / "benchmarks" / "gpu_check.sh"), str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads((tmp_path / "train_step.json").read_text())
    assert {(r["remat"], r["microbatches"]) for r in rows} == {
        ("none", 1),
        ("none", 4),
        ("layer", 1),
        ("layer", 4),
    }
    assert "bfloat16" in (tmp_path / "train_step.md").read_text()
    engine = (tmp_path / "engine.txt").read_text()
    assert "bfloat16" in engine and "MoEEngine decode" in engine
    assert float(engine.split("MoEEngine decode ")[1].split()[0]) > 0
    assert "jax" in (tmp_path / "devices.txt").read_text()


def test_gpu_check_script_fails_loudly_on_a_bad_interpreter(tmp_path):
    env = {**os.environ, "QUICK": "1", "PYTHON": str(tmp_path / "no-such-python")}
    proc = subprocess.run(
        ["bash", str(REPO / "benchmarks" / "gpu_check.sh"), str(tmp_path / "out")],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode != 0 and "no-such-python" in proc.stderr
