"""The loop idle benchmark (benchmarks/loop_idle.py): its argument checks and a small run of the
real loop (4 groups of 2, the tiny preset) that reports the idle time it measured. No figure is
asserted: timing belongs in the benchmark's results, not in a test."""

import json
import pathlib
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

import loop_idle as bench  # noqa: E402


@pytest.mark.parametrize("argv", [["--steps", "1"], ["--repeats", "0"]])
def test_bad_arguments_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as e:
        bench.parse_args(argv)
    assert e.value.code == 2 and "--steps" in capsys.readouterr().err


@pytest.mark.slow  # compiles the tiny train step
def test_a_small_run_reports_idle_and_busy_time(tmp_path):
    out = tmp_path / "result.json"
    sets = ["rollout.batch_groups=4", "rollout.group_size=2"]
    argv = ["--preset", "tiny", "--steps", "2", "--repeats", "1", "--json", str(out)]
    bench.main_cli([*argv, *(a for s in sets for a in ("--set", s))])
    result = json.loads(out.read_text())
    assert result["prefetch"] is True and result["step_s"] > 0
    assert result["idle_s_per_step"] >= 0 and len(result["idle_frac_each"]) == 1
