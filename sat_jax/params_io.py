"""Server weights on disk: the policy's params alone, in one orbax format both ends share.

The trainer writes a weights version with `save_params` and the rollout server's `UpdateWeights`
restores it with `load_params` (docs/DESIGN.md §6, §7). The format is an orbax
`StandardCheckpointer` directory holding the params as a plain nested dict,
`nnx.to_pure_dict(nnx.state(model))`. Local paths are made absolute (orbax needs them so); URLs
such as ``gs://...`` reach orbax unchanged.

`ORBAX_LOCK` serialises every orbax save and restore of the process, these and the trainer's
checkpoints alike: orbax's completion signalling is not safe across concurrent operations of one
process (a save then waits for a signal that never comes, until its 300 s timeout).

Importing this module also works around a leak on orbax's write and read paths
(`leak_free_kvstore_specs`): every array saved or restored otherwise keeps ~220 bytes of Python
strings for good, so a trainer pushing weights every step grows without bound (docs/DESIGN.md §7.3).
"""

from __future__ import annotations

import ast
import math
import os
import threading
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts
from orbax.checkpoint._src.serialization import tensorstore_utils

# One orbax save or restore at a time in this process (see the module docstring).
ORBAX_LOCK = threading.Lock()


def save_params(path: str | os.PathLike[str], params: Any) -> None:
    """Writes `params` as a weights checkpoint at `path`, replacing one already there.

    With several JAX processes every process calls it with the same `path` (on storage they all
    reach) and writes only the shards of its own devices (replica 0 of each); process 0 finalizes
    the checkpoint after a barrier of the JAX distributed client (not a device collective, so a
    background thread may save while the main thread runs steps). No process gathers the params.

    Args:
      path: a local directory (made absolute) or a URL.
      params: a pytree of arrays: jax arrays (any sharding and memory kind) or NumPy arrays (taken
        as replicated: process 0 writes them).
    """
    everyone = ocp.options.MultiprocessingOptions(
        primary_host=0, active_processes=set(range(jax.process_count()))
    )
    with ORBAX_LOCK, ocp.StandardCheckpointer(multiprocessing_options=everyone) as checkpointer:
        checkpointer.save(absolute(path), params, force=True)
        checkpointer.wait_until_finished()


def tree_bytes(params: Any) -> int:
    """Bytes of the arrays of `params` (whole arrays, whatever their sharding or memory kind;
    `jax.ShapeDtypeStruct`s count too, leaves without a shape and dtype count 0)."""
    return sum(
        math.prod(x.shape) * np.dtype(x.dtype).itemsize
        for x in jax.tree.leaves(params)
        if hasattr(x, "shape") and hasattr(x, "dtype")
    )


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


class _LeakFreeSpec:
    """A `ts.KvStore.Spec` whose `to_json()` (no arguments) is read from its repr."""

    def __init__(self, spec: ts.KvStore.Spec):
        self.spec = spec

    def to_json(self, *args: Any, **kwargs: Any) -> Any:
        text = repr(self.spec)
        prefix = "KvStore.Spec("
        if not (args or kwargs) and text.startswith(prefix) and text.endswith(")"):
            try:
                return ast.literal_eval(text[len(prefix) : -1])
            except (ValueError, SyntaxError):
                pass
        return self.spec.to_json(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.spec, name)


class _LeakFreeKvStore:
    """`ts.KvStore` for orbax's `tensorstore_utils`: `Spec(...)` wraps the spec in `_LeakFreeSpec`,
    `open` unwraps it; everything else is tensorstore's."""

    @staticmethod
    def Spec(*args: Any, **kwargs: Any) -> _LeakFreeSpec:
        return _LeakFreeSpec(ts.KvStore.Spec(*args, **kwargs))

    @staticmethod
    def open(spec: Any, *args: Any, **kwargs: Any) -> Any:
        return ts.KvStore.open(getattr(spec, "spec", spec), *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(ts.KvStore, name)


class _LeakFreeTensorstore:
    """The `tensorstore` module as orbax's `tensorstore_utils` sees it, with `_LeakFreeKvStore`."""

    KvStore = _LeakFreeKvStore()

    def __getattr__(self, name: str) -> Any:
        return getattr(ts, name)


def leak_free_kvstore_specs() -> None:
    """Makes orbax (0.12.8) resolve kvstore specs without tensorstore's leaking `to_json`.

    tensorstore's (0.1.86) `KvStore.Spec.to_json()` keeps one reference to every string of the
    dict it returns, and orbax calls it once per array on every save and restore
    (`tensorstore_utils._build_ocdbt_kvstore_tspec`). The spec's repr is the same dict as a Python
    literal and leaks nothing, so orbax's `tensorstore_utils` gets a `tensorstore` whose
    `KvStore.Spec(...).to_json()` parses the repr. Idempotent.
    """
    if not isinstance(tensorstore_utils.ts, _LeakFreeTensorstore):
        tensorstore_utils.ts = _LeakFreeTensorstore()


leak_free_kvstore_specs()


def absolute(path: str | os.PathLike[str]) -> str:
    """`path` made absolute when local; a URL (anything with "://") unchanged."""
    path = os.fspath(path)
    return path if "://" in path else os.path.abspath(path)
