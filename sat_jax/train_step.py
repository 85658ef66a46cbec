"""The sharded policy-gradient train step: forward (optional routing replay) → policy_loss → optax.

``train_step(state, batch) -> (state, metrics)`` is a pure module-level function; ``make_train_step``
binds its static arguments and wraps it in ``jax.jit`` with explicit in/out shardings and the train
state donated.

Token alignment: every per-token array of a ``TrainBatch`` is indexed by the position of the TARGET
token. ``logp[b, t]`` is log π(tokens[b, t] | tokens[b, :t]), computed from the logits at position
t − 1; position 0 has no prediction, so its mask is forced to 0. ``loss_mask[b, t] = 1`` marks the
completion tokens (t ≥ 1), exactly the positions where the rollout engine recorded
``behavior_logp[b, t]`` for the sampled token ``tokens[b, t]``.

Dimension letters: B batch, T sequence, V vocabulary, L MoE layers, K experts per token.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from sat_jax import objectives, sharding
from sat_jax.model import ModelConfig, router_shift_ratio, token_logprobs

Metrics = dict[str, jax.Array]


@flax.struct.dataclass
class TrainState:
    """Everything a step updates; a plain pytree that orbax saves as is.

    Attributes:
      params: nested dict of parameter arrays (``nnx.State.to_pure_dict()`` layout).
      opt_state: the optax state for ``params``.
      step: int32 scalar, the number of updates applied (skipped steps do not count).
    """

    params: Any
    opt_state: optax.OptState
    step: jax.Array


@flax.struct.dataclass
class TrainBatch:
    """One global batch of trajectories, per-token arrays aligned to the target token.

    Attributes:
      tokens: [B, T] int32, prompt followed by completion (and padding).
      loss_mask: [B, T] float, 1 on completion tokens (the target's position), 0 elsewhere.
      behavior_logp: [B, T] float, rollout log-prob of ``tokens[b, t]``.
      advantages: [B, T] float.
      routing: optional [B, T, L, K] uint8/uint16 expert ids recorded by the rollout (for R3).
      old_logp: optional [B, T] float proximal log-probs.
      ref_logp: optional [B, T] float reference-policy log-probs (KL penalty).
    """

    tokens: jax.Array
    loss_mask: jax.Array
    behavior_logp: jax.Array
    advantages: jax.Array
    routing: jax.Array | None = None
    old_logp: jax.Array | None = None
    ref_logp: jax.Array | None = None


def next_token_logprobs(
    logits_btv: jax.Array,
    tokens_bt: jax.Array,
    *,
    temperature: float = 1.0,
    vocab_mask: Any = None,
) -> jax.Array:
    """[B, T] log-probs of ``tokens[:, t]`` under the logits at ``t − 1``; column 0 is 0.

    ``vocab_mask`` ([V] bool, optional): renormalize over these ids only, as a sampler restricted
    to them does (``sat_jax.tasks.sampleable_mask``); without it the behavior and trainer
    log-probs of the same weights differ by the probability mass of the excluded ids.
    """
    if vocab_mask is not None:
        # The most negative finite value, not −inf: exp gives exactly 0 and no inf − inf NaN.
        floor = jnp.finfo(logits_btv.dtype).min
        logits_btv = jnp.where(jnp.asarray(vocab_mask, bool), logits_btv, floor)
    logp = token_logprobs(logits_btv[:, :-1], tokens_bt[:, 1:], temperature=temperature)
    return jnp.pad(logp, ((0, 0), (1, 0)))


def train_step(
    state: TrainState,
    batch: TrainBatch,
    *,
    graphdef: nnx.GraphDef,
    optimizer: optax.GradientTransformation,
    loss_cfg: objectives.PolicyLossConfig,
    routing_replay: bool,
    temperature: float = 1.0,
    vocab_mask: Any = None,
) -> tuple[TrainState, Metrics]:
    """One policy-gradient update.

    loss = policy_loss(logp, ...) + the model's weighted router aux loss
    (``router_aux_loss_coef · balance_loss``, 0 when the coefficient is 0). The update is skipped (params,
    optimizer state and step unchanged, ``step_skipped = 1``) when the loss or the gradient norm is
    not finite or the batch has no active token.

    Args:
      state: the current ``TrainState``.
      batch: a ``TrainBatch``; ``routing`` is required when ``routing_replay``.
      graphdef: the model's ``nnx.GraphDef`` (``nnx.merge(graphdef, params)`` is the model).
      optimizer: the optax transformation ``state.opt_state`` belongs to.
      loss_cfg: the ``PolicyLossConfig``.
      routing_replay: replay ``batch.routing`` in every MoE layer (R3).
      temperature: sampling temperature the behavior log-probs were taken at.
      vocab_mask: optional [V] bool of the ids the sampler draws from (see
        ``next_token_logprobs``).

    Returns:
      ``(new_state, metrics)``; metrics are float32 scalars: the ``policy_loss`` metrics plus
      ``total_loss``, ``aux_loss``, ``balance_loss``, ``grad_norm``, ``update_norm``,
      ``step_skipped`` and, when ``batch.routing`` is given, ``router_shift_ratio`` (recorded
      experts not in the trainer's own top-k, over active tokens).
    """
    if routing_replay and batch.routing is None:
        raise ValueError("routing_replay=True needs TrainBatch.routing [B, T, L, K]")
    mask_bt = batch.loss_mask.astype(jnp.float32).at[:, 0].set(0.0)

    def loss_fn(params: Any) -> tuple[jax.Array, Metrics]:
        model = nnx.merge(graphdef, params)
        out = model.forward(batch.tokens, replay_routing=batch.routing if routing_replay else None)
        logp_bt = next_token_logprobs(
            out.logits_btv, batch.tokens, temperature=temperature, vocab_mask=vocab_mask
        )
        loss, metrics = objectives.policy_loss(
            logp_bt,
            batch.behavior_logp,
            batch.advantages,
            mask_bt,
            loss_cfg,
            old_logp=batch.old_logp,
            ref_logp=batch.ref_logp,
        )
        # ModelOutput.aux_loss is already weighted by config.router_aux_loss_coef (0 = off).
        total = loss + out.aux_loss
        metrics = {
            **metrics,
            "aux_loss": out.aux_loss,
            "balance_loss": out.balance_loss,
            "total_loss": total,
        }
        if batch.routing is not None:
            metrics["router_shift_ratio"] = router_shift_ratio(
                batch.routing, out.routing_btlk, mask_bt
            )
        return total, metrics

    (total, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    grad_norm = optax.tree.norm(grads)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    ok = jnp.isfinite(total) & jnp.isfinite(grad_norm) & (jnp.sum(mask_bt) > 0)
    keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)
    new_state = TrainState(
        params=keep(params, state.params),
        opt_state=keep(opt_state, state.opt_state),
        step=state.step + ok.astype(state.step.dtype),
    )
    metrics = {
        **metrics,
        "grad_norm": grad_norm,
        "update_norm": optax.tree.norm(updates),
        "step_skipped": 1.0 - ok.astype(jnp.float32),
    }
    return new_state, {k: jnp.asarray(v, jnp.float32) for k, v in metrics.items()}


def train_state_shardings(
    model_cfg: ModelConfig, optimizer: optax.GradientTransformation, mesh: Mesh
) -> TrainState:
    """A ``TrainState`` of ``NamedSharding``: params by the rules, optimizer moments like their
    params, scalars (step, counts) replicated. Also the target for an orbax restore."""
    _, abstract = sharding.abstract_model(model_cfg)
    param_sh = sharding.param_shardings(abstract, mesh)
    replicated = NamedSharding(mesh, PartitionSpec())
    abstract_opt = jax.eval_shape(optimizer.init, nnx.to_pure_dict(abstract))
    opt_sh = optax.tree_map_params(
        optimizer,
        lambda _, sh: sh,
        abstract_opt,
        param_sh,
        transform_non_params=lambda _: replicated,
        is_leaf=lambda x: isinstance(x, NamedSharding),
    )
    return TrainState(params=param_sh, opt_state=opt_sh, step=replicated)


def create_train_state(
    model_cfg: ModelConfig, optimizer: optax.GradientTransformation, mesh: Mesh, params: Any
) -> TrainState:
    """A step-0 ``TrainState`` from given params (e.g. an HF import), placed in their shardings.

    ``params`` may be host arrays or arrays on other devices; on several processes every process
    must pass the same values.
    """
    shardings = train_state_shardings(model_cfg, optimizer, mesh)
    params = jax.device_put(params, shardings.params)
    opt_state = jax.jit(optimizer.init, out_shardings=shardings.opt_state)(params)
    step = jax.device_put(jnp.zeros((), jnp.int32), shardings.step)
    return TrainState(params=params, opt_state=opt_state, step=step)


def init_train_state(
    model_cfg: ModelConfig,
    optimizer: optax.GradientTransformation,
    mesh: Mesh,
    rng: int | jax.Array = 0,
) -> TrainState:
    """Initializes params (``sharding.init_sharded``) and optimizer state in their shardings."""
    _, params = sharding.init_sharded(model_cfg, mesh, rng)
    return create_train_state(model_cfg, optimizer, mesh, params)


def batch_shardings(batch: TrainBatch, mesh: Mesh) -> TrainBatch:
    """``NamedSharding`` per batch field: dimension 0 over the batch mesh axes (checked)."""
    return jax.tree.map(
        lambda x: NamedSharding(mesh, sharding.batch_spec(x.shape[0], mesh, x.ndim)), batch
    )


def shard_batch(batch: TrainBatch, mesh: Mesh) -> TrainBatch:
    """Host arrays (the full global batch, on every process) → global sharded ``jax.Array``s.

    Works single- and multi-host: each process only transfers the slices its devices hold.
    """
    shardings = batch_shardings(batch, mesh)

    def put(x: Any, sh: NamedSharding) -> jax.Array:
        x = np.asarray(x)
        return jax.make_array_from_callback(x.shape, sh, lambda idx: x[idx])

    return jax.tree.map(put, batch, shardings)


def make_train_step(
    model_cfg: ModelConfig,
    optimizer: optax.GradientTransformation,
    loss_cfg: objectives.PolicyLossConfig,
    mesh: Mesh,
    *,
    routing_replay: bool,
    temperature: float = 1.0,
    vocab_mask: Any = None,
) -> Callable[[TrainState, TrainBatch], tuple[TrainState, Metrics]]:
    """Jitted ``train_step`` for ``model_cfg`` on ``mesh``.

    The state is donated and keeps the shardings of ``train_state_shardings``; batch fields are
    sharded over ``("data", "fsdp")`` on dimension 0; metrics come back replicated. The aux loss
    weight is ``model_cfg.router_aux_loss_coef``; the batch needs no padding mask because padding
    sits after the completion and attention is causal.

    Args:
      model_cfg: the ``ModelConfig``.
      optimizer: the optax transformation (clipping, AdamW, ... chained by the caller).
      loss_cfg: the ``PolicyLossConfig``.
      mesh: the device mesh.
      routing_replay: replay ``TrainBatch.routing`` (R3).
      temperature: sampling temperature of the behavior log-probs.
      vocab_mask: optional [V] bool of the ids the sampler draws from.

    Returns:
      ``step(state, batch) -> (state, metrics)``.
    """
    graphdef, _ = sharding.abstract_model(model_cfg)
    state_sh = train_state_shardings(model_cfg, optimizer, mesh)
    data_sh = NamedSharding(mesh, PartitionSpec(sharding.batch_axes(mesh)))
    step_fn = functools.partial(
        train_step,
        graphdef=graphdef,
        optimizer=optimizer,
        loss_cfg=loss_cfg,
        routing_replay=routing_replay,
        temperature=temperature,
        vocab_mask=None if vocab_mask is None else np.asarray(vocab_mask, bool),
    )
    return jax.jit(
        step_fn,
        in_shardings=(state_sh, data_sh),
        out_shardings=(state_sh, NamedSharding(mesh, PartitionSpec())),
        donate_argnums=(0,),
    )
