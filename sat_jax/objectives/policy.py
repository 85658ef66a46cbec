"""Policy-gradient objectives for asynchronous RL: PPO/GRPO, GSPO and SAT, with stabilizers.

Equation numbers are those of "Stale but Stable" (arXiv 2607.18722) as restated in docs/DESIGN.md §3
(notation §2, stabilizers §3.4, aggregation and (sum, count) terms §3.5, metrics §4). Per active
token (b, t), with d = logp − old_logp, r = exp(d), d_SAT = sg(logp − behavior_logp) and
sg = stop_gradient:

* (3.1) PPO/GRPO: S = min(r·A, clip(r, 1 − ε_low, 1 + ε_high)·A), loss = −aggregate(S);
* (3.2) GSPO: s_b = mean_t d_bt, and ρ_b = exp(s_b) replaces r for every token of b;
* (3.3) SAT's threshold q = sg(inverted-CDF quantile of |d_SAT| over active tokens), d_SAT := its
  per-response mean in GSPO;
* (3.4) ψ(u; q) = 1 / (1 + (u/q)^p);
* (3.5) where q > 0 and |d_SAT| > q: c₊ = ψ(max(d_SAT, 0); q), c₋ = ψ(max(−d_SAT, 0); q); else 1;
* (3.6) ε̃_high = ε_high·c₊, ε̃_low = ε_low·c₋ (detached) replace ε in (3.1).

SAT measures staleness against the behavior policy even when ``old_logp`` is given (decoupled
PPO; :func:`sat_threshold` says why). M2PO's mask and the ESS (§3.6) are in ``large_lag``.

The kernels are shaped like ``optax.losses``: per-token and unreduced, hyperparameters
keyword-only, the mask passed as ``where=``. :func:`policy_loss` is the thin reducing wrapper; it is
built on :func:`policy_loss_terms`, which keeps every reduction as a (sum, count) pair so
microbatches and hosts combine exactly (:meth:`PolicyLossTerms.merge`), and :func:`sat_threshold`
gives microbatches their batch's q.

Shapes: ``B`` responses, ``T`` tokens; every per-token array is ``[B, T]``.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from sat_jax.objectives import corrections, diagnostics
from sat_jax.objectives.diagnostics import clamp as _clamp
from sat_jax.objectives.large_lag import ESS_LEVELS, M2_TOKEN_SETS, m2po_batch_cutoff
from sat_jax.objectives.loss_terms import LossAgg, PolicyLossTerms, aggregate
from sat_jax.objectives.quantile import masked_quantile
from sat_jax.objectives.stabilizers import KL_ESTIMATORS, KLEstimator, kl_penalty

RatioLevel = Literal["token", "sequence"]
ThresholdScope = Literal["batch", "microbatch"]

_RATIO_LEVELS = ("token", "sequence")
_LOSS_AGGS = ("token_mean", "seq_mean_token_mean")
_THRESHOLD_SCOPES = ("batch", "microbatch")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SATConfig:
    """Staleness-adaptive trust region (docs/DESIGN.md §3.3).

    Attributes:
      enabled: apply SAT. ``PolicyLossConfig`` defaults to ``SATConfig(enabled=False)``.
      quantile: level of the inverted-CDF quantile of |d_SAT| over active tokens, in (0, 1], with
        d_SAT = logp − behavior_logp (its per-response mean in GSPO), also when ``old_logp`` is
        given (see :func:`sat_threshold`). At 1.0 the threshold is the largest |d_SAT|, so the
        strict gate never fires and SAT equals the base loss.
      exponent: p in ψ(u; q) = 1 / (1 + (u/q)^p), > 0.
      threshold_scope: what q is the quantile over when the train step accumulates gradients
        over microbatches (docs/DESIGN.md §3.3): ``"batch"`` (every active token of the batch,
        exactly the single-step q) or ``"microbatch"`` (each microbatch's own tokens, as a
        Megatron-style implementation computes it). The loss functions do not read it.
    """

    enabled: bool = True
    quantile: float = 0.9
    exponent: float = 2.0
    threshold_scope: ThresholdScope = "batch"

    def __post_init__(self):
        if self.threshold_scope not in _THRESHOLD_SCOPES:
            raise ValueError(
                f"SATConfig.threshold_scope must be one of {_THRESHOLD_SCOPES}, "
                f"got {self.threshold_scope!r}"
            )
        if not 0.0 < self.quantile <= 1.0:
            raise ValueError(f"SATConfig.quantile must be in (0, 1], got {self.quantile!r}")
        if not self.exponent > 0.0:
            raise ValueError(f"SATConfig.exponent must be > 0, got {self.exponent!r}")


# The options that weigh tokens by the old-to-behavior ratio, so need old_logp
# (``PolicyLossConfig.rollout_corrections``).
_NEEDS_OLD_LOGP = ("tis_cap", "icepop_range", "seq_tis_cap", "seq_mask_range")


@dataclasses.dataclass(frozen=True, kw_only=True)
class PolicyLossConfig:
    """Configuration of :func:`policy_loss`; every stabilizer is off by default.

    Attributes:
      ratio_level: ``"token"`` (PPO/GRPO, eq. 3.1) or ``"sequence"`` (GSPO, eq. 3.2).
      clip_low: ε_low; the clip interval is [1 − ε_low, 1 + ε_high].
      clip_high: ε_high (``clip_high > clip_low`` is "clip-higher").
      loss_agg: ``"token_mean"`` (Σ mask·ℓ / Σ mask) or ``"seq_mean_token_mean"`` (mean over
        responses with at least one active token of each response's token mean).
      sat: the SAT contraction (docs/DESIGN.md §3.3); disabled by default.
      dual_clip: c > 1: for A < 0 the surrogate is floored at c·A (dual-clip PPO). None = off.
      tis_cap: truncated importance sampling: S is weighted by min(exp(old − behavior), cap),
        detached. Needs ``old_logp``. None = off.
      icepop_range: (α, β): S is weighted by k·1[α ≤ k ≤ β], k = exp(old − behavior), detached.
        Needs ``old_logp``. None = off.
      seq_tis_cap: sequence-level TIS: every token of response b is weighted by
        w_b = min(exp(Σ_t (old − behavior)), cap), the sum over b's active tokens, detached
        (computed as exp(min(Σ, log cap)), so it never overflows). Needs ``old_logp``. None = off.
      seq_mask_range: (low, high): sequence masking (MIS): a response whose geometric-mean ratio
        g_b = exp(mean_t (old − behavior)) over its active tokens lies outside [low, high] gets
        weight 0 (loss and gradient 0) and leaves the loss's denominator, as in verl's rejection
        sampling (the loss is over the kept responses; ``corrections.kept_loss_mask``). Needs
        ``old_logp``. None = off.
      dppo_tv_delta: δ of the DPPO total-variation mask: a token's gradient is zeroed (its value
        kept) when A·(r − 1) > 0 and |exp(logp) − exp(old_logp)| > δ. None = off.
      kl_coef: weight of a KL penalty to a reference policy (needs ``ref_logp`` when > 0).
      kl_estimator: ``"k1"`` (log π − log π_ref), ``"k2"`` (½(log π − log π_ref)²) or ``"k3"``
        (``low_var_kl``: e^x − x − 1 with x = log π_ref − log π clamped to ±20, result to ±10).
      log_ratio_clamp: numerical guard: ratios are exp(clip(d, −L, L)) so they stay finite in float32
        (verl uses 20). The clamp has zero gradient outside ±L. None = no clamp. SAT's quantile and
        gate use the unclamped d_SAT.
      m2_threshold: M2PO's τ (docs/DESIGN.md §3.6; the paper's 0.04): mask the tokens with the
        largest (logp − behavior_logp)² until the rest's mean is below τ (a batch statistic,
        see :func:`m2po_batch_cutoff`). None or 0 = off.
      m2_token_set: the tokens M2PO's mask may remove: ``"trust_region"`` (the paper's Algorithm
        1 and its authors' code: A > 0 and logp > behavior_logp, or A < 0 and logp <
        behavior_logp) or ``"all"`` (every active token, AReaL's code). Read only with M2PO on.
      ess_scaling: VCPO's step scaling: the train step multiplies the optimizer's update by
        sqrt(ess), the batch's effective sample size fraction (§3.6). The loss does not read it.
      ess_level: which ESS the metric ``ess`` (and so ``ess_scaling``) is: ``"sequence"`` (VCPO's
        authors: w_i = exp(Σ_t (logp − behavior_logp)) per response, over the responses) or
        ``"token"`` (w = exp(logp − behavior_logp) per active token). Both are always reported,
        as ``ess_sequence`` and ``ess_token``.
      opob_baseline: VCPO's closed-form off-policy optimal baseline: the train step centers each
        reward on its group's mean weighted by w_i²·‖∇ log π(y_i)‖² (w_i the response's
        behavior → current sequence ratio; ``opob_baselines``, §3.6) instead of the plain mean.
        The loss does not read it.
    """

    ratio_level: RatioLevel = "token"
    clip_low: float = 0.2
    clip_high: float = 0.2
    loss_agg: LossAgg = "token_mean"
    sat: SATConfig = SATConfig(enabled=False)
    dual_clip: float | None = None
    tis_cap: float | None = None
    icepop_range: tuple[float, float] | None = None
    seq_tis_cap: float | None = None
    seq_mask_range: tuple[float, float] | None = None
    dppo_tv_delta: float | None = None
    kl_coef: float = 0.0
    kl_estimator: KLEstimator = "k3"
    log_ratio_clamp: float | None = 20.0
    m2_threshold: float | None = None
    m2_token_set: Literal["trust_region", "all"] = "trust_region"
    ess_scaling: bool = False
    ess_level: Literal["sequence", "token"] = "sequence"
    opob_baseline: bool = False

    def __post_init__(self):
        _check_choice("ratio_level", self.ratio_level, _RATIO_LEVELS)
        _check_choice("loss_agg", self.loss_agg, _LOSS_AGGS)
        _check_choice("kl_estimator", self.kl_estimator, KL_ESTIMATORS)
        _check_choice("m2_token_set", self.m2_token_set, M2_TOKEN_SETS)
        _check_choice("ess_level", self.ess_level, ESS_LEVELS)
        dual, tis, icepop = self.dual_clip, self.tis_cap, self.icepop_range
        tv, clamp = self.dppo_tv_delta, self.log_ratio_clamp
        seq_tis, seq_mask, m2 = self.seq_tis_cap, self.seq_mask_range, self.m2_threshold
        rules = {  # field: (value, valid, what a valid value is)
            "clip_low": (self.clip_low, 0.0 <= self.clip_low < 1.0, "in [0, 1)"),
            "clip_high": (self.clip_high, self.clip_high >= 0.0, ">= 0"),
            "sat": (self.sat, isinstance(self.sat, SATConfig), "a SATConfig"),
            "dual_clip": (dual, dual is None or dual > 1.0, "> 1 or None"),
            "tis_cap": (tis, tis is None or tis > 0.0, "> 0 or None"),
            "icepop_range": (
                icepop,
                icepop is None or (len(icepop) == 2 and 0.0 <= icepop[0] <= icepop[1]),
                "(alpha, beta) with 0 <= alpha <= beta",
            ),
            "seq_tis_cap": (seq_tis, seq_tis is None or seq_tis > 0.0, "> 0 or None"),
            "seq_mask_range": (
                seq_mask,
                seq_mask is None or (len(seq_mask) == 2 and 0.0 <= seq_mask[0] <= seq_mask[1]),
                "(low, high) with 0 <= low <= high",
            ),
            "dppo_tv_delta": (tv, tv is None or tv >= 0.0, ">= 0 or None"),
            "kl_coef": (self.kl_coef, self.kl_coef >= 0.0, ">= 0"),
            "log_ratio_clamp": (clamp, clamp is None or clamp > 0.0, "> 0 or None"),
            "m2_threshold": (m2, m2 is None or m2 >= 0.0, ">= 0 or None"),
            "ess_scaling": (self.ess_scaling, isinstance(self.ess_scaling, bool), "a bool"),
            "opob_baseline": (self.opob_baseline, isinstance(self.opob_baseline, bool), "a bool"),
        }
        for name, (value, valid, want) in rules.items():
            if not valid:
                raise ValueError(f"PolicyLossConfig.{name} must be {want}, got {value!r}")

    @property
    def rollout_corrections(self) -> tuple[str, ...]:
        """The options set that weigh tokens by the proximal-to-behavior ratio (TIS, IcePop, the
        sequence corrections), so need ``old_logp``: the one list of them."""
        return tuple(name for name in _NEEDS_OLD_LOGP if getattr(self, name) is not None)

    @property
    def m2po(self) -> bool:
        """Whether M2PO's mask is on (``m2_threshold`` set and > 0)."""
        return bool(self.m2_threshold)


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"PolicyLossConfig.{name} must be one of {choices}, got {value!r}")


