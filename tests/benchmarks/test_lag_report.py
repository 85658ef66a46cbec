"""The corrected large-lag study's tables (benchmarks/lag_report.py) on synthetic finished cells:
realized lags, updates at the lag, the paired differences, the sign test and the pooled rows."""

import json
import pathlib
import sys

import numpy as np
import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

import lag_report  # noqa: E402


def write_cell(
    out: pathlib.Path,
    method: str,
    lag: int,
    seed: int,
    finals: list[float],
    *,
    steps: int = 6,
    ess: float = 0.5,
) -> None:
    """One finished constant-lag cell: update u at lag min(u, lag), accuracy ``finals`` at steps
    0, 3 and 6, 10 active tokens per update."""
    head = {
        "cell": {"method": method, "lag": lag, "lr": 1e-3, "seed": seed, "lag_mode": "constant"},
        "seconds": 1.0,
        "reach": 0.2,
        "clip": [0.2, 0.2],
    }
    records = [{"step": 0, "accuracy": finals[0]}]
    for u in range(steps):
        r = {
            "step": u + 1,
            "lag": min(u, lag),
            "active_tokens": 10.0,
            "mismatch_abs_mean": 0.1,
            "loss": 0.0,
            "step_skipped": 0.0,
            "ess_sequence": ess,
            "ess_token": 0.9,
            "grad_norm": 1.0,
            "clip_frac_low": 0.01,
            "clip_frac_high": 0.02,
        }
        if u + 1 in (3, 6):
            r["accuracy"] = finals[1 if u + 1 == 3 else 2]
        records.append(r)
    (out / "cells").mkdir(parents=True, exist_ok=True)
    name = f"{method}_lag{lag}_constant_lr0.001_seed{seed}.jsonl"
    (out / "cells" / name).write_text("\n".join(json.dumps(x) for x in [head, *records]) + "\n")


@pytest.mark.parametrize(
    "wins,losses,p",
    [(0, 0, 1.0), (3, 0, 0.25), (0, 3, 0.25), (6, 0, 1 / 32), (5, 1, 14 / 64), (2, 2, 1.0)],
)
def test_sign_p_is_the_two_sided_exact_binomial(wins, losses, p):
    assert lag_report.sign_p(wins, losses) == pytest.approx(p)


def test_realized_lags_weigh_updates_by_tokens():
    got = lag_report.realized_lags(
        [{"lag": 0, "active_tokens": 1.0}, {"lag": 4, "active_tokens": 3.0}]
    )
    assert got["mean"] == pytest.approx(3.0)
    assert (got["p10"], got["p50"], got["max"]) == (0.0, 4.0, 4.0)


def test_pairs_are_per_seed_and_only_where_both_ran(tmp_path):
    for seed, (base, other) in enumerate([(0.20, 0.25), (0.22, 0.22), (0.24, 0.20)]):
        write_cell(tmp_path, "GRPO", 2, seed, [0.2, 0.2, base])
        write_cell(tmp_path, "X", 2, seed, [0.2, 0.2, other])
    write_cell(tmp_path, "X", 2, 7, [0.2, 0.2, 0.9])  # no GRPO seed 7: not a pair
    table = lag_report.cells([tmp_path])
    diff = lag_report.pairs(table, "GRPO")[("X", "constant", 2, 1e-3)]
    np.testing.assert_allclose(diff, [0.05, 0.0, -0.04], atol=1e-12)
    stats = lag_report.diff_stats(diff)
    assert (stats["wins"], stats["ties"], stats["losses"], stats["sign_p"]) == (1, 1, 1, 1.0)
    row = lag_report.paired_rows(table, "GRPO")[2]
    assert row.startswith("| X | constant | 2 | 0.001 | 3 | +0.003 (± 0.026) | 1-1-1 | 1 |")


def test_cell_rows_report_the_realized_lag_and_updates_at_it(tmp_path):
    write_cell(tmp_path, "GRPO", 2, 0, [0.2, 0.3, 0.1])  # lags 0, 1, 2, 2, 2, 2; collapsed
    table = lag_report.cells([tmp_path])
    row = lag_report.cell_rows(table)[2]
    # mean lag 9/6 = 1.5; 4 of 6 updates at lag 2; final 0.1 < 0.5 × best 0.3 at step 6
    assert row == (
        "| GRPO | constant | 2 | 0.001 | 1 | 1.5 (0/2/2, 2) | 67% | 4 | 0.100 | 0.100 | 0/1 | "
        "1/1 (6) |"
    )


def test_pooled_rows_add_the_lags_at_or_above_the_floor(tmp_path):
    for lag in (1, 32, 64):
        for seed in range(2):
            write_cell(tmp_path, "GRPO", lag, seed, [0.2, 0.2, 0.20])
            write_cell(tmp_path, "X", lag, seed, [0.2, 0.2, 0.25], steps=6)
    rows = lag_report.pooled_rows(lag_report.cells([tmp_path]), "GRPO", 32)
    assert rows[2].startswith("| X | constant | 0.001 | 32 64 | 4 | +0.050 (± 0.000) | 4-0-0 |")


def test_mechanism_means_the_updates_at_the_lag(tmp_path):
    write_cell(tmp_path, "GRPO", 2, 0, [0.2, 0.2, 0.2], ess=0.4)
    got = lag_report.mechanism(
        lag_report.cells([tmp_path])[("GRPO", "constant", 2, 1e-3)][0]["records"], 2
    )
    assert got["ess_sequence"] == pytest.approx(0.4)
    assert got["clip_frac"] == pytest.approx(0.03)
    assert np.isnan(got["m2po_masked_frac"])
    assert got["zero_grad"] == 0.0


def test_main_writes_json_and_refuses_an_empty_directory(tmp_path, capsys):
    write_cell(tmp_path, "GRPO", 2, 0, [0.2, 0.2, 0.2])
    lag_report.main([str(tmp_path), "--json", str(tmp_path / "r.json")])
    got = json.loads((tmp_path / "r.json").read_text())
    assert got["cells"][0]["seeds"]["0"]["updates_at_lag"] == 4
    assert "| GRPO | constant | 2 |" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="no finished cells"):
        lag_report.main([str(tmp_path / "empty")])
