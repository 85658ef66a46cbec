"""Large-lag corrections: M2PO's second-moment mask, VCPO's effective-sample-size step scaling and
VCPO's closed-form off-policy optimal baseline (OPOB).

docs/DESIGN.md §3.6 states both with their sources. Per active token, d = sg(logp − behavior_logp),
the log-ratio of the current policy to the sampler (detached), and w = exp(d):

* M2PO (Zheng et al., arXiv 2510.01161): m2 = d². The candidate tokens are, with
  ``m2_token_set="trust_region"`` (the paper's Algorithm 1 and its authors' code), the active
  tokens whose ratio moved the way their advantage pushes (A > 0 and d > 0, or A < 0 and d < 0),
  and with ``"all"`` every active token (AReaL's ``actor.m2_threshold``). Sort the candidates'
  m2 ascending, c_j = the sum of the j smallest; keep the largest j with c_j < τ·j (at least
  one), i.e. mask the fewest largest-m2 candidates after which the mean m2 of the rest is below
  τ. The batch's cutoff v is the smallest masked m2 (+inf when nothing is masked) and a candidate
  is masked iff m2 ≥ v, so tokens tied at v are masked together (the kept mean stays below τ),
  except that the candidates tied at the smallest m2 are never masked (at least one is kept, also
  when every candidate ties). A masked token contributes 0 to the loss and its gradient; it still
  counts in the loss's denominator (the paper's 1/Σ_i |o_i|). Non-candidates are never masked.
* ESS (Kong 1992; VCPO, Huang et al., arXiv 2602.17616): ess = (Σ w)² / (N·Σ w²), in (0, 1], 1
  when every w is equal. At ``ess_level="sequence"`` (VCPO's authors) the N are the responses
  with an active token and w_i = exp(s_i), s_i = Σ_t d_{i,t} over response i's active tokens; at
  ``"token"`` the N are the active tokens and w = exp(d). VCPO scales the step (the learning
  rate) by sqrt(ess), the square-root rule for Adam-type optimizers.

* OPOB (VCPO's second part): per response i, s_i = Σ_t d_{i,t} over its active tokens (the log of
  the sequence ratio w_i = exp(s_i), behavior → current policy) and G_i = ‖∇_θ Σ_t log π_θ(y_t)‖²,
  the squared norm of its score. Group g's baseline is the reward mean weighted by
  W_i = w_i²·G_i, b_g = Σ_{i∈g} W_i R_i / Σ_{i∈g} W_i, the minimum-variance baseline of the
  importance-weighted score-function estimator; it replaces the group mean in GRPO's advantage
  (:func:`~sat_jax.objectives.group_advantages`'s ``baseline``). :func:`opob_baselines` computes
  it from log W (so w_i² never overflows); :func:`sequence_score_stats` gives Σ_t log π and G per
  row, one row's backward at a time.

M2PO's cutoff and the ESS are batch statistics. The ESS of both levels is rebuilt from sums
(Σ w, Σ w², N), which add across microbatches and hosts (row microbatches split whole
responses). The M2PO cutoff is a sort over the whole batch; the train step computes it once per
batch (:func:`m2po_batch_cutoff`, in the gradient-free pass that also gives SAT's batch
threshold) and hands it to every microbatch, like SAT's ``sat_q``; the candidate set is per
token (its A and d), so a microbatch finds its own.

Shapes: ``B`` responses, ``T`` tokens; every per-token array is ``[B, T]``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

# policy imports this module, so its types are named here, not imported (no import cycle).
_PolicyLossConfig = Any  # policy.PolicyLossConfig


# PolicyLossTerms.totals keys of the ESS sums: token level (N is ``active_tokens``) and sequence
# level (N is ``ESS_RESPONSES``, the responses with an active token).
ESS_WEIGHT_SUM = "ess_weight_sum"
ESS_WEIGHT_SQ_SUM = "ess_weight_sq_sum"
ESS_SEQ_WEIGHT_SUM = "ess_seq_weight_sum"
ESS_SEQ_WEIGHT_SQ_SUM = "ess_seq_weight_sq_sum"
ESS_RESPONSES = "ess_responses"
M2_TOKEN_SETS = ("trust_region", "all")
ESS_LEVELS = ("sequence", "token")


def _active(where: ArrayLike | None, like: jax.Array) -> jax.Array:
    if where is None:
        return jnp.ones(like.shape, bool)
    return jnp.asarray(where) > 0


def m2po_cutoff(
    log_ratio: ArrayLike, *, threshold: float, where: ArrayLike | None = None
) -> jax.Array:
    """M2PO's cutoff v: a token is masked iff (log r)² ≥ v; +inf when nothing is masked.

    With the active m2 = d² sorted ascending (a_1 ≤ … ≤ a_n) and c_j = a_1 + … + a_j, the kept
    count is m = max(#{j : c_j < τ·j}, 1) (the running mean of the smallest values is
    non-decreasing, so these j are 1..m) and v = a_{m+1}, or +inf when m = n. The tokens masked are
    then the n − m largest, and any tied with a_{m+1}; when a_{m+1} = a_1 (every kept token ties
    with it) v is the smallest m2 above a_1 instead (+inf if none), so the tokens at the smallest
    m2 are always kept: at least one token, also when all tie.

    Args:
      log_ratio: d, [B, T]; read under stop_gradient (the mask is a constant of the batch).
      threshold: τ > 0, the bound on the kept tokens' mean d².
      where: active (candidate) tokens, [B, T]; all when None.

    Returns:
      A float32 scalar under stop_gradient.
    """
    d = jax.lax.stop_gradient(jnp.asarray(log_ratio, jnp.float32))
    active = _active(where, d)
    m2 = jnp.where(active, d * d, jnp.inf).reshape(-1)  # inactive sort last
    ascending = jnp.sort(m2)
    n = jnp.sum(active, dtype=jnp.int32)
    rank = jnp.arange(1, m2.shape[0] + 1, dtype=jnp.int32)
    real = rank <= n
    running = jnp.cumsum(jnp.where(real, ascending, 0.0))
    under = real & (running < threshold * rank.astype(jnp.float32))
    kept = jnp.maximum(jnp.sum(under, dtype=jnp.int32), jnp.minimum(n, 1))
    last = m2.shape[0] - 1
    cutoff = ascending[jnp.minimum(kept, last)]
    # Tied with the smallest: the next larger value (an inactive +inf slot when there is none).
    above_min = jnp.sum(real & (ascending <= ascending[0]), dtype=jnp.int32)
    cutoff = jnp.where(cutoff <= ascending[0], ascending[jnp.minimum(above_min, last)], cutoff)
    cutoff = jnp.where((kept < n) & (above_min < n), cutoff, jnp.inf)
    return jax.lax.stop_gradient(cutoff)


def m2po_candidates(
    log_ratio: ArrayLike, advantages: ArrayLike | None, token_set: str, *, where: ArrayLike
) -> jax.Array:
    """[B, T] bool: the tokens M2PO's mask may remove (``PolicyLossConfig.m2_token_set``).

    ``"trust_region"``: the active tokens with A > 0 and d > 0, or A < 0 and d < 0 (d the log-ratio
    to the sampler; the paper's trust-region tokens); ``"all"``: every active token.
    """
    active = jnp.asarray(where) > 0
    if token_set == "all":
        return active
    if token_set != "trust_region":
        raise ValueError(f"m2_token_set must be one of {M2_TOKEN_SETS}, got {token_set!r}")
    if advantages is None:
        raise ValueError("m2po: m2_token_set 'trust_region' needs the advantages")
    d = jax.lax.stop_gradient(jnp.asarray(log_ratio, jnp.float32))
    a = jnp.asarray(advantages, jnp.float32)
    return active & (((a > 0) & (d > 0)) | ((a < 0) & (d < 0)))


def m2po_batch_cutoff(
    logp: ArrayLike,
    behavior_logp: ArrayLike,
    mask: ArrayLike,
    cfg: _PolicyLossConfig,
    *,
    advantages: ArrayLike | None = None,
) -> jax.Array:
    """M2PO's cutoff of a batch: the one :func:`~sat_jax.objectives.policy_loss` computes for it.

    :func:`m2po_cutoff` of d = logp − behavior_logp over the batch's candidate tokens
    (:func:`m2po_candidates` of ``cfg.m2_token_set``; ``"trust_region"`` needs ``advantages``),
    always token level and against the sampler, like SAT's d_SAT, whatever ``old_logp`` is (at the
    step's single update, logp is AReaL's recomputed proximal policy). Give it as ``m2_cutoff=``
    to every microbatch of the batch. +inf (nothing masked) when M2PO is off (``cfg.m2po`` false).
    """
    arrays = (logp, behavior_logp, mask) + (() if advantages is None else (advantages,))
    shapes = {jnp.shape(x) for x in arrays}
    if len(shapes) > 1:
        raise ValueError(
            f"m2po_batch_cutoff: logp, behavior_logp, mask, advantages differ in shape: {shapes}"
        )
    if not cfg.m2po:
        return jnp.full((), jnp.inf, jnp.float32)
    active = jnp.asarray(mask) > 0
    d = jnp.where(
        active, jnp.asarray(logp, jnp.float32) - jnp.asarray(behavior_logp, jnp.float32), 0.0
    )
    candidates = m2po_candidates(d, advantages, cfg.m2_token_set, where=active)
    return m2po_cutoff(d, threshold=cfg.m2_threshold, where=candidates)


def m2po_mask(log_ratio: ArrayLike, cutoff: ArrayLike, *, where: ArrayLike | None = None):
    """[B, T] bool: the candidate tokens M2PO masks, (log r)² ≥ ``cutoff`` (:func:`m2po_cutoff`);
    ``where`` is the candidate set (:func:`m2po_candidates`) the cutoff was computed over."""
    d = jax.lax.stop_gradient(jnp.asarray(log_ratio, jnp.float32))
    return _active(where, d) & (d * d >= jnp.asarray(cutoff, jnp.float32))


def importance_weight_sums(
    log_ratio: ArrayLike, *, where: ArrayLike | None = None
) -> tuple[jax.Array, jax.Array]:
    """(Σ w, Σ w²) over the active tokens, w = exp(d), detached: the ESS's additive terms.

    Pass a clamped d (``PolicyLossConfig.log_ratio_clamp``) so that w² stays finite in float32.
    """
    d = jax.lax.stop_gradient(jnp.asarray(log_ratio, jnp.float32))
    active = _active(where, d)
    w = jnp.where(active, jnp.exp(jnp.where(active, d, 0.0)), 0.0)
    return jnp.sum(w), jnp.sum(w * w)


def sequence_weight_sums(
    log_ratio: ArrayLike, *, where: ArrayLike, clamp: float | None = None
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(Σ w_i, Σ w_i², B) over the B responses with an active token, w_i = exp(s_i) and
    s_i = Σ_t d_{i,t} over response i's active tokens (clipped to ±``clamp`` when given, so that
    w_i² stays finite in float32), detached: the sequence-level ESS's additive terms (VCPO)."""
    d = jax.lax.stop_gradient(jnp.asarray(log_ratio, jnp.float32))
    active = jnp.asarray(where) > 0
    s = jnp.sum(jnp.where(active, d, 0.0), axis=-1)
    if clamp is not None:
        s = jnp.clip(s, -clamp, clamp)
    has = jnp.any(active, axis=-1)
    w = jnp.where(has, jnp.exp(jnp.where(has, s, 0.0)), 0.0)
    return jnp.sum(w), jnp.sum(w * w), jnp.sum(has, dtype=jnp.int32)


