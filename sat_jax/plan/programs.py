"""The trainer's and the rollout server's programs, lowered from shapes on a mesh, and their
analytic costs.

Every input is a ``jax.ShapeDtypeStruct`` carrying the ``NamedSharding`` the real program gets, so
``lower(...).compile()`` builds the executable the trainer or server would run on that mesh
without allocating anything: on this host's devices (``sat_jax.plan --compile``) or on a TPU
topology's compile-only devices (``--topology``, ``sat_jax.plan.topology``).

* Train step: ``make_train_step`` of the configured ``StepConfig`` (``sat_jax.step.step_config``),
  exactly as ``train.main`` builds it, with the inputs the trainer gives it (routing replay with
  the recorded routing in the batch, per-row rewards and group ids with the advantages computed
  in the step, the kept counts of a truncating sampler, the reference policy's params with a KL
  penalty, and a [V] vocabulary mask; remat, attention, dispatch and dtypes come with the model
  config).
* Server: ``sat_jax.decoding.DecodeCore``'s jitted prefill (one prompt padded to the prefill
  length), insert (a prefix into the donated decode state) and generate (one sampling + decode
  step of every slot, donated state) at its largest attention window, the whole cache.

Analytic FLOPs (``train_flops``, ``decode_flops_per_token``) count matmuls only: 2 FLOPs per
multiply-add of each parameter a token uses (the input embedding is a gather and costs none; the
output projection does), times 3 for forward + backward in training, plus causal attention
(half of the T×T scores and of their product with V). Decode bytes (``decode_bytes_per_step``)
are what one step must read from HBM at least: the served weights (each expert touched by at
least one slot's top-k, at uniform routing) and the cache window of every slot.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from sat_jax import quant, sharding
from sat_jax.decoding import DecodeCore, SamplingConfig
from sat_jax.model import ModelConfig, placement
from sat_jax.plan import hlo_flops
from sat_jax.step import (
    StepConfig,
    TrainBatch,
    TrainState,
    abstract_train_state,
    batch_shardings,
    make_train_step,
)


def _with(x: Any, sh: NamedSharding) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh)


def abstract_params(model_cfg: ModelConfig, mesh: Mesh) -> Any:
    """The params' pure dict as ``ShapeDtypeStruct``s in their rule shardings on ``mesh``."""
    _, abstract = placement.abstract_model(model_cfg)
    shardings = sharding.param_shardings(abstract, mesh)
    return jax.tree.map(_with, nnx.to_pure_dict(abstract), shardings)


def abstract_served_params(model_cfg: ModelConfig, mesh: Mesh, weight_dtype: str) -> Any:
    """`abstract_params` as a server with ``weight_dtype`` holds them: each quantized weight a
    `quant.QTensor` of 8-bit values in the weight's sharding and float32 scales sharded like it
    on the output axes (replicated on the contraction axes, which they lack)."""
    params = abstract_params(model_cfg, mesh)
    if not quant.is_quantized(weight_dtype):
        return params
    shapes = jax.eval_shape(lambda p: quant.quantize_params(p, weight_dtype), params)

    def place(x: Any, like: jax.ShapeDtypeStruct) -> Any:
        if not isinstance(x, quant.QTensor):
            return like
        spec = list(like.sharding.spec) + [None] * (len(like.shape) - len(like.sharding.spec))
        scale_spec = PartitionSpec(
            *(None if n == 1 else a for n, a in zip(x.scale.shape, spec, strict=True))
        )
        return x.replace(
            q=_with(x.q, like.sharding), scale=_with(x.scale, NamedSharding(mesh, scale_spec))
        )

    is_q = lambda x: isinstance(x, quant.QTensor)
    return jax.tree.map(place, shapes, params, is_leaf=is_q)


