"""Causal self-attention of right-padded sequences, with memory linear in the length T.

Dimension letters: B batch, T positions, G key/value heads, R query heads per KV head, H head_dim,
C block length.

Four paths compute the same softmax(q·kᵀ/√H + mask)·v over the keys a query may see (s ≤ t and
key s valid):
  * "fused": `jax.nn.dot_product_attention`, where the backend has a fused kernel (cuDNN on GPU
    in bfloat16/float16; on other backends it is XLA's dense version);
  * "splash": the Pallas splash-attention TPU kernel, per shard of the ambient mesh
    (`sat_jax.model.tpu_kernels.splash_attention`; Pallas interpret mode off TPU);
  * "blockwise": pure JAX, queries and keys in blocks of C with an online softmax. Each query
    block is rematerialised (`jax.checkpoint`) in the backward pass, so both passes hold
    O(B·T·N·H + B·N·C·T) at a time instead of the O(B·N·T²) scores;
  * "dense": the whole [T, T] score matrix (the reference; what decoding uses over the cache).
`resolve_attention` picks "fused" on GPU, "splash" on TPU (under a mesh or on one device) and
"blockwise" elsewhere under "auto".
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sat_jax.model.tpu_kernels import kernels_placeable, splash_attention, target_platform

# Large finite negative so fully masked rows give a uniform softmax instead of NaN.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def dense_attention(
    q_btgrh: jax.Array, k_bsgh: jax.Array, v_bsgh: jax.Array, allowed_bts: jax.Array, dtype
) -> jax.Array:
    """softmax over S of float32 scores where ``allowed_bts``; [B, T, G, R, H] in ``dtype``."""
    h = q_btgrh.shape[-1]
    scores_bgrts = jnp.einsum(
        "btgrh,bsgh->bgrts",
        q_btgrh,
        k_bsgh.astype(q_btgrh.dtype),
        preferred_element_type=jnp.float32,
    ) * (h**-0.5)
    scores_bgrts = jnp.where(allowed_bts[:, None, None], scores_bgrts, MASK_VALUE)
    probs_bgrts = jax.nn.softmax(scores_bgrts, axis=-1).astype(dtype)
    return jnp.einsum("bgrts,bsgh->btgrh", probs_bgrts, v_bsgh.astype(dtype))


def blockwise_attention(
    q_btgrh: jax.Array,
    k_btgh: jax.Array,
    v_btgh: jax.Array,
    valid_bt: jax.Array,
    *,
    block: int,
    segment_ids_bt: jax.Array | None = None,
) -> jax.Array:
    """Causal attention by blocks of ``block`` positions with an online softmax (see module doc).

    Equal to ``dense_attention`` with allowed = causal & valid keys (& same segment, with
    ``segment_ids_bt``) for every query that sees a key; a query with none (only in an
    all-padding row) gets a finite average of values.
    """
    b, t, g, r, h = q_btgrh.shape
    c = min(block, t)
    n = -(-t // c)
    pad = n * c - t
    seg_bt = jnp.zeros((b, t), jnp.int32) if segment_ids_bt is None else segment_ids_bt
    if pad:  # padded keys are invalid; padded queries are cut off at the end
        widen = lambda x: jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        q_btgrh, k_btgh, v_btgh, valid_bt, seg_bt = map(
            widen, (q_btgrh, k_btgh, v_btgh, valid_bt, seg_bt)
        )
    k_nbcgh = jnp.moveaxis(k_btgh.reshape(b, n, c, g, h), 1, 0)
    v_nbcgh = jnp.moveaxis(v_btgh.reshape(b, n, c, g, h), 1, 0)
    valid_nbc = jnp.moveaxis(valid_bt.reshape(b, n, c), 1, 0)
    seg_nbc = jnp.moveaxis(seg_bt.reshape(b, n, c), 1, 0)
    q_nbcgrh = jnp.moveaxis(q_btgrh.reshape(b, n, c, g, r, h), 1, 0)
    positions_nc = jnp.arange(n * c).reshape(n, c)

    def query_block(_, inputs):
        q_bcgrh, q_pos_c, q_seg_bc = inputs

        def key_block(state, keys):
            m_bgrc, l_bgrc, acc_bcgrh = state
            k_bcgh, v_bcgh, valid_bc, k_pos_c, k_seg_bc = keys
            s_bgrcs = jnp.einsum(
                "bcgrh,bsgh->bgrcs", q_bcgrh, k_bcgh, preferred_element_type=jnp.float32
            ) * (h**-0.5)
            allowed_bcs = (q_pos_c[:, None] >= k_pos_c[None, :])[None] & valid_bc[:, None, :]
            if segment_ids_bt is not None:
                allowed_bcs = allowed_bcs & (q_seg_bc[:, :, None] == k_seg_bc[:, None, :])
            s_bgrcs = jnp.where(allowed_bcs[:, None, None], s_bgrcs, MASK_VALUE)
            m_new = jnp.maximum(m_bgrc, jnp.max(s_bgrcs, axis=-1))
            p_bgrcs = jnp.exp(s_bgrcs - m_new[..., None])
            scale_bgrc = jnp.exp(m_bgrc - m_new)
            l_new = l_bgrc * scale_bgrc + jnp.sum(p_bgrcs, axis=-1)
            pv_bcgrh = jnp.einsum("bgrcs,bsgh->bcgrh", p_bgrcs, v_bcgh.astype(jnp.float32))
            acc_new = acc_bcgrh * jnp.moveaxis(scale_bgrc, -1, 1)[..., None] + pv_bcgrh
            return (m_new, l_new, acc_new), None

        init = (
            jnp.full((b, g, r, c), -jnp.inf, jnp.float32),
            jnp.zeros((b, g, r, c), jnp.float32),
            jnp.zeros((b, c, g, r, h), jnp.float32),
        )
        keys = (k_nbcgh, v_nbcgh, valid_nbc, positions_nc, seg_nbc)
        (_, l_bgrc, acc_bcgrh), _ = jax.lax.scan(key_block, init, keys)
        return None, acc_bcgrh / jnp.moveaxis(l_bgrc, -1, 1)[..., None]

    _, out_nbcgrh = jax.lax.scan(
        jax.checkpoint(query_block), None, (q_nbcgrh, positions_nc, seg_nbc)
    )
    out_btgrh = jnp.moveaxis(out_nbcgrh, 0, 1).reshape(b, n * c, g, r, h)
    return out_btgrh[:, :t]


def resolve_attention(path: str, platform: str | None = None) -> str:
    """The concrete path for a config's ``attention``: "auto" is "fused" on GPU, "splash" on TPU
    where the kernel can be placed (`tpu_kernels.kernels_placeable`: under an ambient mesh or on
    one device) and "blockwise" elsewhere; ``platform`` defaults to the trace's target
    (`tpu_kernels.target_platform`: the ambient mesh's devices, else the default backend)."""
    if path != "auto":
        return path
    platform = platform or target_platform()
    if platform == "tpu" and kernels_placeable():
        return "splash"
    return "fused" if platform == "gpu" else "blockwise"


def causal_attention(
    q_btgrh: jax.Array,
    k_btgh: jax.Array,
    v_btgh: jax.Array,
    valid_bt: jax.Array,
    *,
    path: str,
    block: int,
    dtype,
    segment_ids_bt: jax.Array | None = None,
) -> jax.Array:
    """Causal attention over right-padded keys (``valid_bt`` [B, T]); [B, T, G, R, H] in ``dtype``.

    ``path`` is one of ``sat_jax.model.config.ATTENTION_PATHS`` ("auto": `resolve_attention`).
    With ``segment_ids_bt`` ([B, T] int, a packed row's sequences, 0 on padding; docs/DESIGN.md
    §7.1) the ids replace ``valid_bt``: a query sees only the keys s <= t of its own segment, on
    every path (splash: the kernel's segment ids), so a padding query sees the padding before it.
    """
    path = resolve_attention(path)
    seg = segment_ids_bt
    if seg is not None:
        valid_bt = jnp.ones(valid_bt.shape, bool)
    if path == "splash":
        return splash_attention(
            q_btgrh, k_btgh, v_btgh, valid_bt, block=block, segment_ids_bt=seg
        ).astype(dtype)
    if path == "blockwise":
        return blockwise_attention(
            q_btgrh, k_btgh, v_btgh, valid_bt, block=block, segment_ids_bt=seg
        ).astype(dtype)
    t = q_btgrh.shape[1]
    same_bts = None if seg is None else seg[:, :, None] == seg[:, None, :]
    if path == "dense":
        allowed_bts = jnp.tril(jnp.ones((t, t), bool))[None] & valid_bt[:, None, :]
        if same_bts is not None:
            allowed_bts = allowed_bts & same_bts
        return dense_attention(q_btgrh, k_btgh, v_btgh, allowed_bts, dtype)
    b, t, g, r, h = q_btgrh.shape
    if same_bts is not None:  # packed rows: the segment mask (with the valid keys) is explicit
        out_btnh = jax.nn.dot_product_attention(
            q_btgrh.reshape(b, t, g * r, h).astype(dtype),
            k_btgh.astype(dtype),
            v_btgh.astype(dtype),
            mask=same_bts[:, None],
            is_causal=True,
        )
        return out_btnh.reshape(b, t, g, r, h)
    # Right padding: the valid keys of row b are its first lengths_b positions.
    lengths_b = jnp.sum(valid_bt, axis=-1, dtype=jnp.int32)
    out_btnh = jax.nn.dot_product_attention(
        q_btgrh.reshape(b, t, g * r, h).astype(dtype),
        k_btgh.astype(dtype),
        v_btgh.astype(dtype),
        is_causal=True,
        key_value_seq_lengths=lengths_b,
    )
    return out_btnh.reshape(b, t, g, r, h)
