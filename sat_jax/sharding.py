"""Device meshes and the logical-axis rules: where every logical dimension name meets the mesh.

The model names every parameter and activation dimension logically ("embed", "exp", "mlp", "batch",
...); this module is the one table mapping those names to the physical mesh axes, and it knows
nothing of the model (the model imports it for ``constrain_batch``). ``param_specs`` and
``param_shardings`` apply the rules to any NNX module's parameters, each naming its dimensions through
the ``out_sharding`` metadata; ``sat_jax.model.placement`` initializes the policy into them.

* ``LOGICAL_AXIS_RULES`` maps each logical name to mesh axes (one table for the whole project);
* ``PARAM_SHARDING_EXCEPTIONS`` is an ordered list of ``(regex, PartitionSpec)`` pairs matched against a
  parameter's ``/``-joined path; the first match wins and overrides the table.

Divisibility policy: a parameter dimension that its mesh axes do not divide is not an error; the mesh
axes are dropped from the right until the product divides the dimension (usually leaving the dimension
replicated), so small models run on any mesh. A spec from the exceptions list is explicit, so a
mismatch there raises ``ValueError``. Batch dimensions are checked separately (``batch_spec``) and
raise, because silently replicating data would change the global batch.

Mesh axes: ``data`` (pure data parallel), ``fsdp`` (data parallel with parameters sharded over it),
``expert`` (expert parallel), ``tensor`` (tensor parallel over heads / MLP width / vocab).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec

MESH_AXES: tuple[str, ...] = ("data", "fsdp", "expert", "tensor")

# Logical axis -> mesh axis (or axes, major to minor, or None for replicated).
LOGICAL_AXIS_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    ("batch", ("data", "fsdp")),
    ("length", None),
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("q_heads", "tensor"),
    ("kv_heads", "tensor"),
    ("heads", "tensor"),
    ("head_dim", None),
    ("exp", "expert"),
    ("mlp", "tensor"),
    ("norm", None),
    ("layers", None),
    # LoRA adapters' inner width r: small, so every shard holds all of it.
    ("lora_rank", None),
)

# Ordered (regex on the "/"-joined param path, spec); first match wins over the rules table.
PARAM_SHARDING_EXCEPTIONS: tuple[tuple[str, PartitionSpec], ...] = (
    # The router is small and every token reads all of it; sharding its expert dimension would
    # add a gather per layer for no memory gain.
    (r"(^|/)[^/]*router[^/]*$", PartitionSpec()),
)

AnyMesh = Mesh | AbstractMesh


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeshConfig:
    """Sizes of the four mesh axes; ``-1`` (at most one axis) takes the remaining devices.

    Attributes:
      data: pure data-parallel axis size.
      fsdp: data-parallel axis over which parameters and optimizer state are sharded.
      expert: expert-parallel axis size.
      tensor: tensor-parallel axis size.
    """

    data: int = 1
    fsdp: int = -1
    expert: int = 1
    tensor: int = 1

    def __post_init__(self) -> None:
        fill = []
        for name in MESH_AXES:
            size = getattr(self, name)
            if isinstance(size, bool) or not isinstance(size, int | np.integer):
                raise TypeError(f"MeshConfig.{name} must be an int, got {size!r}")
            if size == -1:
                fill.append(name)
            elif size < 1:
                raise ValueError(f"MeshConfig.{name} must be >= 1 or -1 (fill), got {size}")
        if len(fill) > 1:
            raise ValueError(f"MeshConfig: at most one axis may be -1, got {', '.join(fill)}")

    @classmethod
    def parse(cls, text: str) -> MeshConfig:
        """Parses ``"fsdp=64"`` or ``"data=2,fsdp=-1"``; axes not named get size 1."""
        sizes: dict[str, int] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            name, sep, value = part.partition("=")
            name = name.strip()
            if not sep or name not in MESH_AXES:
                raise ValueError(
                    f"bad mesh entry {part!r} in {text!r}: expected AXIS=SIZE with AXIS in "
                    f"{', '.join(MESH_AXES)}"
                )
            if name in sizes:
                raise ValueError(f"mesh axis {name!r} given twice in {text!r}")
            try:
                sizes[name] = int(value)
            except ValueError:
                raise ValueError(f"mesh axis {name!r}: size {value!r} is not an integer") from None
        if not sizes:
            raise ValueError(f"empty mesh string {text!r}: expected e.g. 'fsdp=8'")
        return cls(**{name: sizes.get(name, 1) for name in MESH_AXES})

    def axis_sizes(self, num_devices: int) -> dict[str, int]:
        """Resolves ``-1`` against ``num_devices``; the product must equal ``num_devices``."""
        sizes = {name: getattr(self, name) for name in MESH_AXES}
        known = math.prod(s for s in sizes.values() if s != -1)
        for name, size in sizes.items():
            if size == -1:
                if num_devices % known:
                    raise ValueError(
                        f"MeshConfig.{name}=-1: {num_devices} devices are not divisible by the "
                        f"product {known} of the other axes {sizes}"
                    )
                sizes[name] = num_devices // known
        if math.prod(sizes.values()) != num_devices:
            raise ValueError(
                f"MeshConfig {sizes} has {math.prod(sizes.values())} devices but "
                f"{num_devices} are available; set one axis to -1 or fix the sizes"
            )
        return sizes


def make_mesh(cfg: MeshConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """Builds a ``Mesh`` with axes ``MESH_AXES`` (all ``Auto``) over ``devices`` (default: all)."""
    devices = list(jax.devices() if devices is None else devices)
    sizes = cfg.axis_sizes(len(devices))
    shape = tuple(sizes[name] for name in MESH_AXES)
    auto = (jax.sharding.AxisType.Auto,) * len(MESH_AXES)
    return jax.make_mesh(shape, MESH_AXES, axis_types=auto, devices=devices)


def abstract_mesh(cfg: MeshConfig, num_devices: int) -> AbstractMesh:
    """A device-free mesh of ``num_devices`` for planning (no devices are touched)."""
    sizes = cfg.axis_sizes(num_devices)
    return AbstractMesh(tuple(sizes[name] for name in MESH_AXES), MESH_AXES)


def _axis_sizes(mesh: AnyMesh | Mapping[str, int]) -> dict[str, int]:
    return dict(mesh.shape) if isinstance(mesh, Mesh | AbstractMesh) else dict(mesh)


def logical_to_spec(
    logical_axes: Sequence[str | None],
    *,
    shape: Sequence[int] | None = None,
    mesh: AnyMesh | Mapping[str, int] | None = None,
    rules: Sequence[tuple[str, str | tuple[str, ...] | None]] = LOGICAL_AXIS_RULES,
) -> PartitionSpec:
    """Maps logical axis names to a ``PartitionSpec`` through ``rules``.

    A mesh axis is used at most once per spec (a later dimension mapping to an already used axis is
    left unsharded). With ``mesh``, mesh axes absent from it are dropped; with ``shape`` too, mesh axes
    are dropped from the right until their product divides the dimension (see the module docstring).

    Args:
      logical_axes: one name (or None) per dimension.
      shape: the array shape, for the divisibility fallback.
      mesh: a ``Mesh``, ``AbstractMesh`` or ``{axis: size}`` mapping.
      rules: the logical-to-mesh table.

    Returns:
      The ``PartitionSpec``, one entry per dimension.

    Raises:
      ValueError: a logical name missing from ``rules``, or ``shape`` of a different rank.
    """
    table = dict(rules)
    sizes = None if mesh is None else _axis_sizes(mesh)
    if shape is not None and len(shape) != len(logical_axes):
        raise ValueError(f"logical axes {tuple(logical_axes)} do not match shape {tuple(shape)}")
    used: set[str] = set()
    entries: list[str | tuple[str, ...] | None] = []
    for dim, name in enumerate(logical_axes):
        if name is None:
            entries.append(None)
            continue
        if name not in table:
            raise ValueError(f"logical axis {name!r} has no entry in the sharding rules table")
        target = table[name]
        axes = [] if target is None else [target] if isinstance(target, str) else list(target)
        axes = [a for a in axes if a not in used and (sizes is None or a in sizes)]
        if shape is not None and sizes is not None:
            while axes and shape[dim] % math.prod(sizes[a] for a in axes):
                axes.pop()
        used.update(axes)
        entries.append(None if not axes else axes[0] if len(axes) == 1 else tuple(axes))
    return PartitionSpec(*entries)


def _check_spec(
    path: str, spec: PartitionSpec, shape: Sequence[int], sizes: dict[str, int]
) -> None:
    if len(spec) > len(shape):
        raise ValueError(f"exception spec {spec} for {path!r} has more entries than shape {shape}")
    for dim, entry in zip(shape, spec, strict=False):
        axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        unknown = [a for a in axes if a not in sizes]
        if unknown:
            raise ValueError(
                f"exception spec {spec} for {path!r} names unknown mesh axes {unknown}"
            )
        if dim % math.prod(sizes[a] for a in axes):
            raise ValueError(f"exception spec {spec} for {path!r} does not divide shape {shape}")


def batch_axes(mesh: AnyMesh | Mapping[str, int]) -> tuple[str, ...]:
    """The mesh axes the ``"batch"`` logical axis maps to (those present in ``mesh``)."""
    sizes = _axis_sizes(mesh)
    return tuple(a for a in dict(LOGICAL_AXIS_RULES)["batch"] if a in sizes)


def batch_spec(batch_size: int, mesh: AnyMesh | Mapping[str, int], ndim: int = 1) -> PartitionSpec:
    """Spec sharding dimension 0 over the ``"batch"`` mesh axes; raises if they do not divide it."""
    sizes = _axis_sizes(mesh)
    axes = batch_axes(sizes)
    shards = math.prod(sizes[a] for a in axes)
    if batch_size % shards:
        raise ValueError(
            f"batch size {batch_size} is not divisible by the {shards} data shards "
            f"({' x '.join(f'{a}={sizes[a]}' for a in axes)})"
        )
    return PartitionSpec(axes, *(None,) * (ndim - 1))


def constrain_batch(x: jax.Array) -> jax.Array:
    """``x`` [B, ...] constrained to dimension 0 over the batch axes of the ambient mesh.

    A no-op outside ``jax.set_mesh`` (``make_train_step`` traces under its mesh) or when those
    axes do not divide B. Scan carries need it: XLA's propagation can leave a loop's carry
    replicated, which would run every row on every device.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x
    sizes = _axis_sizes(mesh)
    if x.shape[0] % math.prod(sizes[a] for a in batch_axes(sizes)):
        return x
    return jax.lax.with_sharding_constraint(x, batch_spec(x.shape[0], sizes, x.ndim))


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
