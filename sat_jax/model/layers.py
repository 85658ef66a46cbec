"""Transformer building blocks: RMSNorm, RoPE, grouped-query attention with q/k norm, SwiGLU.

Dimension letters used in tensor names:
  B batch, T query positions, S key positions (the cache length when decoding), D d_model,
  N query heads, G key/value heads, R query heads per KV head (N = G * R), H head_dim,
  F feed-forward hidden width.

Parameters carry LOGICAL axis names in their `out_sharding` metadata ("vocab", "embed", "q_heads",
"kv_heads", "head_dim", "exp", "mlp", "norm", "lora_rank"); `sat_jax.sharding` maps them onto
mesh axes. Eager sharding is off so a model builds without a mesh (and under `nnx.eval_shape`).

LoRA: `add_lora` gives a weight ``w`` two sibling `nnx.LoRAParam`s, ``w_lora_a`` and ``w_lora_b``
(`LORA_SUFFIXES`; a path ending in one is an adapter, `is_lora_path`), and `lora_weight` reads
``w`` as W + scale · A B wherever the module reads it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx, struct

from sat_jax.model.attention import causal_attention, dense_attention
from sat_jax.model.config import DTypeLike, LoRAConfig

Initializer = Callable[[jax.Array, Sequence[int], DTypeLike], jax.Array]
# Names of a weight's adapters: f"{name}{suffix}".
LORA_A, LORA_B = "_lora_a", "_lora_b"
LORA_SUFFIXES = (LORA_A, LORA_B)


def make_param(
    rngs: nnx.Rngs, init: Initializer, shape: Sequence[int], axes: tuple[str, ...], dtype: DTypeLike
) -> nnx.Param:
    """An `nnx.Param` annotated with logical axis names (one per dimension)."""
    if len(axes) != len(shape):
        raise ValueError(f"axes {axes} do not match shape {tuple(shape)}")
    return nnx.Param(
        init(rngs.params(), tuple(shape), dtype), out_sharding=axes, eager_sharding=False
    )


def fan_in_init(fan_in: int) -> Initializer:
    """Normal init with std 1/sqrt(fan_in), for weights whose fan-in is not one axis."""
    return nnx.initializers.normal(stddev=fan_in**-0.5)


def add_lora(
    module: nnx.Module,
    name: str,
    *,
    rank: int,
    scale: float,
    in_dims: int,
    batch_dims: int = 0,
    rngs: nnx.Rngs,
) -> None:
    """Gives ``module.<name>`` (W, shape [*batch, *in, *out]) its LoRA adapters.

    A [*batch, *in, rank] (normal, std 1/sqrt(prod(in))) and B [*batch, rank, *out] (zeros) become
    ``module.<name>_lora_a`` and ``module.<name>_lora_b``, `nnx.LoRAParam`s in W's param dtype
    whose logical axes are W's with "lora_rank" for the rank; ``module.lora_scale`` = scale.

    Args:
      module: the module holding W.
      name: W's attribute name.
      rank: r.
      scale: alpha / r.
      in_dims: how many of W's dims (after the batch dims) are its input.
      batch_dims: leading dims of W that A and B keep (the expert axis of stacked experts).
      rngs: draws A.
    """
    w = getattr(module, name)
    shape, axes = w.shape, w.get_metadata()["out_sharding"]
    split = batch_dims + in_dims
    batch_shape, in_shape = shape[:batch_dims], shape[batch_dims:split]
    a_shape = (*shape[:split], rank)
    b_shape = (*batch_shape, rank, *shape[split:])
    a_axes = (*axes[:split], "lora_rank")
    b_axes = (*axes[:batch_dims], "lora_rank", *axes[split:])
    a_init = fan_in_init(math.prod(in_shape))
    a = a_init(rngs.params(), a_shape, w.dtype)
    b = jnp.zeros(b_shape, w.dtype)
    setattr(module, name + LORA_A, nnx.LoRAParam(a, out_sharding=a_axes, eager_sharding=False))
    setattr(module, name + LORA_B, nnx.LoRAParam(b, out_sharding=b_axes, eager_sharding=False))
    module.lora_scale = scale


def lora_weight(module: nnx.Module, name: str, dtype: DTypeLike) -> jax.Array:
    """``module.<name>`` in ``dtype``, plus scale · A B when it has adapters (`add_lora`).

    The product contracts A's last (rank) axis with B's first non-batch axis, batched over the
    leading dims they share, so it has W's shape; it is computed in ``dtype``. B starts at zero,
    so a fresh adapter adds exactly 0.
    """
    w = getattr(module, name)[...].astype(dtype)
    if not hasattr(module, name + LORA_A):
        return w
    a = getattr(module, name + LORA_A)[...].astype(dtype)
    b = getattr(module, name + LORA_B)[...].astype(dtype)
    return w + module.lora_scale * lora_delta(a, b, w.ndim)


def lora_delta(a: jax.Array, b: jax.Array, w_ndim: int) -> jax.Array:
    """A B for a weight of ``w_ndim`` dims: A's last (rank) axis contracted with B's first
    non-batch axis, batched over the leading dims they share (the expert axis), so the result
    has W's shape (``add_lora``'s layouts). Unscaled; in the inputs' dtype."""
    nb = a.ndim + b.ndim - 2 - w_ndim
    batch = tuple(range(nb))
    return jax.lax.dot_general(a, b, (((a.ndim - 1,), (nb,)), (batch, batch)))


