"""The loop benchmark's figures (`benchmarks/loop_figures.py`), its simulator predictor
(`benchmarks/sim_predict.py`) and its stand-in trainer step (`benchmarks/stand_in_train.py`)."""

from __future__ import annotations

import pathlib
import sys
import types

import numpy as np
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks"))

import loop_figures as lf
import sim_predict
import stand_in_train


def _poll(t, decode, steps, idle, cpu, tokens, steal):
    return (
        t,
        {
            "decode_seconds": decode,
            "decode_steps": steps,
            "admission_idle_slot_seconds": idle,
            "cpu_seconds": cpu,
            "tokens_generated": tokens,
            "steal_seconds": steal,
        },
    )


def test_at_interpolates_between_polls_and_keeps_none():
    polls = [_poll(10.0, 0.0, 0, 0, 0, 0, None), _poll(12.0, 2.0, 10, 0, 0, 0, None)]
    assert lf.at(polls, "decode_seconds", 11.5) == pytest.approx(1.5)
    assert lf.at(polls, "decode_seconds", 20.0) == pytest.approx(2.0)  # past the last poll
    assert lf.at(polls, "steal_seconds", 11.0) is None


def test_loop_figures_per_batch():
    # 11 records 0.5 s apart from t = 100: 10 batches; the server decoded 0.3 s of every 0.5.
    records = [{"time": 100 + 0.5 * i, "step_s": 0.2, "cpu_s": 0.25} for i in range(11)]
    polls = [
        _poll(99.0, 0.0, 0, 0.0, 0.0, 0, 0.0),
        _poll(106.0, 0.6 * 7, 140, 1.4, 2.8, 7 * 2 * 128, 0.07),
    ]
    got = lf.loop_figures(records, polls, skip=0, install_s=0.01, installs_per_step=1.0)
    assert got["period"] == pytest.approx(0.5)
    assert got["decode"] == pytest.approx(0.3)
    assert got["server_busy"] == pytest.approx(0.31) and got["trainer_busy"] == pytest.approx(0.2)
    assert got["efficiency"] == pytest.approx(0.31 / 0.5)
    assert got["token_s"] == pytest.approx(0.03)
    assert got["tokens"] == pytest.approx(128)
    assert got["admission_idle"] == pytest.approx(0.1)
    assert got["server_cpu"] == pytest.approx(0.2) and got["trainer_cpu"] == pytest.approx(0.25)
    assert got["steal"] == pytest.approx(0.005)


def _components(**kw):
    base = dict(
        step_s=0.1,
        push_s=0.01,
        install_s=0.0,
        installs_per_step=1.0,
        token_s=0.005,
        tokens=5.0,
        pull_s=0.0,
        decode_per_batch_s=0.1,
        slots=16,
        group_size=4,
        batch_groups=8,
        queue_groups=64,
        max_staleness=1,
        interval=1,
    )
    return sim_predict.Components(**{**base, **kw})


def test_prediction_is_the_slower_side_when_nothing_else_binds():
    # 32 samples on 16 slots: two waves of 5 tokens at 5 ms, 0.05 s a batch; steps of 0.1 s.
    assert sim_predict.predict_period(_components(), steps=60) == pytest.approx(0.1, rel=0.02)
    slow = _components(token_s=0.03, decode_per_batch_s=0.3)  # 0.3 s a batch
    assert sim_predict.predict_period(slow, steps=60) == pytest.approx(0.3, rel=0.03)


def test_installs_in_series_slow_the_simulated_server():
    base = _components(token_s=0.03, decode_per_batch_s=0.3)
    installs = _components(token_s=0.03, decode_per_batch_s=0.3, install_s=0.03)
    assert sim_predict.predict_period(installs, steps=60) == pytest.approx(0.33, rel=0.03)
    assert sim_predict.predict_period(installs, steps=60) > sim_predict.predict_period(
        base, steps=60
    )


def test_interval_sim_pushes_every_nth_version():
    sim = sim_predict.build(_components(interval=4, max_staleness=4))
    sim.run(12, warmup=0)
    pushed = sorted({v for _, _, v, _ in sim.pushes} | {sim.servers[0].version})
    assert all(v % 4 == 0 or v == 1 for v in pushed)
    assert sim.servers[0].version % 4 == 0


