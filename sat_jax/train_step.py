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

from sat_jax import objectives
from sat_jax.model import (
    ModelConfig,
    ModelOutput,
    router_shift_counts,
    router_shift_from_counts,
    router_shift_ratio,
    token_logprobs,
)
from sat_jax.model.moe import balance_from_stats
from sat_jax.objectives.loss_terms import loss_count
from sat_jax.parallel import sharding

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
    logp = token_logprobs(
        logits_btv[:, :-1], tokens_bt[:, 1:], temperature=temperature, vocab_mask=vocab_mask
    )
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
    microbatches: int = 1,
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
      microbatches: k; accumulate the gradient over k microbatches of B/k rows (B divisible by
        k). Loss, gradient and metrics equal the one-pass step's (SAT's q per
        ``loss_cfg.sat.threshold_scope``; docs/DESIGN.md §3.3 and §5).

    Returns:
      ``(new_state, metrics)``; metrics are float32 scalars: the ``policy_loss`` metrics plus
      ``total_loss``, ``aux_loss``, ``balance_loss``, ``grad_norm``, ``update_norm``,
      ``step_skipped`` and, when ``batch.routing`` is given, ``router_shift_ratio`` (recorded
      experts not in the trainer's own top-k, over active tokens).
    """
    if routing_replay and batch.routing is None:
        raise ValueError("routing_replay=True needs TrainBatch.routing [B, T, L, K]")
    if batch.tokens.shape[0] % microbatches:
        raise ValueError(
            f"microbatches={microbatches} must divide the batch size {batch.tokens.shape[0]}"
        )
    batch = batch.replace(loss_mask=batch.loss_mask.astype(jnp.float32).at[:, 0].set(0.0))
    forward = functools.partial(
        _forward,
        graphdef=graphdef,
        routing_replay=routing_replay,
        temperature=temperature,
        vocab_mask=vocab_mask,
    )
    if microbatches == 1:
        grads, metrics = _one_pass(state.params, batch, forward, loss_cfg)
    else:
        coef = nnx.merge(graphdef, state.params).config.router_aux_loss_coef
        grads, metrics = _accumulated(state.params, batch, forward, loss_cfg, microbatches, coef)
    return _apply(state, grads, metrics, optimizer, batch.loss_mask)


def _forward(
    params: Any,
    batch: TrainBatch,
    *,
    graphdef: nnx.GraphDef,
    routing_replay: bool,
    temperature: float,
    vocab_mask: Any,
) -> tuple[jax.Array, ModelOutput]:
    """(logp [B, T] of the batch's tokens, the model's output) under ``params``."""
    model = nnx.merge(graphdef, params)
    out = model.forward(
        batch.tokens,
        mask_bt=token_mask(batch.loss_mask),
        replay_routing=batch.routing if routing_replay else None,
    )
    # Scored chunk by chunk from the hidden states: out.logits_btv is never used, so under jit
    # no [B, T, V] float32 buffer is built (docs/DESIGN.md §5).
    logp_bt = model.target_logprobs(
        out.hidden_btd[:, :-1],
        batch.tokens[:, 1:],
        temperature=temperature,
        vocab_mask=vocab_mask,
    )
    return jnp.pad(logp_bt, ((0, 0), (1, 0))), out


def token_mask(loss_mask_bt: jax.Array) -> jax.Array:
    """[B, T] bool: each row's real tokens, everything up to its last completion token.

    Padding sits after the completion, so it is what follows the last ``loss_mask`` position; a
    row without completion tokens counts none. The model takes it as ``mask_bt``: padded keys
    leave attention (a no-op for the real queries of right-padded causal rows) and padded
    positions leave the router's load statistics and the balance loss.
    """
    active_bt = jnp.asarray(loss_mask_bt) > 0
    t = jnp.arange(active_bt.shape[1])
    last_b1 = jnp.max(jnp.where(active_bt, t, -1), axis=1, keepdims=True)
    return t <= last_b1


def _policy_terms(logp_bt, batch: TrainBatch, loss_cfg, sat_q=None) -> objectives.PolicyLossTerms:
    return objectives.policy_loss_terms(
        logp_bt,
        batch.behavior_logp,
        batch.advantages,
        batch.loss_mask,
        loss_cfg,
        old_logp=batch.old_logp,
        ref_logp=batch.ref_logp,
        sat_q=sat_q,
    )


def _one_pass(params: Any, batch: TrainBatch, forward: Callable, loss_cfg) -> tuple[Any, Metrics]:
    """Gradient and metrics of the whole batch in one ``value_and_grad``."""

    def loss_fn(params: Any) -> tuple[jax.Array, Metrics]:
        logp_bt, out = forward(params, batch)
        loss, metrics = _policy_terms(logp_bt, batch, loss_cfg).reduce()
        # ModelOutput.aux_loss is already weighted by config.router_aux_loss_coef (0 = off).
        metrics = _with_aux(loss, metrics, out.aux_loss, out.balance_loss)
        if batch.routing is not None:
            metrics["router_shift_ratio"] = router_shift_ratio(
                batch.routing, out.routing_btlk, batch.loss_mask
            )
        return metrics["total_loss"], metrics

    (_, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    return grads, metrics


def _split(tree: Any, k: int) -> Any:
    """[B, ...] leaves → [k, B/k, ...]; microbatch j holds rows j, j + k, ... so that each device's
    contiguous block of the batch-sharded rows keeps a share of every microbatch."""
    return jax.tree.map(lambda x: jnp.swapaxes(x.reshape(-1, k, *x.shape[1:]), 0, 1), tree)


def _unsplit(x: jax.Array) -> jax.Array:
    """The inverse of ``_split`` for one array."""
    return jnp.swapaxes(x, 0, 1).reshape(-1, *x.shape[2:])


def _batch_statistics(params, batch: TrainBatch, micro: TrainBatch, forward, loss_cfg, coef, w_k):
    """(sat_q, router f [L, E]) of the whole batch, from a forward pass without gradient.

    ``w_k`` [k] is each microbatch's share of the batch's real tokens (``_token_shares``); f of
    the batch is the microbatches' f weighted by it.

    q needs the current policy's logp of every token before any microbatch's gradient (its |d| is
    of logp − old_logp, and logp moves with the params); the balance loss's f_e weighs every
    microbatch's gradient of P_e. Each is None when not needed (SAT off or per-microbatch scope;
    no aux loss), and then the extra forward pass is skipped.
    """
    sat = loss_cfg.sat
    need_q = sat.enabled and sat.threshold_scope == "batch"
    if not need_q and coef == 0:
        return None, None

    def one(_, mb: TrainBatch):
        logp_bt, out = forward(params, mb)
        return None, (logp_bt, out.router_frac_le)

    _, (logp_kbt, frac_kle) = jax.lax.scan(one, None, micro)
    sat_q = None
    if need_q:
        sat_q = objectives.sat_threshold(
            _unsplit(logp_kbt),
            batch.behavior_logp,
            batch.loss_mask,
            loss_cfg,
            old_logp=batch.old_logp,
        )
    return sat_q, _weighted(frac_kle, w_k)


def _token_shares(micro: TrainBatch) -> jax.Array:
    """[k] each microbatch's share of the batch's real tokens (``token_mask``); 0s when none.

    The router statistics f and P are means over real tokens, so the batch's are the
    microbatches' weighted by these shares (equal shares only without padding)."""
    n_k = jnp.sum(jax.vmap(token_mask)(micro.loss_mask), axis=(1, 2)).astype(jnp.float32)
    return n_k / jnp.maximum(jnp.sum(n_k), 1.0)


