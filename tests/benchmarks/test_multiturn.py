"""The multi-turn benchmark (benchmarks/multiturn.py): a ``--quick`` run (the tiny preset) reports
both variants at equal generated tokens, and the prefill counts per turn of its episodes: the
engine computed only the observations after the first turn, fewer tokens than a re-prefill of the
whole conversation."""

import itertools
import json
import pathlib
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

import multiturn as bench  # noqa: E402


def test_quick_run_reports_throughput_and_prefill_per_turn(tmp_path):
    out = tmp_path / "multiturn.json"
    result = bench.main(["--quick", "--json", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    cfg = result["config"]
    single, multi = result["throughput"]
    assert [single["variant"], multi["variant"]] == list(bench.VARIANTS)
    # Equal work: every sample generated turns x turn_tokens tokens (the sampler never stops).
    samples = cfg["groups"] * cfg["group_size"]
    want = samples * cfg["turns"] * cfg["turn_tokens"]
    assert single["samples"] == multi["samples"] == samples
    assert single["generated_tokens"] == multi["generated_tokens"] == want
    assert (single["turns"], multi["turns"]) == (1, cfg["turns"])
    # Single-turn inserts and extends nothing; multi-turn extends by exactly what it inserted,
    # once per turn after the first, and both prefill one prompt per group.
    assert single["inserted_tokens"] == single["engine_extend_tokens"] == 0
    assert single["engine_extend_calls"] == 0
    assert multi["engine_extend_tokens"] == multi["inserted_tokens"] > 0
    assert multi["engine_extend_calls"] == samples * (cfg["turns"] - 1)
    assert single["engine_prefill_calls"] == multi["engine_prefill_calls"] == cfg["groups"]
    assert single["engine_prefill_tokens"] == multi["engine_prefill_tokens"] > 0
    # A multi-turn sample holds its slot for at least its generated and inserted steps.
    assert multi["decode_steps"] >= want // cfg["slots"]
    for r in (single, multi):
        assert r["wall_s"] > 0 and r["tokens_per_s"] > 0
        assert len(r["wall_s_all"]) == cfg["repeats"]

    prefill = result["prefill"]
    assert [r["turn"] for r in prefill] == list(range(1, cfg["turns"] + 1))
    first = prefill[0]
    # Turn 1 is the prompt either way (one prompt per group, the group's samples share it).
    prompt_mean = multi["engine_prefill_tokens"] / cfg["groups"]
    assert first["incremental_tokens"] == first["full_tokens"] == pytest.approx(prompt_mean)
    for before, row in itertools.pairwise(prefill):
        assert row["incremental_tokens"] < row["full_tokens"]
        # The conversation at turn t is the one at turn t - 1, its turn and the observation.
        grown = before["full_tokens"] + cfg["turn_tokens"] + row["incremental_tokens"]
        assert row["full_tokens"] == pytest.approx(grown)
    # Per episode, the observations sum to what the engine extended by.
    inserted = sum(r["incremental_tokens"] for r in prefill[1:]) * samples
    assert inserted == pytest.approx(multi["engine_extend_tokens"])
    for r in prefill:
        assert r["incremental_s"] > 0 and r["full_s"] > 0

    table = bench.format_tables(bench.parse_args(["--quick"]), result["throughput"], prefill)
    assert "| multi-turn |" in table and "full re-prefill tokens" in table
