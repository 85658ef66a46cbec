"""The background weight pusher: one push in flight, newer versions supersede queued ones, versions
stay monotone, errors surface in the caller, close flushes; saves precede UpdateWeights; host copies keep the sharding, take the serving dtype and
survive buffer donation. Pushes block on events the test releases: no wall-clock assertions."""

from __future__ import annotations

import os
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sat_jax import params_io
from train.weight_sync import KEEP_WEIGHTS, WeightPusher, host_copy, push_weights


class Recorder:
    """A push that records (version, params) and may fail; with `blocking` each push waits for
    `release`. `in_flight` counts pushes running at once (the maximum is kept)."""

    def __init__(self, *, blocking: bool = False, fail_at: int | None = None):
        self.fail_at = fail_at
        self.pushes: list[tuple[int, object]] = []
        self.started = threading.Event()
        self.release = threading.Event()
        if not blocking:
            self.release.set()
        self._lock = threading.Lock()
        self.in_flight = self.max_in_flight = 0

    def __call__(self, version, params):
        with self._lock:
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
        self.started.set()
        try:
            assert self.release.wait(timeout=30), "the test never released the push"
            if version == self.fail_at:
                raise OSError(f"disk full at v{version}")
            self.pushes.append((version, params))
        finally:
            with self._lock:
                self.in_flight -= 1


def test_one_push_in_flight_and_newer_versions_supersede_queued_ones():
    push = Recorder(blocking=True)
    with WeightPusher(push) as pusher:
        pusher.submit(1, "p1")
        assert push.started.wait(30)
        # v1 cannot finish before `release`: these submits return while it is still running.
        pusher.submit(2, "p2")  # queued behind v1 ...
        pusher.submit(3, "p3")  # ... and replaced by v3
        assert push.pushes == [] and pusher.metrics()["pushed_version"] is None
        push.release.set()
        pusher.wait()
        assert push.pushes == [(1, "p1"), (3, "p3")]
        assert push.max_in_flight == 1  # never two at once
        m = pusher.metrics()
        assert m["pushed_version"] == 3 and m["pushes_superseded"] == 1
        assert m["push_s"] is not None and m["push_s"] >= 0
        with pytest.raises(ValueError, match="version 3 is not newer than the last pushed 3"):
            pusher.submit(3, "again")


def test_close_flushes_the_last_push():
    push = Recorder(blocking=True)
    pusher = WeightPusher(push)
    pusher.submit(1, "p1")
    assert push.started.wait(30)
    pusher.submit(2, "p2")  # pending while v1 runs
    push.release.set()
    pusher.close()
    assert push.pushes == [(1, "p1"), (2, "p2")]
    with pytest.raises(RuntimeError, match="closed"):
        pusher.submit(3, "p3")


class FakePool:
    """Records `update_weights` calls and checks the weights are on disk when they are made."""

    def __init__(self):
        self.updates: list[tuple[int, str, bool]] = []

    def update_weights(
        self, version, checkpoint_path, *, new_admission_epoch=False, base_path="", wait_s=0.0
    ):
        assert os.path.isdir(checkpoint_path), "UpdateWeights before the save finished"
        self.updates.append((version, checkpoint_path, new_admission_epoch))


def test_push_weights_saves_then_updates_and_keeps_the_newest(tmp_path):
    pool = FakePool()
    params = {"w": np.arange(4, dtype=np.float32)}
    (tmp_path / "v4.tmp-123-0").mkdir()  # a flat save of v4 a killed trainer never finished
    for version in range(1, 6):
        push_weights(pool, params, version, str(tmp_path), new_admission_epoch=version == 1)
    assert pool.updates[0] == (1, str(tmp_path / "v1"), True)
    assert [v for v, _, _ in pool.updates] == [1, 2, 3, 4, 5]
    kept = sorted(p.name for p in tmp_path.iterdir())
    assert kept == [f"v{v}" for v in range(5 - KEEP_WEIGHTS, 6)]
    back = params_io.load_params(tmp_path / "v5", {"w": jnp.zeros(4, jnp.float32)})
    np.testing.assert_array_equal(np.asarray(back["w"]), params["w"])
    assert params_io.is_flat(tmp_path / "v5")  # one process, a local directory: no orbax