def abstract_train_inputs(
    model_cfg: ModelConfig,
    optimizer: optax.GradientTransformation,
    mesh: Mesh,
    batch: int,
    seq_len: int,
    *,
    routing: bool = False,
    rewards: bool = False,
    kept_counts: bool = False,
    packed: tuple[int, int] | None = None,
) -> tuple[TrainState, TrainBatch]:
    """``(state, batch)`` of a [batch, seq_len] step as sharded ``ShapeDtypeStruct``s.

    Args:
      routing: the batch carries the rollout's routing ids [B, T, L, K] (R3).
      rewards: the batch carries per-row rewards and group ids [B] and the step computes the
        advantages (what the trainer sends, with its lag-0 mask); else per-token advantages
        [B, T].
      kept_counts: the batch carries the sampler's kept-set sizes (truncation replay).
      packed: ``(N, C)``: packed rows (``train.packing``) of N trajectories, with segment ids
        and positions [B, T], the trajectory view [N, C], and rewards and group ids [N].
    """
    state = abstract_train_state(model_cfg, optimizer, mesh)
    f32 = jax.ShapeDtypeStruct((batch, seq_len), jnp.float32)
    i32 = jax.ShapeDtypeStruct((batch, seq_len), jnp.int32)
    n = batch if packed is None else packed[0]
    lk = (model_cfg.num_moe_layers, model_cfg.num_experts_per_tok)
    data = TrainBatch(
        tokens=jax.ShapeDtypeStruct((batch, seq_len), jnp.int32),
        loss_mask=f32,
        behavior_logp=f32,
        advantages=None if rewards else f32,
        rewards=jax.ShapeDtypeStruct((n,), jnp.float32) if rewards else None,
        group_ids=jax.ShapeDtypeStruct((n,), jnp.int32) if rewards else None,
        routing=(
            jax.ShapeDtypeStruct((batch, seq_len, *lk), model_cfg.routing_dtype)
            if routing
            else None
        ),
        kept_counts=jax.ShapeDtypeStruct((batch, seq_len), jnp.int32) if kept_counts else None,
        fresh_mask=jax.ShapeDtypeStruct((batch, seq_len), jnp.uint8) if rewards else None,
        segment_ids=None if packed is None else i32,
        positions=None if packed is None else i32,
        view_index=None if packed is None else jax.ShapeDtypeStruct(packed, jnp.int32),
    )
    return state, jax.tree.map(_with, data, batch_shardings(data, mesh))


def compile_train_step(
    model_cfg: ModelConfig,
    optimizer: optax.GradientTransformation,
    cfg: StepConfig,
    mesh: Mesh,
    batch: int,
    seq_len: int,
    packed: tuple[int, int] | None = None,
) -> tuple[jax.stages.Compiled, float]:
    """(the compiled train step of a [batch, seq_len] batch on ``mesh``, compile seconds).

    The step is ``make_train_step(model_cfg, optimizer, cfg, mesh)``, given what the trainer
    gives it: per-row rewards and group ids with the lag-0 mask, the recorded routing under
    ``cfg.routing_replay``, the kept counts under ``cfg.kept_counts``, the reference policy's
    params when ``cfg.uses_reference``, and a [V] vocabulary mask; ``packed`` = (N, C): the
    batch's rows are packed rows of N trajectories (``abstract_train_inputs``).

    Raises:
      ValueError: the batch does not divide over the mesh's batch axes or the microbatches.
      jax.errors.JaxRuntimeError: the compiler's own errors (RESOURCE_EXHAUSTED when the
        program does not fit the target's memory).
    """
    # The trainer always renormalizes over the sampleable ids; the mask's values do not change
    # the program.
    vocab_mask = np.ones((model_cfg.vocab_size,), bool)
    step = make_train_step(model_cfg, optimizer, cfg, mesh, vocab_mask=vocab_mask)
    state, data = abstract_train_inputs(
        model_cfg,
        optimizer,
        mesh,
        batch,
        seq_len,
        routing=cfg.routing_replay,
        rewards=True,
        kept_counts=cfg.kept_counts,
        packed=packed,
    )
    ref_params = abstract_params(model_cfg, mesh) if cfg.uses_reference else None
    start = time.monotonic()
    compiled = step.lower(state, data, ref_params).compile()
    return compiled, time.monotonic() - start


def xla_cost_flops(compiled: jax.stages.Compiled) -> float:
    """XLA's cost-analysis FLOPs of ``compiled``, one device's share of an SPMD program (the
    partitioned module every device runs). It counts each loop body once (``hlo_flops``)."""
    cost = compiled.cost_analysis()
    if isinstance(cost, list | tuple):  # older JAX: one dict per program
        cost = cost[0]
    return float(cost.get("flops", math.nan))