# --------------------------------------------------------------------------------------------
# Per-token kernels (optax.losses-shaped).
# --------------------------------------------------------------------------------------------


def _active(where: ArrayLike | None, like: jax.Array) -> jax.Array:
    if where is None:
        return jnp.ones(like.shape, bool)
    return jnp.asarray(where) > 0


def _sat_gate(d: jax.Array, q: jax.Array) -> jax.Array:
    """Where SAT fires (eq. 3.5): q > 0 and |d| > q, strictly; d and q detached float32."""
    return (q > 0) & (jnp.abs(d) > q)


def sat_contraction(
    log_ratio: ArrayLike, threshold: ArrayLike, *, exponent: float = 2.0
) -> tuple[jax.Array, jax.Array]:
    """SAT's endpoint factors (c_low, c_high) = (c₋, c₊) of eqs. (3.4)–(3.5), detached.

    The gate fires iff q > 0 and |d| > q (strictly); there c₊ = ψ(max(d, 0); q) and
    c₋ = ψ(max(−d, 0); q) with ψ(u; q) = 1/(1 + (u/q)^p), so only the side of sign(d) contracts;
    elsewhere both are exactly 1.

    Args:
      log_ratio: d, [B, T] (token level) or the sequence log-ratio broadcast to tokens.
      threshold: q, a scalar (usually :func:`masked_quantile` of |d|).
      exponent: p > 0.

    Returns:
      (c_low, c_high), each [B, T] in (0, 1], with stop_gradient applied.
    """
    d = jax.lax.stop_gradient(jnp.asarray(log_ratio, jnp.float32))
    q = jax.lax.stop_gradient(jnp.asarray(threshold, jnp.float32))
    gate = _sat_gate(d, q)
    safe_q = jnp.where(q > 0, q, 1.0)

    # u/q can overflow to inf for huge |d|; ψ then is exactly 0, never NaN. ψ(|d|) is computed once
    # and given to the side of sign(d): the other side's ψ(0) is exactly 1, as where the gate is off.
    u = jnp.abs(d) / safe_q
    # An integral p (the default 2) is a few multiplies; a float power is exp(p·log u) on CPU.
    p = float(exponent)
    u_p = jax.lax.integer_pow(u, int(p)) if p.is_integer() else jnp.power(u, p)
    psi = 1.0 / (1.0 + u_p)
    c_high = jnp.where(gate & (d > 0), psi, 1.0)
    c_low = jnp.where(gate & (d < 0), psi, 1.0)
    return c_low, c_high