def _weighted(x_k: jax.Array, w_k: jax.Array) -> jax.Array:
    """Σ_j w_j · x_k[j] over the leading axis."""
    return jnp.tensordot(w_k, x_k, axes=1)


def _accumulated(params, batch: TrainBatch, forward, loss_cfg, k: int, coef: float):
    """Gradient and metrics of the batch summed over k microbatches (one compiled ``scan`` body).

    Each microbatch j differentiates loss_sum / loss_count(batch) + w_j·coef·E·Σ f_e·P_e^j with
    the batch's f and w_j its share of the batch's real tokens (the balance loss is bilinear in f
    and P, and P of the batch is the w-weighted mean of the microbatches' P), so the summed
    gradient is the one-pass gradient.
    """
    micro = _split(batch, k)
    w_k = _token_shares(micro)
    sat_q, frac_le = _batch_statistics(params, batch, micro, forward, loss_cfg, coef, w_k)
    count = jnp.maximum(loss_count(batch.loss_mask, loss_cfg.loss_agg), 1).astype(jnp.float32)

    def objective(p: Any, mb: TrainBatch, w: jax.Array):
        logp_bt, out = forward(p, mb)
        terms = _policy_terms(logp_bt, mb, loss_cfg, sat_q)
        value = terms.loss_sum / count
        if coef:
            value = value + w * coef * balance_from_stats(frac_le, out.router_prob_le)
        shift = (jnp.zeros(()), jnp.zeros(()))
        if mb.routing is not None:
            shift = router_shift_counts(mb.routing, out.routing_btlk, mb.loss_mask)
        return value, (terms, out.router_frac_le, out.router_prob_le, shift)

    def step(acc: Any, xs: tuple[TrainBatch, jax.Array]):
        (_, aux), grads = jax.value_and_grad(objective, has_aux=True)(params, *xs)
        return jax.tree.map(jnp.add, acc, grads), aux

    zeros = jax.tree.map(jnp.zeros_like, params)
    scanned = jax.lax.scan(step, zeros, (micro, w_k))
    grads, (terms_k, frac_kle, prob_kle, (missing_k, slots_k)) = scanned
    unstacked = [jax.tree.map(lambda x, i=i: x[i], terms_k) for i in range(k)]
    loss, metrics = functools.reduce(objectives.PolicyLossTerms.merge, unstacked).reduce()
    balance = balance_from_stats(_weighted(frac_kle, w_k), _weighted(prob_kle, w_k))
    metrics = _with_aux(loss, metrics, coef * balance, balance)
    if batch.routing is not None:
        shift = router_shift_from_counts(jnp.sum(missing_k), jnp.sum(slots_k))
        metrics["router_shift_ratio"] = shift
    return grads, metrics


