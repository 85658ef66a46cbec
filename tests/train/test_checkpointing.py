"""Checkpoints: round trip onto the shardings, keep-N, progress, a kill mid-save, the orbax lock
shared with weight pushes, a gs:// directory reaching orbax unchanged, and LoRA checkpoints
(adapters only, resumed onto the rebuilt base; another base is refused by its fingerprint)."""

from __future__ import annotations

import pathlib
import subprocess
import sys
import threading

import jax
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

from sat_jax import params_io, sharding
from sat_jax.experiment import load_config
from sat_jax.model import ModelConfig, placement
from sat_jax.step import (
    StepConfig,
    TrainBatch,
    init_train_state,
    make_train_step,
    shard_batch,
    train_state_shardings,
)
from tests.workers import REPO, cpu_env
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
    cfg = load_config(None, [f"train.checkpoint.dir={url}", "train.run_dir=runs/gs_test"])
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
    cfg = load_config(None, [f"train.run_dir={tmp_path}", "train.checkpoint.keep=2"])
    progress = checkpointing.Progress(version=1, min_version=1, rng_key=(0, 1))
    with checkpointing.Checkpointer.from_config(cfg.train.checkpoint, str(tmp_path)) as ckpt:
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
    optimizer = cfg.train.optimizer.make(cfg.train.steps)
    step_fn = make_train_step(
        cfg.model, optimizer, StepConfig(loss=cfg.train.loss, routing_replay=False), mesh
    )
    batch = shard_batch(_lora_batch(cfg), mesh)
    base = lambda seed: placement.init_sharded(cfg.model, mesh, seed)[1]

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
    _, params = placement.init_sharded(cfg, one, 0)
    _, abstract = placement.abstract_model(cfg)
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


def _progress(version: int = 1) -> checkpointing.Progress:
    return checkpointing.Progress(version=version, min_version=1, rng_key=(0, 1))


def test_a_background_save_holds_its_steps_state_while_the_next_steps_donate_it(tmp_path):
    """``save`` returns before the write commits; the steps after it donate the state's buffers,
    and the checkpoint is still exactly the state of its own step."""
    cfg = load_config(None, [])
    mesh = sharding.make_mesh(sharding.MeshConfig(fsdp=1), jax.devices()[:1])
    optimizer = cfg.train.optimizer.make(cfg.train.steps)
    step_fn = make_train_step(
        cfg.model, optimizer, StepConfig(loss=cfg.train.loss, routing_replay=False), mesh
    )
    batch = shard_batch(_lora_batch(cfg), mesh)
    state = init_train_state(cfg.model, optimizer, mesh, 0)
    state, _ = step_fn(state, batch)
    saved = _host(state)
    ckpt = checkpointing.Checkpointer(str(tmp_path), keep=2)
    assert ckpt.save(1, state, _progress())
    for _ in range(3):  # each call donates the state the checkpoint was taken of
        state, metrics = step_fn(state, batch)
        assert float(metrics["step_skipped"]) == 0.0
    ckpt.close()
    again = checkpointing.Checkpointer(str(tmp_path), keep=2)
    restored, _ = again.restore(1, checkpointing.abstract_train_state(cfg.model, optimizer, mesh))
    again.close()
    _assert_equal(_host(restored), saved)
    assert int(restored.step) == 1 and int(state.step) == 4


def test_at_most_one_save_in_flight_and_orbax_waits_for_its_commit(
    tmp_path, state_and_mesh, monkeypatch
):
    state, _ = state_and_mesh
    ckpt = checkpointing.Checkpointer(str(tmp_path), keep=3)
    release = threading.Event()
    real_commit = ckpt._commit

    def held_commit(step):
        release.wait()
        real_commit(step)

    monkeypatch.setattr(ckpt, "_commit", held_commit)
    assert ckpt.save(1, state, _progress())  # returns with the write not yet committed
    assert params_io.ORBAX_LOCK.locked()  # a weight push waits for the commit
    second = threading.Thread(target=ckpt.save, args=(2, state, _progress(2)))
    second.start()
    second.join(0.5)
    assert second.is_alive()  # the second save waits for the first
    release.set()
    second.join()
    ckpt.close()
    assert not params_io.ORBAX_LOCK.locked()
    again = checkpointing.Checkpointer(str(tmp_path), keep=3)
    assert again.all_steps() == [1, 2]
    again.close()


@pytest.mark.parametrize("where", ["start", "background"])
def test_a_failed_save_is_logged_training_goes_on_and_the_next_one_writes(
    tmp_path, state_and_mesh, monkeypatch, caplog, where
):
    state, mesh = state_and_mesh
    ckpt = checkpointing.Checkpointer(str(tmp_path / "ckpt"), keep=3)
    assert ckpt.save(1, state, _progress())
    ckpt.wait()
    name = "save" if where == "start" else "wait_until_finished"
    real = getattr(ckpt._manager, name)
    calls = []

    def failing_once(*args, **kwargs):
        # In the background case only the commit thread's wait fails (orbax's save also waits
        # for the save before it, on the loop's thread).
        ours = where == "start" or threading.current_thread().name.startswith("checkpoint-")
        if ours:
            calls.append(1)
        if ours and len(calls) == 1:
            raise OSError(28, "No space left on device")
        return real(*args, **kwargs)

    monkeypatch.setattr(ckpt._manager, name, failing_once)
    with caplog.at_level("ERROR", "train"):
        started = ckpt.save(2, state, _progress(2))
        ckpt.wait()
    assert started == (where == "background") and ckpt.failures == 1
    assert not params_io.ORBAX_LOCK.locked()
    [record] = [r for r in caplog.records if "checkpoint 2" in r.getMessage()]
    assert str(tmp_path / "ckpt") in record.getMessage()
    assert "No space left on device" in record.getMessage()
    # A save that fails at its start writes nothing. The background failure here is injected
    # into the wait after orbax's own write, which committed; either way checkpoint 1 stays whole.
    assert ckpt.latest_step() == (1 if where == "start" else 2)
    abstract = checkpointing.abstract_train_state(MODEL_CFG, OPTIMIZER, mesh)
    restored, got = ckpt.restore(1, abstract)
    assert got == _progress() and int(restored.step) == int(state.step)
    assert ckpt.save(3, state, _progress(3))
    ckpt.close()
    again = checkpointing.Checkpointer(str(tmp_path / "ckpt"), keep=3)
    assert again.latest_step() == 3
    again.close()


@pytest.mark.slow  # a checkpointing process, killed
def test_a_kill_during_a_background_save_leaves_a_whole_checkpoint_to_resume_from(tmp_path):
    proc = subprocess.Popen(
        [sys.executable, str(pathlib.Path(__file__).with_name("checkpoint_kill_worker.py")),
         str(tmp_path)],
        cwd=REPO, env=cpu_env(""), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("saving 2"):
                proc.kill()
                break
    finally:
        proc.kill()
        proc.wait(timeout=60)
    assert any(x.startswith("saving 2") for x in lines), "".join(lines)
    ckpt = checkpointing.Checkpointer(str(tmp_path), keep=3)
    latest = ckpt.latest_step()
    ckpt.close()
    # Checkpoint 1 was committed; 2 is there only if its commit beat the kill. Either way the
    # latest is whole and holds its own step's values.
    assert latest in (1, 2)
    restored = ocp.StandardCheckpointer().restore(str(tmp_path / str(latest) / "state"))
    assert int(restored["step"]) == latest
    for i in range(16):
        np.testing.assert_array_equal(np.asarray(restored["params"][f"w{i}"]), latest + i)
