"""8-bit quantization of served weights and of the decode KV cache (docs/DESIGN.md §6.1).

Pure functions. Two formats, both symmetric with float32 scales:
  * "int8": q = clip(round(x / scale), -127, 127), scale = amax / 127;
  * "fp8": q = float8_e4m3fn(x / scale), scale = amax / 448 (e4m3's largest finite value).
``"bfloat16"`` means "not quantized" (the served dtype stays ``server.dtype``).

Weights are quantized per output channel: the amax runs over each weight's contraction axes
(`CONTRACTION_AXES`, by the leaf's name), so every output channel (and every expert) has its own
scale. The router, the norms and the embedding are never quantized; the LM head is, unless tied
to the embedding. The KV cache is quantized per (layer, row, position, KV head): the amax runs
over head_dim, so writing one position never rescales another (the in-place write stays a
scatter). A `QTensor` is a pytree node: the quantized tree of a param dict goes through `jit`
as is, and `dequantize_params` turns it back into the model's param dict inside the program
(dequantize-on-use).

A trainer pushing to 8-bit servers quantizes the same way before it saves (`quantize_params` of
the serving-dtype cast), so the push carries the values and scales (about half the bytes);
`tree_format` names the format of such a tree and `abstract_quantized` is what its load restores
into.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

# What `server.weight_dtype` / `server.kv_cache_dtype` may name; "bfloat16" = unquantized.
FORMATS = ("bfloat16", "int8", "fp8")
_STORAGE = {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn}
_QMAX = {"int8": 127.0, "fp8": 448.0}
# Each quantized weight's contraction axes (the amax runs over them: one scale per output
# channel). Leaves of other names (router, norms, embedding, LoRA adapters) stay as they are.
CONTRACTION_AXES = {
    "w_q_dnh": (0,),
    "w_k_dgh": (0,),
    "w_v_dgh": (0,),
    "w_o_nhd": (0, 1),
    "w_gate_edf": (1,),
    "w_up_edf": (1,),
    "w_down_efd": (1,),
    "w_gate_df": (0,),
    "w_up_df": (0,),
    "w_down_fd": (0,),
    "lm_head_dv": (0,),
}


@struct.dataclass
class QTensor:
    """A quantized array: ``q`` (int8 or float8_e4m3fn) times ``scale`` (float32, broadcastable
    to ``q``), dequantized to ``dtype``."""

    q: jax.Array
    scale: jax.Array
    dtype: str = struct.field(pytree_node=False, default="bfloat16")


def check_format(name: str, key: str) -> None:
    """Raises ValueError (one line naming ``key``) unless ``name`` is one of `FORMATS`."""
    if name not in FORMATS:
        raise ValueError(f"{key} must be one of {', '.join(FORMATS)}, got {name!r}")


def is_quantized(fmt: str) -> bool:
    return fmt != "bfloat16"


def storage_dtype(fmt: str) -> jnp.dtype:
    """The dtype 8-bit values of ``fmt`` are stored in."""
    return jnp.dtype(_STORAGE[fmt])


def format_of(dtype: jnp.dtype) -> str:
    """The format whose storage dtype is ``dtype`` ("bfloat16" for any other dtype)."""
    for fmt, d in _STORAGE.items():
        if jnp.dtype(dtype) == jnp.dtype(d):
            return fmt
    return "bfloat16"


def quantize(x: jax.Array, fmt: str, axes: tuple[int, ...]) -> tuple[jax.Array, jax.Array]:
    """(q, scale) of ``x`` in ``fmt``, one float32 scale per slice over ``axes`` (kept as size-1
    dims): scale = amax / qmax (1 where the slice is all zero), q = x / scale rounded (int8:
    to nearest, clipped to ±127; fp8: e4m3's round to nearest even)."""
    x32 = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x32), axis=axes, keepdims=True)
    scale = jnp.where(amax > 0, amax / _QMAX[fmt], 1.0)
    y = x32 / scale
    if fmt == "int8":
        q = jnp.clip(jnp.round(y), -127, 127).astype(jnp.int8)
    else:
        q = jnp.clip(y, -448.0, 448.0).astype(jnp.float8_e4m3fn)
    return q, scale


def dequantize(q: jax.Array, scale: jax.Array, dtype) -> jax.Array:
    """q · scale in float32, cast to ``dtype``."""
    return (q.astype(jnp.float32) * scale).astype(dtype)


def fake_quantize(x: jax.Array, fmt: str, axes: tuple[int, ...]) -> jax.Array:
    """``dequantize(quantize(x))`` in ``x``'s dtype: what a reader of the 8-bit copy sees."""
    return dequantize(*quantize(x, fmt, axes), x.dtype)


def _leaf_name(path) -> str:
    last = path[-1]
    return str(getattr(last, "key", getattr(last, "name", last)))


def quantize_params(params, fmt: str):
    """``params`` (a param dict) with every weight of `CONTRACTION_AXES` replaced by its
    `QTensor` in ``fmt`` (unchanged for "bfloat16")."""
    if not is_quantized(fmt):
        return params

    def one(path, x):
        axes = CONTRACTION_AXES.get(_leaf_name(path))
        if axes is None:
            return x
        q, scale = quantize(x, fmt, axes)
        return QTensor(q=q, scale=scale, dtype=jnp.dtype(x.dtype).name)

    return jax.tree_util.tree_map_with_path(one, params)


