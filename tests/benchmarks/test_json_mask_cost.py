"""benchmarks/json_mask_cost.py: its replies are what the formats accept (every token of a
batch replays into a table), and its quick run prints each figure's line."""

from __future__ import annotations

import json
import pathlib
import random
import sys

import jsonschema
import numpy as np

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

import json_mask_cost  # noqa: E402


def test_the_replies_are_values_of_their_formats():
    for fmt, text in json_mask_cost.replies(random.Random(0), 12):
        value = json.loads(text)
        if json.loads(fmt)["type"] == "json_schema":
            jsonschema.validate(value, json_mask_cost.SCHEMA)
        else:
            assert isinstance(value, dict)


def test_the_quick_run_prints_every_figure(capsys):
    json_mask_cost.main(["--quick"])
    out = capsys.readouterr().out
    assert "tokenizer: 4096 ids" in out and "token trie:" in out
    lines = [x for x in out.splitlines() if x.startswith("batch ")]
    assert [x.split(":")[0] for x in lines] == ["batch cold", "batch warm"]
    for line in lines:
        rows = int(line.split(" distinct masks")[0].rsplit(" ", 1)[1])
        assert rows > 1 and np.isfinite(float(line.split("replay ")[1].split(" s")[0]))
