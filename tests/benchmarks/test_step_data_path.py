"""The per-step data path benchmark (benchmarks/step_data_path.py): its argument checks and a
small run (4 groups of 2, KL on; 8 rows for the 8 simulated devices) whose batch crosses host →
device once, with nothing coming back but the metrics."""

import json
import pathlib
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

import step_data_path as bench  # noqa: E402


@pytest.mark.parametrize("argv", [["--repeats", "0"], ["--warmup", "-1"]])
def test_bad_arguments_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as e:
        bench.parse_args(argv)
    assert e.value.code == 2 and "--repeats" in capsys.readouterr().err


def test_a_small_run_times_every_phase_and_moves_the_batch_once(tmp_path):
    out = tmp_path / "result.json"
    sets = ["rollout.batch_groups=4", "rollout.group_size=2", "train.length_bucket=0"]
    argv = ["--repeats", "2", "--warmup", "1", "--json", str(out)]
    bench.main_cli([*argv, *(a for s in sets for a in ("--set", s))])
    result = json.loads(out.read_text())
    assert set(result["median_ms"]) == {"decode", "assemble", "shard", "step", "total"}
    assert set(result["trainer_cpu_s_per_1000_groups"]) == {"decode", "assemble"}
    assert all(ms > 0 for ms in result["median_ms"].values()) and result["repeats"] == 2
    # 8 rows of T = 24: tokens, mask, behavior log-probs [8, 24] 4 bytes each, routing
    # [8, 24, 2, 2] uint8, the lag-0 mask [8, 24] uint8, rewards and group ids [8] 4 bytes each;
    # no advantages or reference log-probs, and nothing back.
    rows, t = 8, 24
    h2d = 3 * rows * t * 4 + rows * t * 4 + rows * t + 2 * rows * 4
    assert result["bytes"] == {"h2d": h2d, "d2h": 0}
