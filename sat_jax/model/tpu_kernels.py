"""The model's TPU kernels (Pallas): splash attention and the megablox grouped matmul.

Dimension letters: B batch, T positions, G key/value heads, R query heads per KV head, N = G·R,
H head_dim, D d_model, E experts (E_l on one shard), F expert width, K experts per token,
M token-slots (T·K).

Why kernels: `blockwise_attention` is a `lax.scan` of small matmuls that also computes the fully
masked blocks, and XLA:TPU compiles the weight gradient of `jax.lax.ragged_dot` (a ragged
*contracting* dimension) to a dense product over all E experts (43x the analytic FLOPs for one
Qwen3-30B-A3B MoE layer, benchmarks/RESULTS.md "TPU kernels"). Here:
  * `splash_attention`: jax's splash attention (`jax.experimental.pallas.ops.tpu.splash_attention`),
    causal, GQA native (R query heads share a KV head), the right padding as segment ids;
  * `gmm_dispatch`: sort token-slots by expert, then megablox `gmm` (forward and input gradient)
    and `tgmm` (weight gradient) grouped matmuls, which compute only the rows of each group.

Sharding: XLA's SPMD partitioner cannot split a Pallas call (over sharded operands the compile
fails: "Mosaic kernels cannot be automatically partitioned"). Under an ambient mesh (`jax.set_mesh`; the train step traces under its mesh) both
functions therefore run per shard in `jax.shard_map`: the batch over the mesh's batch axes
(`sat_jax.sharding.batch_axes`), attention heads over "tensor", and for the experts the
expert dimension over "expert" and their width F over "tensor" (partial outputs summed with
`psum`). An axis that does not divide its dimension leaves it whole (computed redundantly there).

Without an ambient mesh the kernels run as they are, which XLA accepts on one device only, so
"auto" picks them on TPU only where `kernels_placeable` (the train step always traces under its
mesh; a multi-chip server that does not keeps `ragged_dot`, whose forward XLA:TPU compiles to a
grouped matmul already).

Interpret mode: off TPU the kernels run in Pallas interpret mode (plain JAX ops, slow), which is
what the CPU tests compare against the reference paths; "auto" never picks them off TPU. The
target platform is that of the ambient mesh's devices, so compiling for a TPU topology on a CPU
host (`jax.experimental.topologies`) lowers the real Mosaic kernels.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu import megablox
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as splash_mask
from jax.sharding import PartitionSpec as P

from sat_jax.sharding import batch_axes

# TPU vector lanes: splash attention's block lengths must be multiples of it; head_dim is padded
# to it on TPU (zero columns of q and k add nothing to q·k; zero columns of v are sliced off).
LANES = 128
# Largest splash block (queries and keys): MaxText's default (sa_block_* = 512).
SPLASH_MAX_BLOCK = 512
# gmm tiles (contracted, output): MaxText's defaults (tile_embed_dim, tile_mlp_dim), clipped to the
# problem. The row tile is chosen per call by `gmm_row_tile`.
GMM_TILING = (1024, 1024)


def target_platform() -> str:
    """The platform the current trace compiles for: the ambient mesh's devices' ("tpu" when
    compiling for a TPU topology on a CPU host), else `jax.default_backend()`."""
    mesh = jax.sharding.get_abstract_mesh()
    device = None if mesh.empty else mesh.abstract_device
    return device.platform if device is not None else jax.default_backend()


def kernels_placeable() -> bool:
    """Whether a Pallas TPU kernel can be placed in the current trace: under an ambient mesh (it
    runs per shard in `jax.shard_map`) or on a single device. XLA cannot partition a Mosaic
    kernel by itself ("Mosaic kernels cannot be automatically partitioned"), so "auto" keeps
    XLA's paths in a multi-device program traced without a mesh."""
    return not jax.sharding.get_abstract_mesh().empty or jax.device_count() == 1


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def gmm_row_tile(m: int, num_experts: int) -> int:
    """Row tile of the grouped matmuls for M token-slots over E experts.

    Each group's last row tile is computed whole, so a call computes up to M + E·(tile - 1) rows
    while XLA's cost analysis (megablox's estimate) counts M. The tile is the largest of 512,
    256, 128 with E·tile <= M/4, which bounds that waste at about a quarter of the rows (with
    balanced routing: under an "expert" axis a shard visits M·E_l/E rows and pays E_l·tile),
    and never below 128 (the MXU's width; smaller tiles go memory-bound).
    """
    tile = next((c for c in (512, 256) if num_experts * c * 4 <= m), LANES)
    return min(tile, _round_up(m, LANES))


