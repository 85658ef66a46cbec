"""Parameter shardings and sharded initialization of the policy model.

Applies the logical-axis rules of ``sat_jax.parallel.rules`` to the model's parameters (each names
its dimensions through the NNX ``out_sharding`` metadata), and re-exports the rules' public names, so
``sharding.make_mesh``, ``sharding.MeshConfig``, ``sharding.batch_spec``, ... keep one home for a
caller (``from sat_jax.parallel import sharding``; ``sat_jax.sharding`` is the same module's stable
short name). See ``sat_jax.parallel.rules`` for the divisibility policy.

LoRA (``ModelConfig.lora.rank`` > 0): ``split_lora`` parts a params tree (or any tree of the same
nested-dict layout: shardings, specs, shapes) into the frozen base and the adapters, ``join_lora``
puts them back together, and ``init_lora`` makes fresh adapters on their own (for a base read
from a checkpoint).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from sat_jax.model.config import ModelConfig
from sat_jax.model.layers import is_lora_path
from sat_jax.model.transformer import Transformer
from sat_jax.parallel.rules import (
    LOGICAL_AXIS_RULES,
    MESH_AXES,
    PARAM_SHARDING_EXCEPTIONS,
    AnyMesh,
    MeshConfig,
    _axis_sizes,
    _check_spec,
    abstract_mesh,
    batch_axes,
    batch_spec,
    constrain_batch,
    logical_to_spec,
    make_mesh,
)

__all__ = [
    "LOGICAL_AXIS_RULES",
    "MESH_AXES",
    "PARAM_SHARDING_EXCEPTIONS",
    "AnyMesh",
    "MeshConfig",
    "abstract_adapters",
    "abstract_mesh",
    "abstract_model",
    "batch_axes",
    "batch_spec",
    "constrain_batch",
    "init_lora",
    "init_sharded",
    "join_lora",
    "logical_to_spec",
    "make_mesh",
    "param_shardings",
    "param_specs",
    "split_lora",
]


def _flat_variables(state: nnx.State | nnx.Module) -> list[tuple[tuple[Any, ...], nnx.Variable]]:
    if isinstance(state, nnx.Module):
        state = nnx.state(state)
    return [(tuple(path), var) for path, var in nnx.to_flat_state(state)]


def _nest(flat: Sequence[tuple[tuple[Any, ...], Any]]) -> dict:
    out: dict = {}
    for path, value in flat:
        node = out
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return out


def param_specs(
    abstract_state: nnx.State | nnx.Module,
    mesh: AnyMesh | Mapping[str, int],
    *,
    rules: Sequence[tuple[str, str | tuple[str, ...] | None]] = LOGICAL_AXIS_RULES,
    exceptions: Sequence[tuple[str, PartitionSpec]] = PARAM_SHARDING_EXCEPTIONS,
) -> dict:
    """``PartitionSpec`` per variable, read from each variable's ``out_sharding`` logical names.

    Args:
      abstract_state: an ``nnx.State`` (e.g. from ``nnx.split(nnx.eval_shape(...))``) or module.
      mesh: a ``Mesh``, ``AbstractMesh`` or ``{axis: size}`` mapping.
      rules: the logical-to-mesh table.
      exceptions: ordered ``(regex, spec)`` overrides on the ``/``-joined path; first match wins.

    Returns:
      A nested dict with the structure of ``abstract_state.to_pure_dict()``.
    """
    sizes = _axis_sizes(mesh)
    flat = []
    for path, var in _flat_variables(abstract_state):
        name = "/".join(str(k) for k in path)
        shape = tuple(np.shape(var.get_value()))
        spec = next((s for rx, s in exceptions if re.search(rx, name)), None)
        if spec is not None:
            _check_spec(name, spec, shape, sizes)
        else:
            logical = var.get_metadata().get("out_sharding") or (None,) * len(shape)
            try:
                spec = logical_to_spec(logical, shape=shape, mesh=sizes, rules=rules)
            except ValueError as e:
                raise ValueError(f"parameter {name!r}: {e}") from None
        flat.append((path, spec))
    return _nest(flat)


def param_shardings(
    abstract_state: nnx.State | nnx.Module,
    mesh: Mesh,
    *,
    rules: Sequence[tuple[str, str | tuple[str, ...] | None]] = LOGICAL_AXIS_RULES,
    exceptions: Sequence[tuple[str, PartitionSpec]] = PARAM_SHARDING_EXCEPTIONS,
) -> dict:
    """``NamedSharding`` per variable on ``mesh``; see ``param_specs``."""
    specs = param_specs(abstract_state, mesh, rules=rules, exceptions=exceptions)
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=_is_spec)


def _is_spec(x: Any) -> bool:
    return isinstance(x, PartitionSpec)


def abstract_model(model_cfg: ModelConfig) -> tuple[nnx.GraphDef, nnx.State]:
    """``(graphdef, abstract state)`` of a ``Transformer`` via ``nnx.eval_shape`` (no allocation)."""
    model = nnx.eval_shape(lambda: Transformer(model_cfg, rngs=nnx.Rngs(0)))
    return nnx.split(model)


def init_sharded(model_cfg: Any, mesh: Mesh, rng: int | jax.Array = 0) -> tuple[nnx.GraphDef, dict]:
    """Initializes a ``Transformer`` directly into its shardings on ``mesh``.

    ``nnx.eval_shape`` gives the abstract state, the rules give its shardings, and the init runs
    under ``jax.jit(..., out_shardings=...)``, so no parameter is ever materialized whole on one
    device. The values equal ``Transformer(model_cfg, rngs=nnx.Rngs(rng))``.

    Args:
      model_cfg: a ``sat_jax.model.ModelConfig``.
      mesh: the device mesh.
      rng: an int seed or a PRNG key.

    Returns:
      ``(graphdef, params)`` with ``params`` a plain nested dict of sharded arrays;
      ``nnx.merge(graphdef, params)`` rebuilds the module.
    """
    graphdef, abstract = abstract_model(model_cfg)
    shardings = param_shardings(abstract, mesh)
    key = jax.random.key(rng) if isinstance(rng, int) else rng

    def init(key: jax.Array) -> dict:
        return nnx.to_pure_dict(nnx.state(Transformer(model_cfg, rngs=nnx.Rngs(key))))

    return graphdef, jax.jit(init, out_shardings=shardings)(key)


def split_lora(tree: Mapping) -> tuple[dict, dict]:
    """``(base, adapters)``: a nested dict of the params' layout (``nnx.to_pure_dict``; leaves may
    be arrays, shardings, specs, shapes) parted by ``sat_jax.model.layers.is_lora_path``.

    Sub-dicts left empty are dropped, so without adapters ``base`` is ``tree`` and ``adapters``
    is ``{}``. ``join_lora(*split_lora(tree))`` equals ``tree``.
    """
    base: dict = {}
    adapters: dict = {}
    for path, leaf in _flat_dict(tree):
        _put(adapters if is_lora_path(path) else base, path, leaf)
    return base, adapters


def join_lora(base: Mapping, adapters: Mapping) -> dict:
    """The full params tree of ``split_lora``'s two parts (``nnx.merge`` takes it whole)."""
    out: dict = {}
    for part in (base, adapters):
        for path, leaf in _flat_dict(part):
            _put(out, path, leaf)
    return out


