"""The Qwen3-MoE-family policy model: config, Flax NNX modules, routing capture/replay, decoding."""

from sat_jax.model.config import PRESETS, LoRAConfig, ModelConfig
from sat_jax.model.transformer import (
    DecodeOutput,
    KVCache,
    ModelOutput,
    PrefillOutput,
    Transformer,
    router_shift_counts,
    router_shift_from_counts,
    router_shift_ratio,
    token_logprobs,
)

__all__ = [
    "PRESETS",
    "DecodeOutput",
    "KVCache",
    "LoRAConfig",
    "ModelConfig",
    "ModelOutput",
    "PrefillOutput",
    "Transformer",
    "router_shift_counts",
    "router_shift_from_counts",
    "router_shift_ratio",
    "token_logprobs",
]
