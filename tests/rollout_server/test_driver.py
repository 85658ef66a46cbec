"""The generate loop: restarted after JetStream 0.2.2's free-slot race, any other error reported
(`on_fatal`) instead of killing the process."""

import queue
import types

import pytest

from rollout_server import jetstream_compat  # noqa: F401  (must precede jetstream imports)

# isort: split

from jetstream.core import orchestrator

from rollout_server.driver import RolloutDriver

RACE = "At this point we must have some requests inserted into the slots."


def make_driver(free_slots: int, capacity: int = 2) -> RolloutDriver:
    driver = object.__new__(RolloutDriver)  # only what _generate_thread reads
    driver.live = True
    driver.on_fatal = None
    slots = queue.Queue()
    for slot in range(free_slots):
        slots.put(slot)
    driver._generate_slots = [slots]
    driver._generate_engines = [types.SimpleNamespace(max_concurrent_decodes=capacity)]
    return driver


def fake_loop(errors):
    calls = []

    def loop(self, idx):
        calls.append(idx)
        if errors:
            raise errors.pop(0)

    return loop, calls


def test_race_with_every_slot_free_restarts_the_loop(monkeypatch):
    loop, calls = fake_loop([AssertionError(RACE), AssertionError(RACE)])
    monkeypatch.setattr(orchestrator.Driver, "_generate_thread", loop)
    make_driver(free_slots=2)._generate_thread(0)
    assert calls == [0, 0, 0]


@pytest.mark.parametrize(
    "error,free_slots",
    [
        (AssertionError(RACE), 1),  # a slot is busy: not the race, something is really wrong
        (AssertionError("another assertion"), 2),
        (RuntimeError("engine failure"), 2),
    ],
)
def test_anything_else_ends_the_loop_and_reports_it(monkeypatch, error, free_slots):
    # JetStream's thread wrapper SIGKILLs the process on an exception: none may escape; the
    # server stops cleanly from `on_fatal` instead.
    loop, calls = fake_loop([error])
    monkeypatch.setattr(orchestrator.Driver, "_generate_thread", loop)
    driver = make_driver(free_slots=free_slots)
    fatal = []
    driver.on_fatal = fatal.append
    assert driver._generate_thread(0) is None
    assert calls == [0] and fatal == [error]


def test_stops_when_the_driver_stops(monkeypatch):
    driver = make_driver(free_slots=2)
    calls = []

    def loop(self, idx):
        calls.append(idx)
        self.live = False  # the driver stops while the loop runs, which then hits the race
        raise AssertionError(RACE)

    monkeypatch.setattr(orchestrator.Driver, "_generate_thread", loop)
    assert driver._generate_thread(0) is None  # returns instead of restarting or raising
    assert calls == [0]
    driver._generate_thread(0)  # a stopped driver does not start the loop again
    assert calls == [0]


def test_token_buffer_fills_preallocated_arrays_and_hands_out_views():
    import numpy as np

    from rollout_server.driver import TokenBuffer

    prompt_routing = np.arange(3 * 2 * 2, dtype=np.uint8).reshape(3, 2, 2)
    buffer = TokenBuffer(np.array([1, 5, 6]), prompt_routing, max_tokens=4)
    for i in range(2):
        step_routing = np.full((2, 2), 20 + i, np.int32)  # the engine's int32 column
        buffer.add(7 + i, np.float32(-0.5 * i), np.int32(3), step_routing)
    sample = buffer.sample("stop")
    assert sample.completion_ids.tolist() == [7, 8] and sample.completion_ids.dtype == np.int32
    assert sample.logprobs.tolist() == [0.0, -0.5] and sample.logprobs.dtype == np.float32
    assert sample.versions.tolist() == [3, 3] and sample.versions.dtype == np.int64
    assert sample.routing.shape == (5, 2, 2) and sample.routing.dtype == np.uint8
    np.testing.assert_array_equal(sample.routing[:3], prompt_routing)
    assert sample.routing[3:].ravel().tolist() == [20] * 4 + [21] * 4
    assert sample.prompt_ids.dtype == np.int32 and sample.finish_reason == "stop"
    assert np.shares_memory(sample.routing, buffer.routing)  # no copy per finished sample