def matmul_flops(compiled: jax.stages.Compiled) -> hlo_flops.HloFlops:
    """One device's matmul FLOPs of ``compiled``, loops times their trip counts."""
    return hlo_flops.matmul_flops(compiled.as_text())


def matmul_params(model_cfg: ModelConfig, active_params: int) -> int:
    """Parameters a token multiplies by: the active ones less the input embedding (a gather),
    unless it is also the output projection (tied)."""
    embed = 0 if model_cfg.tie_embeddings else model_cfg.vocab_size * model_cfg.d_model
    return active_params - embed


def attention_flops(model_cfg: ModelConfig, queries: int, keys: float) -> float:
    """Forward FLOPs of ``queries`` query positions each attending ``keys`` keys, every layer:
    2·keys·H for q·kᵀ and as much for p·v, per query head."""
    c = model_cfg
    return 4.0 * queries * keys * c.num_heads * c.head_dim * c.num_layers


def train_flops(model_cfg: ModelConfig, active_params: int, batch: int, seq_len: int) -> float:
    """6·N·B·T + causal attention (3 × forward): the step's FLOPs with nothing recomputed."""
    tokens = batch * seq_len
    dense = 6.0 * matmul_params(model_cfg, active_params) * tokens
    # Causal: query t sees t + 1 keys, (T + 1) / 2 on average.
    return dense + 3.0 * attention_flops(model_cfg, tokens, (seq_len + 1) / 2)


def expected_recompute(model_cfg: ModelConfig, cfg: StepConfig) -> tuple[float, list[str]]:
    """(the FLOPs factor over ``train_flops`` the step's design implies, its reasons).

    remat="layer" runs each layer's forward again in the backward pass (4 forwards' worth
    instead of 3); with several microbatches, SAT's batch-scope threshold and the router's
    batch statistics take one more forward pass over the batch (``sat_jax.step.accumulation``).
    """
    passes, why = 3.0, []
    if model_cfg.remat == "layer":
        passes += 1
        why.append("remat=layer recomputes the forward in the backward pass")
    sat = cfg.loss.sat
    needs_stats = (sat.enabled and sat.threshold_scope == "batch") or (
        model_cfg.router_aux_loss_coef > 0
    )
    if cfg.microbatches > 1 and needs_stats:
        passes += 1
        why.append("microbatches > 1: one extra forward for the batch's SAT q / router stats")
    return passes / 3.0, why


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServerPrograms:
    """The rollout server's compiled programs and what they hold.

    Attributes:
      prefill, insert, generate: the compiled programs (generate at ``window`` positions).
      window: the attention window generate was compiled for (the whole cache).
      cache_length: positions a slot uses (prefill length + max_new_tokens + 1).
      cache_positions: positions stored per slot (``DecodeCore.cache_positions``: the length
        rounded up to a multiple of 16).
      seconds: total compile seconds.
    """

    prefill: jax.stages.Compiled
    insert: jax.stages.Compiled
    generate: jax.stages.Compiled
    window: int
    cache_length: int
    cache_positions: int
    seconds: float


class ProgramOutOfMemory(RuntimeError):
    """XLA:TPU refused one of the server's programs for lack of HBM.

    Attributes:
      program: "prefill", "insert" or "generate".
    """

    def __init__(self, program: str, error: Exception):
        super().__init__(f"{program}: {error}")
        self.program = program


def _compile(program: str, lowered: jax.stages.Lowered) -> jax.stages.Compiled:
    try:
        return lowered.compile()
    except jax.errors.JaxRuntimeError as e:
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        raise ProgramOutOfMemory(program, e) from e


def _replicated(x: Any, mesh: Mesh) -> jax.ShapeDtypeStruct:
    return _with(x, NamedSharding(mesh, PartitionSpec()))


