"""Environments for multi-turn, tool-using episodes (`task.env`, `task.max_turns`).

The interface (base.py): `reset(prompt) -> messages`, `step(assistant_text) -> Step(observations,
reward, done)`, one instance per episode. `Episode` (episode.py) drives one and enforces the
limits; `EpisodeRunner` (runner.py) renders episodes as token ids for a decoder;
`load_environment` (registry.py) resolves `task.env`. Shipped: `single_turn` (the
default), `feedback` and `calculator`. Pure Python: no server, model or grpc dependency.
"""

from sat_jax.tasks.envs.base import EnvConfig, Environment, Message, SingleTurn, Step
from sat_jax.tasks.envs.calculator import CALCULATOR_TOOL, Calculator
from sat_jax.tasks.envs.episode import EnvError, Episode
from sat_jax.tasks.envs.expression import CalculatorError, calculate, evaluate
from sat_jax.tasks.envs.feedback import RETRY_MESSAGE, Feedback
from sat_jax.tasks.envs.registry import SHIPPED, check_env_name, load_environment
from sat_jax.tasks.envs.runner import EpisodeRunner

__all__ = [
    "CALCULATOR_TOOL",
    "RETRY_MESSAGE",
    "SHIPPED",
    "Calculator",
    "CalculatorError",
    "EnvConfig",
    "EnvError",
    "Environment",
    "Episode",
    "EpisodeRunner",
    "Feedback",
    "Message",
    "SingleTurn",
    "Step",
    "calculate",
    "check_env_name",
    "evaluate",
    "load_environment",
]
