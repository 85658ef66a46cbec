"""The trainer's optimizer (docs/DESIGN.md §7, §11): global-norm clipping → AdamW with the
configured learning-rate schedule, its state in float32 whatever the parameter dtype.

    optimizer = cfg.train.optimizer.make(cfg.train.steps)

`OptimizerConfig` is the `train.optimizer.*` section of the experiment config (docs/DESIGN.md §8).

`float32_state` wraps a transformation so its state (Adam's m and v) and its updates are float32:
bfloat16 master weights keep full-precision moments, and `optax.apply_updates` casts the sum back
to the parameter dtype. For float32 params it changes nothing.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax

LR_SCHEDULES = ("constant", "cosine", "linear")


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    """Global-norm clipping → AdamW with a learning-rate schedule.

    The `train.optimizer.*` keys; the run's length comes from `train.steps` when it is built
    (`make(num_steps)`).

    Attributes:
      learning_rate: the peak rate.
      lr_schedule: "constant", or "cosine" | "linear" decay to 0 over the run's updates −
        `lr_warmup_steps`.
      lr_warmup_steps: linear warm-up from 0 over this many updates (0 = none).
      adam_b1, adam_b2, weight_decay: AdamW's.
      grad_clip: global-norm clipping threshold (0 = off).
    """

    learning_rate: float = 1e-4
    lr_schedule: str = "constant"
    lr_warmup_steps: int = 0
    adam_b1: float = 0.9
    adam_b2: float = 0.98
    weight_decay: float = 0.0
    grad_clip: float = 1.0

    def __post_init__(self) -> None:
        if self.lr_schedule not in LR_SCHEDULES:
            raise ValueError(f"lr_schedule must be one of {LR_SCHEDULES}, got {self.lr_schedule!r}")
        if self.lr_warmup_steps < 0:
            raise ValueError(f"lr_warmup_steps must be >= 0, got {self.lr_warmup_steps}")
        if not self.learning_rate > 0:
            raise ValueError(f"learning_rate must be > 0, got {self.learning_rate}")
        if not (0 <= self.adam_b1 < 1 and 0 <= self.adam_b2 < 1):
            raise ValueError("adam_b1 and adam_b2 must be in [0, 1)")
        if self.weight_decay < 0 or self.grad_clip < 0:
            raise ValueError("weight_decay and grad_clip must be >= 0")

    def schedule(self, num_steps: int) -> optax.Schedule:
        """The learning rate per update of a run of `num_steps` updates: linear warm-up from 0,
        then the decay."""
        if num_steps <= 0:
            raise ValueError(f"num_steps must be positive, got {num_steps}")
        decay_steps = max(num_steps - self.lr_warmup_steps, 1)
        peak = self.learning_rate
        decay = {
            "constant": optax.constant_schedule(peak),
            "cosine": optax.cosine_decay_schedule(peak, decay_steps),
            "linear": optax.linear_schedule(peak, 0.0, decay_steps),
        }[self.lr_schedule]
        if not self.lr_warmup_steps:
            return decay
        warmup = optax.linear_schedule(0.0, peak, self.lr_warmup_steps)
        return optax.join_schedules([warmup, decay], [self.lr_warmup_steps])

    def make(self, num_steps: int) -> optax.GradientTransformation:
        """Global-norm clipping → AdamW with `schedule(num_steps)`; Adam's moments are float32
        (`float32_state`)."""
        adamw = float32_state(
            optax.adamw(
                self.schedule(num_steps),
                b1=self.adam_b1,
                b2=self.adam_b2,
                weight_decay=self.weight_decay,
            )
        )
        if not self.grad_clip:
            return adamw
        return optax.chain(optax.clip_by_global_norm(self.grad_clip), adamw)


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