def compile_server_programs(
    model_cfg: ModelConfig,
    mesh: Mesh,
    *,
    slots: int,
    max_prefill_length: int,
    max_decode_length: int,
    sampling: SamplingConfig,
    weight_dtype: str = "bfloat16",
    kv_cache_dtype: str = "bfloat16",
) -> ServerPrograms:
    """Compiles ``DecodeCore``'s prefill, insert and generate (at the whole cache) on ``mesh``.

    ``model_cfg`` is the served one (``ExperimentConfig.serving_model``: ``server.dtype`` as the
    parameter dtype). The params come in their rule shardings, the KV cache in
    ``DecodeCore``'s (heads over ``tensor``); the decode state's small arrays replicated.
    ``weight_dtype`` / ``kv_cache_dtype``: ``server.*``'s (8-bit weights as
    `abstract_served_params`, an 8-bit cache with its scales).

    Raises:
      ProgramOutOfMemory: XLA:TPU refused a program for lack of HBM (which one is named).
    """
    graphdef, _ = placement.abstract_model(model_cfg)
    core = DecodeCore(
        graphdef,
        model_cfg,
        slots=slots,
        max_prefill_length=max_prefill_length,
        max_decode_length=max_decode_length,
        sampling=sampling,
        sampleable_v=np.ones((model_cfg.vocab_size,), bool),
        mesh=mesh,
        kv_cache_dtype=kv_cache_dtype,
    )
    params = abstract_served_params(model_cfg, mesh, weight_dtype)
    scalar = _replicated(jax.ShapeDtypeStruct((), jnp.int32), mesh)
    tokens = _replicated(jax.ShapeDtypeStruct((max_prefill_length,), jnp.int32), mesh)
    start = time.monotonic()
    prefill = _compile("prefill", core.prefill.lower(params, tokens, scalar, scalar))
    prefix = jax.tree.map(
        _with,
        jax.eval_shape(core.prefill.fn, params, tokens, scalar, scalar),
        prefill.output_shardings,
    )
    shapes = jax.eval_shape(core.init_state)
    axes = ("layers", None, "length", "kv_heads", "head_dim")
    cache_sh = lambda x: NamedSharding(
        mesh, sharding.logical_to_spec(axes[: x.ndim], shape=x.shape, mesh=mesh)
    )
    state = jax.tree.map(lambda x: _replicated(x, mesh), shapes)
    state = state.replace(cache=shapes.cache.map_arrays(lambda x: _with(x, cache_sh(x))))
    state = state.replace(
        cache=state.cache.replace(lengths_b=_replicated(shapes.cache.lengths_b, mesh))
    )
    # DecodeCore.insert's jitted step (its host bookkeeping aside).
    insert = _compile("insert", core._insert_step.lower(prefix, state, scalar))
    window = core.cache_length
    generate = _compile("generate", core.generate_step.lower(params, state, scalar, window))
    return ServerPrograms(
        prefill=prefill,
        insert=insert,
        generate=generate,
        window=window,
        cache_length=core.cache_length,
        cache_positions=core.cache_positions,
        seconds=time.monotonic() - start,
    )


def kv_cache_bytes(
    model_cfg: ModelConfig, slots: int, positions: int, kv_cache_dtype: str = "bfloat16"
) -> int:
    """Bytes of the keys and values of ``slots`` rows of ``positions`` (every layer), stored in
    the served parameter dtype as ``DecodeCore.init_state`` keeps them, or 8-bit with a float32
    scale per position and KV head (``kv_cache_dtype`` "int8" / "fp8")."""
    c = model_cfg
    if quant.is_quantized(kv_cache_dtype):
        per_head = c.head_dim + 4
    else:
        per_head = c.head_dim * c.params_dtype.itemsize
    return slots * positions * 2 * c.num_layers * c.num_kv_heads * per_head


def touched_expert_fraction(model_cfg: ModelConfig, slots: int) -> float:
    """Expected share of one layer's experts that at least one of ``slots`` tokens routes to,
    at uniform routing: 1 − (1 − K/E)^slots."""
    if model_cfg.num_experts == 0:
        return 1.0
    return 1.0 - (1.0 - model_cfg.num_experts_per_tok / model_cfg.num_experts) ** slots


def decode_flops_per_token(model_cfg: ModelConfig, active_params: int, window: int) -> float:
    """Forward FLOPs of one generated token attending ``window`` cached positions."""
    return 2.0 * matmul_params(model_cfg, active_params) + attention_flops(model_cfg, 1, window)
