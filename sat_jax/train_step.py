"""The sharded policy-gradient train step: forward (optional routing replay) → policy_loss → optax.

``train_step(state, batch, ref_params=None) -> (state, metrics)`` is a pure module-level function;
``make_train_step`` binds its static arguments and wraps it in ``jax.jit`` with explicit in/out
shardings and the train state donated.

What derives from the batch is computed inside the step, so a batch crosses host → device once
(docs/DESIGN.md §7.1): the GRPO/Dr.GRPO advantages from per-row rewards and group ids
(``with_advantages``, over the whole batch before any microbatch split) and, for the KL penalty,
the reference policy's log-probs from its params (``ref_params``, a separate argument that is not
donated), scored chunk by chunk like the policy's (``Transformer.logprobs``).

Token alignment: every per-token array of a ``TrainBatch`` is indexed by the position of the TARGET
token. ``logp[b, t]`` is log π(tokens[b, t] | tokens[b, :t]), computed from the logits at position
t − 1; position 0 has no prediction, so its mask is forced to 0. ``loss_mask[b, t] = 1`` marks the
completion tokens (t ≥ 1), exactly the positions where the rollout engine recorded
``behavior_logp[b, t]`` for the sampled token ``tokens[b, t]``.

Multi-turn rows (docs/DESIGN.md §7.1): an observation token, inserted by the environment between
two generated ones, has loss mask 0 like the prompt, so it is out of the loss, SAT's quantile and
every metric (all of them read only loss-mask tokens); under routing replay it replays the
routing the server's cache extension recorded for it, like every other position.

Dimension letters: B batch, T sequence, V vocabulary, L MoE layers, K experts per token.
"""

from __future__ import annotations

import dataclasses
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
)
from sat_jax.model.moe import balance_from_stats
from sat_jax.objectives.loss_terms import loss_count
from sat_jax.parallel import sharding

Metrics = dict[str, jax.Array]


@flax.struct.dataclass
class TrainState:
    """Everything a step updates; a plain pytree that orbax saves as is.

    Attributes:
      params: nested dict of the trained parameter arrays (``nnx.State.to_pure_dict()`` layout):
        all of the model's, or with LoRA (``ModelConfig.lora.rank`` > 0) only its adapters.
      opt_state: the optax state for ``params``.
      step: int32 scalar, the number of updates applied (skipped steps do not count).
      frozen: with LoRA, the base params (every non-adapter leaf, in their param dtype and
        shardings), which the step reads and returns unchanged; ``sharding.join_lora(frozen,
        params)`` is the whole model. None without LoRA.
    """

    params: Any
    opt_state: optax.OptState
    step: jax.Array
    frozen: Any = None

    @property
    def model_params(self) -> Any:
        """The whole model's params: ``params``, joined with ``frozen`` under LoRA."""
        return _whole(self.frozen, self.params)


def _whole(frozen: Any, params: Any) -> Any:
    return params if frozen is None else sharding.join_lora(frozen, params)