def splash_block(block: int, t: int) -> int:
    """Splash block length for T positions: `block` rounded up to a lane multiple, at most
    `SPLASH_MAX_BLOCK` and at most T rounded up to a lane multiple (T is padded to a multiple)."""
    return min(_round_up(max(block, 1), LANES), SPLASH_MAX_BLOCK, _round_up(t, LANES))


def _shard_spec_axes(size: int, axes: tuple[str, ...], sizes: dict[str, int]):
    """``axes`` as one PartitionSpec entry when their product divides ``size``, else None."""
    axes = tuple(a for a in axes if sizes.get(a, 1) > 1)
    if not axes or size % math.prod(sizes[a] for a in axes):
        return None
    return axes[0] if len(axes) == 1 else axes


def splash_attention(
    q_btgrh: jax.Array,
    k_btgh: jax.Array,
    v_btgh: jax.Array,
    valid_bt: jax.Array,
    *,
    block: int,
    interpret: bool | None = None,
    segment_ids_bt: jax.Array | None = None,
) -> jax.Array:
    """Causal attention of right-padded rows by the splash kernel; [B, T, G, R, H] in q's dtype.

    Equal to ``causal_attention(path="dense")``: a query at t sees the keys s <= t that are valid.
    The padding enters as segment ids (every query 1, a key 1 when valid else 0), so a padded
    query sees the valid keys before it, as on the other paths. T is padded to a multiple of the
    block (`splash_block`), and on TPU head_dim to a multiple of 128; q is scaled by 1/sqrt(H)
    before the kernel (splash does not scale).

    Args:
      q_btgrh: [B, T, G, R, H] queries; k_btgh, v_btgh: [B, T, G, H] keys and values.
      valid_bt: [B, T] bool, real (not padding) positions.
      block: requested block length (`ModelConfig.attention_block`), see `splash_block`.
      interpret: Pallas interpret mode; default: unless the target platform is TPU.
      segment_ids_bt: optional [B, T] int, the sequences of packed rows (0 on padding, which
        they mark instead of ``valid_bt``): the kernel's query and key segment ids, so attention
        never crosses a segment.
    """
    if interpret is None:
        interpret = target_platform() != "tpu"
    b, t, g, r, h = q_btgrh.shape
    bq = splash_block(block, t)
    t_pad, h_pad = _round_up(t, bq), h if interpret else _round_up(h, LANES)
    q_btgrh = q_btgrh * jnp.asarray(h**-0.5, q_btgrh.dtype)

    def widen(x, ndim_tail):
        pads = [(0, 0), (0, t_pad - t)] + [(0, 0)] * ndim_tail + [(0, h_pad - h)]
        return jnp.pad(x, pads) if t_pad > t or h_pad > h else x

    q_btgrh, k_btgh, v_btgh = widen(q_btgrh, 2), widen(k_btgh, 1), widen(v_btgh, 1)
    valid_bt = jnp.pad(valid_bt, [(0, 0), (0, t_pad - t)]) if t_pad > t else valid_bt
    if segment_ids_bt is None:
        q_seg_bt, kv_seg_bt = jnp.ones(valid_bt.shape, jnp.int32), valid_bt.astype(jnp.int32)
    else:
        seg_bt = jnp.asarray(segment_ids_bt, jnp.int32)
        seg_bt = jnp.pad(seg_bt, [(0, 0), (0, t_pad - t)]) if t_pad > t else seg_bt
        q_seg_bt = kv_seg_bt = seg_bt
    local = functools.partial(_splash_local, block=bq, interpret=interpret)
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty:
        sizes = dict(mesh.shape)
        bax = _shard_spec_axes(b, batch_axes(sizes), sizes)
        g_ax = _shard_spec_axes(g, ("tensor",), sizes)
        r_ax = None if g_ax else _shard_spec_axes(r, ("tensor",), sizes)
        q_spec, kv_spec = P(bax, None, g_ax, r_ax, None), P(bax, None, g_ax, None)
        local = jax.shard_map(
            local,
            mesh=mesh,
            in_specs=(q_spec, kv_spec, kv_spec, P(bax, None), P(bax, None)),
            out_specs=q_spec,
            check_vma=False,
        )
    out_btgrh = local(q_btgrh, k_btgh, v_btgh, q_seg_bt, kv_seg_bt)
    return out_btgrh[:, :t, :, :, :h]


