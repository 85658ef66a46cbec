"""The objective family: PPO/GRPO, GSPO and SAT, their stabilizers, reductions and advantages.

``from sat_jax import objectives`` is the public face (docs/DESIGN.md §3): every name below is
importable from here. The modules behind it, each usable on its own:

- ``policy``: the configs (``PolicyLossConfig``, ``SATConfig``), the optax-shaped per-token kernels
  (``clipped_surrogate_loss``, ``sat_clipped_surrogate_loss``, ``sat_contraction``), SAT's batch
  threshold (``sat_threshold``) and the reducing wrappers (``policy_loss_terms``, ``policy_loss``);
- ``loss_terms``: (sum, count) reductions that add up across microbatches and hosts;
- ``quantile``: the exact masked inverted-CDF quantile SAT's threshold uses;
- ``stabilizers``: TIS, IcePop, DPPO-TV, the sequence-level rollout corrections (sequence TIS,
  geometric-mean sequence masking) and the KL penalty estimators;
- ``large_lag``: M2PO's second-moment mask (``m2po_candidates``, ``m2po_cutoff``, ``m2po_mask``,
  the batch's ``m2po_batch_cutoff``) and the effective sample size of the importance weights
  (``importance_weight_sums``, ``sequence_weight_sums``, ``effective_sample_size``, VCPO's
  ``ess_step_scale``) and VCPO's
  off-policy optimal baseline (``opob_baselines``, from ``sequence_score_stats``);
- ``corrections`` and ``diagnostics``: the wrapper's corrections to the per-token loss and its
  metrics (internal to ``policy_loss_terms``), and ``kept_loss_mask`` (the tokens in the loss's
  denominator once MIS has rejected responses, for the train step's accumulated count);
- ``advantages``: group-relative advantages (GRPO, Dr.GRPO), jittable, and the host-side check
  of their group ids.
"""

from sat_jax.objectives.advantages import AdvantageEstimator, check_group_ids, group_advantages
from sat_jax.objectives.corrections import kept_loss_mask
from sat_jax.objectives.large_lag import (
    effective_sample_size,
    ess_step_scale,
    importance_weight_sums,
    m2po_batch_cutoff,
    m2po_candidates,
    m2po_cutoff,
    m2po_mask,
    opob_baselines,
    sequence_score_stats,
    sequence_weight_sums,
)
from sat_jax.objectives.loss_terms import LossAgg, PolicyLossTerms, aggregate, loss_count
from sat_jax.objectives.policy import (
    PolicyLossConfig,
    RatioLevel,
    SATConfig,
    ThresholdScope,
    clipped_surrogate_loss,
    policy_loss,
    policy_loss_terms,
    sat_clipped_surrogate_loss,
    sat_contraction,
    sat_threshold,
    sequence_log_ratio,
)
from sat_jax.objectives.quantile import masked_quantile
from sat_jax.objectives.stabilizers import (
    KL_ESTIMATORS,
    KLEstimator,
    dppo_tv_mask,
    geometric_mean_mask,
    icepop_weights,
    kl_penalty,
    sequence_importance_weights,
    truncated_importance_weights,
)

__all__ = [
    "KL_ESTIMATORS",
    "AdvantageEstimator",
    "KLEstimator",
    "LossAgg",
    "PolicyLossConfig",
    "PolicyLossTerms",
    "RatioLevel",
    "SATConfig",
    "ThresholdScope",
    "aggregate",
    "check_group_ids",
    "clipped_surrogate_loss",
    "dppo_tv_mask",
    "effective_sample_size",
    "ess_step_scale",
    "geometric_mean_mask",
    "group_advantages",
    "icepop_weights",
    "importance_weight_sums",
    "kept_loss_mask",
    "kl_penalty",
    "loss_count",
    "m2po_batch_cutoff",
    "m2po_candidates",
    "m2po_cutoff",
    "m2po_mask",
    "masked_quantile",
    "opob_baselines",
    "policy_loss",
    "policy_loss_terms",
    "sat_clipped_surrogate_loss",
    "sat_contraction",
    "sat_threshold",
    "sequence_importance_weights",
    "sequence_log_ratio",
    "sequence_score_stats",
    "sequence_weight_sums",
    "truncated_importance_weights",
]
