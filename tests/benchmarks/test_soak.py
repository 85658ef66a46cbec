"""The soak (benchmarks/soak.py): its growth figures on synthetic samples, its argument checks, and
the ``--smoke`` run (a real server and trainer, 12 s after the first step)."""

import csv
import json
import os
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

import soak  # noqa: E402


def samples(server: list[float], trainer: list[float], *, startup: int = 1) -> list[soak.Sample]:
    """Samples 10 s apart: ``startup`` before the first step, then a 20 s warm-up, then the soak."""
    out = []
    for i, (s, t) in enumerate(zip(server, trainer, strict=True)):
        soak_s = None if i < startup else 10.0 * (i - startup)
        phase = "startup" if soak_s is None else ("warmup" if soak_s < 20 else "soak")
        out.append(soak.Sample(10.0 * i, soak_s, phase, s, t, max(0, i - startup)))
    return out


def test_growth_is_measured_from_the_first_sample_after_warm_up():
    # Startup and warm-up samples (100, 400, 500) are left out; after it 1000 → 1050 = +5%.
    got = soak.growth(samples([100, 400, 500, 1000, 1100, 1050], [0] * 6), "server_rss_mb")
    assert got["rss_first_step_mb"] == 400
    assert (got["rss_after_warmup_mb"], got["rss_end_mb"], got["rss_max_mb"]) == (1000, 1050, 1100)
    assert got["growth_pct"] == 5.0
    # Least squares through (1/3 min, 1000), (1/2 min, 1100), (2/3 min, 1050): 150 MiB/min.
    assert got["slope_mb_per_min"] == pytest.approx(150.0)


def test_summary_verdict_needs_both_processes_under_the_target():
    args = soak.parse_args(["--minutes", "1", "--warmup-minutes", "0.3"])
    flat = samples([500] * 6, [800, 800, 800, 800, 820, 840])  # trainer +5%
    assert soak.summarize(args, flat)["within_target"]
    leaking = samples([500, 500, 500, 500, 530, 560], [800] * 6)  # server +12%
    summary = soak.summarize(args, leaking)
    assert summary["server"]["growth_pct"] == 12.0 and not summary["within_target"]
    assert summary["steps"] == [0, 4]


def test_too_few_samples_after_warm_up_is_an_error():
    with pytest.raises(RuntimeError, match="fewer than 2 samples after warm-up"):
        soak.growth(samples([1, 2, 3, 4], [1, 2, 3, 4]), "trainer_rss_mb")


def test_bad_arguments_exit_2(capsys):
    with pytest.raises(SystemExit) as e:
        soak.parse_args(["--minutes", "1", "--warmup-minutes", "2"])
    assert e.value.code == 2
    assert "need --minutes > --warmup-minutes" in capsys.readouterr().err


def test_rss_of_an_exited_process_is_an_error():
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], stdout=-1)
    with pytest.raises((RuntimeError, FileNotFoundError)):
        soak.rss_mb(int(proc.stdout))
    assert soak.rss_mb(os.getpid()) > 1  # this process: a few MiB at least


def processes_mentioning(text: str) -> list[int]:
    """The pids whose command line contains ``text``."""
    found = []
    for entry in pathlib.Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and text in (entry / "cmdline").read_text(errors="replace"):
                found.append(int(entry.name))
        except OSError:
            continue  # exited meanwhile
    return found


@pytest.mark.slow
def test_smoke_run_samples_both_processes_and_writes_its_outputs(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "soak.py"), "--smoke", "--out", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=840,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "| minutes | steps |" in proc.stdout
    with open(tmp_path / "samples.csv") as f:
        rows = list(csv.DictReader(f))
    phases = [r["phase"] for r in rows]
    assert phases == sorted(phases, key=["startup", "warmup", "soak"].index)
    assert phases.count("soak") >= 2
    assert all(float(r["server_rss_mb"]) > 0 and float(r["trainer_rss_mb"]) > 0 for r in rows)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"][1] > summary["steps"][0] >= 1  # the trainer kept stepping
    for name in ("server", "trainer"):
        assert summary[name]["rss_end_mb"] > 0
    assert processes_mentioning(str(tmp_path / "work")) == []  # server and trainer stopped
