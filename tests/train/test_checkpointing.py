"""Checkpoints: round trip onto the shardings, keep-N, progress, a kill mid-save, the orbax lock
shared with weight pushes, a gs:// directory reaching orbax unchanged, and LoRA checkpoints
(adapters only, resumed onto the rebuilt base; another base is refused by its fingerprint)."""

from __future__ import annotations

import jax
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

from sat_jax import params_io
from sat_jax.experiment import load_config
from sat_jax.model import ModelConfig
from sat_jax.parallel import sharding
from sat_jax.step import (
    StepConfig,
    TrainBatch,
    init_train_state,
    make_train_step,
    shard_batch,
    train_state_shardings,
)
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


def _lora_batch(cfg) -> TrainBatch:
    rng = np.random.default_rng(0)
    b, t = 4, 10
    mask = np.zeros((b, t), np.float32)
    mask[:, 4:] = 1.0
    return TrainBatch(
        tokens=rng.integers(0, cfg.model.vocab_size, (b, t)).astype(np.int32),
        loss_mask=mask,
        behavior_logp=np.log(rng.uniform(0.01, 0.3, (b, t))).astype(np.float32),
        advantages=np.repeat(rng.normal(size=(b, 1)), t, 1).astype(np.float32),
    )


def _host(tree):
    return jax.tree.map(np.asarray, jax.device_get(tree))


def _assert_equal(got, want) -> None:
    got, want = (
        jax.tree_util.tree_flatten_with_path(got),
        jax.tree_util.tree_flatten_with_path(want),
    )
    assert got[1] == want[1]
    for (path, a), (_, b) in zip(got[0], want[0], strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=str(path))


def test_lora_checkpoint_holds_the_adapters_resumes_and_refuses_another_base(tmp_path):
    """A LoRA run (through train.main.start_or_resume): two steps, a checkpoint without the base,
    a resume onto the rebuilt base that restores adapters, optimizer state and step exactly and
    goes on as the uninterrupted run does, and a resume onto another base that fails naming it."""
    from train import main

    cfg = load_config(None, [f"train.run_dir={tmp_path}", "model.lora.rank=4"])
    mesh = sharding.make_mesh(sharding.MeshConfig(fsdp=2, expert=2), jax.devices()[:4])
    optimizer = cfg.train.optimizer.make()
    step_fn = make_train_step(
        cfg.model, optimizer, StepConfig(loss=cfg.train.loss, routing_replay=False), mesh
    )
    batch = shard_batch(_lora_batch(cfg), mesh)
    base = lambda seed: sharding.init_sharded(cfg.model, mesh, seed)[1]

    ckpt = checkpointing.Checkpointer(str(tmp_path / "ckpt"), keep=2)
    state, progress = main.start_or_resume(cfg, ckpt, optimizer, mesh, base(0))
    assert progress.base_fingerprint == checkpointing.base_fingerprint(state.frozen)
    for _ in range(2):
        state, metrics = step_fn(state, batch)
        assert float(metrics["step_skipped"]) == 0.0
    saved = _host(state)
    ckpt.save(2, state, progress)
    ckpt.close()
    # The checkpoint holds the adapters, their optimizer state and the step, not the base.
    meta = ocp.StandardCheckpointer().metadata(str(tmp_path / "ckpt" / "2" / "state"))
    meta = meta.item_metadata
    assert jax.tree.leaves(meta["frozen"]) == []
    paths = [p for p, _ in jax.tree_util.tree_leaves_with_path(meta["params"])]
    assert paths and all(str(p[-1].key).endswith(("_lora_a", "_lora_b")) for p in paths)

    again = checkpointing.Checkpointer(str(tmp_path / "ckpt"), keep=2)
    restored, got = main.start_or_resume(cfg, again, optimizer, mesh, base(0))
    assert got == progress and int(restored.step) == 2
    _assert_equal(_host(restored.params), saved.params)
    _assert_equal(_host(restored.opt_state), saved.opt_state)
    _assert_equal(_host(restored.frozen), saved.frozen)
    # Going on from the restored state is going on from the saved one.
    after_restore, _ = step_fn(restored, batch)
    after_saved, _ = step_fn(
        jax.device_put(saved, train_state_shardings(cfg.model, optimizer, mesh)), batch
    )
    _assert_equal(_host(after_restore.params), _host(after_saved.params))

    with pytest.raises(checkpointing.BaseMismatch, match=r"checkpoint 2: the base model differs"):
        main.start_or_resume(cfg, again, optimizer, mesh, base(1))
    other = base(0)
    other["layers"][1]["attn"]["w_q_dnh"] = other["layers"][1]["attn"]["w_q_dnh"] * 1.001
    with pytest.raises(
        checkpointing.BaseMismatch, match=r"1 of \d+ tensors differ: layers/1/attn/w_q"
    ):
        main.start_or_resume(cfg, again, optimizer, mesh, other)
    again.close()


def test_base_fingerprint_is_exact_and_independent_of_the_sharding():
    cfg = MODEL_CFG
    one = sharding.make_mesh(sharding.MeshConfig(fsdp=1), jax.devices()[:1])
    eight = sharding.make_mesh(sharding.MeshConfig(fsdp=2, expert=2, tensor=2))
    _, params = sharding.init_sharded(cfg, one, 0)
    _, abstract = sharding.abstract_model(cfg)
    spread = jax.device_put(params, sharding.param_shardings(abstract, eight))
    assert checkpointing.base_fingerprint(params) == checkpointing.base_fingerprint(spread)
    # One bit of one element, or two elements swapped, change that leaf's hash only.
    flipped = dict(params, final_norm={"scale": params["final_norm"]["scale"].at[3].multiply(-1.0)})
    w = params["embedding_vd"]
    swapped = dict(params, embedding_vd=w.at[0, 0].set(w[0, 1]).at[0, 1].set(w[0, 0]))
    base = checkpointing.base_fingerprint(params)
    for changed, name in ((flipped, "final_norm/scale"), (swapped, "embedding_vd")):
        got = checkpointing.base_fingerprint(changed)
        assert [k for k in base if got[k] != base[k]] == [name]
