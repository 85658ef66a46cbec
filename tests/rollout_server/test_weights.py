"""rollout_server.weights: the checkpoint-root policy; loading refusals are CheckpointPathError."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rollout_server.weights import CheckpointPathError, load_under_root, resolve_under_root
from sat_jax.params_io import save_flat, save_params


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