def effective_sample_size(
    weight_sum: ArrayLike, weight_sq_sum: ArrayLike, count: ArrayLike
) -> jax.Array:
    """ess = (Σ w)² / (N·Σ w²), the effective sample size as a fraction of the N tokens; 0 when
    N = 0. Computed as (Σ w / N)·(Σ w / Σ w²) so that (Σ w)² never overflows."""
    s1 = jnp.asarray(weight_sum, jnp.float32)
    s2 = jnp.asarray(weight_sq_sum, jnp.float32)
    n = jnp.asarray(count).astype(jnp.float32)
    ok = (n > 0) & (s2 > 0)
    ess = (s1 / jnp.where(ok, n, 1.0)) * (s1 / jnp.where(ok, s2, 1.0))
    return jnp.where(ok, ess, 0.0)


def ess_step_scale(ess: ArrayLike) -> jax.Array:
    """VCPO's step multiplier sqrt(ess) for the batch's ``ess`` (:func:`effective_sample_size`)."""
    return jnp.sqrt(jnp.clip(jnp.asarray(ess, jnp.float32), 0.0, 1.0))


def sequence_score_stats(
    score: Callable[[Any, Any], jax.Array], params: Any, rows: Any, *, rows_per_pass: int = 1
) -> tuple[jax.Array, jax.Array]:
    """(score [B], ‖∇_params score‖² [B]) of every row: OPOB's Σ_t log π and G_i.

    Args:
      score: ``score(params, row) -> scalar``, where ``row`` is ``rows`` sliced to one row with
        its leading dimension kept (size 1); for OPOB the row's Σ_t log π over its active tokens.
      params: what the gradient is taken with respect to.
      rows: a pytree whose every leaf has the leading dimension B.
      rows_per_pass: rows differentiated together (``jax.lax.map``'s ``batch_size``): memory
        holds that many gradients of ``params`` at once; 1 = one row's backward at a time.

    Returns:
      Two float32 [B] arrays: each row's score and its gradient's squared L2 norm (float32 sum
      of squares over every leaf).
    """
    if rows_per_pass < 1:
        raise ValueError(f"sequence_score_stats: rows_per_pass must be >= 1, got {rows_per_pass}")

    def one(row: Any) -> tuple[jax.Array, jax.Array]:
        value, grads = jax.value_and_grad(score)(params, jax.tree.map(lambda x: x[None], row))
        leaves = jax.tree.leaves(grads)
        sq = sum(jnp.sum(jnp.square(jnp.asarray(g, jnp.float32))) for g in leaves)
        return jnp.asarray(value, jnp.float32), jnp.asarray(sq, jnp.float32)

    size = None if rows_per_pass == 1 else rows_per_pass
    return jax.lax.map(one, rows, batch_size=size)