def clipped_surrogate_loss(
    ratio: ArrayLike,
    advantages: ArrayLike,
    *,
    clip_low: ArrayLike = 0.2,
    clip_high: ArrayLike = 0.2,
    dual_clip: float | None = None,
    where: ArrayLike | None = None,
) -> jax.Array:
    """Per-token PPO loss −S, S = min(r·A, clip(r, 1 − ε_low, 1 + ε_high)·A) (eq. 3.1).

    ``clip_low``/``clip_high`` may be per-token arrays (SAT passes ε̃). With ``dual_clip`` = c,
    S = max(S, c·A) where A < 0. Gradient flows through ``ratio``; the clip bounds are treated as
    constants (pass detached arrays).

    Returns:
      [B, T] losses, 0 where ``where`` is not active.
    """
    r = jnp.asarray(ratio, jnp.float32)
    a = jnp.asarray(advantages, jnp.float32)
    active = _active(where, r)
    a = jnp.where(active, a, 0.0)
    clipped = jnp.clip(r, 1.0 - jnp.asarray(clip_low), 1.0 + jnp.asarray(clip_high))
    surrogate = jnp.minimum(r * a, clipped * a)
    if dual_clip is not None:
        surrogate = jnp.where(a < 0, jnp.maximum(surrogate, dual_clip * a), surrogate)
    return jnp.where(active, -surrogate, 0.0)