def test_stand_in_step_sleeps_and_advances_the_step():
    import jax.numpy as jnp

    from sat_jax.step import TrainState

    sleeps = []
    step = stand_in_train.sleep_step(0.25, sleep=sleeps.append)
    state = TrainState(params={"w": jnp.ones(2)}, opt_state=(), step=jnp.int32(3))
    batch = types.SimpleNamespace(loss_mask=jnp.array([[0.0, 1.0, 1.0], [0.0, 0.0, 1.0]]))
    new, metrics = step(state, batch)
    assert sleeps == [0.25] and int(new.step) == 4 and metrics["step_skipped"] == 0
    assert metrics["active_tokens"] == 3
    assert np.array_equal(new.params["w"], state.params["w"])


def test_cpu_loop_efficiency_and_batch_host_per_batch():
    # The server burned 0.45 CPU s of every 0.5 s batch, the trainer 0.25: the CPU bound is the
    # server's, 90% of the period; batch_host_s is averaged over the records that have it.
    records = [{"time": 100 + 0.5 * i, "step_s": 0.2, "cpu_s": 0.25} for i in range(11)]
    records[1]["batch_host_s"], records[3]["batch_host_s"] = 0.002, 0.004  # others have none
    polls = [
        _poll(99.0, 0.0, 0, 0.0, 0.0, 0, 0.0),
        _poll(106.0, 0.6 * 7, 140, 1.4, 0.9 * 7, 7 * 2 * 128, 0.07),
    ]
    got = lf.loop_figures(records, polls, skip=0, install_s=0.01, installs_per_step=1.0)
    assert got["cpu_efficiency"] == pytest.approx(0.45 / 0.5)
    assert got["efficiency"] == pytest.approx(0.31 / 0.5)  # by decode + installs: unchanged
    assert got["batch_host"] == pytest.approx(0.003)
    without = lf.loop_figures(
        [{"time": 100 + 0.5 * i, "step_s": 0.2} for i in range(11)],
        polls,
        skip=0,
        install_s=0.01,
        installs_per_step=1.0,
    )
    assert without["batch_host"] is None and without["trainer_cpu"] is None
    assert without["cpu_efficiency"] == pytest.approx(0.9)  # the server's alone


def test_server_cpu_beyond_decode_slows_the_simulated_server():
    # Decode alone makes a batch in 0.05 s; the server's CPU per batch is 0.3 s (host work in
    # series with decoding): the simulated period is the server's 0.3, not the 0.1 s step.
    host = _components(server_cpu_s=0.3)
    assert sim_predict.server_speed(host) == pytest.approx(32 * 5 / (16 * 0.3))
    assert sim_predict.predict_period(host, steps=60) == pytest.approx(0.3, rel=0.03)
    # CPU below decode + installs changes nothing.
    assert sim_predict.server_speed(_components(server_cpu_s=0.05)) == pytest.approx(200.0)
    assert sim_predict.predict_period(
        _components(server_cpu_s=0.05), steps=60
    ) == sim_predict.predict_period(_components(), steps=60)


def test_trainer_batch_host_time_counts_only_when_the_batch_fills_late():
    sim = sim_predict.build(_components(pull_s=0.002, batch_host_s=0.003))
    assert sim.pull_delay == pytest.approx(0.002) and sim.batch_host == pytest.approx(0.003)
    # Trainer-bound (a batch every 0.05 s, steps of 0.1 s): the batch is prefetched during the
    # step before, its host time hidden.
    hidden = sim_predict.predict_period(_components(batch_host_s=0.02), steps=60)
    assert hidden == pytest.approx(sim_predict.predict_period(_components(), steps=60), rel=0.01)
    # max_staleness 0: the server generates a batch only after the step before, so every batch
    # fills up after its step's end and the host time is waited for.
    serial = dict(max_staleness=0)
    base = sim_predict.predict_period(_components(**serial), steps=60)
    slower = sim_predict.predict_period(_components(**serial, batch_host_s=0.02), steps=60)
    assert slower == pytest.approx(base + 0.02, rel=0.02)
