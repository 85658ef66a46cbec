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
- ``advantages``: group-relative advantages (GRPO, Dr.GRPO), jittable, and the host-side check
  of their group ids.
"""

from sat_jax.objectives.advantages import AdvantageEstimator, check_group_ids, group_advantages
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
    "geometric_mean_mask",
    "group_advantages",
    "icepop_weights",
    "kl_penalty",
    "loss_count",
    "masked_quantile",
    "policy_loss",
    "policy_loss_terms",
    "sat_clipped_surrogate_loss",
    "sat_contraction",
    "sat_threshold",
    "sequence_importance_weights",
    "sequence_log_ratio",
    "truncated_importance_weights",
]