def sat_clipped_surrogate_loss(
    log_ratio: ArrayLike,
    advantages: ArrayLike,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    quantile: float = 0.9,
    exponent: float = 2.0,
    dual_clip: float | None = None,
    where: ArrayLike | None = None,
) -> jax.Array:
    """Per-token SAT loss −S_SAT (eqs. 3.3–3.6) from the token log-ratio d = logp − old_logp.

    A standalone kernel (no clamp of d); :func:`policy_loss` adds aggregation, metrics, GSPO and
    stabilizers. q is the quantile of |sg(d)| over the active tokens of this call.

    Returns:
      [B, T] losses, 0 where ``where`` is not active.
    """
    d = jnp.asarray(log_ratio, jnp.float32)
    active = _active(where, d)
    d = jnp.where(active, d, 0.0)
    q = masked_quantile(jnp.abs(jax.lax.stop_gradient(d)), quantile, where=active)
    c_low, c_high = sat_contraction(d, q, exponent=exponent)
    return clipped_surrogate_loss(
        jnp.exp(d),
        advantages,
        clip_low=clip_low * c_low,
        clip_high=clip_high * c_high,
        dual_clip=dual_clip,
        where=active,
    )


def sequence_log_ratio(
    log_ratio: ArrayLike, *, where: ArrayLike | None = None, keepdims: bool = False
) -> jax.Array:
    """GSPO's s_b = mean over active tokens of d_bt (eq. 3.2), broadcast to [B, T].

    Differentiable: the gradient reaches every active token of b through the mean. A response with
    no active token gets 0. With ``keepdims`` the result stays [B, 1] (broadcast it at use: a
    function of s_b then costs B evaluations, not B·T).
    """
    d = jnp.asarray(log_ratio, jnp.float32)
    active = _active(where, d)
    total = jnp.sum(jnp.where(active, d, 0.0), axis=-1, keepdims=True)
    count = jnp.sum(active, axis=-1, keepdims=True, dtype=jnp.int32)
    s_b1 = total / jnp.maximum(count, 1)
    return s_b1 if keepdims else jnp.broadcast_to(s_b1, d.shape)


