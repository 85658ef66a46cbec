"""The comparison grid (benchmarks/grid.py): its method table, lag schedule and a two-cell smoke run."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

import grid  # noqa: E402


def test_methods_map_to_the_loss_configs():
    cfg, replay = grid.loss_config("GRPO")
    assert (cfg.ratio_level, cfg.sat.enabled, replay, cfg.tis_cap) == ("token", False, False, None)
    cfg, replay = grid.loss_config("GSPO+SAT+R3")
    assert (cfg.ratio_level, cfg.sat.enabled, replay) == ("sequence", True, True)
    assert (cfg.clip_low, cfg.clip_high) == (3e-4, 4e-4)
    cfg, replay = grid.loss_config("GRPO+TIS")
    assert (cfg.tis_cap, cfg.sat.enabled, replay) == (grid.TIS_CAP, False, False)
    cfg, _ = grid.loss_config("GSPO+DPPO-TV")
    assert cfg.dppo_tv_delta == grid.DPPO_TV_DELTA
    assert len(grid.METHODS) == 12 and len(set(grid.METHODS)) == 12


@pytest.mark.parametrize("name", ["PPO", "GRPO+", "GRPO+SAT+TIS", "grpo", "GRPO+R3+SAT"])
def test_unknown_method_is_named(name):
    with pytest.raises(ValueError, match="unknown grid method"):
        grid.loss_config(name)


def test_behavior_version_is_the_configured_lag():
    lags = lambda n: [u - grid.behavior_version(u, n) for u in range(1, 18)]
    assert lags(1) == [1] * 17  # one-step off-policy
    assert lags(8) == [1, 2, 3, 4, 5, 6, 7, 8] * 2 + [1]
    assert grid.behavior_version(0, 8) == 0
    # Published versions only ever move forward, at multiples of n.
    versions = [grid.behavior_version(u, 8) for u in range(40)]
    assert versions == sorted(versions) and all(v % 8 == 0 for v in versions)


def test_bad_arguments_exit_2_naming_the_argument(tmp_path):
    for argv, needle in (
        (["--lags", "0"], "--lags"),
        (["--steps", "0"], "--steps"),
        (["--methods", "PPO"], "unknown grid method"),
    ):
        with pytest.raises(SystemExit) as e:
            grid.main(["--out", str(tmp_path / "out"), *argv])
        assert e.value.code == 2, needle
    assert not (tmp_path / "out").exists()  # nothing written


def test_two_cell_smoke_run_writes_tables_and_pictures(tmp_path):
    out = tmp_path / "grid"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # one device, as users run it
    cmd = [
        sys.executable,
        str(REPO / "benchmarks" / "grid.py"),
        "--out",
        str(out),
        "--steps",
        "4",
        "--seeds",
        "1",
        "--lags",
        "2",
        "--methods",
        "GRPO+SAT+R3",
        "GSPO+TIS",
        "--workers",
        "1",
        "--eval-every",
        "2",
        "--eval-problems",
        "16",
        "--set",
        "train.warmup.steps=0",
        "rollout.batch_groups=4",
        "rollout.group_size=4",
    ]
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    table = (out / "grid.md").read_text()
    assert "| GRPO+SAT+R3 |" in table and "| GSPO+TIS |" in table
    assert (out / "grid_accuracy.png").stat().st_size > 0
    assert (out / "grid_mismatch.png").stat().st_size > 0
    lines = (out / "cells" / "GRPO+SAT+R3_lag2_seed0.jsonl").read_text().splitlines()
    head, records = json.loads(lines[0]), [json.loads(x) for x in lines[1:]]
    assert head["cell"] == {"method": "GRPO+SAT+R3", "lag": 2, "seed": 0}
    steps = [r for r in records if "lag" in r]
    assert [r["lag"] for r in steps] == [0, 1, 2, 1]
    assert all("router_shift_ratio" in r and "mismatch_abs_mean" in r for r in steps)
    assert steps[0]["mismatch_abs_mean"] < 1e-5  # lag 0: behavior = current weights
    assert [r["step"] for r in records if "accuracy" in r] == [0, 2, 4]
    # A rerun finds every cell finished and only rebuilds the report.
    mtimes = sorted(p.stat().st_mtime_ns for p in (out / "cells").iterdir())
    again = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "(2 finished before)" in again.stdout
    assert sorted(p.stat().st_mtime_ns for p in (out / "cells").iterdir()) == mtimes


def test_sat_reach_is_where_the_contracted_window_still_bites():
    import math

    assert grid.sat_reach("GRPO+SAT") == pytest.approx(-math.log(0.8))  # the wider, low side
    assert grid.sat_reach("GSPO+SAT+R3") == pytest.approx(math.log1p(4e-4))