@flax.struct.dataclass
class TrainBatch:
    """One global batch of trajectories, per-token arrays aligned to the target token.

    Attributes:
      tokens: [B, T] int32, prompt followed by completion (and padding).
      loss_mask: [B, T] float, 1 on completion tokens (the target's position), 0 elsewhere
        (also on a multi-turn row's observation tokens).
      behavior_logp: [B, T] float, rollout log-prob of ``tokens[b, t]``.
      advantages: [B, T] float per-token advantages; or None, and then ``rewards`` and
        ``group_ids`` are given and the step computes them (``with_advantages``). Exactly one of
        the two forms.
      rewards: [B] float per-row rewards (with ``group_ids``; instead of ``advantages``).
      group_ids: [B] int32 each row's group in [0, B); -1 marks a padding row (no group, no
        advantage).
      routing: optional [B, T, L, K] uint8/uint16 expert ids recorded by the rollout (for R3).
      old_logp: optional [B, T] float proximal log-probs (the step can instead take its own,
        ``recompute_old_logp``).
      ref_logp: optional [B, T] float reference-policy log-probs (KL penalty); the step computes
        them itself when given the reference's params instead.
      kept_counts: optional [B, T] int32, the sampler's kept-set size of ``tokens[b, t]`` after
        top-k / top-p truncation (0 where there was none, and off the completion): the step's
        log-probs (the policy's and the reference's) replay that truncation
        (``Transformer.logprobs``, docs/DESIGN.md §2).
      fresh_mask: optional [B, T] (uint8 from the trainer), 1 on the completion tokens sampled by the weights being
        trained (lag 0): the ``sampler_kl`` metric averages over them (all active tokens when
        None).
    """

    tokens: jax.Array
    loss_mask: jax.Array
    behavior_logp: jax.Array
    advantages: jax.Array | None = None
    rewards: jax.Array | None = None
    group_ids: jax.Array | None = None
    routing: jax.Array | None = None
    old_logp: jax.Array | None = None
    ref_logp: jax.Array | None = None
    kept_counts: jax.Array | None = None
    fresh_mask: jax.Array | None = None


def with_advantages(
    batch: TrainBatch,
    *,
    estimator: objectives.AdvantageEstimator = "grpo",
    normalize_std: bool = True,
) -> TrainBatch:
    """The batch with per-token ``advantages`` and without ``rewards`` / ``group_ids``.

    Given advantages are kept. Otherwise each row's ``objectives.group_advantages`` over the whole
    batch (``num_groups`` = B, static; rows of group id -1 are padding) is spread over its
    loss-mask tokens, exactly what the host used to send as [B, T]. Jittable.

    Raises:
      ValueError: not exactly one of ``advantages`` and (``rewards``, ``group_ids``).
    """
    _check_advantage_form(batch)
    if batch.advantages is not None:
        return batch
    group_ids = jnp.asarray(batch.group_ids, jnp.int32)
    per_row_b = objectives.group_advantages(
        batch.rewards,
        jnp.maximum(group_ids, 0),
        num_groups=group_ids.shape[0],
        estimator=estimator,
        normalize_std=normalize_std,
        where=group_ids >= 0,
    )
    advantages_bt = per_row_b[:, None] * jnp.asarray(batch.loss_mask, jnp.float32)
    return batch.replace(advantages=advantages_bt, rewards=None, group_ids=None)


def _check_advantage_form(batch: TrainBatch) -> None:
    """Raises ValueError unless the batch has exactly one of ``advantages`` and (``rewards``,
    ``group_ids``) (which fields are set is static: this holds under ``jit`` too)."""
    per_row = (batch.rewards is not None, batch.group_ids is not None)
    if (batch.advantages is None) != all(per_row) or any(per_row) != all(per_row):
        shape = lambda x: "None" if x is None else str(tuple(np.shape(x)))
        raise ValueError(
            "TrainBatch needs either advantages [B, T] or both rewards [B] and group_ids [B]; got "
            f"advantages={shape(batch.advantages)}, rewards={shape(batch.rewards)}, "
            f"group_ids={shape(batch.group_ids)}"
        )


def check_batch(batch: TrainBatch) -> None:
    """Host-side checks of a concrete batch that the jitted step cannot make on values: exactly
    one form of advantages; rewards and group ids [B], the ids in [0, B) or -1 (padding).

    Raises:
      ValueError: naming what is wrong.
    """
    _check_advantage_form(batch)
    if batch.group_ids is None:
        return
    group_ids = np.asarray(batch.group_ids)
    rows = np.shape(batch.tokens)[0]
    if group_ids.shape != (rows,) or np.shape(batch.rewards) != (rows,):
        raise ValueError(
            f"TrainBatch rewards and group_ids must be [B] = [{rows}], got "
            f"{np.shape(batch.rewards)} and {group_ids.shape}"
        )
    if group_ids.size and (group_ids.min() < -1 or group_ids.max() >= rows):
        raise ValueError(
            f"TrainBatch.group_ids must lie in [0, {rows}) or be -1 (padding), got "
            f"[{group_ids.min()}, {group_ids.max()}]"
        )


