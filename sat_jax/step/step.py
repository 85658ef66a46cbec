"""The sharded policy-gradient train step: forward (optional routing replay) → policy_loss → optax.

``train_step(state, batch, ref_params=None) -> (state, metrics)`` is a pure module-level function;
``make_train_step`` binds its static arguments (the model's graph, the optimizer, the
``StepConfig`` and the vocabulary mask) and wraps it in ``jax.jit`` with explicit in/out
shardings and the train state donated.

What derives from the batch is computed inside the step, so a batch crosses host → device once
(docs/DESIGN.md §7.1): the GRPO/Dr.GRPO advantages from per-row rewards and group ids
(``with_advantages``, over the whole batch before any microbatch split) and, for the KL penalty,
the reference policy's log-probs from its params (``ref_params``, a separate argument that is not
donated), scored chunk by chunk like the policy's (``Transformer.logprobs``). The batch's token
alignment and masks are ``sat_jax.step.batch``'s; the gradient, in one pass or accumulated over
microbatches, is ``sat_jax.step.accumulation``'s.

Dimension letters: B batch, T sequence, V vocabulary.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from sat_jax import objectives, sharding
from sat_jax.model import ModelConfig, ModelOutput, placement
from sat_jax.step import accumulation
from sat_jax.step.batch import (
    TrainBatch,
    real_tokens,
    trainable_mask,
    trajectory_view,
    with_advantages,
)
from sat_jax.step.config import StepConfig
from sat_jax.step.state import TrainState, train_state_shardings, whole_params

Metrics = dict[str, jax.Array]


def train_step(
    state: TrainState,
    batch: TrainBatch,
    ref_params: Any = None,
    *,
    graphdef: nnx.GraphDef,
    optimizer: optax.GradientTransformation,
    cfg: StepConfig,
    vocab_mask: Any = None,
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
      batch: a ``TrainBatch``; ``routing`` is required under ``cfg.routing_replay``, and
        ``kept_counts`` exactly when ``cfg.kept_counts``. Per-row ``rewards`` and ``group_ids``
        become advantages here (``with_advantages`` with ``cfg.estimator`` and
        ``cfg.normalize_std``), over the whole batch before any microbatch split.
      ref_params: optional reference-policy params (the whole model's structure, adapters
        included under LoRA; e.g. ``state.model_params`` of an earlier state): their log-probs of
        the batch's tokens become ``ref_logp`` (the KL penalty and the ``kl_ref`` metric),
        computed per (micro)batch without the full logits. Not with ``batch.ref_logp``.
      graphdef: the model's ``nnx.GraphDef`` (``nnx.merge(graphdef, params)`` is the model).
      optimizer: the optax transformation ``state.opt_state`` belongs to.
      cfg: the step's options (``StepConfig``).
      vocab_mask: optional [V] bool of the ids the sampler draws from: log-probs (the policy's
        and the reference's) renormalize over them, as the sampler does; a constrained token's
        (``batch.format_ids``) over its ``batch.format_masks`` row's as well.

    Returns:
      ``(new_state, metrics)``; metrics are float32 scalars: the ``policy_loss`` metrics plus
      ``total_loss``, ``aux_loss``, ``balance_loss``, ``grad_norm``, ``update_norm``,
      ``step_skipped``, ``ess_step_scale`` with ``cfg.loss.ess_scaling`` (VCPO: the update is
      multiplied by sqrt(ess)), ``opob_shift`` with ``cfg.loss.opob_baseline`` (VCPO's
      baseline: the mean |baseline − group mean| over rows) and, when ``batch.routing`` is given, ``router_shift_ratio``
      (recorded experts not in the trainer's own top-k, over active tokens).

    Raises:
      ValueError: the batch does not have what ``cfg`` needs (see ``batch``), or carries what
        the step computes itself (``old_logp`` under ``cfg.recompute_old_logp``, ``ref_logp``
        with ``ref_params``).
    """
    _check_inputs(batch, ref_params, cfg)
    # The mask table is the whole batch's, not per row: every (micro)batch's forward reads it.
    format_masks, batch = batch.format_masks, batch.replace(format_masks=None)
    scored = functools.partial(
        _logprobs,
        graphdef=graphdef,
        temperature=cfg.temperature,
        vocab_mask=vocab_mask,
        format_masks=format_masks,
    )

    def forward(params: Any, batch: TrainBatch) -> tuple[jax.Array, ModelOutput]:
        # Under LoRA `params` are the adapters (what is differentiated); the base is a constant.
        return scored(whole_params(state.frozen, params), batch, replay=cfg.routing_replay)

    baseline = shift = None
    if cfg.loss.opob_baseline and batch.advantages is None:
        baseline, shift = _opob_baseline(state.params, batch, forward, _microbatches(batch, cfg))
    batch = with_advantages(
        batch, estimator=cfg.estimator, normalize_std=cfg.normalize_std, baseline=baseline
    )
    batch = batch.replace(loss_mask=trainable_mask(batch))

    def reference(batch: TrainBatch) -> TrainBatch:
        if ref_params is None:
            return batch
        return batch.replace(ref_logp=scored(ref_params, batch, replay=False)[0])

    if _microbatches(batch, cfg) == 1:
        grads, metrics = accumulation.one_pass(state.params, reference(batch), forward, cfg)
    else:
        coef = nnx.merge(graphdef, state.model_params).config.router_aux_loss_coef
        grads, metrics = accumulation.accumulated(
            state.params, batch, forward, reference, cfg, coef, _microbatches(batch, cfg)
        )
    step_scale = None
    if cfg.loss.ess_scaling:
        step_scale = objectives.ess_step_scale(metrics["ess"])
        metrics = {**metrics, "ess_step_scale": step_scale}
    if shift is not None:
        metrics = {**metrics, "opob_shift": shift}
    return _apply(state, grads, metrics, optimizer, batch.loss_mask, step_scale)