def dequantize_params(params):
    """The param dict of a `quantize_params` tree: each `QTensor` dequantized to its dtype
    (other leaves as they are; a tree without any comes back unchanged)."""
    is_q = lambda x: isinstance(x, QTensor)
    return jax.tree.map(
        lambda x: dequantize(x.q, x.scale, x.dtype) if is_q(x) else x, params, is_leaf=is_q
    )


def _is_q(x) -> bool:
    return isinstance(x, QTensor)


def tree_format(params) -> str:
    """The format of ``params``' `QTensor` leaves: "bfloat16" when it has none (a full-precision
    tree).

    Raises:
      ValueError: leaves of two formats in one tree.
    """
    found = {format_of(x.q.dtype) for x in jax.tree.leaves(params, is_leaf=_is_q) if _is_q(x)}
    if len(found) > 1:
        raise ValueError(f"the params mix weight formats {sorted(found)}")
    return found.pop() if found else "bfloat16"


def _scale_sharding(sharding, axes: tuple[int, ...]):
    """The sharding of a scale reduced over ``axes`` of a weight sharded by ``sharding``: a
    `NamedSharding`'s spec with those axes unsharded; any other sharding as it is."""
    if not isinstance(sharding, jax.sharding.NamedSharding):
        return sharding
    spec = list(sharding.spec) + [None] * (max(axes, default=-1) + 1 - len(sharding.spec))
    for a in axes:
        spec[a] = None
    return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*spec))


def abstract_quantized(like, fmt: str):
    """The abstract tree of ``quantize_params(params, fmt)`` for params shaped like ``like`` (a
    tree of arrays or `jax.ShapeDtypeStruct`s): `jax.ShapeDtypeStruct`s, each `QTensor`'s values
    on its weight's sharding and its scale on that sharding less the contraction axes (what a
    load of a pre-quantized push restores into). ``like`` itself for "bfloat16"."""
    if not is_quantized(fmt):
        return like

    def one(path, x):
        sharding = getattr(x, "sharding", None)
        axes = CONTRACTION_AXES.get(_leaf_name(path))
        if axes is None:
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
        shape = tuple(1 if i in axes else n for i, n in enumerate(x.shape))
        scale_sharding = None if sharding is None else _scale_sharding(sharding, axes)
        return QTensor(
            q=jax.ShapeDtypeStruct(x.shape, storage_dtype(fmt), sharding=sharding),
            scale=jax.ShapeDtypeStruct(shape, jnp.float32, sharding=scale_sharding),
            dtype=jnp.dtype(x.dtype).name,
        )

    return jax.tree_util.tree_map_with_path(one, like)


def all_finite(params) -> jax.Array:
    """Whether every floating leaf of ``params`` is finite (a push with inf or NaN has no
    scale)."""
    leaves = [x for x in jax.tree.leaves(params) if jnp.issubdtype(x.dtype, jnp.floating)]
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves])) if leaves else True


def kv_storage_dtype(fmt: str) -> jnp.dtype:
    """The dtype an 8-bit KV cache of ``fmt`` is stored in: int8, or fp8's bits as uint8 (XLA
    scatters uint8 into a donated buffer in place on every backend; XLA:CPU widens a float8
    scatter through a temporary copy)."""
    return jnp.dtype(jnp.int8 if fmt == "int8" else jnp.uint8)


def kv_format_of(dtype: jnp.dtype) -> str:
    """The format of a KV cache stored in ``dtype`` (`kv_storage_dtype`; "bfloat16" for any
    float dtype)."""
    dtype = jnp.dtype(dtype)
    return {jnp.dtype(jnp.int8): "int8", jnp.dtype(jnp.uint8): "fp8"}.get(dtype, "bfloat16")


def quantize_kv(x_gh: jax.Array, fmt: str) -> tuple[jax.Array, jax.Array]:
    """(q [..., G, H] in `kv_storage_dtype`, scale [..., G]) of keys or values: one scale per
    KV head and position."""
    q, scale = quantize(x_gh, fmt, (-1,))
    if fmt == "fp8":
        q = jax.lax.bitcast_convert_type(q, jnp.uint8)
    return q, scale[..., 0]


def dequantize_kv(q_gh: jax.Array, scale_g: jax.Array, dtype) -> jax.Array:
    """Keys or values [..., G, H] in ``dtype`` from `quantize_kv`'s (q, scale)."""
    if q_gh.dtype == jnp.uint8:
        q_gh = jax.lax.bitcast_convert_type(q_gh, jnp.float8_e4m3fn)
    return dequantize(q_gh, scale_g[..., None], dtype)


def fake_quantize_kv(x_gh: jax.Array, fmt: str) -> jax.Array:
    """``x_gh`` as a reader of its 8-bit cache entry sees it (identity for "bfloat16")."""
    if not is_quantized(fmt):
        return x_gh
    return dequantize_kv(*quantize_kv(x_gh, fmt), x_gh.dtype)


def bytes_per_element(fmt: str, dtype_bytes: int = 2) -> int:
    """Stored bytes of one element in ``fmt`` (``dtype_bytes`` when unquantized)."""
    return 1 if is_quantized(fmt) else dtype_bytes


__all__ = [
    "CONTRACTION_AXES",
    "FORMATS",
    "QTensor",
    "abstract_quantized",
    "all_finite",
    "bytes_per_element",
    "check_format",
    "dequantize",
    "dequantize_kv",
    "dequantize_params",
    "fake_quantize",
    "fake_quantize_kv",
    "format_of",
    "is_quantized",
    "kv_format_of",
    "kv_storage_dtype",
    "quantize",
    "quantize_kv",
    "quantize_params",
    "storage_dtype",
    "tree_format",
]
