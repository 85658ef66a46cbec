"""Weights for `UpdateWeights`: which paths the server may load, and loading them (docs/DESIGN.md
§5, §6, §10).

The formats are `sat_jax.params_io`'s, written by the trainer (`train.weight_sync.save_version`):
flat weights from a one-process trainer with a local weights directory, sharded weights from
several trainer processes with a local one (each process its own shards' files), an orbax
checkpoint for a URL; `params_io.load_params` tells them apart and the server restores any of
them into its engine's own shardings. The
server loads only directories inside its configured checkpoint root (symlinks resolved), so a
client cannot make it read arbitrary files; every refusal is a `CheckpointPathError`.

A whole-params push may be pre-quantized (docs/DESIGN.md §6.1): its index records its
`weight_dtype` (`params_io.stored_weight_dtype`), and it is restored into that format's layout
(`quant.abstract_quantized`: values on the weights' shardings, scales beside them) for the
engine to install (`MoEEngine.swap_params`). A format the server does not know is refused
before anything is read.

Under LoRA (`model.lora.rank` > 0) a push names two directories: the adapters alone
(`checkpoint_path`, a few MB to a few hundred) and the frozen base they apply to (`base_path`).
`WeightsLoader` keeps the last base it loaded (its adapted weights in host memory, the others
shared with the served params), reads a base only when a push names another one, and serves every
adapted weight merged, base + (alpha/rank)·A·B, so decoding runs at the base model's speed.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import pathlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from sat_jax import params_io, quant
from sat_jax.model.config import LoRAConfig
from sat_jax.model.layers import LORA_A, LORA_B, lora_delta


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


def load_under_root(
    path: str, root: str, like: Any, *, verify: bool = False
) -> tuple[pathlib.Path, Any]:
    """Loads the weights at `path`, which must lie inside `root`.

    Args:
      path: the checkpoint directory a client named.
      root: the server's checkpoint root ("" = loading disabled).
      like: the engine's current params (shapes, dtypes and shardings to restore into).
      verify: check flat weights' CRC-32 (`params_io.load_flat`): a restart reloading what the
        state names, which a crash of the machine may have torn (pushes are not fsynced).

    Returns:
      (the resolved path, the params shaped and sharded like `like`).

    Raises:
      CheckpointPathError: the path is refused (see `resolve_under_root`) or is not a checkpoint
        of params of that structure.
    """
    real = resolve_under_root(path, root)
    try:
        return real, params_io.load_params(real, like, verify=verify)
    except Exception as e:  # orbax raises many types for a bad or mismatched checkpoint
        raise CheckpointPathError(f"cannot restore params from {str(real)!r}: {e}") from e


@dataclasses.dataclass(frozen=True)
class Loaded:
    """What one `WeightsLoader.load` read.

    Attributes:
      path: the resolved checkpoint directory.
      params: the whole served params, shaped and sharded like the engine's.
      nbytes: bytes of weights read (the adapters, plus the base when one was loaded).
    """

    path: pathlib.Path
    params: Any
    nbytes: int


class WeightsLoader:
    """Turns what an `UpdateWeights` names into params the engine can swap in.

    Args:
      root: the server's checkpoint root ("" = loading disabled).
      lora: the trainer's LoRA config (`model.lora`); rank 0 = whole params only.
      adapters_like: with LoRA, the adapters' abstract tree in the serving mesh's shardings
        (`sat_jax.model.lora.abstract_adapters`); None without.

    Not thread-safe: the server calls it from its one weights thread.
    """

    def __init__(self, root: str, lora: LoRAConfig, adapters_like: Any = None):
        if lora.rank and adapters_like is None:
            raise ValueError("LoRA needs the adapters' abstract tree (adapters_like)")
        self._root = root
        self._lora = lora
        self._adapters_like = adapters_like
        self._targets: tuple[tuple[str, ...], ...] = ()
        if adapters_like is not None:
            flat = traverse_util.flatten_dict(adapters_like)
            self._targets = tuple(
                (*p[:-1], p[-1][: -len(LORA_A)]) for p in flat if p[-1].endswith(LORA_A)
            )
        # (resolved base path, its non-target leaves on device, its targets in host memory)
        self._kept: tuple[str, dict, dict] | None = None

    @property
    def kept_base(self) -> str:
        """The resolved path of the base kept for adapter pushes ("" = none)."""
        return self._kept[0] if self._kept else ""

    def load(
        self, checkpoint_path: str, base_path: str, like: Any, *, verify: bool = False
    ) -> Loaded:
        """Loads a push: whole params (``base_path`` "") or adapters over ``base_path``'s base.

        Args:
          checkpoint_path: the directory the client named (whole params, or the adapters).
          base_path: the base directory of a LoRA push ("" = none).
          like: the engine's current params (shapes, dtypes and shardings to restore into).
          verify: check flat weights' CRC-32 (`load_under_root`): a restart's reload.

        Raises:
          CheckpointPathError: a path is refused (`resolve_under_root`), is not a checkpoint of
            the expected structure, or the push and this server disagree about LoRA.
        """
        if not base_path:
            real = resolve_under_root(checkpoint_path, self._root)
            fmt = _stored_format(real)
            self._kept = None  # the served params stop being the kept base's
            like = quant.abstract_quantized(like, fmt)
            real, params = load_under_root(str(real), self._root, like, verify=verify)
            return Loaded(real, params, params_io.tree_bytes(params))
        if not self._lora.rank:
            raise CheckpointPathError(
                "the push carries LoRA adapters (base_path is set) but this server runs with "
                "model.lora.rank = 0: start it with the trainer's model.lora settings"
            )
        nbytes = 0
        base_real = resolve_under_root(base_path, self._root)
        for real in (base_real, resolve_under_root(checkpoint_path, self._root)):
            if quant.is_quantized(_stored_format(real)):
                raise CheckpointPathError(
                    f"{str(real)!r} holds pre-quantized weights: a LoRA push's base and adapters "
                    "are full precision (the server merges, then quantizes)"
                )
        if self.kept_base != str(base_real):
            self._kept = None
            _, base = load_under_root(str(base_real), self._root, like, verify=verify)
            nbytes += params_io.tree_bytes(base)
            self._keep(str(base_real), base)
        real, adapters = load_under_root(
            checkpoint_path, self._root, self._adapters_like, verify=verify
        )
        nbytes += params_io.tree_bytes(adapters)
        return Loaded(real, self._merge(adapters), nbytes)

    def _keep(self, path: str, base: Any) -> None:
        flat = traverse_util.flatten_dict(base)
        missing = [p for p in self._targets if p not in flat]
        if missing:
            raise CheckpointPathError(
                f"the base at {path!r} has no {'/'.join(map(str, missing[0]))}, which model.lora adapts"
            )
        host = {p: _to_host(flat.pop(p)) for p in self._targets}
        self._kept = (path, flat, host)

    def _merge(self, adapters: Any) -> Any:
        assert self._kept is not None
        _, others, host = self._kept
        flat_adapters = traverse_util.flatten_dict(adapters)
        flat = dict(others)
        scale = self._lora.scale
        for p in self._targets:
            w_host, device_sharding = host[p]
            a = flat_adapters[(*p[:-1], p[-1] + LORA_A)]
            b = flat_adapters[(*p[:-1], p[-1] + LORA_B)]
            w = jax.device_put(w_host, device_sharding)
            flat[p] = _merged(w, a, b, scale=scale)
        return traverse_util.unflatten_dict(flat)


def _stored_format(real: pathlib.Path) -> str:
    """The `weight_dtype` the version at ``real`` was written in (`params_io`).

    Raises:
      CheckpointPathError: a format this server cannot install.
    """
    fmt = params_io.stored_weight_dtype(real)
    if fmt not in quant.FORMATS:
        raise CheckpointPathError(
            f"checkpoint_path {str(real)!r} holds weights of weight_dtype {fmt!r}, which this "
            f"server cannot install (one of {', '.join(quant.FORMATS)})"
        )
    return fmt


@functools.partial(jax.jit, static_argnames=("scale",))
def _merged(w: jax.Array, a: jax.Array, b: jax.Array, *, scale: float) -> jax.Array:
    """W + scale · A B in float32, cast back to W's dtype."""
    f32 = jnp.float32
    delta = lora_delta(a.astype(f32), b.astype(f32), w.ndim)
    return (w.astype(f32) + scale * delta).astype(w.dtype)


def _to_host(x: jax.Array) -> tuple[Any, Any]:
    """(x in host memory, x's device sharding): pinned host memory in x's sharding where the
    backend has it (no gather), else a NumPy copy."""
    try:
        return jax.device_put(x, x.sharding.with_memory_kind("pinned_host")), x.sharding
    except (ValueError, jax.errors.JaxRuntimeError):  # a backend without pinned host memory
        return np.asarray(x), x.sharding