def is_lora_path(path: Sequence[object]) -> bool:
    """Whether a parameter path (keys from the root) names a LoRA adapter."""
    return bool(path) and str(path[-1]).endswith(LORA_SUFFIXES)


class RMSNorm(nnx.Module):
    """Root-mean-square norm over the last axis, computed in float32 (HF Qwen3RMSNorm)."""

    def __init__(self, dim: int, *, eps: float, param_dtype: DTypeLike, rngs: nnx.Rngs):
        self.eps = eps
        self.scale = make_param(rngs, nnx.initializers.ones, (dim,), ("norm",), param_dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        """Normalizes `x [..., dim]`; returns the same shape and dtype."""
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (y * self.scale[...].astype(jnp.float32)).astype(x.dtype)


def apply_rope(x_btnh: jax.Array, positions_bt: jax.Array, *, theta: float) -> jax.Array:
    """Rotary embedding, rotate-half convention (HF Qwen3): pairs (i, i + H/2) rotate together.

    Args:
      x_btnh: [B, T, N, H] queries or keys (any head count N).
      positions_bt: [B, T] integer positions.
      theta: RoPE base.

    Returns:
      [B, T, N, H] in x's dtype; the rotation is computed in float32.
    """
    h = x_btnh.shape[-1]
    inv_freq = 1.0 / (theta ** (jnp.arange(0, h, 2, dtype=jnp.float32) / h))
    angle_bti = positions_bt.astype(jnp.float32)[..., None] * inv_freq
    cos, sin = jnp.cos(angle_bti)[:, :, None, :], jnp.sin(angle_bti)[:, :, None, :]
    x32 = x_btnh.astype(jnp.float32)
    x1, x2 = x32[..., : h // 2], x32[..., h // 2 :]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x_btnh.dtype)


@struct.dataclass
class QKV:
    """Projected, normed and rotated attention inputs of T new positions."""

    q_btnh: jax.Array
    k_btgh: jax.Array
    v_btgh: jax.Array


class Attention(nnx.Module):
    """Grouped-query attention with per-head RMSNorm on q and k before RoPE (Qwen3), no biases.

    Split in two halves so the KV cache can sit between them: `project` makes q/k/v of the new
    positions, `attend` attends them to whatever keys/values the caller supplies.
    """

    def __init__(
        self,
        *,
        d_model: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        rope_theta: float,
        eps: float,
        dtype: DTypeLike,
        param_dtype: DTypeLike,
        rngs: nnx.Rngs,
    ):
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.rope_theta = rope_theta
        self.dtype = dtype
        d_init, o_init = fan_in_init(d_model), fan_in_init(num_heads * head_dim)
        self.w_q_dnh = make_param(
            rngs,
            d_init,
            (d_model, num_heads, head_dim),
            ("embed", "q_heads", "head_dim"),
            param_dtype,
        )
        self.w_k_dgh = make_param(
            rngs,
            d_init,
            (d_model, num_kv_heads, head_dim),
            ("embed", "kv_heads", "head_dim"),
            param_dtype,
        )
        self.w_v_dgh = make_param(
            rngs,
            d_init,
            (d_model, num_kv_heads, head_dim),
            ("embed", "kv_heads", "head_dim"),
            param_dtype,
        )
        self.w_o_nhd = make_param(
            rngs,
            o_init,
            (num_heads, head_dim, d_model),
            ("q_heads", "head_dim", "embed"),
            param_dtype,
        )
        self.q_norm = RMSNorm(head_dim, eps=eps, param_dtype=param_dtype, rngs=rngs)
        self.k_norm = RMSNorm(head_dim, eps=eps, param_dtype=param_dtype, rngs=rngs)

    def add_lora(self, lora: LoRAConfig, *, rngs: nnx.Rngs) -> None:
        """Adapters on q, k, v and o when `lora.targets` has "attention"."""
        if "attention" not in lora.targets:
            return
        for name, in_dims in (("w_q_dnh", 1), ("w_k_dgh", 1), ("w_v_dgh", 1), ("w_o_nhd", 2)):
            add_lora(self, name, rank=lora.rank, scale=lora.scale, in_dims=in_dims, rngs=rngs)

    def project(self, x_btd: jax.Array, positions_bt: jax.Array) -> QKV:
        """q/k/v of `x_btd [B, T, D]` at `positions_bt [B, T]`; q and k normed, then rotated."""
        x = x_btd.astype(self.dtype)
        q_btnh = jnp.einsum("btd,dnh->btnh", x, lora_weight(self, "w_q_dnh", self.dtype))
        k_btgh = jnp.einsum("btd,dgh->btgh", x, lora_weight(self, "w_k_dgh", self.dtype))
        v_btgh = jnp.einsum("btd,dgh->btgh", x, lora_weight(self, "w_v_dgh", self.dtype))
        q_btnh = apply_rope(self.q_norm(q_btnh), positions_bt, theta=self.rope_theta)
        k_btgh = apply_rope(self.k_norm(k_btgh), positions_bt, theta=self.rope_theta)
        return QKV(q_btnh=q_btnh, k_btgh=k_btgh, v_btgh=v_btgh)

    def attend(
        self, q_btnh: jax.Array, k_bsgh: jax.Array, v_bsgh: jax.Array, allowed_bts: jax.Array
    ) -> jax.Array:
        """Softmax attention (float32 scores) of T queries over S keys.

        Args:
          q_btnh: [B, T, N, H] queries.
          k_bsgh: [B, S, G, H] keys; v_bsgh: [B, S, G, H] values.
          allowed_bts: [B, T, S] bool, which keys each query may see (causal and valid).

        Returns:
          [B, T, D] attention output after the output projection.
        """
        out_btgrh = dense_attention(self._groups(q_btnh), k_bsgh, v_bsgh, allowed_bts, self.dtype)
        return self._output(out_btgrh)

    def attend_causal(
        self,
        q_btnh: jax.Array,
        k_btgh: jax.Array,
        v_btgh: jax.Array,
        valid_bt: jax.Array,
        *,
        path: str,
        block: int,
        segment_ids_bt: jax.Array | None = None,
    ) -> jax.Array:
        """Causal self-attention of right-padded rows (``valid_bt`` [B, T] marks real tokens), or
        of packed rows (``segment_ids_bt``: a query sees its own segment only), by
        `sat_jax.model.attention.causal_attention`'s ``path``; [B, T, D] after the projection."""
        out_btgrh = causal_attention(
            self._groups(q_btnh),
            k_btgh,
            v_btgh,
            valid_bt,
            path=path,
            block=block,
            dtype=self.dtype,
            segment_ids_bt=segment_ids_bt,
        )
        return self._output(out_btgrh)

    def _groups(self, q_btnh: jax.Array) -> jax.Array:
        b, t, n, h = q_btnh.shape
        return q_btnh.reshape(b, t, self.num_kv_heads, n // self.num_kv_heads, h)

    def _output(self, out_btgrh: jax.Array) -> jax.Array:
        b, t, g, r, h = out_btgrh.shape
        out_btnh = out_btgrh.reshape(b, t, g * r, h).astype(self.dtype)
        return jnp.einsum("btnh,nhd->btd", out_btnh, lora_weight(self, "w_o_nhd", self.dtype))


def swiglu(
    x_td: jax.Array, w_gate_df: jax.Array, w_up_df: jax.Array, w_down_fd: jax.Array
) -> jax.Array:
    """silu(x W_gate) * (x W_up) W_down for `x [..., D]`; weights [D, F], [D, F], [F, D]."""
    h = jax.nn.silu(x_td @ w_gate_df) * (x_td @ w_up_df)
    return h @ w_down_fd


class DenseMLP(nnx.Module):
    """SwiGLU feed-forward of the dense (non-MoE) layers."""

    def __init__(
        self,
        *,
        d_model: int,
        hidden_dim: int,
        dtype: DTypeLike,
        param_dtype: DTypeLike,
        rngs: nnx.Rngs,
    ):
        self.dtype = dtype
        self.w_gate_df = make_param(
            rngs, fan_in_init(d_model), (d_model, hidden_dim), ("embed", "mlp"), param_dtype
        )
        self.w_up_df = make_param(
            rngs, fan_in_init(d_model), (d_model, hidden_dim), ("embed", "mlp"), param_dtype
        )
        self.w_down_fd = make_param(
            rngs, fan_in_init(hidden_dim), (hidden_dim, d_model), ("mlp", "embed"), param_dtype
        )

    def add_lora(self, lora: LoRAConfig, *, rngs: nnx.Rngs) -> None:
        """Adapters on gate, up and down when `lora.targets` has "mlp"."""
        if "mlp" not in lora.targets:
            return
        for name in ("w_gate_df", "w_up_df", "w_down_fd"):
            add_lora(self, name, rank=lora.rank, scale=lora.scale, in_dims=1, rngs=rngs)

    def __call__(self, x_btd: jax.Array) -> jax.Array:
        """[B, T, D] -> [B, T, D] in the compute dtype."""
        weight = lambda name: lora_weight(self, name, self.dtype)
        return swiglu(
            x_btd.astype(self.dtype), weight("w_gate_df"), weight("w_up_df"), weight("w_down_fd")
        )
