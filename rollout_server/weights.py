"""Weights for `UpdateWeights`: which paths the server may load, and loading them (docs/DESIGN.md
§6, §10).

The format is `sat_jax.params_io`'s, written by the trainer with `params_io.save_params` (each
trainer process its own shards); the server restores it into its engine's own shardings. The
server loads only directories inside its configured checkpoint root (symlinks resolved), so a
client cannot make it read arbitrary files; every refusal is a `CheckpointPathError`.
"""

from __future__ import annotations

import os
import pathlib
from typing import Any

from sat_jax import params_io


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


def load_under_root(path: str, root: str, like: Any) -> tuple[pathlib.Path, Any]:
    """Loads the weights at `path`, which must lie inside `root`.

    Args:
      path: the checkpoint directory a client named.
      root: the server's checkpoint root ("" = loading disabled).
      like: the engine's current params (shapes, dtypes and shardings to restore into).

    Returns:
      (the resolved path, the params shaped and sharded like `like`).

    Raises:
      CheckpointPathError: the path is refused (see `resolve_under_root`) or is not a checkpoint
        of params of that structure.
    """
    real = resolve_under_root(path, root)
    try:
        return real, params_io.load_params(real, like)
    except Exception as e:  # orbax raises many types for a bad or mismatched checkpoint
        raise CheckpointPathError(f"cannot restore params from {str(real)!r}: {e}") from e