def _splash_local(q_btgrh, k_btgh, v_btgh, q_seg_bt, kv_seg_bt, *, block: int, interpret: bool):
    """One shard of `splash_attention` (shapes already padded): the kernel vmapped over B."""
    b, t, g, r, h = q_btgrh.shape
    n = g * r
    sizes = splash.BlockSizes(
        block_q=block,
        block_kv=block,
        block_kv_compute=block,
        block_q_dkv=block,
        block_kv_dkv=block,
        block_kv_dkv_compute=block,
        block_q_dq=block,
        block_kv_dq=block,
    )
    # Head n = g·R + r of the flattened queries uses KV head n // R = g: splash's GQA layout.
    mask = splash_mask.MultiHeadMask([splash_mask.CausalMask((t, t))] * n)
    kernel = splash.make_splash_mha(
        mask, block_sizes=sizes, head_shards=1, q_seq_shards=1, interpret=interpret
    )
    q_bnth = jnp.moveaxis(q_btgrh.reshape(b, t, n, h), 1, 2)
    k_bgth, v_bgth = jnp.moveaxis(k_btgh, 1, 2), jnp.moveaxis(v_btgh, 1, 2)
    segments = splash.SegmentIds(q=q_seg_bt, kv=kv_seg_bt)
    out_bnth = jax.vmap(kernel)(q_bnth, k_bgth, v_bgth, segments)
    return jnp.moveaxis(out_bnth, 2, 1).reshape(b, t, g, r, h)


def gmm_dispatch(
    x_td: jax.Array,
    ids_tk: jax.Array,
    weights_tk: jax.Array,
    gate_edf: jax.Array,
    up_edf: jax.Array,
    down_efd: jax.Array,
    *,
    interpret: bool | None = None,
) -> jax.Array:
    """Dropless MoE dispatch by megablox grouped matmuls; [T, D] sum_k w_tk · expert_{ids_tk}(x_t).

    Same result as `sat_jax.model.moe.dispatch_dense`. Under a mesh with an "expert" axis the
    tokens are the same on every expert shard (the batch is sharded over data/fsdp only), so each
    shard sorts its slots with its own E_l experts first, computes only those groups and the
    shards' outputs are summed: no all-to-all, and each expert's rows computed once.

    Args:
      x_td: [T, D] tokens in the compute dtype.
      ids_tk: [T, K] expert ids; weights_tk: [T, K] combine weights.
      gate_edf, up_edf: [E, D, F]; down_efd: [E, F, D] expert weights in the compute dtype.
      interpret: Pallas interpret mode; default: unless the target platform is TPU.
      segment_ids_bt: optional [B, T] int, the sequences of packed rows (0 on padding, which
        they mark instead of ``valid_bt``): the kernel's query and key segment ids, so attention
        never crosses a segment.
    """
    if interpret is None:
        interpret = target_platform() != "tpu"
    num_experts, _, f = gate_edf.shape
    local = functools.partial(
        _gmm_local, num_experts=num_experts, expert_axis=None, interpret=interpret
    )
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return local(x_td, ids_tk, weights_tk, gate_edf, up_edf, down_efd)
    sizes = dict(mesh.shape)
    tok = _shard_spec_axes(x_td.shape[0], batch_axes(sizes), sizes)
    e_ax = _shard_spec_axes(num_experts, ("expert",), sizes)
    f_ax = _shard_spec_axes(f, ("tensor",), sizes)
    summed = tuple(a for a in (e_ax, f_ax) if a)

    def body(*args):
        y_td = functools.partial(local, expert_axis=e_ax)(*args)
        return jax.lax.psum(y_td, summed) if summed else y_td

    row = P(tok, None)
    return jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(row, row, row, P(e_ax, None, f_ax), P(e_ax, None, f_ax), P(e_ax, f_ax, None)),
        out_specs=row,
        check_vma=False,
    )(x_td, ids_tk, weights_tk, gate_edf, up_edf, down_efd)


