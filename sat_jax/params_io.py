"""Server weights on disk: the policy's params alone, in one orbax format both ends share.

The trainer writes a weights version with `save_params` and the rollout server's `UpdateWeights`
restores it with `load_params` (docs/DESIGN.md §6, §7). The format is an orbax
`StandardCheckpointer` directory holding the params as a plain nested dict,
`nnx.to_pure_dict(nnx.state(model))`. Local paths are made absolute (orbax needs them so); URLs
such as ``gs://...`` reach orbax unchanged.

`ORBAX_LOCK` serialises every orbax save and restore of the process, these and the trainer's
checkpoints alike: orbax's completion signalling is not safe across concurrent operations of one
process (a save then waits for a signal that never comes, until its 300 s timeout).
"""

from __future__ import annotations

import os
import threading
from typing import Any

import jax
import orbax.checkpoint as ocp

# One orbax save or restore at a time in this process (see the module docstring).
ORBAX_LOCK = threading.Lock()


def save_params(path: str | os.PathLike[str], params: Any) -> None:
    """Writes `params` as a weights checkpoint at `path`, replacing one already there.

    Written by the calling process alone (no cross-process barrier): with several JAX processes
    only one of them saves, from a host copy of the whole params.

    Args:
      path: a local directory (made absolute) or a URL.
      params: a pytree of arrays (NumPy or jax).
    """
    me = jax.process_index()
    alone = ocp.options.MultiprocessingOptions(primary_host=me, active_processes={me})
    with ORBAX_LOCK, ocp.StandardCheckpointer(multiprocessing_options=alone) as checkpointer:
        checkpointer.save(absolute(path), params, force=True)
        checkpointer.wait_until_finished()


def load_params(path: str | os.PathLike[str], like: Any) -> Any:
    """Restores the params `save_params` wrote at `path`, shaped and sharded like `like`.

    Args:
      path: a local directory (made absolute) or a URL.
      like: a pytree of jax arrays or `jax.ShapeDtypeStruct`s giving each leaf's shape, dtype and
        sharding.

    Returns:
      The params, a pytree of the structure of `like`.

    Raises:
      Exception: whatever orbax raises for a missing directory, a directory that is not a
        checkpoint, or params of another structure (its types vary: FileNotFoundError,
        ValueError, KeyError, ...).
    """
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), like
    )
    with ORBAX_LOCK, ocp.StandardCheckpointer() as checkpointer:
        return checkpointer.restore(absolute(path), abstract)


def absolute(path: str | os.PathLike[str]) -> str:
    """`path` made absolute when local; a URL (anything with "://") unchanged."""
    path = os.fspath(path)
    return path if "://" in path else os.path.abspath(path)
