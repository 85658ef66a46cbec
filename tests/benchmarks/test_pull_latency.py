"""The Pull latency benchmark (benchmarks/pull_latency.py): its argument checks and a short run
against this tree (the figures themselves are timings, not checked here)."""

import json
import pathlib
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

import pull_latency as bench  # noqa: E402


@pytest.mark.parametrize(
    "argv, name",
    [(["--seconds", "1"], "--seconds"), (["--clients", "0"], "--clients"),
     (["--queue-groups", "1"], "--queue-groups")],
)  # fmt: skip
def test_bad_arguments_exit_2(argv, name, capsys):
    with pytest.raises(SystemExit) as e:
        bench.parse_args(argv)
    assert e.value.code == 2 and name in capsys.readouterr().err


def test_a_short_run_reports_every_figure(tmp_path):
    out = tmp_path / "result.json"
    argv = ["--seconds", "1.5", "--clients", "1", "--queue-groups", "8", "--dir", str(tmp_path)]
    bench.main([*argv, "--json", str(out)])
    result = json.loads(out.read_text())
    for kind in ("pull_acks", "pull", "ack"):
        assert set(result[kind]) == {"n", "median_ms", "p99_ms"}
    assert result["tree"] == str(REPO)
    assert result["groups_dispatched"] >= 0 and result["writes"] >= 0
    assert list(tmp_path.iterdir()) == [out]  # the state_dir was temporary
