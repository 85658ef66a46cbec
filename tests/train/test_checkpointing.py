"""Checkpoints: round trip onto the shardings, keep-N, progress, a kill mid-save, the orbax lock
shared with weight pushes, and a gs:// directory reaching orbax unchanged."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest

from sat_jax import params_io
from sat_jax.experiment import load_config
from sat_jax.model import ModelConfig
from sat_jax.parallel import sharding
from sat_jax.train_step import init_train_state
from train import checkpointing, setup

MODEL_CFG = ModelConfig.preset("tiny")
OPTIMIZER = optax.adamw(1e-3, b2=0.98)


@pytest.fixture(scope="module")
def state_and_mesh():
    mesh = sharding.make_mesh(sharding.MeshConfig(fsdp=1), jax.devices()[:1])
    return init_train_state(MODEL_CFG, OPTIMIZER, mesh, 3), mesh


def test_round_trip_keep_n_and_progress(tmp_path, state_and_mesh):
    state, mesh = state_and_mesh
    ckpt = checkpointing.Checkpointer(str(tmp_path / "ckpt"), keep=2)
    key = jax.random.key(7)
    for step in (1, 2, 3):
        progress = checkpointing.Progress(
            version=step + 1,
            min_version=1,
            rng_key=tuple(int(x) for x in jax.random.key_data(key)),
            groups_trained=8 * step,
            recent_prompt_ids=tuple(f"p{i}" for i in range(step)),
        )
        state = state.replace(step=state.step + 1)
        ckpt.save(step, state, progress)
    assert ckpt.all_steps() == [2, 3] and ckpt.latest_step() == 3
    ckpt.close()

    again = checkpointing.Checkpointer(str(tmp_path / "ckpt"), keep=2)
    abstract = checkpointing.abstract_train_state(MODEL_CFG, OPTIMIZER, mesh)
    restored, got = again.restore(again.latest_step(), abstract)
    assert got == progress
    assert int(restored.step) == 3
    same = jax.tree.map(lambda a, b: np.array_equal(np.asarray(a), np.asarray(b)), restored, state)
    assert all(jax.tree.leaves(same))
    shardings_ok = jax.tree.map(lambda a, s: a.sharding == s.sharding, restored, abstract)
    assert all(jax.tree.leaves(shardings_ok))
    key_back = jax.random.wrap_key_data(np.asarray(got.rng_key, np.uint32))
    assert np.array_equal(jax.random.key_data(key_back), jax.random.key_data(key))
    again.close()


def test_unfinished_save_is_ignored(tmp_path, state_and_mesh):
    state, _ = state_and_mesh
    ckpt = checkpointing.Checkpointer(str(tmp_path), keep=3)
    ckpt.save(1, state, checkpointing.Progress(version=1, min_version=1, rng_key=(0, 1)))
    ckpt.close()
    # What a SIGKILL during a save leaves behind: a temporary directory orbax never committed.
    (tmp_path / "2.orbax-checkpoint-tmp-123").mkdir()
    again = checkpointing.Checkpointer(str(tmp_path), keep=3)
    assert again.latest_step() == 1
    again.close()


def test_checkpoints_share_the_params_io_lock(tmp_path, state_and_mesh, monkeypatch):
    """Checkpoints (the loop's thread) and weight pushes (the pusher's) take one process-wide lock:
    concurrent orbax operations of one process can wait forever on each other's signals."""
    state, mesh = state_and_mesh
    ckpt = checkpointing.Checkpointer(str(tmp_path), keep=2)
    held = []
    manager = ckpt._manager
    for name in ("save", "restore"):
        real = getattr(manager, name)

        def recording(*args, _real=real, _name=name, **kwargs):
            held.append((_name, params_io.ORBAX_LOCK.locked()))
            return _real(*args, **kwargs)

        monkeypatch.setattr(manager, name, recording)
    ckpt.save(1, state, checkpointing.Progress(version=1, min_version=1, rng_key=(0, 1)))
    ckpt.restore(1, checkpointing.abstract_train_state(MODEL_CFG, OPTIMIZER, mesh))
    ckpt.close()
    assert held == [("save", True), ("restore", True)]
    assert not params_io.ORBAX_LOCK.locked()


def test_url_checkpoint_dir_reaches_orbax_unchanged(tmp_path, monkeypatch):
    """No network: orbax's manager is replaced by a recorder. The real one resolves the URL with
    etils epath (TensorFlow's gfile or gcsfs for gs://) and needs GCS credentials; test_gcs.py
    runs it against a local emulator."""
    opened = []

    class RecordingManager:
        def __init__(self, directory, **kwargs):
            opened.append(directory)

        def close(self):
            pass

    monkeypatch.setattr(checkpointing.ocp, "CheckpointManager", RecordingManager)
    monkeypatch.chdir(tmp_path)
    url = "gs://bucket/sat-jax/run-1/checkpoints"
    cfg = load_config(None, [f"train.checkpoint_dir={url}", "train.run_dir=runs/gs_test"])
    run_dir, ckpt_dir, weights_dir = setup.run_paths(cfg)
    assert ckpt_dir == url
    assert (run_dir, weights_dir) == ("runs/gs_test", "runs/gs_test/weights")
    with checkpointing.Checkpointer(ckpt_dir, keep=2):
        pass
    assert opened == [url]
    assert not list(tmp_path.rglob("gs*")), "a local directory was made for the URL"
    # Local paths still become absolute (orbax needs them so).
    checkpointing.Checkpointer("rel/ckpt", keep=2).close()
    assert opened[-1] == str(tmp_path / "rel" / "ckpt")


def test_the_checkpoint_part_opens_its_directory_and_keeps_its_number(tmp_path, state_and_mesh):
    state, _ = state_and_mesh
    cfg = load_config(None, [f"train.run_dir={tmp_path}", "train.keep_checkpoints=2"])
    progress = checkpointing.Progress(version=1, min_version=1, rng_key=(0, 1))
    with checkpointing.Checkpointer.from_config(cfg.train.checkpoints, str(tmp_path)) as ckpt:
        for step in (1, 2, 3):
            ckpt.save(step, state, progress)
        assert ckpt.all_steps() == [2, 3]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["2", "3"]
    assert setup.run_paths(cfg)[1] == str(tmp_path / "checkpoints")