def _gmm_local(
    x_td, ids_tk, weights_tk, gate_edf, up_edf, down_efd, *, num_experts, expert_axis, interpret
):
    """One shard of `gmm_dispatch`: its tokens through its E_l experts (all E without an axis)."""
    t, k = ids_tk.shape
    e_local, d, f = gate_edf.shape
    if not interpret and (d % LANES or f % LANES):
        # Mosaic blocks are whole 128-lane multiples (or whole dimensions, which the backward's
        # swapped tiles break): pad D and F with zeros, which add nothing (silu(0) · 0 = 0).
        dp, fp = _round_up(d, LANES) - d, _round_up(f, LANES) - f
        x_td = jnp.pad(x_td, [(0, 0), (0, dp)])
        gate_edf, up_edf = (jnp.pad(w, [(0, 0), (0, dp), (0, fp)]) for w in (gate_edf, up_edf))
        down_efd = jnp.pad(down_efd, [(0, 0), (0, fp), (0, dp)])
        y_td = _gmm_local(
            x_td,
            ids_tk,
            weights_tk,
            gate_edf,
            up_edf,
            down_efd,
            num_experts=num_experts,
            expert_axis=expert_axis,
            interpret=interpret,
        )
        return y_td[:, :d]
    m = t * k
    ids_m = ids_tk.reshape(m)
    shift = 0 if expert_axis is None else jax.lax.axis_index(expert_axis) * e_local
    # This shard's experts first: its groups are then the first rows of the sorted slots.
    key_m = (ids_m - shift) % num_experts
    order_m = jnp.argsort(key_m, stable=True)
    sizes_e = jnp.bincount(key_m, length=num_experts).astype(jnp.int32)[:e_local]
    tm = gmm_row_tile(m, num_experts)
    m_pad = _round_up(m, tm)
    # Rows past the shard's groups (other shards' slots, tile padding) are never visited by the
    # kernels: zero them going in and coming out.
    in_groups_m = (jnp.arange(m_pad) < jnp.sum(sizes_e))[:, None]
    x_md = jnp.pad(x_td[order_m // k], [(0, m_pad - m), (0, 0)])
    x_md = jnp.where(in_groups_m, x_md, 0)

    def grouped(lhs, rhs):
        tiling = (tm, min(GMM_TILING[0], lhs.shape[1]), min(GMM_TILING[1], rhs.shape[2]))
        return megablox.gmm(lhs, rhs, sizes_e, lhs.dtype, tiling, None, None, False, interpret)

    h_mf = jax.nn.silu(grouped(x_md, gate_edf)) * grouped(x_md, up_edf)
    y_md = jnp.where(in_groups_m, grouped(h_mf, down_efd), 0)[:m]
    y_tkd = jnp.zeros_like(y_md).at[order_m].set(y_md, unique_indices=True).reshape(t, k, d)
    return jnp.einsum("tkd,tk->td", y_tkd, weights_tk.astype(y_tkd.dtype))