# --------------------------------------------------------------------------------------------
# The reducing wrapper.
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Batch:
    """The wrapper's inputs as float32 [B, T] arrays; ``adv`` is 0 on padding, ``active`` bool."""

    logp: jax.Array
    behavior: jax.Array
    old: jax.Array  # old_logp, or behavior_logp when none is given
    adv: jax.Array
    active: jax.Array
    has_old: bool  # whether old_logp was given
    fresh: jax.Array | None  # active & fresh_mask, bool; None when no fresh_mask is given


def _check_shapes(fn: str, **arrays: ArrayLike) -> None:
    shapes = {name: jnp.shape(x) for name, x in arrays.items()}
    if len(set(shapes.values())) > 1:
        raise ValueError(f"{fn}: {', '.join(shapes)} must share one [B, T] shape, got {shapes}")


def _prepare(
    logp, behavior_logp, advantages, mask, cfg, old_logp, ref_logp, sat_q, fresh_mask
) -> _Batch:
    """Checks the arguments of :func:`policy_loss_terms` against ``cfg`` and converts them."""
    optional = {"fresh_mask": fresh_mask, "old_logp": old_logp}
    _check_shapes(
        "policy_loss",
        logp=logp,
        behavior_logp=behavior_logp,
        advantages=advantages,
        mask=mask,
        **{name: x for name, x in optional.items() if x is not None},
    )
    needs_old = cfg.rollout_corrections
    if old_logp is None and needs_old:
        raise ValueError(f"policy_loss: {needs_old[0]} is set but old_logp is None")
    if cfg.kl_coef > 0 and ref_logp is None:
        raise ValueError("policy_loss: kl_coef > 0 but ref_logp is None")
    if sat_q is not None and jnp.shape(sat_q) != ():
        raise ValueError(f"policy_loss: sat_q must be a scalar, got shape {jnp.shape(sat_q)}")
    behavior, active = jnp.asarray(behavior_logp, jnp.float32), jnp.asarray(mask) > 0
    old = behavior if old_logp is None else jnp.asarray(old_logp, jnp.float32)
    adv = jnp.where(active, jnp.asarray(advantages, jnp.float32), 0.0)
    fresh = None if fresh_mask is None else active & (jnp.asarray(fresh_mask) > 0)
    lp = jnp.asarray(logp, jnp.float32)
    return _Batch(lp, behavior, old, adv, active, old_logp is not None, fresh)


def _log_ratio(logp: jax.Array, old: jax.Array, active: jax.Array, ratio_level: RatioLevel):
    """(d, weight of each d in SAT's quantile): d_bt [B, T] (eq. 3.1) or GSPO's s_b [B, 1] (3.2).

    Padding is zeroed so garbage there (−inf log-probs) reaches neither the loss nor the gradient.
    s_b stays [B, 1] and broadcasts at use: B exps instead of B·T, and the token-level quantile of
    |s_b| is a quantile of B values, each counted once per active token of its response.
    """
    d = jnp.where(active, logp - old, 0.0)
    if ratio_level == "token":
        return d, active
    s_b1 = sequence_log_ratio(d, where=active, keepdims=True)
    return s_b1, jnp.sum(active, axis=-1, keepdims=True, dtype=jnp.int32)