def train_step(
    state: TrainState,
    batch: TrainBatch,
    ref_params: Any = None,
    *,
    graphdef: nnx.GraphDef,
    optimizer: optax.GradientTransformation,
    loss_cfg: objectives.PolicyLossConfig,
    routing_replay: bool,
    temperature: float = 1.0,
    vocab_mask: Any = None,
    microbatches: int = 1,
    estimator: objectives.AdvantageEstimator = "grpo",
    normalize_std: bool = True,
    recompute_old_logp: bool = False,
) -> tuple[TrainState, Metrics]:
    """One policy-gradient update.

    With LoRA (``state.frozen`` set) the model is ``join_lora(state.frozen, state.params)``: the
    gradient, the optimizer and the skip rule see the adapters only, and ``frozen`` comes back
    as it came.

    loss = policy_loss(logp, ...) + the model's weighted router aux loss
    (``router_aux_loss_coef · balance_loss``, 0 when the coefficient is 0). The update is skipped (params,
    optimizer state and step unchanged, ``step_skipped = 1``) when the loss or the gradient norm is
    not finite or the batch has no active token.

    Args:
      state: the current ``TrainState``.
      batch: a ``TrainBatch``; ``routing`` is required when ``routing_replay``. Per-row
        ``rewards`` and ``group_ids`` become advantages here (``with_advantages``), over the whole
        batch before any microbatch split.
      ref_params: optional reference-policy params (the whole model's structure, adapters
        included under LoRA; e.g. ``state.model_params`` of an earlier state): their log-probs of
        the batch's tokens become ``ref_logp`` (the KL penalty and the ``kl_ref`` metric),
        computed per (micro)batch without the full logits. Not with ``batch.ref_logp``.
      graphdef: the model's ``nnx.GraphDef`` (``nnx.merge(graphdef, params)`` is the model).
      optimizer: the optax transformation ``state.opt_state`` belongs to.
      loss_cfg: the ``PolicyLossConfig``.
      routing_replay: replay ``batch.routing`` in every MoE layer (R3).
      temperature: sampling temperature the behavior log-probs were taken at.
      vocab_mask: optional [V] bool of the ids the sampler draws from: log-probs (the policy's
        and the reference's) renormalize over them, as the sampler does.
      microbatches: k; accumulate the gradient over k microbatches of B/k rows (B divisible by
        k). Loss, gradient and metrics equal the one-pass step's (SAT's q per
        ``loss_cfg.sat.threshold_scope``; docs/DESIGN.md §3.3 and §5).
      estimator, normalize_std: the ``group_advantages`` options (for ``rewards``).
      recompute_old_logp: the proximal log-probs ``old_logp`` are the current params' own,
        before this update (AReaL's decoupled objective, docs/DESIGN.md §3.4): TIS, IcePop and
        the sequence corrections then weigh behavior → proximal. The step applies one update
        per batch, so they are its own forward's log-probs under ``stop_gradient``, exactly, at
        no extra forward pass. Not with ``batch.old_logp``.

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
    if ref_params is not None and batch.ref_logp is not None:
        raise ValueError("give the reference as ref_params or as TrainBatch.ref_logp, not both")
    if recompute_old_logp and batch.old_logp is not None:
        raise ValueError("recompute_old_logp=True computes old_logp; the batch must not carry it")
    batch = with_advantages(batch, estimator=estimator, normalize_std=normalize_std)
    batch = batch.replace(loss_mask=batch.loss_mask.astype(jnp.float32).at[:, 0].set(0.0))
    scored = functools.partial(
        _logprobs, graphdef=graphdef, temperature=temperature, vocab_mask=vocab_mask
    )

    def forward(params: Any, batch: TrainBatch) -> tuple[jax.Array, ModelOutput]:
        # Under LoRA `params` are the adapters (what is differentiated); the base is a constant.
        return scored(_whole(state.frozen, params), batch, replay=routing_replay)

    def reference(batch: TrainBatch) -> TrainBatch:
        if ref_params is None:
            return batch
        return batch.replace(ref_logp=scored(ref_params, batch, replay=False)[0])

    loss_cfg = _TermsConfig(loss_cfg, recompute_old_logp)
    if microbatches == 1:
        grads, metrics = _one_pass(state.params, reference(batch), forward, loss_cfg)
    else:
        coef = nnx.merge(graphdef, state.model_params).config.router_aux_loss_coef
        grads, metrics = _accumulated(
            state.params, batch, forward, reference, loss_cfg, microbatches, coef
        )
    return _apply(state, grads, metrics, optimizer, batch.loss_mask)


def _logprobs(
    params: Any,
    batch: TrainBatch,
    *,
    replay: bool,
    graphdef: nnx.GraphDef,
    temperature: float,
    vocab_mask: Any,
) -> tuple[jax.Array, ModelOutput]:
    """(logp [B, T] of the batch's tokens, the model's output) under ``params``; replays
    ``batch.routing`` when ``replay``. ``Transformer.logprobs``: out.logits_btv is never used,
    so under jit no [B, T, V] float32 buffer is built (docs/DESIGN.md §5)."""
    return nnx.merge(graphdef, params).logprobs(
        batch.tokens,
        temperature=temperature,
        vocab_mask=vocab_mask,
        mask_bt=token_mask(batch.loss_mask),
        replay_routing=batch.routing if replay else None,
        kept_bt=batch.kept_counts,
    )


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


@dataclasses.dataclass(frozen=True)
class _TermsConfig:
    """The loss config and where ``old_logp`` comes from."""

    loss: objectives.PolicyLossConfig
    recompute_old_logp: bool = False

    @property
    def sat(self) -> objectives.SATConfig:
        return self.loss.sat

    @property
    def loss_agg(self) -> str:
        return self.loss.loss_agg


def _policy_terms(
    logp_bt, batch: TrainBatch, cfg: _TermsConfig, sat_q=None
) -> objectives.PolicyLossTerms:
    old_logp = batch.old_logp
    if cfg.recompute_old_logp:
        # The proximal policy is the params before this (the batch's only) update: the step's
        # own log-probs, detached (docs/DESIGN.md §3.4).
        old_logp = jax.lax.stop_gradient(logp_bt)
    return objectives.policy_loss_terms(
        logp_bt,
        batch.behavior_logp,
        batch.advantages,
        batch.loss_mask,
        cfg.loss,
        old_logp=old_logp,
        ref_logp=batch.ref_logp,
        sat_q=sat_q,
        fresh_mask=batch.fresh_mask,
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
            loss_cfg.loss,
            old_logp=None if loss_cfg.recompute_old_logp else batch.old_logp,
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


def _accumulated(params, batch: TrainBatch, forward, reference, loss_cfg, k: int, coef: float):
    """Gradient and metrics of the batch summed over k microbatches (one compiled ``scan`` body).

    Each microbatch j differentiates loss_sum / loss_count(batch) + w_j·coef·E·Σ f_e·P_e^j with
    the batch's f and w_j its share of the batch's real tokens (the balance loss is bilinear in f
    and P, and P of the batch is the w-weighted mean of the microbatches' P), so the summed
    gradient is the one-pass gradient. ``reference`` adds a microbatch's reference log-probs
    (outside its gradient), so the reference's activations are a microbatch's too.
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
        mb, w = xs
        (_, aux), grads = jax.value_and_grad(objective, has_aux=True)(params, reference(mb), w)
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
        frozen=state.frozen,
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
    """A ``TrainState`` of ``NamedSharding``: params (and with LoRA the frozen base) by the rules,
    optimizer moments like their params, scalars (step, counts) replicated. Also the target for
    an orbax restore."""
    _, abstract = sharding.abstract_model(model_cfg)
    frozen_sh, param_sh = _trained(model_cfg, sharding.param_shardings(abstract, mesh))
    replicated = NamedSharding(mesh, PartitionSpec())
    _, trained = _trained(model_cfg, nnx.to_pure_dict(abstract))
    abstract_opt = jax.eval_shape(optimizer.init, trained)
    opt_sh = optax.tree_map_params(
        optimizer,
        lambda _, sh: sh,
        abstract_opt,
        param_sh,
        transform_non_params=lambda _: replicated,
        is_leaf=lambda x: isinstance(x, NamedSharding),
    )
    return TrainState(params=param_sh, opt_state=opt_sh, step=replicated, frozen=frozen_sh)


def _trained(model_cfg: ModelConfig, tree: Any) -> tuple[Any, Any]:
    """``(frozen, trained)`` parts of a params-layout tree: ``(None, tree)`` without LoRA, else
    ``sharding.split_lora``'s (base, adapters)."""
    if not model_cfg.lora.rank:
        return None, tree
    return sharding.split_lora(tree)


def abstract_train_state(
    model_cfg: ModelConfig, optimizer: optax.GradientTransformation, mesh: Mesh
) -> TrainState:
    """The ``TrainState`` of ``create_train_state`` as ``ShapeDtypeStruct``s carrying their
    shardings (nothing allocated): the target of a restore or an ahead-of-time compile."""
    _, abstract = sharding.abstract_model(model_cfg)
    frozen, params = _trained(model_cfg, nnx.to_pure_dict(abstract))
    shapes = TrainState(
        params=params,
        opt_state=jax.eval_shape(optimizer.init, params),
        step=jax.ShapeDtypeStruct((), jnp.int32),
        frozen=frozen,
    )
    with_sharding = lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh)
    return jax.tree.map(with_sharding, shapes, train_state_shardings(model_cfg, optimizer, mesh))


