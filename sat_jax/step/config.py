"""The train step's options: ``StepConfig`` (defined with the config sections,
``sat_jax.config.step``, so the train section builds it) and ``step_config``, the one function
that builds them from an experiment's config.

Every builder of the step (the trainer, ``python -m sat_jax.plan``, the benchmarks and the tests)
takes a ``StepConfig``; none of them lists the options again, so the program the plan compiles is
the one the trainer runs (docs/DESIGN.md §7.1).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sat_jax.config.step import StepConfig

if TYPE_CHECKING:
    from sat_jax.experiment import ExperimentConfig

__all__ = ["StepConfig", "step_config"]


def step_config(cfg: ExperimentConfig) -> StepConfig:
    """The configured train step's options: ``train.*``'s own (``TrainConfig.step_options``),
    with the sampler's ``rollout.temperature`` and whether its truncation is replayed.

    The trainer (``train.main``), ``python -m sat_jax.plan`` (with or without ``--topology``)
    and the benchmarks build their step from this, so they compile the same program.
    """
    return cfg.train.step_options(
        temperature=cfg.rollout.temperature, kept_counts=cfg.rollout.replays_truncation
    )
