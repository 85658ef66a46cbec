"""The live fleet benchmark (benchmarks/fleet.py): its argument checks (a run starts server
processes and takes minutes; its figures are timings, not checked here)."""

import pathlib
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

import fleet as bench  # noqa: E402


@pytest.mark.parametrize(
    "argv, name",
    [(["--steps", "4"], "--steps"), (["--servers", "0"], "--servers"),
     (["--step-s", "-1"], "--step-s"), (["--staleness", "-1"], "--staleness"),
     (["--duty", "1"], "--duty"), (["--duty", "0.5", "--duty-period", "0"], "--duty-period"),
     (["--kill"], "--kill"), (["--servers", "2", "--kill", "--sigterm"], "--sigterm"),
     (["--servers", "2", "--pause", "0"], "--pause"), (["--pause", "5"], "--pause")],
)  # fmt: skip
def test_bad_arguments_exit_2_naming_the_flag(argv, name, capsys):
    with pytest.raises(SystemExit) as e:
        bench.parse_args(argv)
    assert e.value.code == 2 and name in capsys.readouterr().err


def test_the_defaults_and_a_fault_run_parse():
    args = bench.parse_args([])
    assert (args.servers, args.steps, args.step_s, args.staleness) == ([1, 2], 40, 0.5, 1)
    assert bench.parse_args(["--servers", "2", "--sigterm"]).sigterm
