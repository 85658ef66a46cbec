"""The Qwen3-MoE-family policy model: config, Flax NNX modules, routing capture/replay, decoding."""

from sat_jax.model.config import PRESETS, LoRAConfig, ModelConfig
from sat_jax.model.kv_cache import DecodeOutput, KVCache, PrefillOutput
from sat_jax.model.logprobs import format_allowed, token_logprobs
from sat_jax.model.router_shift import (
    router_shift_counts,
    router_shift_from_counts,
    router_shift_ratio,
)
from sat_jax.model.transformer import ModelOutput, Transformer, empty_cache

__all__ = [
    "PRESETS",
    "DecodeOutput",
    "KVCache",
    "LoRAConfig",
    "ModelConfig",
    "ModelOutput",
    "PrefillOutput",
    "Transformer",
    "empty_cache",
    "format_allowed",
    "router_shift_counts",
    "router_shift_from_counts",
    "router_shift_ratio",
    "token_logprobs",
]
