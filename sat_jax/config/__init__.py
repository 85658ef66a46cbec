"""The experiment's config sections and their generic loader (docs/DESIGN.md §8).

``sat_jax.experiment`` composes the sections into ``ExperimentConfig`` and loads it.
"""

from sat_jax.config.loader import ConfigError, build, coerce, read_overrides
from sat_jax.config.rollout import RolloutConfig
from sat_jax.config.server import ServerConfig
from sat_jax.config.train import (
    CheckpointConfig,
    ClientConfig,
    Connection,
    EvalConfig,
    TrainConfig,
    WarmupConfig,
)

__all__ = [
    "CheckpointConfig",
    "ClientConfig",
    "ConfigError",
    "Connection",
    "EvalConfig",
    "RolloutConfig",
    "ServerConfig",
    "TrainConfig",
    "WarmupConfig",
    "build",
    "coerce",
    "read_overrides",
]