def opob_baselines(
    rewards: ArrayLike,
    group_ids: ArrayLike,
    seq_log_ratio: ArrayLike,
    grad_sq_norm: ArrayLike,
    *,
    num_groups: int,
    where: ArrayLike | None = None,
) -> tuple[jax.Array, jax.Array]:
    """VCPO's off-policy optimal baseline of each response's group, and its mean shift.

    b_g = Σ_{i∈g} W_i R_i / Σ_{i∈g} W_i with W_i = w_i²·G_i, w_i = exp(s_i), computed as
    mean_g + Σ_i p_i (R_i − mean_g), p_i = softmax_g(2 s_i + log G_i), so that it never overflows
    and a constant group's baseline is exactly its mean. A group whose weights are all 0 (every
    G_i = 0) keeps its mean.

    Args:
      rewards: float [N].
      group_ids: int [N] in [0, num_groups).
      seq_log_ratio: s_i, [N]: Σ_t (logp − behavior_logp) over response i's active tokens.
      grad_sq_norm: G_i ≥ 0, [N] (:func:`sequence_score_stats`).
      num_groups: static number of groups.
      where: optional [N] mask of real responses; the others neither weigh nor get a baseline
        (0).

    Returns:
      (baseline [N] float32, the mean over real responses of |b_{g(i)} − mean_{g(i)}|): detached.
    """
    rewards = jnp.asarray(rewards, jnp.float32)
    ids = jnp.asarray(group_ids, jnp.int32)
    s = jax.lax.stop_gradient(jnp.asarray(seq_log_ratio, jnp.float32))
    g2 = jax.lax.stop_gradient(jnp.asarray(grad_sq_norm, jnp.float32))
    shapes = {rewards.shape, ids.shape, s.shape, g2.shape}
    if len(shapes) > 1 or rewards.ndim != 1:
        raise ValueError(f"opob_baselines: the four inputs must share one shape [N], got {shapes}")
    active = _active(where, rewards)
    per_group = lambda x: jax.ops.segment_sum(x, ids, num_segments=num_groups)
    count = per_group(active.astype(jnp.float32))
    mean = per_group(jnp.where(active, rewards, 0.0)) / jnp.maximum(count, 1.0)
    log_w = jnp.where(active & (g2 > 0), 2.0 * s + jnp.log(jnp.where(g2 > 0, g2, 1.0)), -jnp.inf)
    top = jax.ops.segment_max(log_w, ids, num_segments=num_groups)
    finite_top = jnp.where(jnp.isfinite(top), top, 0.0)
    e = jnp.where(jnp.isfinite(log_w), jnp.exp(log_w - finite_top[ids]), 0.0)
    total = per_group(e)
    shift = per_group(e * jnp.where(active, rewards - mean[ids], 0.0))
    shift = jnp.where(total > 0, shift / jnp.where(total > 0, total, 1.0), 0.0)
    baseline = jnp.where(active, (mean + shift)[ids], 0.0)
    n = jnp.maximum(jnp.sum(active), 1)
    mean_shift = jnp.sum(jnp.where(active, jnp.abs(shift[ids]), 0.0)) / n
    return jax.lax.stop_gradient(baseline), jax.lax.stop_gradient(mean_shift)
