"""rollout_server.weights: the checkpoint-root policy and orbax round trip."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rollout_server.weights import (
    CheckpointPathError,
    load_params,
    resolve_under_root,
    save_params,
)


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


def test_save_load_round_trip_and_mismatch(tmp_path):
    params = {"w": jnp.arange(6.0).reshape(2, 3), "inner": {"b": jnp.ones(3, jnp.float32)}}
    save_params(tmp_path / "ck", params)
    back = load_params(tmp_path / "ck", params)
    jax.tree_util.tree_map(np.testing.assert_array_equal, back, params)
    with pytest.raises(CheckpointPathError):
        load_params(tmp_path / "ck", {"w": jnp.zeros((4, 4))})
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointPathError):
        load_params(tmp_path / "empty", params)