def _with_aux(loss: jax.Array, metrics: Metrics, aux: jax.Array, balance: jax.Array) -> Metrics:
    """The policy metrics plus the router aux terms and ``total_loss`` = loss + aux."""
    return {**metrics, "aux_loss": aux, "balance_loss": balance, "total_loss": loss + aux}


def _apply(state: TrainState, grads: Any, metrics: Metrics, optimizer, mask_bt) -> tuple:
    """The optimizer update, skipped when the loss or gradient is not finite or nothing is active."""
    grad_norm = optax.tree.norm(grads)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    ok = jnp.isfinite(metrics["total_loss"]) & jnp.isfinite(grad_norm) & (jnp.sum(mask_bt) > 0)
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
    microbatches: int = 1,
) -> Callable[[TrainState, TrainBatch], tuple[TrainState, Metrics]]:
    """Jitted ``train_step`` for ``model_cfg`` on ``mesh``.

    The state is donated and keeps the shardings of ``train_state_shardings``; batch fields are
    sharded over ``("data", "fsdp")`` on dimension 0; metrics come back replicated. The aux loss
    weight is ``model_cfg.router_aux_loss_coef``; the batch needs no padding mask: padding sits
    after the completion, and ``token_mask`` takes it out of the router's statistics.

    Args:
      model_cfg: the ``ModelConfig``.
      optimizer: the optax transformation (clipping, AdamW, ... chained by the caller).
      loss_cfg: the ``PolicyLossConfig``.
      mesh: the device mesh.
      routing_replay: replay ``TrainBatch.routing`` (R3).
      temperature: sampling temperature of the behavior log-probs.
      vocab_mask: optional [V] bool of the ids the sampler draws from.
      microbatches: gradient accumulation over this many microbatches (see ``train_step``).

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
        microbatches=microbatches,
    )
    jitted = jax.jit(
        step_fn,
        in_shardings=(state_sh, data_sh),
        out_shardings=(state_sh, NamedSharding(mesh, PartitionSpec())),
        donate_argnums=(0,),
    )
    return _under_mesh(jitted, mesh)


class _under_mesh:
    """``fn`` traced and run with ``mesh`` as the ambient mesh, so the model's activation
    constraints (``sharding.constrain_batch``) see it; ``lower`` is forwarded the same way."""

    def __init__(self, fn: Any, mesh: Mesh):
        self.fn, self.mesh = fn, mesh

    def __call__(self, *args: Any) -> Any:
        with jax.set_mesh(self.mesh):
            return self.fn(*args)

    def lower(self, *args: Any) -> Any:
        with jax.set_mesh(self.mesh):
            return self.fn.lower(*args)