def sat_threshold(
    logp: ArrayLike,
    behavior_logp: ArrayLike,
    mask: ArrayLike,
    cfg: PolicyLossConfig,
    *,
    old_logp: ArrayLike | None = None,
) -> jax.Array:
    """SAT's threshold q of a batch (eq. 3.3): the one :func:`policy_loss` computes for it.

    q is the exact inverted-CDF ``cfg.sat.quantile`` of |d_SAT| over the active tokens, with d_SAT
    the token log-ratio to the sampler, logp − behavior_logp (``cfg.ratio_level == "token"``), or
    its per-response mean, counted once per active token of the response (``"sequence"``). Give it
    as ``sat_q=`` to every microbatch of the batch so that all contract with the full batch's
    threshold.

    SAT measures staleness against the behavior policy also when ``old_logp`` is given (decoupled
    PPO), so q does not depend on it: with old_logp recomputed by the current params just before a
    single update (AReaL's decoupled objective), logp − old_logp is identically 0 at the update and
    a gate on it would never fire, while the high-staleness tail is where a token's log-ratio to
    the sampler is large. Without ``old_logp`` (which then stands for behavior_logp), d_SAT is d.
    So for every ``old_logp``, q is the ``sat_q`` that :func:`policy_loss` reports for the same
    arguments (docs/DESIGN.md §3.3).

    Args:
      logp, behavior_logp, mask: as in :func:`policy_loss`, [B, T].
      cfg: a :class:`PolicyLossConfig`.
      old_logp: optional proximal log-probs, as in :func:`policy_loss`: checked like its (the
        same [B, T] shape), so a call mirrors the loss's; its values do not move q (see above).

    Returns:
      A float32 scalar under stop_gradient; 0 when SAT is disabled or no token is active.

    Raises:
      ValueError: the arrays (``old_logp`` included, when given) do not share one shape.
    """
    given = {} if old_logp is None else {"old_logp": old_logp}
    _check_shapes("sat_threshold", logp=logp, behavior_logp=behavior_logp, mask=mask, **given)
    if not cfg.sat.enabled:
        return jnp.zeros((), jnp.float32)
    behavior = jnp.asarray(behavior_logp, jnp.float32)
    active = jnp.asarray(mask) > 0
    d, weight = _log_ratio(jnp.asarray(logp, jnp.float32), behavior, active, cfg.ratio_level)
    # A token-level weight is the mask itself: as ``where`` it takes the faster unweighted path.
    by = {"where": weight} if cfg.ratio_level == "token" else {"counts": weight}
    q = masked_quantile(jnp.abs(jax.lax.stop_gradient(d)), cfg.sat.quantile, **by)
    return jax.lax.stop_gradient(q)


@dataclasses.dataclass(frozen=True)
class _TrustRegion:
    """ε̃ = (ε_low·c₋, ε_high·c₊) and SAT's diagnostics, detached; [B, T], or [B, 1] for GSPO."""

    eps_low: jax.Array | float  # the Python float ε_low when SAT is disabled
    eps_high: jax.Array | float
    c_low: jax.Array
    c_high: jax.Array
    q: jax.Array
    gate: jax.Array
    c_min: jax.Array


def _sat_log_ratio(d: jax.Array, batch: _Batch, cfg: PolicyLossConfig) -> jax.Array:
    """d_SAT, the log-ratio SAT's gate and contraction read: logp − behavior_logp, [B, T], or its
    per-response mean, [B, 1] (GSPO). It is the ratio's d itself when no old_logp is given (or SAT
    is off, when it goes unread). See :func:`sat_threshold` for why it is against the sampler."""
    if not (batch.has_old and cfg.sat.enabled):
        return d
    return _log_ratio(batch.logp, batch.behavior, batch.active, cfg.ratio_level)[0]