def _opob_baseline(
    params: Any, batch: TrainBatch, forward: Any, microbatches: int
) -> tuple[jax.Array, jax.Array]:
    """VCPO's off-policy optimal baseline per row and its mean shift (docs/DESIGN.md §3.6):
    each row's Σ_t log π and ‖∇ Σ_t log π‖² under the current params, one row's backward at a
    time (``objectives.sequence_score_stats``), then ``objectives.opob_baselines``. Packed rows:
    one trajectory's backward at a time too, through its packed row with the loss mask cut to
    its segment (attention stays within a segment and dispatch is dropless, so that is the
    trajectory's own score)."""
    mask = trainable_mask(batch)
    rows = batch.replace(loss_mask=mask)
    packed = batch.packed
    if packed:
        rows = _trajectory_rows(rows, microbatches)

    def masked(row: TrainBatch, logp_bt: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(the row's loss mask, its log-probs), in the trajectory's view when packed."""
        if packed:
            view, logp_bt = trajectory_view(row, logp_bt)
            return view.loss_mask, logp_bt
        return row.loss_mask, logp_bt

    def score(p: Any, row: TrainBatch) -> jax.Array:
        mask_1t, logp_1t = masked(row, forward(p, row)[0])
        return jnp.sum(jnp.where(mask_1t > 0, logp_1t, 0.0))

    logp_sum, grad_sq = objectives.sequence_score_stats(score, params, rows)
    if packed:  # each trajectory's behavior log-probs, through its view
        one = lambda row: masked(jax.tree.map(lambda x: x[None], row), row.behavior_logp[None])
        mask_n1c, behavior_n1c = jax.vmap(one)(rows)
        behavior_sum = jnp.sum(jnp.where(mask_n1c > 0, behavior_n1c, 0.0), axis=(-2, -1))
    else:
        behavior_sum = jnp.sum(jnp.where(mask > 0, batch.behavior_logp, 0.0), axis=-1)
    group_ids = jnp.asarray(batch.group_ids, jnp.int32)
    return objectives.opob_baselines(
        batch.rewards,
        jnp.maximum(group_ids, 0),
        logp_sum - behavior_sum,
        grad_sq,
        num_groups=group_ids.shape[0],
        where=group_ids >= 0,
    )


def _trajectory_rows(batch: TrainBatch, k: int) -> TrainBatch:
    """Packed ``batch`` (unsplit, laid out for ``k`` microbatches: its view indices are of
    microbatch n mod k) as one packed row per trajectory, [N, T] leaves: trajectory n's packed
    row with its loss mask cut to its segment and ``view_index`` [N, C] into that one row (for
    ``sequence_score_stats``). A trajectory without completion tokens gets row 0, all masked."""
    t = batch.tokens.shape[1]
    idx = jnp.asarray(batch.view_index, jnp.int32)
    traj = jnp.arange(idx.shape[0])
    # Trajectory n sits in microbatch j = n mod k, whose local row i is global row i·k + j.
    first = jnp.max(idx, axis=1)  # a flat index of its completion (−1: none)
    row_n = jnp.where(first >= 0, (first // t) * k + traj % k, 0)
    seg = jnp.asarray(batch.segment_ids)[row_n]
    own = (seg == (traj + 1)[:, None]) & (first >= 0)[:, None]
    per_row = lambda x: None if x is None else jnp.asarray(x)[row_n]
    return TrainBatch(
        tokens=per_row(batch.tokens),
        loss_mask=jnp.where(own, batch.loss_mask[row_n], 0.0),
        behavior_logp=per_row(batch.behavior_logp),
        routing=per_row(batch.routing),
        kept_counts=per_row(batch.kept_counts),
        format_ids=per_row(batch.format_ids),
        segment_ids=seg,
        positions=per_row(batch.positions),
        view_index=jnp.where(idx >= 0, idx % t, -1),
    )


def _microbatches(batch: TrainBatch, cfg: StepConfig) -> int:
    """k: the batch's own (chosen by the host from its tokens), else ``cfg.microbatches``."""
    return batch.microbatches or cfg.microbatches


def _check_inputs(batch: TrainBatch, ref_params: Any, cfg: StepConfig) -> None:
    """Raises ValueError unless the batch's fields (static under ``jit``) fit ``cfg``."""
    if cfg.routing_replay and batch.routing is None:
        raise ValueError("routing_replay=True needs TrainBatch.routing [B, T, L, K]")
    if cfg.kept_counts != (batch.kept_counts is not None):
        raise ValueError(
            f"StepConfig.kept_counts={cfg.kept_counts} but TrainBatch.kept_counts is "
            f"{'None' if batch.kept_counts is None else 'given'}: the batch carries the "
            "sampler's kept-set sizes exactly when the step replays its truncation"
        )
    if (batch.format_ids is None) != (batch.format_masks is None):
        raise ValueError("TrainBatch.format_ids and format_masks come together or not at all")
    k = _microbatches(batch, cfg)
    if batch.tokens.shape[0] % k or (batch.packed and batch.view_index.shape[0] % k):
        raise ValueError(f"microbatches={k} must divide the batch size {batch.tokens.shape[0]}")
    if ref_params is not None and batch.ref_logp is not None:
        raise ValueError("give the reference as ref_params or as TrainBatch.ref_logp, not both")
    if cfg.recompute_old_logp and batch.old_logp is not None:
        raise ValueError("recompute_old_logp=True computes old_logp; the batch must not carry it")


def _logprobs(
    params: Any,
    batch: TrainBatch,
    *,
    replay: bool,
    graphdef: nnx.GraphDef,
    temperature: float,
    vocab_mask: Any,
    format_masks: jax.Array | None = None,
) -> tuple[jax.Array, ModelOutput]:
    """(logp [B, T] of the batch's tokens, the model's output) under ``params``; replays
    ``batch.routing`` when ``replay`` and constrained decoding's masks (``format_masks``, the
    batch's table, with ``batch.format_ids``). ``Transformer.logprobs``: out.logits_btv is never
    used, so under jit no [B, T, V] float32 buffer is built (docs/DESIGN.md §5)."""
    return nnx.merge(graphdef, params).logprobs(
        batch.tokens,
        temperature=temperature,
        vocab_mask=vocab_mask,
        mask_bt=real_tokens(batch),
        replay_routing=batch.routing if replay else None,
        kept_bt=batch.kept_counts,
        positions_bt=batch.positions,
        segment_ids_bt=batch.segment_ids,
        format_masks=format_masks,
        format_ids_bt=batch.format_ids,
    )


def _apply(
    state: TrainState,
    grads: Any,
    metrics: Metrics,
    optimizer: optax.GradientTransformation,
    mask_bt: jax.Array,
    step_scale: jax.Array | None = None,
) -> tuple[TrainState, Metrics]:
    """The optimizer update, skipped when the loss or gradient is not finite or nothing is active.

    ``step_scale`` (VCPO's sqrt(ess), docs/DESIGN.md §3.6) multiplies the optimizer's update,
    i.e. the learning rate."""
    grad_norm = optax.tree.norm(grads)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    if step_scale is not None:
        updates = jax.tree.map(lambda u: (u * step_scale).astype(u.dtype), updates)
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


def make_train_step(
    model_cfg: ModelConfig,
    optimizer: optax.GradientTransformation,
    cfg: StepConfig,
    mesh: Mesh,
    *,
    vocab_mask: Any = None,
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
      cfg: the step's options (``StepConfig``; ``step_config`` reads them from an experiment).
      mesh: the device mesh.
      vocab_mask: optional [V] bool of the ids the sampler draws from (derived from the
        tokenizer, so an array beside the options).

    Returns:
      ``step(state, batch, ref_params=None) -> (state, metrics)`` (a ``Step``).
    """
    graphdef, _ = placement.abstract_model(model_cfg)
    state_sh = train_state_shardings(model_cfg, optimizer, mesh)
    data_sh = NamedSharding(mesh, PartitionSpec(sharding.batch_axes(mesh)))
    step_fn = functools.partial(
        train_step,
        graphdef=graphdef,
        optimizer=optimizer,
        cfg=cfg,
        vocab_mask=None if vocab_mask is None else np.asarray(vocab_mask, bool),
    )
    jit = functools.partial(
        jax.jit,
        step_fn,
        out_shardings=(state_sh, NamedSharding(mesh, PartitionSpec())),
        donate_argnums=(0,),
    )
    return Step(
        jit(in_shardings=(state_sh, data_sh)),
        jit(in_shardings=(state_sh, data_sh, whole_params(state_sh.frozen, state_sh.params))),
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

    @property
    def compiled_programs(self) -> int:
        """How many programs the step has compiled so far (one per batch shape and form: a
        run with bucketed shapes compiles a handful; the ``compiled_programs`` metric)."""
        return self.plain._cache_size() + self.with_reference._cache_size()

    def lower(self, state: Any, batch: Any, ref_params: Any = None) -> Any:
        with jax.set_mesh(self.mesh):
            if ref_params is None:
                return self.plain.lower(state, batch)
            return self.with_reference.lower(state, batch, ref_params)
