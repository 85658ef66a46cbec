"""The decoder-only MoE transformer: full forward, routing capture/replay, KV-cache decoding.

Dimension letters used in tensor names:
  B batch, T positions, S cache positions, D d_model, V vocab, L MoE layers, K experts per token,
  E experts, G key/value heads, H head_dim.

Contract (docs/DESIGN.md §5):
  logits_btv = model(tokens_bt)
  logits_btv, routing_btlk = model(tokens_bt, return_routing=True)   # uint8 ids when E <= 256
`Transformer.forward` returns the full `ModelOutput` (aux loss, expert load) for the trainer.
`Transformer.logprobs` scores a batch's own tokens from it chunk by chunk: the one log-prob path of
the train step (policy and reference), the supervised warm-up and the benchmarks.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx, struct

from sat_jax import quant
from sat_jax.model.config import ModelConfig
from sat_jax.model.kv_cache import DecodeOutput, KVCache, PrefillOutput
from sat_jax.model.layers import Attention, DenseMLP, RMSNorm, fan_in_init, make_param
from sat_jax.model.logprobs import token_logprobs
from sat_jax.model.moe import MoE, MoEOutput, balance_from_stats
from sat_jax.sharding import constrain_batch


@struct.dataclass
class ModelOutput:
    """Everything one forward pass produces.

    Attributes:
      logits_btv: [B, T, V] float32.
      routing_btlk: [B, T, L, K] the router's own top-k ids under the current params, in
        `config.routing_dtype` (under replay the experts USED are the replayed ones).
      aux_loss: scalar, `router_aux_loss_coef * balance_loss`, ready to add to the loss.
      balance_loss: scalar, the load-balancing loss averaged over MoE layers (0 without MoE).
      expert_load_le: [L, E] fraction of active token-slots per expert, per MoE layer.
      router_frac_le, router_prob_le: [L, E] f and P of the balance loss per MoE layer
        (`moe.router_stats`): gradient accumulation rebuilds the batch's balance loss from them.
      hidden_btd: [B, T, D] the final-normed hidden states `logits_btv` is projected from;
        `Transformer.target_logprobs` scores targets from them chunk by chunk (when only that is
        used under `jit`, the full logits are never computed).
    """

    logits_btv: jax.Array
    routing_btlk: jax.Array
    aux_loss: jax.Array
    balance_loss: jax.Array
    expert_load_le: jax.Array
    router_frac_le: jax.Array
    router_prob_le: jax.Array
    hidden_btd: jax.Array


@struct.dataclass
class _Trunk:
    """What `Transformer._trunk` computes: the residual stream after the last layer, each MoE
    layer's output, and the keys and values: [L, B, T, G, H] of the T positions without a cache,
    the whole updated cache [L, B, S, G, H] with one (and, for an 8-bit cache, its scales)."""

    x_btd: jax.Array
    moe: tuple[MoEOutput, ...]
    k_lbtgh: jax.Array
    v_lbtgh: jax.Array
    k_scale_lbtg: jax.Array | None = None
    v_scale_lbtg: jax.Array | None = None


class DecoderLayer(nnx.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x)); mlp is MoE or dense SwiGLU."""

    def __init__(self, config: ModelConfig, layer_idx: int, *, rngs: nnx.Rngs):
        c = config
        self.is_moe = c.is_moe_layer(layer_idx)
        norm = lambda: RMSNorm(c.d_model, eps=c.rms_norm_eps, param_dtype=c.param_dtype, rngs=rngs)
        self.attn_norm = norm()
        self.attn = Attention(
            d_model=c.d_model,
            num_heads=c.num_heads,
            num_kv_heads=c.num_kv_heads,
            head_dim=c.head_dim,
            rope_theta=c.rope_theta,
            eps=c.rms_norm_eps,
            dtype=c.dtype,
            param_dtype=c.param_dtype,
            rngs=rngs,
        )
        self.mlp_norm = norm()
        if self.is_moe:
            self.mlp = MoE(
                d_model=c.d_model,
                num_experts=c.num_experts,
                k=c.num_experts_per_tok,
                expert_dim=c.expert_dim,
                norm_topk_prob=c.norm_topk_prob,
                dispatch=c.dispatch,
                dtype=c.dtype,
                param_dtype=c.param_dtype,
                rngs=rngs,
            )
        else:
            self.mlp = DenseMLP(
                d_model=c.d_model,
                hidden_dim=c.dense_dim,
                dtype=c.dtype,
                param_dtype=c.param_dtype,
                rngs=rngs,
            )


