"""Weight pushes with several trainer processes, each a ``WeightPusher`` on a thread here, sharing a
fake key-value store: ``submit`` never waits (not on a push, not on a checkpoint commit held open),
process 0 picks the versions every process saves and announces a version only once every
process's part of it is written, and a process's failed part surfaces in both loops with nothing
announced. Saves block on events the test releases: no sleeps, no wall-clock assertions."""

from __future__ import annotations

import threading

import jax.numpy as jnp
import numpy as np
import pytest

from sat_jax import params_io
from sat_jax.step import TrainState
from train import checkpointing, weight_sync
from train.weight_sync import PushGroup, WeightPusher


class FakeKeyValue:
    """The distributed runtime's key-value store, shared by the threads of one test."""

    def __init__(self):
        self.values: dict[str, str] = {}
        self._cond = threading.Condition()

    def set(self, key: str, value: str) -> None:
        with self._cond:
            self.values[key] = value
            self._cond.notify_all()

    def get(self, key: str, timeout_ms: int) -> str | None:
        with self._cond:
            self._cond.wait_for(lambda: key in self.values, timeout_ms / 1000)
            return self.values.get(key)

    def delete(self, key: str) -> None:
        with self._cond:
            for k in [k for k in self.values if k == key or k.startswith(f"{key}/")]:
                del self.values[k]


def groups(count: int = 2) -> list[PushGroup]:
    kv = FakeKeyValue()
    return [PushGroup(i, count, kv, "test/weights") for i in range(count)]


class Announcer:
    """Process 0's pool: records each announced version and which processes had saved it then."""

    def __init__(self, saved: dict[int, set[int]]):
        self.saved = saved
        self.pushes: list[int] = []
        self.saved_when_announced: dict[int, set[int]] = {}

    def update_weights(self, version, path, *, new_admission_epoch=False, base_path="", wait_s=0.0):
        self.pushes.append(version)
        self.saved_when_announced[version] = set(self.saved.get(version, ()))


def fake_pushes(count: int = 2):
    """A pusher per process whose push is ``group.save_everywhere`` of a save that records
    (version → processes done) and blocks while the process's ``hold`` event is clear; process 0
    then announces to an ``Announcer``. Returns (pushers, holds, started, announcer, fail_at)."""
    saved: dict[int, set[int]] = {}
    lock = threading.Lock()
    announcer = Announcer(saved)
    holds = [threading.Event() for _ in range(count)]
    started = [threading.Event() for _ in range(count)]
    fail_at: dict[int, int] = {}
    for hold in holds:
        hold.set()

    def push_for(group: PushGroup):
        def save(version: int) -> str:
            started[group.index].set()
            assert holds[group.index].wait(60), "the test never released the save"
            if fail_at.get(group.index) == version:
                raise OSError(f"disk full at v{version}")
            with lock:
                saved.setdefault(version, set()).add(group.index)
            return f"part-{group.index}"

        def push(version: int, params) -> None:
            parts = group.save_everywhere(lambda: save(version))
            if group.lead:
                assert parts == [f"part-{i}" for i in range(count)]
                announcer.update_weights(version, f"v{version}")

        return push

    pushers = [WeightPusher(push_for(g), group=g) for g in groups(count)]
    return pushers, holds, started, announcer, fail_at


def submit_all(pushers: list[WeightPusher], version: int) -> None:
    for pusher in pushers:
        pusher.submit(version, f"params{version}")


def test_process_0_announces_only_versions_every_process_saved_and_newer_ones_supersede():
    pushers, holds, started, announcer, _ = fake_pushes()
    holds[1].clear()  # process 1's save of the first picked version stays in flight
    submit_all(pushers, 1)
    assert started[1].wait(60)
    submit_all(pushers, 2)  # returns at once: process 0 holds it, process 1 keeps its copy
    submit_all(pushers, 3)  # supersedes 2 on process 0
    assert announcer.pushes == []  # process 0's part of v1 is written, process 1's is not
    holds[1].set()
    for pusher in pushers:
        pusher.wait()
    assert announcer.pushes == [1, 3]
    assert announcer.saved_when_announced == {1: {0, 1}, 3: {0, 1}}
    # Both processes wrote the same versions: 2 was dropped by each, counted as superseded.
    assert [p.metrics()["pushes_superseded"] for p in pushers] == [1, 1]
    assert [p.metrics()["pushed_version"] for p in pushers] == [3, 3]
    for pusher in pushers:
        pusher.close()


