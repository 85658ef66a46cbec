"""Mixture-of-experts feed-forward: softmax router, top-k, routing replay (R3) and dispatch.

Dimension letters used in tensor names:
  B batch, T tokens, D d_model, E experts, K experts per token, F expert hidden width,
  M token-slots (M = T * K).

Routing replay (R3): given recorded expert ids, the layer uses that expert SET with weights gathered
from the CURRENT dense softmax of the router logits (renormalized over the K when `norm_topk_prob`),
so the router still gets gradients. Gathering from the dense softmax, never from top-k-zeroed
probabilities, keeps the weights defined for experts outside the current top-k. A per-token replay
mask replays only some tokens and routes the rest by the live top-k, exactly as without replay:
their weights are the same softmax entries top-k returns. (The train step replays every token:
the server records the routing of multi-turn observation tokens too.)

Dispatch paths (all dropless, identical in exact arithmetic):
  "dense": every expert computes every token; the outputs are combined with a [T, E] weight matrix
    that is zero outside each token's chosen set. E/K times the active FLOPs, all in plain matmuls.
  "ragged": token-slots are sorted by expert and run through `jax.lax.ragged_dot` grouped matmuls,
    then unsorted and combined. Active FLOPs only (on accelerators; see `resolve_dispatch`).
  "blocked": the same sort, with each expert's group padded to whole blocks that run as one batched
    matmul; the fast sparse path on CPU, where `ragged_dot` has no grouped kernel.
  "gmm": the same sort, then megablox grouped matmuls (Pallas TPU kernels, per shard of the
    ambient mesh: `sat_jax.model.tpu_kernels.gmm_dispatch`). The TPU path: XLA:TPU compiles
    `ragged_dot`'s forward to a grouped matmul but its weight gradient to a dense product over
    all E experts (benchmarks/RESULTS.md "TPU kernels").
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx, struct

from sat_jax.model.config import DTypeLike, LoRAConfig
from sat_jax.model.layers import add_lora, fan_in_init, lora_weight, make_param
from sat_jax.model.tpu_kernels import gmm_dispatch, kernels_placeable, target_platform

# Measured by benchmarks/moe_layer.py on the development CPU (2 shared cores, jax 0.10.2; dense
# f32 matmul 80-126 GFLOP/s), forward + backward of one MoE layer, T = 2048, D = 512, F = 256,
# K = 2, interleaved medians in ms, beside the dense SwiGLU FFN with the same active FLOPs:
#   E/K   FFN   dense   ragged   blocked
#    4    186    856    1310      341
#    8    183   1776    2551      388
#   16    106   1871    2756      289
# CPU `ragged_dot` lowers to a masked dense product over all E groups for each of the T * K
# slots: K times the work of "dense" at lower speed, so it never wins on CPU. Per computed row,
# "dense" and "blocked" (sort and weight gather included) cost about the same; the factor below
# keeps "dense" only where it computes at most 1.25x the rows of "blocked".
CPU_BLOCKED_OVERHEAD = 1.25


@struct.dataclass
class Routing:
    """What the router decided for T tokens.

    Attributes:
      ids_tk: [T, K] int32 experts used (the replayed ids when replaying).
      weights_tk: [T, K] float32 combine weights, differentiable w.r.t. the router.
      probs_te: [T, E] float32 dense softmax of the router logits.
    """

    ids_tk: jax.Array
    weights_tk: jax.Array
    probs_te: jax.Array


@struct.dataclass
class Experts:
    """Stacked SwiGLU expert weights, already in the compute dtype."""

    gate_edf: jax.Array
    up_edf: jax.Array
    down_efd: jax.Array


@struct.dataclass
class MoEOutput:
    """One MoE layer's result.

    Attributes:
      y_btd: [B, T, D] layer output.
      topk_ids_btk: [B, T, K] int32, the router's own top-k under the current params (equal to the
        experts used unless replaying).
      balance_loss: scalar float32 load-balancing loss over active tokens (not yet weighted).
      load_e: [E] float32 fraction of active token-slots sent to each expert (sums to 1).
      router_frac_e, router_prob_e: [E] the f_e and P_e of ``balance_loss`` (means over active
        tokens, so microbatches of equal size average to the batch's; P_e carries the gradient).
    """

    y_btd: jax.Array
    topk_ids_btk: jax.Array
    balance_loss: jax.Array
    load_e: jax.Array
    router_frac_e: jax.Array
    router_prob_e: jax.Array


def route(
    logits_te: jax.Array,
    *,
    k: int,
    norm_topk_prob: bool,
    replay_ids_tk: jax.Array | None = None,
    replay_mask_t: jax.Array | None = None,
) -> Routing:
    """Top-k softmax routing, or routing replay when `replay_ids_tk` is given.

    weights = softmax(logits)[ids], divided by their sum over the K when `norm_topk_prob`.

    Args:
      logits_te: [T, E] router logits (float32).
      k: experts per token.
      norm_topk_prob: renormalize the K weights to sum to one.
      replay_ids_tk: [T, K] recorded expert ids (any int dtype) or None.
      replay_mask_t: [T] bool, with `replay_ids_tk`: the tokens that replay; the others take
        the live top-k (their recorded ids are not read). None = every token replays.
    """
    probs_te = jax.nn.softmax(logits_te.astype(jnp.float32), axis=-1)
    if replay_ids_tk is None:
        weights_tk, ids_tk = jax.lax.top_k(probs_te, k)
    else:
        ids_tk = jnp.asarray(replay_ids_tk, jnp.int32)  # NumPy ids too, under jit
        if replay_mask_t is not None:
            live_tk = jax.lax.top_k(probs_te, k)[1]
            ids_tk = jnp.where(jnp.asarray(replay_mask_t, bool)[:, None], ids_tk, live_tk)
        weights_tk = jnp.take_along_axis(probs_te, ids_tk, axis=-1)
    if norm_topk_prob:
        weights_tk = weights_tk / jnp.sum(weights_tk, axis=-1, keepdims=True)
    return Routing(ids_tk=ids_tk.astype(jnp.int32), weights_tk=weights_tk, probs_te=probs_te)


def dispatch_dense(
    x_td: jax.Array, ids_tk: jax.Array, weights_tk: jax.Array, experts: Experts
) -> jax.Array:
    """Reference dispatch: all experts on all tokens, one-hot weighted combine.

    Args:
      x_td: [T, D] tokens in the compute dtype.
      ids_tk: [T, K] expert ids; weights_tk: [T, K] combine weights.
      experts: stacked expert weights.

    Returns:
      [T, D] sum_k weights_tk * expert_{ids_tk}(x_t).
    """
    num_experts = experts.gate_edf.shape[0]
    combine_te = jnp.einsum(
        "tk,tke->te", weights_tk, jax.nn.one_hot(ids_tk, num_experts, dtype=weights_tk.dtype)
    )
    gate_tef = jnp.einsum("td,edf->tef", x_td, experts.gate_edf)
    up_tef = jnp.einsum("td,edf->tef", x_td, experts.up_edf)
    h_tef = jax.nn.silu(gate_tef) * up_tef * combine_te[:, :, None].astype(x_td.dtype)
    return jnp.einsum("tef,efd->td", h_tef, experts.down_efd)


def dispatch_ragged(
    x_td: jax.Array, ids_tk: jax.Array, weights_tk: jax.Array, experts: Experts
) -> jax.Array:
    """Dropless dispatch: sort token-slots by expert, grouped matmuls, unsort, combine.

    Same arguments and result as `dispatch_dense`.
    """
    t, k = ids_tk.shape
    num_experts = experts.gate_edf.shape[0]
    ids_m = ids_tk.reshape(t * k)
    order_m = jnp.argsort(ids_m, stable=True)
    x_md = x_td[order_m // k]
    group_sizes_e = jnp.bincount(ids_m, length=num_experts).astype(jnp.int32)
    gate_mf = jax.lax.ragged_dot(x_md, experts.gate_edf, group_sizes_e)
    up_mf = jax.lax.ragged_dot(x_md, experts.up_edf, group_sizes_e)
    y_md = jax.lax.ragged_dot(jax.nn.silu(gate_mf) * up_mf, experts.down_efd, group_sizes_e)
    y_tkd = jnp.zeros_like(y_md).at[order_m].set(y_md, unique_indices=True).reshape(t, k, -1)
    return jnp.einsum("tkd,tk->td", y_tkd, weights_tk.astype(y_tkd.dtype))


def blocked_capacity(num_slots: int, num_experts: int, block_size: int) -> int:
    """Static row count of the blocked layout: each group padded to a block multiple, worst case."""
    rows = num_slots + num_experts * (block_size - 1)
    return -(-rows // block_size) * block_size


def default_block_size(num_slots: int, num_experts: int) -> int:
    """A power of two near half the mean group size, within [64, 256].

    Padding then costs at most about half the active rows. Measured on CPU (fwd+bwd, T = 2048,
    D = 512, F = 256, K = 2, medians of 5): E=8: 357/318/317 ms at blocks 64/128/256; E=16:
    388/371 ms at 64/128; E=32: 659/494/500 ms at 32/64/128. Smaller blocks fall off matmul
    speed and gather more copies of the expert weights.
    """
    half = max(num_slots // (2 * max(num_experts, 1)), 1)
    return int(min(max(1 << (half.bit_length() - 1), 64), 256))


def dispatch_blocked(
    x_td: jax.Array,
    ids_tk: jax.Array,
    weights_tk: jax.Array,
    experts: Experts,
    *,
    block_size: int | None = None,
) -> jax.Array:
    """Dropless grouped matmul from plain batched matmuls, for backends without a fast ragged_dot.

    Token-slots are sorted by expert and each expert's group is padded to a multiple of
    `block_size` rows, so every block of rows belongs to one expert; the blocks then run as one
    batched matmul against their experts' (gathered) weights. At most M + E * (block_size - 1)
    rows are computed, at most about 1.5x the active rows with the default block size at balanced
    routing. Same arguments and result as `dispatch_dense`.
    """
    t, k = ids_tk.shape
    num_experts, d_model, _ = experts.gate_edf.shape
    m = t * k
    block = block_size or default_block_size(m, num_experts)
    rows = blocked_capacity(m, num_experts, block)
    ids_m = ids_tk.reshape(m)
    order_m = jnp.argsort(ids_m, stable=True)
    sorted_ids_m = ids_m[order_m]
    sizes_e = jnp.bincount(ids_m, length=num_experts).astype(jnp.int32)
    padded_e = -(-sizes_e // block) * block
    start_e = jnp.cumsum(sizes_e) - sizes_e
    padded_end_e = jnp.cumsum(padded_e)
    # Row of the padded layout that sorted slot i lands on.
    dest_m = (padded_end_e - padded_e)[sorted_ids_m] + jnp.arange(m) - start_e[sorted_ids_m]
    # Padding rows read a zero row appended at index t.
    src_row_p = jnp.full((rows,), t, jnp.int32).at[dest_m].set(order_m // k, unique_indices=True)
    x_pad_td = jnp.concatenate([x_td, jnp.zeros((1, d_model), x_td.dtype)])
    x_nbd = x_pad_td[src_row_p].reshape(rows // block, block, d_model)
    block_start_n = jnp.arange(rows // block) * block
    expert_n = jnp.minimum(
        jnp.searchsorted(padded_end_e, block_start_n, side="right"), num_experts - 1
    )
    gate_nbf = jnp.einsum("nbd,ndf->nbf", x_nbd, experts.gate_edf[expert_n])
    up_nbf = jnp.einsum("nbd,ndf->nbf", x_nbd, experts.up_edf[expert_n])
    y_nbd = jnp.einsum("nbf,nfd->nbd", jax.nn.silu(gate_nbf) * up_nbf, experts.down_efd[expert_n])
    slot_row_m = jnp.zeros((m,), jnp.int32).at[order_m].set(dest_m, unique_indices=True)
    y_tkd = y_nbd.reshape(rows, d_model)[slot_row_m].reshape(t, k, d_model)
    return jnp.einsum("tkd,tk->td", y_tkd, weights_tk.astype(y_tkd.dtype))


def dispatch_gmm(
    x_td: jax.Array, ids_tk: jax.Array, weights_tk: jax.Array, experts: Experts
) -> jax.Array:
    """Dropless dispatch by megablox grouped matmuls (`tpu_kernels.gmm_dispatch`); Pallas
    interpret mode off TPU. Same arguments and result as `dispatch_dense`."""
    return gmm_dispatch(
        x_td, ids_tk, weights_tk, experts.gate_edf, experts.up_edf, experts.down_efd
    )


DISPATCH_FNS = {
    "dense": dispatch_dense,
    "ragged": dispatch_ragged,
    "blocked": dispatch_blocked,
    "gmm": dispatch_gmm,
}


def resolve_dispatch(
    dispatch: str, *, num_tokens: int, num_experts: int, k: int, backend: str | None = None
) -> str:
    """The concrete path ("dense", "ragged", "blocked" or "gmm") for a config's `dispatch`.

    "auto" takes "gmm" on TPU where the kernel can be placed (`tpu_kernels.kernels_placeable`:
    under an ambient mesh, as the train step traces, or on one device), because XLA:TPU turns
    `ragged_dot`'s weight gradient into dense compute over all E experts and megablox's `tgmm`
    does not; else "ragged" on TPU (its forward is a grouped matmul there) and on GPU.
    On CPU, `ragged_dot` lowers to a masked dense product over all E groups (E times the active
    FLOPs, worse than "dense"), so "auto" compares the rows each remaining path computes: T * E
    for "dense" against CPU_BLOCKED_OVERHEAD times the padded rows of "blocked" (which pays for
    the sort and the weight gather), and takes the cheaper. `backend` defaults to the trace's
    target platform (`tpu_kernels.target_platform`: the ambient mesh's devices, else the default
    backend).
    """
    if dispatch != "auto":
        return dispatch
    backend = backend or target_platform()
    if backend == "tpu" and kernels_placeable():
        return "gmm"
    if backend != "cpu":
        return "ragged"
    m = num_tokens * k
    blocked_rows = blocked_capacity(m, num_experts, default_block_size(m, num_experts))
    return "dense" if num_tokens * num_experts <= CPU_BLOCKED_OVERHEAD * blocked_rows else "blocked"


def router_stats(
    probs_te: jax.Array, ids_tk: jax.Array, mask_t: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """(f_e, P_e) of the load-balancing loss over active tokens, each [E] float32.

    f_e = fraction of active tokens whose K experts include e (sums to K, as in HF
    `load_balancing_loss_func`), detached by construction (one-hot of ids); P_e = mean router
    probability of e over active tokens, differentiable.

    Args:
      probs_te: [T, E] dense router softmax.
      ids_tk: [T, K] experts used.
      mask_t: [T] bool or 0/1 active tokens.
    """
    num_experts = probs_te.shape[-1]
    m_t = mask_t.astype(jnp.float32)
    n = jnp.maximum(jnp.sum(m_t), 1.0)
    chosen_te = jnp.sum(jax.nn.one_hot(ids_tk, num_experts, dtype=jnp.float32), axis=1)
    f_e = jnp.einsum("te,t->e", chosen_te, m_t) / n
    p_e = jnp.einsum("te,t->e", probs_te, m_t) / n
    return f_e, p_e


def balance_from_stats(frac_le: jax.Array, prob_le: jax.Array) -> jax.Array:
    """E · Σ_e f_e · P_e per layer, averaged over the L layers of [L, E] stats (0 when L = 0)."""
    if frac_le.shape[0] == 0:
        return jnp.zeros((), jnp.float32)
    return jnp.mean(frac_le.shape[-1] * jnp.sum(frac_le * prob_le, axis=-1))


def balance_loss(probs_te: jax.Array, ids_tk: jax.Array, mask_t: jax.Array) -> jax.Array:
    """Switch/Qwen load-balancing loss over active tokens: E * sum_e f_e * P_e (`router_stats`).

    Its minimum, at perfectly uniform routing, is K. Gradients flow through P only.
    """
    f_e, p_e = router_stats(probs_te, ids_tk, mask_t)
    return balance_from_stats(f_e[None], p_e[None])


def expert_load(ids_tk: jax.Array, mask_t: jax.Array, num_experts: int) -> jax.Array:
    """[E] fraction of active token-slots routed to each expert (sums to 1 when any is active)."""
    m_t = mask_t.astype(jnp.float32)
    counts_e = jnp.einsum("tke,t->e", jax.nn.one_hot(ids_tk, num_experts, dtype=jnp.float32), m_t)
    return counts_e / jnp.maximum(jnp.sum(counts_e), 1.0)


class MoE(nnx.Module):
    """Sparse MoE block of SwiGLU experts with a softmax top-k router (HF Qwen3MoeSparseMoeBlock).

    Params: w_router_de [D, E]; w_gate_edf, w_up_edf [E, D, F]; w_down_efd [E, F, D]; and LoRA
    adapters on some of them after `add_lora`.
    """

    def __init__(
        self,
        *,
        d_model: int,
        num_experts: int,
        k: int,
        expert_dim: int,
        norm_topk_prob: bool,
        dispatch: str,
        dtype: DTypeLike,
        param_dtype: DTypeLike,
        rngs: nnx.Rngs,
    ):
        self.num_experts, self.k = num_experts, k
        self.norm_topk_prob, self.dispatch, self.dtype = norm_topk_prob, dispatch, dtype
        d_init = fan_in_init(d_model)
        self.w_router_de = make_param(
            rngs, d_init, (d_model, num_experts), ("embed", "exp"), param_dtype
        )
        self.w_gate_edf = make_param(
            rngs, d_init, (num_experts, d_model, expert_dim), ("exp", "embed", "mlp"), param_dtype
        )
        self.w_up_edf = make_param(
            rngs, d_init, (num_experts, d_model, expert_dim), ("exp", "embed", "mlp"), param_dtype
        )
        self.w_down_efd = make_param(
            rngs,
            fan_in_init(expert_dim),
            (num_experts, expert_dim, d_model),
            ("exp", "mlp", "embed"),
            param_dtype,
        )

    def add_lora(self, lora: LoRAConfig, *, rngs: nnx.Rngs) -> None:
        """Adapters on every expert's gate, up and down (A [E, D or F, r], B [E, r, F or D]) when
        `lora.targets` has "experts", and on the router when it has "router"."""
        names = ("w_gate_edf", "w_up_edf", "w_down_efd") if "experts" in lora.targets else ()
        for name in names:
            add_lora(
                self, name, rank=lora.rank, scale=lora.scale, in_dims=1, batch_dims=1, rngs=rngs
            )
        if "router" in lora.targets:
            add_lora(self, "w_router_de", rank=lora.rank, scale=lora.scale, in_dims=1, rngs=rngs)

    def __call__(
        self,
        x_btd: jax.Array,
        *,
        mask_bt: jax.Array,
        replay_ids_btk: jax.Array | None = None,
        replay_mask_bt: jax.Array | None = None,
        dispatch: str | None = None,
    ) -> MoEOutput:
        """Routes and runs the experts.

        Args:
          x_btd: [B, T, D] normed hidden states.
          mask_bt: [B, T] active tokens (for the loss and load statistics only; every token is
            routed and computed).
          replay_ids_btk: [B, T, K] recorded expert ids to replay, or None.
          replay_mask_bt: [B, T] bool, the tokens that replay (the others are routed by the
            live top-k); None = all of them.
          dispatch: overrides the module's dispatch path (one of `DISPATCH_PATHS`).
        """
        b, t, d = x_btd.shape
        x_td = x_btd.reshape(b * t, d)
        w_router_de = lora_weight(self, "w_router_de", jnp.float32)
        logits_te = jnp.dot(x_td.astype(jnp.float32), w_router_de)
        replay_tk = None if replay_ids_btk is None else replay_ids_btk.reshape(b * t, self.k)
        routing = route(
            logits_te,
            k=self.k,
            norm_topk_prob=self.norm_topk_prob,
            replay_ids_tk=replay_tk,
            replay_mask_t=None if replay_mask_bt is None else replay_mask_bt.reshape(b * t),
        )
        if replay_tk is None:
            topk_ids_tk = routing.ids_tk
        else:
            topk_ids_tk = jax.lax.top_k(routing.probs_te, self.k)[1]
        weight = lambda name: lora_weight(self, name, self.dtype)
        experts = Experts(
            gate_edf=weight("w_gate_edf"), up_edf=weight("w_up_edf"), down_efd=weight("w_down_efd")
        )
        path = resolve_dispatch(
            dispatch or self.dispatch, num_tokens=b * t, num_experts=self.num_experts, k=self.k
        )
        y_td = DISPATCH_FNS[path](
            x_td.astype(self.dtype), routing.ids_tk, routing.weights_tk, experts
        )
        mask_t = mask_bt.reshape(b * t)
        f_e, p_e = router_stats(routing.probs_te, routing.ids_tk, mask_t)
        return MoEOutput(
            y_btd=y_td.reshape(b, t, d),
            topk_ids_btk=topk_ids_tk.reshape(b, t, self.k),
            balance_loss=balance_from_stats(f_e[None], p_e[None]),
            load_e=expert_load(routing.ids_tk, mask_t, self.num_experts),
            router_frac_e=f_e,
            router_prob_e=p_e,
        )