def create_train_state(
    model_cfg: ModelConfig, optimizer: optax.GradientTransformation, mesh: Mesh, params: Any
) -> TrainState:
    """A step-0 ``TrainState`` from given params (e.g. an HF import), placed in their shardings.

    ``params`` is the whole model's tree (``nnx.to_pure_dict`` layout). With LoRA it must hold
    the adapters too (``sharding.init_sharded`` and ``hf.load_params`` make them): the adapters
    become ``params`` (the optimizer state covers only them) and the rest ``frozen``, kept in
    its param dtype. ``params`` may be host arrays or arrays on other devices; on several
    processes every process must pass the same values.

    Raises:
      ValueError: LoRA is on and ``params`` has no adapters.
    """
    shardings = train_state_shardings(model_cfg, optimizer, mesh)
    frozen, params = _trained(model_cfg, params)
    if frozen is not None and not params:
        raise ValueError(
            "model.lora.rank > 0 but the params have no LoRA adapters; make them with "
            "sharding.init_sharded or hf.load_params under the LoRA config (or sharding.init_lora)"
        )
    params = jax.device_put(params, shardings.params)
    frozen = None if frozen is None else jax.device_put(frozen, shardings.frozen)
    opt_state = jax.jit(optimizer.init, out_shardings=shardings.opt_state)(params)
    step = jax.device_put(jnp.zeros((), jnp.int32), shardings.step)
    return TrainState(params=params, opt_state=opt_state, step=step, frozen=frozen)