def test_a_process_whose_save_fails_stops_both_loops_and_nothing_is_announced():
    pushers, holds, started, announcer, fail_at = fake_pushes()
    fail_at[1] = 2
    submit_all(pushers, 1)
    for pusher in pushers:
        pusher.wait()
    submit_all(pushers, 2)
    for pusher in pushers:
        with pytest.raises(RuntimeError, match="version 2 failed") as failed:
            pusher.wait()
    assert "disk full at v2" in str(failed.value.__cause__)
    assert announcer.pushes == [1]
    with pytest.raises(RuntimeError, match="process 1: OSError: disk full at v2"):
        pushers[0].check()
    for pusher in pushers:  # the next submit raises in the loop
        with pytest.raises(RuntimeError, match="version 2 failed"):
            pusher.submit(3, "params3")


def test_submit_never_blocks_with_process_count_2_and_a_checkpoint_commit_held(
    tmp_path, monkeypatch
):
    """Real saves (sharded weights, both processes' parts) and a real background checkpoint whose
    commit is held open: four versions are submitted, saved by both processes and announced while
    the commit (and with it orbax's lock) is still held."""
    commit = threading.Event()
    ckpt = checkpointing.Checkpointer(str(tmp_path / "ckpt"), keep=2)
    finish = ckpt._commit  # runs on the checkpoint's thread, orbax's lock held, until commit

    def held_commit(step: int) -> None:
        assert commit.wait(60), "the test never released the commit"
        finish(step)

    ckpt._commit = held_commit
    state = TrainState(params={"w": jnp.ones(8)}, opt_state=(), step=jnp.int32(1))
    progress = checkpointing.Progress(version=1, min_version=1, rng_key=(0, 0))
    assert ckpt.save(1, state, progress)
    assert params_io.ORBAX_LOCK.locked()  # the commit holds it, as with a larger checkpoint

    monkeypatch.setattr(params_io, "weights_format", lambda path: "shards")
    weights_dir = tmp_path / "weights"
    weights_dir.mkdir()
    announcer = Announcer({})
    pushers = []
    for group in groups():
        pool = announcer if group.lead else None
        push = lambda v, p, pool=pool, group=group: weight_sync.push_weights(
            pool, p, v, str(weights_dir), group=group
        )
        pushers.append(WeightPusher(push, group=group))
    versions = {v: {"w": np.full(8, v, np.float32)} for v in range(2, 6)}
    for v, params in versions.items():
        submit_all_params(pushers, v, params)  # returns at once, commit held or not
    for pusher in pushers:
        pusher.wait()
    assert params_io.ORBAX_LOCK.locked() and not commit.is_set()
    assert announcer.pushes[-1] == 5 and announcer.pushes == sorted(set(announcer.pushes))
    like = {"w": jnp.zeros(8, jnp.float32)}
    back = params_io.load_params(weights_dir / "v5", like, verify=True)
    np.testing.assert_array_equal(np.asarray(back["w"]), versions[5]["w"])
    commit.set()
    ckpt.close()
    assert ckpt.failures == 0 and not params_io.ORBAX_LOCK.locked()
    for pusher in pushers:
        pusher.close()


def submit_all_params(pushers: list[WeightPusher], version: int, params) -> None:
    for pusher in pushers:
        pusher.submit(version, params)


def test_sharded_weights_name_only_the_parts_of_their_save(tmp_path):
    """Process 0's index names the parts of the last save of a path: a re-save of the same
    version replaces the earlier parts, which are removed."""
    path = tmp_path / "v1"
    first = params_io.save_shards(path, {"w": np.zeros(4, np.float32)}, durable=False)
    params_io.finish_shards(path, [first], durable=False)
    second = params_io.save_shards(path, {"w": np.ones(4, np.float32)}, durable=False)
    part1 = params_io.save_shards(path, {"w": np.ones(4, np.float32)}, process=1, durable=False)
    params_io.finish_shards(path, [second, part1], durable=False)
    assert sorted(p.name for p in path.iterdir()) == sorted(
        [
            params_io.SHARDS_INDEX,
            second,
            second.replace(".json", ".bin"),
            part1,
            part1.replace(".json", ".bin"),
        ]
    )
    back = params_io.load_params(path, {"w": jnp.zeros(4, jnp.float32)}, verify=True)
    np.testing.assert_array_equal(np.asarray(back["w"]), np.ones(4, np.float32))
    with pytest.raises(ValueError, match="no shards-p1-x.json"):
        params_io.finish_shards(path, [second, "shards-p1-x.json"])