def _flat_dict(tree: Mapping, prefix: tuple = ()) -> list[tuple[tuple, Any]]:
    out = []
    for key, value in tree.items():
        if isinstance(value, Mapping):
            out += _flat_dict(value, (*prefix, key))
        else:
            out.append(((*prefix, key), value))
    return out


def _put(tree: dict, path: tuple, leaf: Any) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    if path[-1] in tree:
        raise ValueError(f"parameter {'/'.join(map(str, path))} is in both parts")
    tree[path[-1]] = leaf


def abstract_adapters(model_cfg: ModelConfig, mesh: Mesh) -> dict:
    """The LoRA adapters of ``model_cfg`` as ``jax.ShapeDtypeStruct``s in their shardings on
    ``mesh`` (the rules'), nothing allocated: what a loader restores adapters into.

    Raises:
      ValueError: ``model_cfg.lora.rank`` is 0.
    """
    if not model_cfg.lora.rank:
        raise ValueError("abstract_adapters needs model_cfg.lora.rank > 0")
    _, abstract = abstract_model(model_cfg)
    shardings = split_lora(param_shardings(abstract, mesh))[1]
    shapes = split_lora(nnx.to_pure_dict(abstract))[1]
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes, shardings
    )


def init_lora(model_cfg: ModelConfig, shardings: Any = None, rng: int | jax.Array = 0) -> dict:
    """Fresh LoRA adapters of ``model_cfg``: those of ``init_sharded(model_cfg, mesh, rng)`` (A
    random, fan-in scaled; B zero), for a base that comes from elsewhere (an HF checkpoint).

    The model's init runs under ``jax.jit`` with only the adapters as outputs, so the base's
    random init is dead code XLA drops: nothing of the base is computed or allocated.

    Args:
      model_cfg: a config with ``lora.rank`` > 0.
      shardings: the adapters' shardings (a nested dict, e.g. ``split_lora`` of
        ``param_shardings``), or None for the default device.
      rng: an int seed or a PRNG key.
    """
    if not model_cfg.lora.rank:
        raise ValueError("init_lora needs model_cfg.lora.rank > 0")
    key = jax.random.key(rng) if isinstance(rng, int) else rng

    def init(key: jax.Array) -> dict:
        model = Transformer(model_cfg, rngs=nnx.Rngs(key))
        return split_lora(nnx.to_pure_dict(nnx.state(model)))[1]

    return jax.jit(init, out_shardings=shardings)(key)
