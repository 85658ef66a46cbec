"""The recipe benchmark's accounting: step means, per-batch sums, running counts, the accuracy
curve against wall-clock, and the tables (mean ± std over seeds)."""

from __future__ import annotations

import json
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks"))

import recipe as bench


def _write(path: pathlib.Path, records: list[dict]) -> pathlib.Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_summarize_reads_means_sums_running_counts_and_the_curve(tmp_path):
    records = [
        {"step": 0, "time": 100.0, "accuracy": 0.2},
        {"step": 1, "time": 101.0, "active_tokens": 5, "sampler_kl": 1e-3, "sat_q": 0.5,
         "groups_filtered": 2.0, "stale_dropped": 1.0},
        {"step": 2, "time": 103.0, "active_tokens": 5, "sampler_kl": 3e-3, "sat_q": 0.7,
         "groups_filtered": 1.0, "stale_dropped": 4.0},
        {"step": 2, "time": 110.0, "accuracy": 0.35},
    ]  # fmt: skip
    s = bench.summarize(_write(tmp_path / "m.jsonl", records), wall_s=12.0)
    assert s["steps"] == 2 and s["wall_s"] == 12.0
    assert s["sampler_kl"] == pytest.approx(2e-3) and s["sat_q"] == pytest.approx(0.6)
    assert s["groups_filtered"] == 3.0  # per batch: summed
    assert s["stale_dropped"] == 4.0  # a running count: its last value
    assert s["mismatch_abs_mean"] is None  # not logged
    assert (s["accuracy_before"], s["accuracy_after"]) == (0.2, 0.35)
    assert s["curve"] == [(0.0, 0, 0.2), (10.0, 2, 0.35)]


def test_report_tables_give_mean_and_std_over_seeds(tmp_path):
    def cell(variant, seed, **values):
        base = {"variant": variant, "seed": seed, "curve": [(0.0, 0, 0.2), (50.0, 10, 0.3)]}
        return base | values

    cells = [
        cell("top_p0.9-truncated", 0, sampler_kl=1e-7, accuracy_after=0.3),
        cell("top_p0.9-truncated", 1, sampler_kl=3e-7, accuracy_after=0.4),
        cell("filter-all_equal", 0, wall_s=100.0, groups_filtered=7.0, accuracy_after=0.5),
    ]
    text = bench.report(tmp_path, cells)
    row = next(line for line in text.splitlines() if line.startswith("| truncated |"))
    assert "| 2 |" in row and "2.00e-07 ± 1.41e-07" in row and "0.350 ± 0.071" in row
    row = next(line for line in text.splitlines() if line.startswith("| all_equal |"))
    assert "| 1 |" in row and "| 100 |" in row and "| 7 |" in row
    assert (tmp_path / "recipe.md").read_text() == text
    assert (tmp_path / "recipe_filter.png").stat().st_size > 0
