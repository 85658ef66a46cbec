"""rollout_server.loop_stats and its Prometheus gauges: decode seconds, admission-idle
slot-seconds, CPU and steal, on fake clocks."""

from __future__ import annotations

import math
import os

import prometheus_client as prom
import pytest

from rollout_server.loop_stats import DecodeClock, IdleMeter, LoopAccounting
from rollout_server.metrics import ServerMetrics
from tests.clock import FakeClock


def test_decode_clock_counts_queued_steps_once():
    clock = FakeClock()
    decode = DecodeClock(clock)
    decode.dispatched()  # t = 0: steps 1 and 2 dispatched at once (the generate thread runs ahead)
    decode.dispatched()
    clock.advance(0.010)
    decode.ready()  # step 1: 0 → 10 ms
    clock.advance(0.010)
    decode.ready()  # step 2 waited behind step 1: 10 → 20 ms, not 0 → 20
    assert decode.seconds == pytest.approx(0.020) and decode.steps == 2


def test_decode_clock_leaves_out_the_time_nothing_was_dispatched():
    clock = FakeClock()
    decode = DecodeClock(clock)
    decode.dispatched()
    clock.advance(0.005)
    decode.ready()
    clock.advance(1.0)  # every slot free: the generate thread waits for a prefill
    decode.dispatched()
    clock.advance(0.005)
    decode.ready()
    assert decode.seconds == pytest.approx(0.010) and decode.steps == 2


def test_idle_meter_counts_free_slots_only_while_admission_is_closed():
    clock = FakeClock()
    state = {"open": True, "free": 4}
    idle = IdleMeter(lambda: state["open"], lambda: state["free"], clock)
    idle.sample()
    clock.advance(1.0)
    state.update(open=False, free=3)
    idle.sample()  # the second before: open, not idle
    clock.advance(2.0)
    state.update(free=1)
    idle.sample()  # closed with 3 free for 2 s
    clock.advance(0.5)
    state.update(open=True, free=1)
    idle.sample()  # closed with 1 free for 0.5 s
    clock.advance(3.0)
    idle.sample()
    assert idle.slot_seconds == pytest.approx(3 * 2.0 + 1 * 0.5)


def _accounting(tmp_path, steal_column: bool):
    ticks = os.sysconf("SC_CLK_TCK")
    stat = tmp_path / "stat"
    stat.write_text("cpu  1 0 1 1 0 0 0" + (f" {ticks}" if steal_column else "") + "\n")
    decode = DecodeClock(FakeClock())
    idle = IdleMeter(lambda: False, lambda: 2, FakeClock())
    acc = LoopAccounting(decode, idle, str(stat))
    decode.dispatched()
    decode.ready()
    if steal_column:
        stat.write_text(f"cpu  1 0 1 1 0 0 0 {3 * ticks}\n")
    return acc


def test_accounting_stats_and_gauges(tmp_path):
    acc = _accounting(tmp_path, steal_column=True)
    got = acc.stats()
    assert got["decode_steps"] == 1 and got["steal_seconds"] == pytest.approx(2.0)
    assert got["cpu_seconds"] >= 0 and got["admission_idle_slot_seconds"] == 0.0
    registry = prom.CollectorRegistry()
    ServerMetrics(lambda: {}, lambda: 0, registry, accounting=acc.stats)
    assert registry.get_sample_value("satjax_rollout_decode_steps") == 1.0
    assert registry.get_sample_value("satjax_rollout_steal_seconds") == pytest.approx(2.0)


def test_steal_not_reported_is_absent_and_nan_not_zero(tmp_path):
    acc = _accounting(tmp_path, steal_column=False)
    assert "steal_seconds" not in acc.stats()
    registry = prom.CollectorRegistry()
    ServerMetrics(lambda: {}, lambda: 0, registry, accounting=acc.stats)
    assert math.isnan(registry.get_sample_value("satjax_rollout_steal_seconds"))