def init_train_state(
    model_cfg: ModelConfig,
    optimizer: optax.GradientTransformation,
    mesh: Mesh,
    rng: int | jax.Array = 0,
) -> TrainState:
    """Initializes params (``sharding.init_sharded``, adapters included under LoRA) and the
    optimizer state in their shardings."""
    _, params = sharding.init_sharded(model_cfg, mesh, rng)
    return create_train_state(model_cfg, optimizer, mesh, params)


def batch_shardings(batch: TrainBatch, mesh: Mesh) -> TrainBatch:
    """``NamedSharding`` per batch field: dimension 0 over the batch mesh axes (checked)."""
    return jax.tree.map(
        lambda x: NamedSharding(mesh, sharding.batch_spec(x.shape[0], mesh, x.ndim)), batch
    )


def shard_batch(batch: TrainBatch, mesh: Mesh) -> TrainBatch:
    """Host arrays (the full global batch, on every process) → global sharded ``jax.Array``s,
    after ``check_batch``.

    Works single- and multi-host: each process only transfers the slices its devices hold.
    """
    check_batch(batch)
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
    estimator: objectives.AdvantageEstimator = "grpo",
    normalize_std: bool = True,
    recompute_old_logp: bool = False,
) -> Step:
    """Jitted ``train_step`` for ``model_cfg`` on ``mesh``.

    The state is donated and keeps the shardings of ``train_state_shardings``; batch fields are
    sharded over ``("data", "fsdp")`` on dimension 0; the reference params (optional, not donated;
    the whole model's tree, adapters included under LoRA) come in the rules' shardings; metrics
    come back replicated. The aux loss weight is
    ``model_cfg.router_aux_loss_coef``; the batch needs no padding mask: padding sits after the
    completion, and ``token_mask`` takes it out of the router's statistics.

    Args:
      model_cfg: the ``ModelConfig``.
      optimizer: the optax transformation (clipping, AdamW, ... chained by the caller).
      loss_cfg: the ``PolicyLossConfig``.
      mesh: the device mesh.
      routing_replay: replay ``TrainBatch.routing`` (R3).
      temperature: sampling temperature of the behavior log-probs.
      vocab_mask: optional [V] bool of the ids the sampler draws from.
      microbatches: gradient accumulation over this many microbatches (see ``train_step``).
      estimator, normalize_std: advantages from ``TrainBatch.rewards`` (``with_advantages``).
      recompute_old_logp: the proximal log-probs are the current params' own (``train_step``).

    Returns:
      ``step(state, batch, ref_params=None) -> (state, metrics)`` (a ``Step``).
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
        estimator=estimator,
        normalize_std=normalize_std,
        recompute_old_logp=recompute_old_logp,
    )
    jit = functools.partial(
        jax.jit,
        step_fn,
        out_shardings=(state_sh, NamedSharding(mesh, PartitionSpec())),
        donate_argnums=(0,),
    )
    return Step(
        jit(in_shardings=(state_sh, data_sh)),
        jit(in_shardings=(state_sh, data_sh, _whole(state_sh.frozen, state_sh.params))),
        mesh,
    )


class Step:
    """The jitted step: ``step(state, batch, ref_params=None) -> (state, metrics)``.

    Two compiled programs, one without reference params and one with them; each is traced and
    run with ``mesh`` as the ambient mesh, so the model's activation constraints
    (``sharding.constrain_batch``) see it; ``lower`` is forwarded the same way.
    """

    def __init__(self, plain: Any, with_reference: Any, mesh: Mesh):
        self.plain, self.with_reference, self.mesh = plain, with_reference, mesh

    def __call__(
        self, state: TrainState, batch: TrainBatch, ref_params: Any = None
    ) -> tuple[TrainState, Metrics]:
        with jax.set_mesh(self.mesh):
            if ref_params is None:
                return self.plain(state, batch)
            return self.with_reference(state, batch, ref_params)

    def lower(self, state: Any, batch: Any, ref_params: Any = None) -> Any:
        with jax.set_mesh(self.mesh):
            if ref_params is None:
                return self.plain.lower(state, batch)
            return self.with_reference.lower(state, batch, ref_params)