def test_a_version_a_server_still_loads_or_holds_is_not_removed(tmp_path):
    """A server whose load takes several pushes (its sender sends the newest next) or that holds
    an old version (its restart reloads it) keeps that version's directory."""
    pool = FakePool()
    pool.pinned_versions = lambda: {1}
    params = {"w": np.arange(4, dtype=np.float32)}
    for version in range(1, 7):
        push_weights(pool, params, version, str(tmp_path))
    kept = sorted(p.name for p in tmp_path.iterdir())
    assert kept == ["v1"] + [f"v{v}" for v in range(6 - KEEP_WEIGHTS, 7)]


def test_a_push_is_not_fsynced_and_a_restart_can_check_it(tmp_path, monkeypatch):
    """A push's save is off the disk's sync path (a restarting server checks the CRC instead:
    tests/rollout_server/test_weights.py)."""

    def no_fsync(fd):
        raise AssertionError("a push fsynced")

    monkeypatch.setattr(params_io.os, "fsync", no_fsync)
    params = {"w": np.arange(4, dtype=np.float32)}
    push_weights(FakePool(), params, 1, str(tmp_path))
    back = params_io.load_params(tmp_path / "v1", {"w": jnp.zeros(4, jnp.float32)}, verify=True)
    np.testing.assert_array_equal(np.asarray(back["w"]), params["w"])


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


def test_host_copy_survives_donation_and_keeps_the_sharding():
    params = {"w": jnp.arange(6.0).reshape(2, 3), "b": {"c": jnp.ones(4, jnp.bfloat16)}, "n": 5}
    want = jax.tree.map(np.array, params)
    shardings = {"w": params["w"].sharding, "c": params["b"]["c"].sharding}
    copy = host_copy(params)
    step = jax.jit(lambda p: jax.tree.map(lambda x: x * 0 - 7, p), donate_argnums=0)
    jax.block_until_ready(step({"w": params["w"], "b": params["b"]}))
    for got, expected in zip(jax.tree.leaves(copy), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(got), expected)
        assert np.asarray(got).dtype == expected.dtype
    for got, sharding in ((copy["w"], shardings["w"]), (copy["b"]["c"], shardings["c"])):
        assert isinstance(got, jax.Array)
        assert got.sharding == sharding.with_memory_kind("pinned_host")
    assert isinstance(copy["n"], np.ndarray) and copy["n"].flags.owndata


def test_host_copy_casts_floats_to_the_serving_dtype():
    """Float leaves, on device or not, in the serving dtype; others as they were; a sharded
    leaf keeps its sharding through the cast."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("fsdp",))
    sharded = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("fsdp"))
    params = {
        "w": jnp.linspace(-1, 1, 8, dtype=jnp.float32),
        "i": jnp.arange(3, dtype=jnp.int32),
        "s": jax.device_put(jnp.linspace(0, 1, 4, dtype=jnp.float32), sharded),
        "n": np.linspace(0, 2, 5, dtype=np.float32),
    }
    copy = host_copy(params, "bfloat16")
    assert copy["w"].dtype == jnp.bfloat16 and copy["i"].dtype == jnp.int32
    assert copy["s"].sharding == sharded.with_memory_kind("pinned_host")
    assert isinstance(copy["n"], np.ndarray) and copy["n"].dtype == jnp.bfloat16
    for k in ("w", "s", "n"):
        want = np.asarray(jnp.asarray(params[k]).astype(jnp.bfloat16))
        np.testing.assert_array_equal(np.asarray(copy[k]), want)
    np.testing.assert_array_equal(np.asarray(copy["i"]), np.arange(3))


def test_push_weights_without_a_pool_only_saves(tmp_path):
    params = {"w": np.arange(4, dtype=np.float32)}
    push_weights(None, params, 1, str(tmp_path))
    back = params_io.load_params(tmp_path / "v1", {"w": jnp.zeros(4, jnp.float32)})
    np.testing.assert_array_equal(np.asarray(back["w"]), params["w"])
