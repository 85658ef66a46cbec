"""Temperature / top-k / top-p sampling that also returns the log-prob of what it sampled.

The log-prob is taken under the exact distribution the token was drawn from: logits / temperature,
truncated to the top-k tokens and then to the smallest top-p nucleus, renormalized. That is the
behavior policy μ of docs/DESIGN.md §2 (with top_p = 1 and top_k = 0 it is
log_softmax(logits / T)).

Dimension letters: B rows (slots), V vocab.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from sat_jax.experiment import RolloutConfig


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingConfig:
    """temperature > 0; top_k = 0 and top_p = 1 disable truncation."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    @classmethod
    def from_rollout(cls, cfg: RolloutConfig) -> SamplingConfig:
        """The sampler of an experiment's `RolloutConfig` (where its defaults live)."""
        return cls(temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p)

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


def sampling_logprobs(logits_bv: jax.Array, cfg: SamplingConfig) -> jax.Array:
    """[B, V] float32 log-probs of the sampling distribution (-inf outside the kept set)."""
    x_bv = logits_bv.astype(jnp.float32) / cfg.temperature
    vocab = x_bv.shape[-1]
    if 0 < cfg.top_k < vocab:
        kth_b1 = jax.lax.top_k(x_bv, cfg.top_k)[0][:, -1:]
        x_bv = jnp.where(x_bv < kth_b1, -jnp.inf, x_bv)
    if cfg.top_p < 1.0:
        sorted_bv = jnp.sort(x_bv, axis=-1)[:, ::-1]
        probs_bv = jax.nn.softmax(sorted_bv, axis=-1)
        mass_before_bv = jnp.cumsum(probs_bv, axis=-1) - probs_bv
        # Keep the smallest prefix whose mass reaches top_p: a token stays while the mass strictly
        # before it is below top_p (the most likely token always stays).
        keep_bv = mass_before_bv < cfg.top_p
        threshold_b1 = jnp.min(jnp.where(keep_bv, sorted_bv, jnp.inf), axis=-1, keepdims=True)
        x_bv = jnp.where(x_bv < threshold_b1, -jnp.inf, x_bv)
    return jax.nn.log_softmax(x_bv, axis=-1)


def sample(
    logits_bv: jax.Array, key: jax.Array, cfg: SamplingConfig
) -> tuple[jax.Array, jax.Array]:
    """Draws one token per row; returns (tokens [B] int32, their log-probs [B] float32)."""
    logp_bv = sampling_logprobs(logits_bv, cfg)
    tokens_b = jax.random.categorical(key, logp_bv, axis=-1).astype(jnp.int32)
    return tokens_b, jnp.take_along_axis(logp_bv, tokens_b[:, None], axis=-1)[:, 0]