def _trust_region(d: jax.Array, active: jax.Array, cfg: PolicyLossConfig, q: ArrayLike):
    """The clip bounds of eq. (3.1), contracted by SAT (eqs. 3.4–3.6) with threshold q if enabled.

    ``d`` is d_SAT (:func:`_sat_log_ratio`); the bounds contract on the side of its sign.
    """
    if not cfg.sat.enabled:  # q is ignored (sat_threshold gives 0 then)
        ones, no_gate = jnp.ones(active.shape, jnp.float32), jnp.zeros(active.shape, bool)
        q, c_min = jnp.zeros((), jnp.float32), jnp.ones((), jnp.float32)
        return _TrustRegion(cfg.clip_low, cfg.clip_high, ones, ones, q, no_gate, c_min)
    d_sg, q = jax.lax.stop_gradient(d), jax.lax.stop_gradient(jnp.asarray(q, jnp.float32))
    c_low, c_high = sat_contraction(d_sg, q, exponent=cfg.sat.exponent)
    c_min = jnp.min(jnp.where(active, jnp.minimum(c_low, c_high), 1.0), initial=1.0)
    eps_low, eps_high = cfg.clip_low * c_low, cfg.clip_high * c_high
    return _TrustRegion(eps_low, eps_high, c_low, c_high, q, _sat_gate(d_sg, q), c_min)


def policy_loss_terms(
    logp: ArrayLike,
    behavior_logp: ArrayLike,
    advantages: ArrayLike,
    mask: ArrayLike,
    cfg: PolicyLossConfig,
    *,
    old_logp: ArrayLike | None = None,
    ref_logp: ArrayLike | None = None,
    sat_q: ArrayLike | None = None,
    fresh_mask: ArrayLike | None = None,
    m2_cutoff: ArrayLike | None = None,
) -> PolicyLossTerms:
    """The loss of :func:`policy_loss` and its metrics as (sum, count) pairs; same arguments.

    Microbatches of one batch that all get the batch's ``sat_q`` (:func:`sat_threshold`) and
    ``m2_cutoff`` (:func:`m2po_batch_cutoff`) merge to the full batch's loss and metrics
    (docs/DESIGN.md §3.5); the merged ``sat_q`` metric is then that shared q.
    """
    batch = _prepare(
        logp, behavior_logp, advantages, mask, cfg, old_logp, ref_logp, sat_q, fresh_mask
    )
    if sat_q is None:
        sat_q = sat_threshold(logp, behavior_logp, mask, cfg)
    d, _ = _log_ratio(batch.logp, batch.old, batch.active, cfg.ratio_level)
    ratio = jnp.exp(_clamp(d, cfg.log_ratio_clamp))
    region = _trust_region(_sat_log_ratio(d, batch, cfg), batch.active, cfg, sat_q)
    per_token = clipped_surrogate_loss(
        ratio,
        batch.adv,
        clip_low=region.eps_low,
        clip_high=region.eps_high,
        dual_clip=cfg.dual_clip,
        where=batch.active,
    )
    per_token, stabilizer_metrics = corrections.stabilize(per_token, ratio, batch, cfg)
    per_token, seq_sums, seq_counts = corrections.sequence_corrections(per_token, batch, cfg)
    if cfg.m2po:
        if m2_cutoff is None:
            m2_cutoff = m2po_batch_cutoff(logp, behavior_logp, mask, cfg, advantages=batch.adv)
        per_token, m2_sums, m2_counts = corrections.m2po_correction(
            per_token, batch, cfg, m2_cutoff
        )
        seq_sums, seq_counts = {**seq_sums, **m2_sums}, {**seq_counts, **m2_counts}

    kept = corrections.kept_loss_mask(batch.behavior, batch.old, batch.active, cfg)
    loss_sum, loss_count = aggregate(per_token, kept, cfg.loss_agg)
    sums = {"pg_loss": jax.lax.stop_gradient(loss_sum)}
    if ref_logp is not None:
        kl = kl_penalty(batch.logp, ref_logp, estimator=cfg.kl_estimator, where=kept)
        kl_sum, _ = aggregate(kl, kept, cfg.loss_agg)
        sums["kl_ref"] = jax.lax.stop_gradient(kl_sum)
        if cfg.kl_coef > 0:
            loss_sum = loss_sum + cfg.kl_coef * kl_sum
    sums["loss"] = jax.lax.stop_gradient(loss_sum)

    token_metrics = {**stabilizer_metrics, **diagnostics.diagnostics(ratio, region, batch, cfg)}
    metric_sums, metric_counts = diagnostics.metric_terms(token_metrics, region, batch.active, cfg)
    kl_k3 = token_metrics["kl_k3"]
    kl_sum, n_fresh = diagnostics.sampler_kl_terms(kl_k3, batch, metric_sums, metric_counts)
    metric_sums["sampler_kl"], metric_counts["sampler_kl"] = kl_sum, n_fresh
    return PolicyLossTerms(
        loss_sum=loss_sum,
        loss_count=loss_count,
        sums={**sums, **metric_sums, **seq_sums},
        counts={**dict.fromkeys(sums, loss_count), **metric_counts, **seq_counts},
        mins={"sat_c_min": region.c_min},
        totals={
            "active_tokens": metric_counts["kl_k3"],
            "fresh_tokens": n_fresh,
            **diagnostics.ess_totals(batch, cfg),
        },
        ess_level=cfg.ess_level,
    )


