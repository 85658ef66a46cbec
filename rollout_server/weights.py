"""Weights checkpoints for `UpdateWeights`: path policy and orbax loading.

Format (what the trainer writes): an orbax `StandardCheckpointer` directory holding the policy's
params as a plain nested dict, `nnx.to_pure_dict(nnx.state(model))`:

    ocp.StandardCheckpointer().save(path, params); checkpointer.wait_until_finished()
"""

from __future__ import annotations

import os
import pathlib
from typing import Any

import jax
import orbax.checkpoint as ocp


class CheckpointPathError(ValueError):
    """The checkpoint path is outside the configured root, or not a checkpoint directory."""


def resolve_under_root(path: str, root: str) -> pathlib.Path:
    """`path` resolved (symlinks included) if it is an existing directory inside `root`.

    Raises:
      CheckpointPathError: no root is configured, or the path escapes it or does not exist.
    """
    if not root:
        raise CheckpointPathError("the server has no checkpoint root: UpdateWeights is disabled")
    if not path or "\x00" in path or len(path) > 4096:
        raise CheckpointPathError("checkpoint_path must be a non-empty path")
    root_real = pathlib.Path(os.path.realpath(root))
    real = pathlib.Path(os.path.realpath(path))
    if real != root_real and root_real not in real.parents:
        raise CheckpointPathError(f"checkpoint_path {path!r} is outside the checkpoint root")
    if not real.is_dir():
        raise CheckpointPathError(f"checkpoint_path {path!r} is not a directory")
    return real


def load_params(path: pathlib.Path, like: Any) -> Any:
    """Restores params shaped (and sharded) like `like`.

    Raises:
      CheckpointPathError: the directory is not a checkpoint of params of that structure.
    """
    abstract = jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), like
    )
    try:
        with ocp.StandardCheckpointer() as checkpointer:
            return checkpointer.restore(path, abstract)
    except Exception as e:  # orbax raises many types for a bad or mismatched checkpoint
        raise CheckpointPathError(f"cannot restore params from {str(path)!r}: {e}") from e


def save_params(path: str | pathlib.Path, params: Any) -> None:
    """Writes `params` in the format `load_params` reads (for tests and benchmarks)."""
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(pathlib.Path(path).absolute(), params)
        checkpointer.wait_until_finished()
