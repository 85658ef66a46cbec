"""rollout_server.weights: the checkpoint-root policy; loading refusals are CheckpointPathError; a
restart reloads the pushed weights its state names, and refuses torn ones."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rollout_api.proto import rollout_pb2
from rollout_server.weights import CheckpointPathError, load_under_root, resolve_under_root
from sat_jax import sharding
from sat_jax.experiment import load_config
from sat_jax.model import placement
from sat_jax.params_io import FLAT_DATA, save_flat, save_params
from tests.rollout_server.conftest import CONFIG, SHAPES, stats


def test_resolve_under_root(tmp_path):
    root = tmp_path / "root"
    (root / "a" / "b").mkdir(parents=True)
    (tmp_path / "outside").mkdir()
    os.symlink(tmp_path / "outside", root / "link")
    assert resolve_under_root(str(root / "a" / "b"), str(root)) == root / "a" / "b"
    for bad in [
        str(tmp_path / "outside"),
        str(root / ".." / "outside"),
        str(root / "link"),
        str(root / "missing"),
        "",
        "a\x00b",
        "/",
    ]:
        with pytest.raises(CheckpointPathError):
            resolve_under_root(bad, str(root))
    with pytest.raises(CheckpointPathError, match="no checkpoint root"):
        resolve_under_root(str(root / "a"), "")


@pytest.mark.parametrize("save", [save_params, save_flat], ids=["orbax", "flat"])
def test_load_under_root_round_trip_and_refusals(tmp_path, save):
    root = tmp_path / "root"
    params = {"w": jnp.arange(6.0).reshape(2, 3), "inner": {"b": jnp.ones(3, jnp.float32)}}
    root.mkdir()
    save(root / "ck", params)
    real, back = load_under_root(str(root / "ck"), str(root), params)
    assert real == root / "ck"
    jax.tree_util.tree_map(np.testing.assert_array_equal, back, params)
    with pytest.raises(CheckpointPathError, match="cannot restore params"):
        load_under_root(str(root / "ck"), str(root), {"w": jnp.zeros((4, 4))})
    (root / "empty").mkdir()
    with pytest.raises(CheckpointPathError, match="cannot restore params"):
        load_under_root(str(root / "empty"), str(root), params)
    save(tmp_path / "outside", params)
    with pytest.raises(CheckpointPathError, match="outside the checkpoint root"):
        load_under_root(str(tmp_path / "outside"), str(root), params)
    with pytest.raises(CheckpointPathError, match="no checkpoint root"):
        load_under_root(str(root / "ck"), "", params)


@pytest.mark.slow  # starts server processes
def test_a_restart_reloads_pushed_flat_weights_and_refuses_torn_ones(server_factory, tmp_path):
    """Pushes are written without fsync, so a restart checks the CRC of the weights its state
    names: intact, it reloads them; torn (zeros where a crash of the machine lost the bytes), it
    says so and starts from version 0, waiting for the trainer's next push."""
    root = tmp_path / "root"
    overrides = [f"server.state_dir={tmp_path / 'state'}", f"server.checkpoint_root={root}"]
    served_cfg = load_config(str(CONFIG), [*SHAPES, *overrides]).serving_model
    mesh = sharding.make_mesh(sharding.MeshConfig(), jax.devices()[:1])
    _, params = placement.init_sharded(served_cfg, mesh, 3)
    save_flat(root / "v1", params, durable=False)
    first = server_factory(overrides)
    first.rollout_stub().UpdateWeights(
        rollout_pb2.UpdateWeightsRequest(version=1, checkpoint_path=str(root / "v1")), timeout=60
    )
    first.kill()

    second = server_factory(overrides)
    assert f"restored weights version 1 from {(root / 'v1').resolve()}" in second.log()
    assert stats(second.rollout_stub()).version == 1
    second.kill()

    data = root / "v1" / FLAT_DATA
    torn = bytearray(data.read_bytes())
    torn[len(torn) // 2 :] = bytes(len(torn) - len(torn) // 2)
    data.write_bytes(bytes(torn))
    third = server_factory(overrides)
    log = third.log()
    assert "cannot restore the persisted weights" in log and "CRC-32" in log, log
    assert stats(third.rollout_stub()).version == 0
    assert third.stop() == 0