def policy_loss(
    logp: ArrayLike,
    behavior_logp: ArrayLike,
    advantages: ArrayLike,
    mask: ArrayLike,
    cfg: PolicyLossConfig,
    *,
    old_logp: ArrayLike | None = None,
    ref_logp: ArrayLike | None = None,
    sat_q: ArrayLike | None = None,
    fresh_mask: ArrayLike | None = None,
    m2_cutoff: ArrayLike | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The policy-gradient loss (PPO/GRPO, GSPO, SAT, stabilizers) and its metrics (docs/DESIGN.md §3–4).

    loss = −aggregate(S) [+ kl_coef·aggregate(KL)], S per eqs. (3.1)–(3.6): ratios from
    d = logp − old_logp (token) or its per-response mean (GSPO); with SAT, the clip endpoints
    contract on the high-|d_SAT| tail, d_SAT = logp − behavior_logp (its per-response mean in GSPO;
    d itself without ``old_logp``; see :func:`sat_threshold`), with q, c₋, c₊ and ε̃ all under
    stop_gradient; stabilizer weights (token and sequence level) are detached. Jittable;
    differentiable in ``logp``.

    Args:
      logp: log π_θ of the sampled tokens under the current params, float [B, T].
      behavior_logp: log μ reported by the rollout engine, float [B, T].
      advantages: per token (or per response broadcast), float [B, T].
      mask: 1 on active (completion, non-padding) tokens, 0 elsewhere, [B, T].
      cfg: a :class:`PolicyLossConfig`.
      old_logp: optional proximal log-probs, [B, T]; ``behavior_logp`` when None.
      ref_logp: optional reference-policy log-probs for the KL penalty / ``kl_ref`` metric, [B, T].
      sat_q: optional SAT threshold q (a scalar, detached) used instead of the one computed from
        this call's tokens, e.g. :func:`sat_threshold` of the whole batch when this call sees a
        microbatch. Ignored when SAT is disabled (``sat_threshold`` then gives 0), so callers can
        pass it unconditionally.
      fresh_mask: optional, [B, T]: 1 where the token was sampled by the weights being trained
        (lag 0). Only the ``sampler_kl`` and ``fresh_tokens`` metrics read it; every active token
        counts as fresh when None.
      m2_cutoff: optional M2PO cutoff (:func:`m2po_batch_cutoff` of the whole batch) used
        instead of this call's; ignored when M2PO is off.

    Returns:
      (loss, metrics): a float32 scalar and a dict of float32 scalars with the docs/DESIGN.md §4 names
      (``mismatch_abs_mean``, ``is_deviation_frac``, ``kl_k3``, ``clip_frac_low``,
      ``clip_frac_high``, ``sat_q``, ``sat_gate_rate``, ``sat_eps_low_mean``,
      ``sat_eps_high_mean``, ``sat_c_min``) plus ``loss``, ``pg_loss``, ``ratio_mean``,
      ``active_tokens``, ``sampler_kl`` (k3 = e^x − 1 − x, x = logp − behavior_logp clamped as
      for ``kl_k3``, averaged over the active tokens that are fresh: the sampler–trainer mismatch
      with staleness excluded), ``fresh_tokens`` (the number of those tokens), ``ess`` (§3.6, of
      ``cfg.ess_level``), ``ess_token`` and ``ess_sequence`` (both levels, always) and
      the metrics of enabled options (``dual_clip_frac``, ``tis_weight_mean``, ``icepop_kept_frac``,
      ``seq_tis_weight_mean`` and ``seq_masked_frac`` (means over the responses with an active
      token of w_b and of the masked flag), ``dppo_tv_masked_frac``, ``kl_ref``,
      ``m2po_masked_frac``, ``m2po_second_moment``).
      An all-padding batch gives loss 0 and zero gradient.
    """
    terms = policy_loss_terms(
        logp,
        behavior_logp,
        advantages,
        mask,
        cfg,
        old_logp=old_logp,
        ref_logp=ref_logp,
        sat_q=sat_q,
        fresh_mask=fresh_mask,
        m2_cutoff=m2_cutoff,
    )
    return terms.reduce()