class Transformer(nnx.Module):
    """Qwen3-MoE-family decoder.

    Params: embedding_vd [V, D]; lm_head_dv [D, V] (absent when tied); final_norm; layers[i] with
    attn_norm, attn (w_q_dnh, w_k_dgh, w_v_dgh, w_o_nhd, q_norm, k_norm), mlp_norm and mlp (MoE:
    w_router_de, w_gate_edf, w_up_edf, w_down_efd; dense: w_gate_df, w_up_df, w_down_fd).
    With `config.lora.rank` > 0 the targeted weights w gain adapters w_lora_a and w_lora_b
    (`nnx.LoRAParam`, `sat_jax.model.layers.add_lora`); with rank 0 there are none.
    """

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        c = self.config = config
        self.embedding_vd = make_param(
            rngs,
            nnx.initializers.normal(stddev=c.d_model**-0.5),
            (c.vocab_size, c.d_model),
            ("vocab", "embed"),
            c.param_dtype,
        )
        self.layers = nnx.List([DecoderLayer(c, i, rngs=rngs) for i in range(c.num_layers)])
        self.final_norm = RMSNorm(
            c.d_model, eps=c.rms_norm_eps, param_dtype=c.param_dtype, rngs=rngs
        )
        self.lm_head_dv = (
            None
            if c.tie_embeddings
            else make_param(
                rngs,
                fan_in_init(c.d_model),
                (c.d_model, c.vocab_size),
                ("embed", "vocab"),
                c.param_dtype,
            )
        )
        if c.lora.rank:
            # After every base weight, so the base draws the same values as without LoRA.
            for layer in self.layers:
                layer.attn.add_lora(c.lora, rngs=rngs)
                layer.mlp.add_lora(c.lora, rngs=rngs)

    # The trunk shared by forward, prefill and decode.

    def _trunk(
        self,
        tokens_bt: jax.Array,
        positions_bt: jax.Array,
        mask_bt: jax.Array,
        allowed_bts: jax.Array,
        *,
        cache: KVCache | None = None,
        replay_btlk: jax.Array | None = None,
        dispatch: str | None = None,
        window: int | None = None,
        kv_format: str = "bfloat16",
    ) -> _Trunk:
        """Runs every layer. With `cache`, the T new keys/values of row b go to its positions
        `positions_bt[b]` (lengths_b[b] onwards; positions past the cache are dropped) and
        attention covers the cache's first `window` positions (default all); without, it covers
        the T new positions.

        With `cache`, each layer's keys and values are scattered into the whole [L, B, S, G, H]
        buffers carried from layer to layer, and the returned `_Trunk` holds those buffers: under
        `jit` with the cache donated, XLA writes the new entries into the donated buffers in
        place, so no second cache is built (docs/DESIGN.md §5). Without, the T positions' keys
        and values are stacked over layers.

        An 8-bit cache (`KVCache.kv_format`) is written quantized (`quant.quantize_kv`) and read
        dequantized; without a cache, ``kv_format`` "int8" / "fp8" makes attention see the keys
        and values as such a cache holds them (`quant.fake_quantize_kv`), so a prefill's prompt
        and a full forward read what the decode steps later read."""
        c = self.config
        x_btd = self.embedding_vd[...].astype(c.dtype)[tokens_bt]
        rows_b = jnp.arange(tokens_bt.shape[0])
        moe_outs, ks, vs = [], [], []
        k_all, v_all = (None, None) if cache is None else (cache.k_lbsgh, cache.v_lbsgh)
        ks_all, vs_all = (None, None) if cache is None else (cache.k_scale_lbsg, cache.v_scale_lbsg)
        fmt = kv_format if cache is None else cache.kv_format
        if cache is not None:
            # Row b's position p is row b·S + p of the cache seen as [L, B·S, G, H] (positions
            # past the cache go to B·S, out of range, and are dropped). One index per update, not
            # (row, position): XLA:TPU lays out a scatter indexed by an iota over rows with the
            # rows minor to the positions, against the positions-minor layout the attention
            # reads, and relayouts the whole cache around every step. The reshape is free when
            # S is a multiple of the sublane tile (`DecodeCore` rounds it up to 16).
            num_l, b, s, g, h = cache.k_lbsgh.shape
            flat_bt = jnp.where(positions_bt < s, rows_b[:, None] * s + positions_bt, b * s)
        for i, layer in enumerate(self.layers):
            qkv = layer.attn.project(layer.attn_norm(x_btd), positions_bt)
            k_bsgh, v_bsgh = qkv.k_btgh, qkv.v_btgh
            if cache is None:
                ks.append(k_bsgh)
                vs.append(v_bsgh)
                k_bsgh, v_bsgh = (
                    quant.fake_quantize_kv(k_bsgh, fmt),
                    quant.fake_quantize_kv(v_bsgh, fmt),
                )
            else:  # T new tokens per row, written at their positions of layer i
                put = lambda c, x, i=i: (
                    c.reshape(num_l, b * s, *c.shape[3:])
                    .at[i, flat_bt]
                    .set(x.astype(c.dtype), mode="drop")
                    .reshape(c.shape)
                )
                span = k_all.shape[2] if window is None else window
                if quant.is_quantized(fmt):
                    dtype = k_bsgh.dtype
                    (kq, k_sc), (vq, v_sc) = (
                        quant.quantize_kv(k_bsgh, fmt),
                        quant.quantize_kv(v_bsgh, fmt),
                    )
                    k_all, v_all = put(k_all, kq), put(v_all, vq)
                    ks_all, vs_all = put(ks_all, k_sc), put(vs_all, v_sc)
                    k_bsgh = quant.dequantize_kv(k_all[i, :, :span], ks_all[i, :, :span], dtype)
                    v_bsgh = quant.dequantize_kv(v_all[i, :, :span], vs_all[i, :, :span], dtype)
                else:
                    k_all, v_all = put(k_all, k_bsgh), put(v_all, v_bsgh)
                    k_bsgh, v_bsgh = k_all[i, :, :span], v_all[i, :, :span]
            x_btd = x_btd + layer.attn.attend(qkv.q_btnh, k_bsgh, v_bsgh, allowed_bts)
            h_btd = layer.mlp_norm(x_btd)
            if layer.is_moe:
                j = len(moe_outs)
                replay_btk = None if replay_btlk is None else replay_btlk[:, :, j]
                out = layer.mlp(
                    h_btd, mask_bt=mask_bt, replay_ids_btk=replay_btk, dispatch=dispatch
                )
                moe_outs.append(out)
                x_btd = x_btd + out.y_btd
            else:
                x_btd = x_btd + layer.mlp(h_btd)
        if cache is None:
            k_all, v_all = jnp.stack(ks), jnp.stack(vs)
        return _Trunk(
            x_btd=x_btd,
            moe=tuple(moe_outs),
            k_lbtgh=k_all,
            v_lbtgh=v_all,
            k_scale_lbtg=ks_all,
            v_scale_lbtg=vs_all,
        )

    def _logits(self, x_btd: jax.Array) -> jax.Array:
        return self._project(self.final_norm(x_btd).astype(self.config.dtype))

    def _project(self, h_btd: jax.Array) -> jax.Array:
        """float32 logits [..., V] of final-normed hidden states [..., D]."""
        c = self.config
        if self.lm_head_dv is None:
            w_dv = self.embedding_vd[...].astype(c.dtype).T
        else:
            w_dv = self.lm_head_dv[...].astype(c.dtype)
        return jnp.einsum("...d,dv->...v", h_btd, w_dv, preferred_element_type=jnp.float32)

    def target_logprobs(
        self,
        hidden_btd: jax.Array,
        targets_bt: jax.Array,
        *,
        temperature: float = 1.0,
        vocab_mask: jax.Array | None = None,
        kept_bt: jax.Array | None = None,
        format_masks: jax.Array | None = None,
        format_ids_bt: jax.Array | None = None,
    ) -> jax.Array:
        """[B, T] float32 log softmax(logits / temperature) at ``targets_bt``, from the hidden
        states of `ModelOutput.hidden_btd`, `config.logits_chunk` positions at a time.

        Each chunk's [B, chunk, V] logits are recomputed in the backward pass (`jax.checkpoint`),
        so no full float32 [B, T, V] buffer exists in either pass. ``vocab_mask`` ([V] bool)
        renormalizes over those ids only, as a sampler restricted to them does; ``kept_bt``
        ([B, T] int) replays a top-k / top-p truncation; ``format_masks`` ([M, W] uint32) with
        ``format_ids_bt`` ([B, T] int) constrained decoding's masks, unpacked a chunk at a time
        (`token_logprobs`).
        """
        b, t, d = hidden_btd.shape
        c = min(self.config.logits_chunk, t)
        n = -(-t // c)
        pad = ((0, 0), (0, n * c - t))
        chunks = lambda x: jnp.moveaxis(jnp.pad(x, pad).reshape(b, n, c), 1, 0)
        h_nbcd = jnp.moveaxis(jnp.pad(hidden_btd, (*pad, (0, 0))).reshape(b, n, c, d), 1, 0)
        optional = {"kept_bt": kept_bt, "format_ids_bt": format_ids_bt}
        given = {k: chunks(v) for k, v in optional.items() if v is not None}

        @jax.checkpoint
        def one(h_bcd: jax.Array, y_bc: jax.Array, per_token: dict[str, jax.Array]) -> jax.Array:
            logits_bcv = self._project(h_bcd)
            return token_logprobs(
                logits_bcv,
                y_bc,
                temperature=temperature,
                vocab_mask=vocab_mask,
                format_masks=format_masks,
                **per_token,
            )

        logp_nbc = jax.lax.map(lambda xs: one(*xs), (h_nbcd, chunks(targets_bt), given))
        return jnp.moveaxis(logp_nbc, 0, 1).reshape(b, n * c)[:, :t]

    def _routing(self, trunk: _Trunk, b: int, t: int) -> jax.Array:
        c = self.config
        if not trunk.moe:
            return jnp.zeros((b, t, 0, c.num_experts_per_tok), c.routing_dtype)
        return jnp.stack([o.topk_ids_btk for o in trunk.moe], axis=2).astype(c.routing_dtype)

    # Public API.

    def forward(
        self,
        tokens_bt: jax.Array,
        *,
        positions_bt: jax.Array | None = None,
        mask_bt: jax.Array | None = None,
        replay_routing: jax.Array | None = None,
        replay_mask_bt: jax.Array | None = None,
        dispatch: str | None = None,
        segment_ids_bt: jax.Array | None = None,
        kv_cache_dtype: str = "bfloat16",
    ) -> ModelOutput:
        """Full causal forward of right-padded sequences, or of packed rows.

        Args:
          tokens_bt: [B, T] int token ids.
          positions_bt: [B, T] RoPE positions; default 0..T-1 per row.
          mask_bt: [B, T] valid tokens (right padding); padded keys are masked out of attention
            and padded tokens out of the aux loss and load statistics. Default: all valid.
          replay_routing: [B, T, L, K] recorded expert ids (any int dtype) to replay (R3).
          replay_mask_bt: [B, T] bool, with `replay_routing`: the positions that replay it; the
            others are routed by the live router, exactly as without replay (a multi-turn
            trajectory's observation tokens). None = every position replays.
          dispatch: overrides `config.dispatch` for this call ("auto" | "dense" | "ragged").
          segment_ids_bt: [B, T] int, packed rows (docs/DESIGN.md §7.1): the id of each
            position's sequence, 0 on padding; a token attends to the earlier tokens of its own
            segment only (give each segment's own `positions_bt`, restarting at 0).
          kv_cache_dtype: "int8" / "fp8": attention reads the keys and values as an 8-bit decode
            cache of that format holds them (`quant.fake_quantize_kv`): the forward a server
            with that `server.kv_cache_dtype` decodes. "bfloat16" (default): as computed.
        """
        c = self.config
        b, t = tokens_bt.shape
        if positions_bt is None:
            positions_bt = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        mask_bt = jnp.ones((b, t), bool) if mask_bt is None else mask_bt.astype(bool)
        if replay_routing is not None and replay_routing.shape != (
            b,
            t,
            c.num_moe_layers,
            c.num_experts_per_tok,
        ):
            raise ValueError(
                f"replay_routing has shape {replay_routing.shape}, expected "
                f"{(b, t, c.num_moe_layers, c.num_experts_per_tok)}"
            )
        x_btd = self.embedding_vd[...].astype(c.dtype)[tokens_bt]
        if replay_mask_bt is not None:
            if replay_routing is None:
                raise ValueError("replay_mask_bt needs replay_routing")
            replay_mask_bt = jnp.asarray(replay_mask_bt, bool)
        x_btd, stats = self._scan_layers(
            x_btd,
            positions_bt,
            mask_bt,
            replay_routing,
            dispatch,
            replay_mask_bt,
            segment_ids_bt,
            kv_cache_dtype,
        )
        balance = balance_from_stats(stats.frac_le, stats.prob_le)
        hidden_btd = self.final_norm(x_btd).astype(c.dtype)
        return ModelOutput(
            logits_btv=self._project(hidden_btd),
            routing_btlk=jnp.moveaxis(stats.ids_lbtk, 0, 2).astype(c.routing_dtype),
            aux_loss=c.router_aux_loss_coef * balance,
            balance_loss=balance,
            expert_load_le=stats.load_le,
            router_frac_le=stats.frac_le,
            router_prob_le=stats.prob_le,
            hidden_btd=hidden_btd,
        )

    def logprobs(
        self,
        tokens_bt: jax.Array,
        *,
        temperature: float = 1.0,
        vocab_mask: jax.Array | None = None,
        mask_bt: jax.Array | None = None,
        replay_routing: jax.Array | None = None,
        replay_mask_bt: jax.Array | None = None,
        kept_bt: jax.Array | None = None,
        positions_bt: jax.Array | None = None,
        segment_ids_bt: jax.Array | None = None,
        kv_cache_dtype: str = "bfloat16",
        format_masks: jax.Array | None = None,
        format_ids_bt: jax.Array | None = None,
    ) -> tuple[jax.Array, ModelOutput]:
        """Log-probs of a batch's own tokens, and the forward's `ModelOutput`.

        ``logp_bt[b, t]`` = log π(tokens[b, t] | tokens[b, :t]) at ``temperature`` over
        ``vocab_mask``, scored from the hidden state at t − 1 by `target_logprobs`; column 0 has
        no prediction and is 0. The one log-prob path of the train step (policy and reference),
        the supervised warm-up and the benchmarks' samplers: under `jit`, unless the caller reads
        ``ModelOutput.logits_btv``, no [B, T, V] float32 buffer is built (docs/DESIGN.md §5).

        Args:
          tokens_bt: [B, T] int token ids, right-padded.
          temperature, vocab_mask: as in `target_logprobs`.
          mask_bt, replay_routing, replay_mask_bt, positions_bt, segment_ids_bt,
            kv_cache_dtype: as in `forward` (packed rows: a segment's first token is scored
            from the previous segment's last, a log-prob the caller masks like column 0's).
          kept_bt: optional [B, T] int, the sampler's kept-set size of ``tokens_bt[b, t]``
            (aligned like the log-probs; 0 = no truncation): replays top-k / top-p truncation
            (`token_logprobs`).
          format_masks, format_ids_bt: optional, together: constrained decoding's masks, [M, W]
            uint32 bit-packed rows and [B, T] int (aligned like ``kept_bt``; 0 = free, r >= 1 =
            row r − 1): a constrained token is renormalized over its row's ids
            (`token_logprobs`, docs/DESIGN.md §6.6).

        Returns:
          ``(logp_bt [B, T] float32, the forward's ModelOutput)``.
        """
        out = self.forward(
            tokens_bt,
            positions_bt=positions_bt,
            mask_bt=mask_bt,
            replay_routing=replay_routing,
            replay_mask_bt=replay_mask_bt,
            segment_ids_bt=segment_ids_bt,
            kv_cache_dtype=kv_cache_dtype,
        )
        logp_bt = self.target_logprobs(
            out.hidden_btd[:, :-1],
            tokens_bt[:, 1:],
            temperature=temperature,
            vocab_mask=vocab_mask,
            kept_bt=None if kept_bt is None else kept_bt[:, 1:],
            format_masks=format_masks,
            format_ids_bt=None if format_ids_bt is None else format_ids_bt[:, 1:],
        )
        return jnp.pad(logp_bt, ((0, 0), (1, 0))), out

    def _scan_layers(
        self,
        x_btd,
        positions_bt,
        mask_bt,
        replay_btlk,
        dispatch,
        replay_mask_bt,
        segment_ids_bt,
        kv_format="bfloat16",
    ):
        """The full forward's layers: each run of identical consecutive layers (all dense or all
        MoE) is one `lax.scan` over its params stacked on the fly, so one layer of each kind is
        compiled whatever the depth, and the param tree (HF names, checkpoints, sharding rules)
        stays per layer. With `config.remat == "layer"` the scan body is `jax.checkpoint`ed."""
        c = self.config
        b, t = mask_bt.shape
        stats, moe_seen = [], 0
        for start, end in _runs([layer.is_moe for layer in self.layers]):
            graphdef, _ = nnx.split(self.layers[start])
            stacked = jax.tree.map(
                lambda *xs: jnp.stack(xs), *[nnx.state(layer) for layer in self.layers[start:end]]
            )
            is_moe, replay = self.layers[start].is_moe, None
            if is_moe and replay_btlk is not None:
                replay = jnp.moveaxis(replay_btlk[:, :, moe_seen : moe_seen + end - start], 2, 0)

            def body(x, xs, graphdef=graphdef):
                x, stats = _layer_step(
                    nnx.merge(graphdef, xs[0]),
                    constrain_batch(x),
                    positions_bt,
                    mask_bt,
                    xs[1],
                    dispatch,
                    c,
                    replay_mask_bt,
                    segment_ids_bt,
                    kv_format,
                )
                return constrain_batch(x), stats

            body = jax.checkpoint(body) if c.remat == "layer" else body
            x_btd, run_stats = jax.lax.scan(body, x_btd, (stacked, replay))
            if is_moe:
                stats.append(run_stats)
                moe_seen += end - start
        if not stats:
            k, e = c.num_experts_per_tok, c.num_experts
            empty = _LayerStats(
                ids_lbtk=jnp.zeros((0, b, t, k), jnp.int32),
                load_le=jnp.zeros((0, e), jnp.float32),
                frac_le=jnp.zeros((0, e), jnp.float32),
                prob_le=jnp.zeros((0, e), jnp.float32),
            )
            return x_btd, empty
        return x_btd, jax.tree.map(lambda *xs: jnp.concatenate(xs), *stats)

    def __call__(
        self,
        tokens_bt: jax.Array,
        *,
        positions_bt: jax.Array | None = None,
        mask_bt: jax.Array | None = None,
        replay_routing: jax.Array | None = None,
        return_routing: bool = False,
    ) -> jax.Array | tuple[jax.Array, jax.Array]:
        """The documented contract (docs/DESIGN.md §5): float32 logits [B, T, V], or (logits, routing ids [B, T, L, K]).

        The routing ids are the router's own top-k under the current params in
        `config.routing_dtype` (under replay, the experts used are the replayed ones). Arguments
        as in `forward`.
        """
        out = self.forward(
            tokens_bt, positions_bt=positions_bt, mask_bt=mask_bt, replay_routing=replay_routing
        )
        return (out.logits_btv, out.routing_btlk) if return_routing else out.logits_btv

    def init_cache(
        self, batch: int, max_len: int | None = None, kv_format: str = "bfloat16"
    ) -> KVCache:
        """An empty cache of `max_len` (default `config.max_seq_len`) positions for `batch` rows,
        in `config.dtype`, or 8-bit with scales for ``kv_format`` "int8" / "fp8"."""
        c = self.config
        return empty_cache(
            (c.num_layers, batch, max_len or c.max_seq_len, c.num_kv_heads, c.head_dim),
            c.dtype,
            kv_format,
        )

    def prefill(
        self,
        cache: KVCache,
        tokens_bt: jax.Array,
        *,
        mask_bt: jax.Array | None = None,
        return_routing: bool = False,
    ) -> PrefillOutput:
        """Runs right-padded prompts [B, T] (T <= cache length) and writes every row's cache.

        Row b's prompt is tokens_bt[b, :lengths_b[b]] with lengths_b = mask_bt.sum(-1); its next
        token's logits are logits_btv[b, lengths_b[b] - 1].
        """
        b, t = tokens_bt.shape
        if t > cache.max_len:
            raise ValueError(f"prompt length {t} exceeds the cache length {cache.max_len}")
        mask_bt = jnp.ones((b, t), bool) if mask_bt is None else mask_bt.astype(bool)
        positions_bt = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        allowed_bts = jnp.tril(jnp.ones((t, t), bool))[None] & mask_bt[:, None, :]
        fmt = cache.kv_format
        trunk = self._trunk(tokens_bt, positions_bt, mask_bt, allowed_bts, kv_format=fmt)
        new = {"k_lbsgh": trunk.k_lbtgh, "v_lbsgh": trunk.v_lbtgh}
        if quant.is_quantized(fmt):
            (kq, k_sc), (vq, v_sc) = (quant.quantize_kv(x, fmt) for x in new.values())
            new = {"k_lbsgh": kq, "v_lbsgh": vq, "k_scale_lbsg": k_sc, "v_scale_lbsg": v_sc}
        cache = cache.replace(
            **{
                n: jax.lax.dynamic_update_slice_in_dim(c, new[n].astype(c.dtype), 0, axis=2)
                for n, c in cache.arrays().items()
            },
            lengths_b=jnp.sum(mask_bt, axis=-1, dtype=jnp.int32),
        )
        routing = self._routing(trunk, b, t) if return_routing else None
        return PrefillOutput(
            logits_btv=self._logits(trunk.x_btd), routing_btlk=routing, cache=cache
        )

    def decode_step(
        self,
        cache: KVCache,
        tokens_b: jax.Array,
        *,
        active_b: jax.Array | None = None,
        return_routing: bool = False,
        window: int | None = None,
    ) -> DecodeOutput:
        """Feeds one token per row at position lengths_b and advances the active rows.

        Args:
          cache: the cache after `prefill` or earlier steps.
          tokens_b: [B] int next input token per row.
          active_b: [B] bool rows to advance (default all); inactive rows compute but keep their
            length, so their next step overwrites this one. A row already at the cache length
            is not written (the scatter drops out-of-range slots); size the cache to fit.
          return_routing: also return this step's routing ids [B, L, K].
          window: attend over the cache's first `window` positions only (a static int, default
            the whole cache), so the step's attention costs O(window), not O(cache length).
            Exact for every active row with lengths_b < window; other rows compute garbage
            (their keys/values are still written to the full cache).
        """
        b = tokens_b.shape[0]
        active_b = jnp.ones((b,), bool) if active_b is None else active_b.astype(bool)
        span = cache.max_len if window is None else min(window, cache.max_len)
        out = self._append(cache, tokens_b[:, None], active_b[:, None], span, return_routing)
        routing = None if out.routing_btlk is None else out.routing_btlk[:, 0]
        return DecodeOutput(logits_bv=out.logits_btv[:, 0], routing_blk=routing, cache=out.cache)

    def extend(
        self,
        cache: KVCache,
        tokens_bt: jax.Array,
        *,
        mask_bt: jax.Array | None = None,
        return_routing: bool = False,
        window: int | None = None,
    ) -> PrefillOutput:
        """Appends T tokens per row to a filled cache: row b's tokens go to positions
        lengths_b[b] onwards, each attending to the row's cache before it and to the new tokens
        up to itself (a chunked prefill; `decode_step` is the T = 1 case without padding).

        Exact: the keys, values and logits equal those of one `prefill` of the whole sequence
        (up to the float reassociation of a different attention length).

        Args:
          cache: the cache after `prefill`, `decode_step`s or earlier extensions; keys and values
            at positions >= lengths_b are ignored and overwritten.
          tokens_bt: [B, T] tokens, right-padded per row.
          mask_bt: [B, T] the real tokens (default all); row b gains mask_bt[b].sum() positions.
            Padding positions are written past the new length, where they are ignored.
          return_routing: also return the new tokens' routing ids [B, T, L, K].
          window: attend over the cache's first `window` positions (a static int, default the
            whole cache); every row's new tokens must end before it.

        Returns:
          The new tokens' logits [B, T, V] (row b's next token is sampled from
          logits_btv[b, n_b - 1]), their routing, and the extended cache.
        """
        b, t = tokens_bt.shape
        mask_bt = jnp.ones((b, t), bool) if mask_bt is None else mask_bt.astype(bool)
        span = cache.max_len if window is None else min(window, cache.max_len)
        return self._append(cache, tokens_bt, mask_bt, span, return_routing)

    def _append(
        self,
        cache: KVCache,
        tokens_bt: jax.Array,
        mask_bt: jax.Array,
        window: int,
        return_routing: bool,
    ) -> PrefillOutput:
        """`extend` and `decode_step`: T tokens per row at positions lengths_b onwards, attending
        over the cache's first `window` positions; row b advances by mask_bt[b].sum()."""
        b, t = tokens_bt.shape
        positions_bt = cache.lengths_b[:, None] + jnp.arange(t, dtype=jnp.int32)[None]
        allowed_bts = jnp.arange(window)[None, None, :] <= positions_bt[:, :, None]
        trunk = self._trunk(
            tokens_bt, positions_bt, mask_bt, allowed_bts, cache=cache, window=window
        )
        cache = KVCache(
            k_lbsgh=trunk.k_lbtgh,
            v_lbsgh=trunk.v_lbtgh,
            lengths_b=cache.lengths_b + jnp.sum(mask_bt, axis=-1, dtype=jnp.int32),
            k_scale_lbsg=trunk.k_scale_lbtg,
            v_scale_lbsg=trunk.v_scale_lbtg,
        )
        routing = self._routing(trunk, b, t) if return_routing else None
        return PrefillOutput(
            logits_btv=self._logits(trunk.x_btd), routing_btlk=routing, cache=cache
        )


@struct.dataclass
class _LayerStats:
    """Per-MoE-layer results of the full forward, stacked over layers ([L, ...])."""

    ids_lbtk: jax.Array
    load_le: jax.Array
    frac_le: jax.Array
    prob_le: jax.Array


def _runs(kinds: list[bool]) -> list[tuple[int, int]]:
    """[start, end) of each run of equal consecutive entries."""
    starts = [i for i in range(len(kinds)) if i == 0 or kinds[i] != kinds[i - 1]]
    return list(zip(starts, [*starts[1:], len(kinds)], strict=True))


def _layer_step(
    layer,
    x_btd,
    positions_bt,
    mask_bt,
    replay_btk,
    dispatch,
    c: ModelConfig,
    replay_mask_bt=None,
    segment_ids_bt=None,
    kv_format="bfloat16",
):
    """One decoder layer of the full forward: (new residual stream, MoE stats or None)."""
    qkv = layer.attn.project(layer.attn_norm(x_btd), positions_bt)
    x_btd = x_btd + layer.attn.attend_causal(
        qkv.q_btnh,
        quant.fake_quantize_kv(qkv.k_btgh, kv_format),
        quant.fake_quantize_kv(qkv.v_btgh, kv_format),
        mask_bt,
        path=c.attention,
        block=c.attention_block,
        segment_ids_bt=segment_ids_bt,
    )
    h_btd = layer.mlp_norm(x_btd)
    if not layer.is_moe:
        return x_btd + layer.mlp(h_btd), None
    out = layer.mlp(
        h_btd,
        mask_bt=mask_bt,
        replay_ids_btk=replay_btk,
        replay_mask_bt=None if replay_btk is None else replay_mask_bt,
        dispatch=dispatch,
    )
    stats = _LayerStats(
        ids_lbtk=out.topk_ids_btk,
        load_le=out.load_e,
        frac_le=out.router_frac_e,
        prob_le=out.router_prob_e,
    )
    return x_btd + out.y_btd, stats


def empty_cache(shape_lbsgh: tuple[int, ...], dtype, kv_format: str = "bfloat16") -> KVCache:
    """A zero cache of ``shape_lbsgh`` [L, B, S, G, H] for every row: in ``dtype``, or for
    ``kv_format`` "int8" / "fp8" in its 8-bit storage with float32 scales [L, B, S, G] of 1."""
    b = shape_lbsgh[1]
    if not quant.is_quantized(kv_format):
        zeros = lambda: jnp.zeros(shape_lbsgh, dtype)
        return KVCache(k_lbsgh=zeros(), v_lbsgh=zeros(), lengths_b=jnp.zeros((b,), jnp.int32))
    zeros = lambda: jnp.zeros(shape_lbsgh, quant.kv_storage_dtype(kv_format))
    ones = lambda: jnp.ones(shape_lbsgh[:-1], jnp.float32)
    return KVCache(
        k_lbsgh=zeros(),
        v_lbsgh=zeros(),
        lengths_b=jnp.zeros((b,), jnp.int32),
        k_scale_lbsg=ones(),
        v_scale_lbsg=ones(),
    )
