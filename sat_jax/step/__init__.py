"""The train step in parts (docs/DESIGN.md §7.1):

- ``config``: ``step_config``, the one function that builds the step's options (``StepConfig``,
  defined with the config sections so the train section builds it) from an experiment's config.
- ``state``: ``TrainState``, its shardings, and how it is created, initialized or described as
  shapes.
- ``batch``: ``TrainBatch``, its checks, masks and advantages, and its placement on the mesh.
- ``accumulation``: the batch's gradient and metrics, in one pass or over microbatches.
- ``step``: ``train_step`` and ``make_train_step``, the jitted ``Step``.
"""

from sat_jax.step.batch import (
    TrainBatch,
    batch_shardings,
    check_batch,
    shard_batch,
    token_mask,
    with_advantages,
)
from sat_jax.step.config import StepConfig, step_config
from sat_jax.step.state import (
    TrainState,
    abstract_train_state,
    create_train_state,
    init_train_state,
    train_state_shardings,
    whole_params,
)
from sat_jax.step.step import Step, make_train_step, train_step

__all__ = [
    "Step",
    "StepConfig",
    "TrainBatch",
    "TrainState",
    "abstract_train_state",
    "batch_shardings",
    "check_batch",
    "create_train_state",
    "init_train_state",
    "make_train_step",
    "shard_batch",
    "step_config",
    "token_mask",
    "train_state_shardings",
    "train_step",
    "whole_params",
    "with_advantages",
]
