"""Built-in tasks: a character tokenizer, the arithmetic task, rewards and grain prompt pipelines.

Shared by the rollout server and the trainer; nothing here imports grpc or jetstream.
"""

from sat_jax.tasks.arithmetic import ArithmeticTask, Prompt
from sat_jax.tasks.pipeline import (
    arithmetic_dataset,
    arithmetic_task,
    file_dataset,
    prompt_dataset,
)
from sat_jax.tasks.rewards import exact_match_reward, make_reward, math_reward
from sat_jax.tasks.tokenizer import CharTokenizer

__all__ = [
    "ArithmeticTask",
    "CharTokenizer",
    "Prompt",
    "arithmetic_dataset",
    "arithmetic_task",
    "exact_match_reward",
    "file_dataset",
    "make_reward",
    "math_reward",
    "prompt_dataset",
]
