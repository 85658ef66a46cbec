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


def test_the_stand_in_step_returns_at_dispatch_and_is_waited_for_at_its_metrics(monkeypatch):
    """Like a jitted step, the stand-in returns at once (the loop's prefetch pulls the next batch
    meanwhile) and takes its time when its metrics are read (a fake clock: no sleep)."""
    import jax
    import numpy as np

    from sat_jax.step import TrainState

    now = [100.0]
    monkeypatch.setattr(bench.time, "monotonic", lambda: now[0])
    monkeypatch.setattr(bench.time, "sleep", lambda s: now.__setitem__(0, now[0] + s))
    trained, hooked = [], []
    step = bench._step(0.5, {1: lambda: hooked.append(now[0])}, trained)
    batch = type("Batch", (), {"loss_mask": np.ones((2, 3))})()
    state, metrics = step(TrainState(params={}, opt_state=(), step=np.int32(0)), batch)
    assert now[0] == 100.0 and trained == [] and hooked == [100.0]  # dispatched, not run
    assert int(state.step) == 1
    assert bool(jax.device_get(metrics)["step_skipped"]) is False
    assert now[0] == 100.5 and trained == [(100.5, 6)]  # waited out when read, recorded once
    jax.device_get(metrics)
    assert now[0] == 100.5 and trained == [(100.5, 6)]
