"""The background weight pusher: one push in flight, newer versions supersede queued ones, versions
stay monotone, errors surface in the caller, close flushes; host copies survive buffer donation."""

from __future__ import annotations

import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from train.weight_sync import WeightPusher, host_copy


class Recorder:
    """A push that takes `seconds` and records (version, params, start, end); optionally fails."""

    def __init__(self, seconds: float = 0.0, fail_at: int | None = None):
        self.seconds, self.fail_at = seconds, fail_at
        self.pushes: list[tuple[int, object, float, float]] = []
        self.started = threading.Event()

    def __call__(self, version, params):
        start = time.monotonic()
        self.started.set()
        time.sleep(self.seconds)
        if version == self.fail_at:
            raise OSError(f"disk full at v{version}")
        self.pushes.append((version, params, start, time.monotonic()))


def test_one_push_in_flight_and_newer_versions_supersede_queued_ones():
    push = Recorder(seconds=0.3)
    with WeightPusher(push) as pusher:
        start = time.monotonic()
        pusher.submit(1, "p1")
        assert push.started.wait(5)
        pusher.submit(2, "p2")  # queued behind v1 ...
        pusher.submit(3, "p3")  # ... and replaced by v3
        assert time.monotonic() - start < 0.2  # submit never waits for a push
        pusher.wait()
        assert [(v, p) for v, p, _, _ in push.pushes] == [(1, "p1"), (3, "p3")]
        (_, _, _, end1), (_, _, start3, _) = push.pushes
        assert start3 >= end1  # never two at once
        m = pusher.metrics()
        assert m["pushed_version"] == 3 and m["pushes_superseded"] == 1
        assert m["push_s"] == pytest.approx(0.3, abs=0.2)
        with pytest.raises(ValueError, match="version 3 is not newer than the last pushed 3"):
            pusher.submit(3, "again")


def test_close_flushes_the_last_push():
    push = Recorder(seconds=0.2)
    pusher = WeightPusher(push)
    pusher.submit(1, "p1")
    pusher.submit(2, "p2")
    pusher.close()
    assert push.pushes[-1][0] == 2
    with pytest.raises(RuntimeError, match="closed"):
        pusher.submit(3, "p3")


def test_a_failed_push_is_raised_in_the_caller():
    push = Recorder(fail_at=2)
    pusher = WeightPusher(push)
    pusher.submit(1, "p1")
    pusher.wait()
    pusher.submit(2, "p2")
    with pytest.raises(RuntimeError, match="pushing weights version 2 failed") as info:
        pusher.wait()
    assert isinstance(info.value.__cause__, OSError)
    for call in (pusher.check, lambda: pusher.submit(3, "p3"), pusher.close):
        with pytest.raises(RuntimeError, match="disk full at v2"):
            call()


def test_exit_on_an_error_does_not_hide_it():
    push = Recorder(fail_at=1)
    with pytest.raises(KeyError):
        with WeightPusher(push) as pusher:
            pusher.submit(1, "p1")
            raise KeyError("the loop's own error")


def test_host_copy_survives_donation():
    params = {"w": jnp.arange(6.0).reshape(2, 3), "b": {"c": jnp.ones(4, jnp.bfloat16)}}
    want = jax.tree.map(np.array, params)
    copy = host_copy(params)
    step = jax.jit(lambda p: jax.tree.map(lambda x: x * 0 - 7, p), donate_argnums=0)
    jax.block_until_ready(step(params))
    for got, expected in zip(jax.tree.leaves(copy), jax.tree.leaves(want), strict=True):
        assert isinstance(got, np.ndarray) and got.flags.owndata
        np.testing.assert_array_equal(got, expected)
