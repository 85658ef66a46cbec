"""The trainer's optimizer (docs/DESIGN.md §7, §11): global-norm clipping → AdamW with the
configured learning-rate schedule, its state in float32 whatever the parameter dtype.

    optimizer = make_optimizer(cfg.train)

`float32_state` wraps a transformation so its state (Adam's m and v) and its updates are float32:
bfloat16 master weights keep full-precision moments, and `optax.apply_updates` casts the sum back
to the parameter dtype. For float32 params it changes nothing.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from sat_jax.experiment import TrainConfig


def _to_float32(tree: Any) -> Any:
    return jax.tree.map(
        lambda x: x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree
    )


def float32_state(inner: optax.GradientTransformation) -> optax.GradientTransformation:
    """`inner` run on float32 copies of its inputs: its state and updates are float32."""

    def init(params: Any) -> Any:
        return inner.init(_to_float32(params))

    def update(updates: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
        return inner.update(
            _to_float32(updates), state, None if params is None else _to_float32(params)
        )

    return optax.GradientTransformation(init, update)


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    """Global-norm clipping → AdamW (β₂ = 0.98 by default) with the configured LR schedule; Adam's
    moments are float32 (`float32_state`)."""
    decay_steps = max(cfg.steps - cfg.lr_warmup_steps, 1)
    peak = cfg.learning_rate
    decay = {
        "constant": optax.constant_schedule(peak),
        "cosine": optax.cosine_decay_schedule(peak, decay_steps),
        "linear": optax.linear_schedule(peak, 0.0, decay_steps),
    }[cfg.lr_schedule]
    schedule = (
        optax.join_schedules(
            [optax.linear_schedule(0.0, peak, cfg.lr_warmup_steps), decay], [cfg.lr_warmup_steps]
        )
        if cfg.lr_warmup_steps
        else decay
    )
    adamw = float32_state(
        optax.adamw(schedule, b1=cfg.adam_b1, b2=cfg.adam_b2, weight_decay=cfg.weight_decay)
    )
    return optax.chain(optax.clip_by_global_norm(cfg.grad_clip), adamw) if cfg.grad_clip else adamw
