"""The train step's options, held once: ``StepConfig``, which the train section builds
(``TrainConfig.step_options``) and every builder of the step takes (``sat_jax.step``; the trainer,
``python -m sat_jax.plan``, the benchmarks and the tests), so the program the plan compiles is the
one the trainer runs (docs/DESIGN.md §7.1).

It lives with the config sections, below the step, so that the section that holds the options
can build it.
"""

from __future__ import annotations

import dataclasses

from sat_jax import objectives


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepConfig:
    """What the jitted train step computes, besides the model, the optimizer and the mesh.

    Attributes:
      loss: the ``PolicyLossConfig``. With ``loss.kl_coef`` > 0 the trainer passes the
        reference policy's params (``uses_reference``).
      routing_replay: replay ``TrainBatch.routing`` in every MoE layer (R3); the batch must
        carry it.
      temperature: the sampling temperature the behavior log-probs were taken at.
      microbatches: k; the gradient is accumulated over k microbatches of B/k rows (B divisible
        by k). Loss, gradient and metrics equal the one-pass step's (docs/DESIGN.md §3.3, §5).
      estimator, normalize_std: the ``objectives.group_advantages`` options, for a batch that
        carries per-row rewards and group ids (``with_advantages``).
      recompute_old_logp: the proximal log-probs ``old_logp`` are the current params' own,
        before this update (AReaL's decoupled objective, docs/DESIGN.md §3.4); the batch must not
        carry ``old_logp``.
      kept_counts: the batch carries the sampler's kept-set sizes (``TrainBatch.kept_counts``),
        and the step's log-probs replay that truncation; the batch must carry them exactly when
        this is set.
    """

    loss: objectives.PolicyLossConfig
    routing_replay: bool = False
    temperature: float = 1.0
    microbatches: int = 1
    estimator: objectives.AdvantageEstimator = "grpo"
    normalize_std: bool = True
    recompute_old_logp: bool = False
    kept_counts: bool = False

    def __post_init__(self) -> None:
        if self.microbatches < 1:
            raise ValueError(f"microbatches must be >= 1, got {self.microbatches}")
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if self.estimator not in ("grpo", "dr_grpo"):
            raise ValueError(f"estimator must be 'grpo' or 'dr_grpo', got {self.estimator!r}")

    @property
    def uses_reference(self) -> bool:
        """Whether the step scores a reference policy: the KL penalty is on."""
        return self.loss.kl_coef > 0
