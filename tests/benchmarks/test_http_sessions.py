"""The HTTP sessions benchmark (benchmarks/http_sessions.py): a ``--quick`` run (the tiny preset)
plays the same episodes inside the server and over HTTP with the official client (streamed), and
reports both modes' tokens/s at equal generated tokens and the per-turn figures of the HTTP path,
time to the first streamed content included."""

import json
import pathlib
import sys

import pytest

pytest.importorskip("openai")
REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

import http_sessions as bench  # noqa: E402

pytestmark = pytest.mark.slow  # starts an HTTP server and client threads


def test_quick_run_reports_both_modes_and_the_time_per_turn(tmp_path):
    out = tmp_path / "http_sessions.json"
    result = bench.main(["--quick", "--stream", "--json", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    cfg = result["config"]
    assert set(result["modes"]) == set(bench.MODES)
    samples = cfg["groups"] * cfg["group_size"]
    turns = samples * cfg["turns"]
    for mode in bench.MODES:
        m = result["modes"][mode]
        # The same episodes: every sample generated turns x turn_tokens tokens.
        assert m["samples"] == samples
        assert m["generated_tokens"] == samples * cfg["turns"] * cfg["turn_tokens"]
        assert m["tokens_per_s"] > 0 and m["wall_s"] > 0
        assert len(m["wall_s_all"]) == cfg["repeats"]
        # Every turn of every counted round has its engine time.
        assert m["engine_turn_ms"]["n"] == turns * cfg["repeats"]
        assert m["engine_turn_ms"]["median"] > 0
    http = result["modes"]["http"]
    assert http["client_turn_ms"]["n"] == turns * cfg["repeats"]
    assert result["ratio"] == pytest.approx(
        http["tokens_per_s"] / result["modes"]["in-server"]["tokens_per_s"]
    )
    overhead = result["overhead_ms"]
    assert overhead["n"] == turns * cfg["repeats"]
    # A client's turn contains the engine's turn.
    assert overhead["median"] > 0 and overhead["mean"] > 0
    assert isinstance(result["wall_added_per_turn_ms"], float)

    table = bench.format_table(bench.parse_args(["--quick"]), result)
    assert "| http |" in table and "| in-server |" in table and "Time added per turn" in table
    # Streamed (the agents read server-sent events): every turn's first content is timed, and
    # arrives no later than the turn's end.
    assert result["config"]["stream"]
    first = http["first_content_ms"]
    assert first["n"] == turns * cfg["repeats"] and first["mean"] <= http["client_turn_ms"]["mean"]
    assert "first content chunk" in table
