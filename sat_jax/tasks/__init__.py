"""Built-in tasks: the prompt record, tokenizers (character and Hugging Face), the arithmetic task,
rewards and grain prompt pipelines.

Shared by the rollout server and the trainer; nothing here imports grpc or jetstream.
"""

from sat_jax.tasks.arithmetic import ArithmeticTask
from sat_jax.tasks.config import TaskConfig
from sat_jax.tasks.pipeline import (
    arithmetic_dataset,
    arithmetic_task,
    file_dataset,
    prompt_dataset,
    prompt_source,
    read_prompts,
)
from sat_jax.tasks.prompt import Prompt
from sat_jax.tasks.rewards import exact_match_reward, gsm8k_reward, make_reward, math_reward
from sat_jax.tasks.tokenizer import CharTokenizer, Tokenizer, sampleable_mask

__all__ = [
    "ArithmeticTask",
    "CharTokenizer",
    "Prompt",
    "TaskConfig",
    "Tokenizer",
    "arithmetic_dataset",
    "arithmetic_task",
    "exact_match_reward",
    "file_dataset",
    "gsm8k_reward",
    "make_reward",
    "math_reward",
    "prompt_dataset",
    "prompt_source",
    "read_prompts",
    "sampleable_mask",
]
