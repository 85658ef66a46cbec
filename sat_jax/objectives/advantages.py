"""Group-relative advantages (GRPO and Dr.GRPO) from per-response rewards.

Each prompt is sampled G times; the G responses form a group with a shared ``group_id``. GRPO's
advantage of response i in group g is (R_i − mean_g) / (std_g + eps) (std normalization optional);
Dr.GRPO (Liu et al., 2025, "Understanding R1-Zero-Like Training") drops the std division and keeps
only the centering. Groups whose rewards are all equal get advantage 0 — no NaN, whatever the
normalization. Shapes: ``N`` responses; ``num_groups`` static.

``group_advantages`` is jittable (the train step computes a batch's advantages inside its jitted
step from per-row rewards and group ids, docs/DESIGN.md §7.1). Group ids outside
``[0, num_groups)`` cannot be detected under ``jit``: ``check_group_ids`` checks them on the host,
and ``group_advantages`` runs it itself when it is given concrete (not traced) ids.
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

AdvantageEstimator = Literal["grpo", "dr_grpo"]


def group_advantages(
    rewards: ArrayLike,
    group_ids: ArrayLike,
    *,
    num_groups: int,
    estimator: AdvantageEstimator = "grpo",
    normalize_std: bool = True,
    eps: float = 1e-6,
    where: ArrayLike | None = None,
    baseline: ArrayLike | None = None,
    weights: ArrayLike | None = None,
) -> jax.Array:
    """Per-response group-relative advantages.

    Args:
      rewards: float [N].
      group_ids: int [N] in [0, num_groups); responses of one prompt share an id.
      num_groups: static number of groups; concrete ids outside ``[0, num_groups)`` raise
        (``check_group_ids``), traced ones are not checked.
      estimator: ``"grpo"`` (centered, divided by the group std when ``normalize_std``) or
        ``"dr_grpo"`` (centered only; ``normalize_std`` is ignored).
      normalize_std: GRPO's division by the group's sample standard deviation (ddof = 1).
      eps: added to the std before dividing.
      where: optional [N] mask; inactive responses (padding) neither enter group statistics nor
        get an advantage (0).
      baseline: optional float [N], what each response's reward is centered on instead of its
        group's mean (VCPO's off-policy optimal baseline, ``opob_baselines``; docs/DESIGN.md
        §3.6): A_i = (R_i − baseline_i) / (std_g + eps), the std still the group's own. A group
        whose rewards are all equal keeps advantage 0.
      weights: optional float [N] > 0, each response's weight in its group's count, mean and
        variance (a forked session's k segments weigh 1/k each and share its reward: the
        statistics are over sessions, docs/DESIGN.md §6.6); None = 1 each.

    Returns:
      float32 [N] advantages; 0 for inactive responses, single-response groups and groups whose
      rewards are all equal.
    """
    if estimator not in ("grpo", "dr_grpo"):
        raise ValueError(
            f"group_advantages: estimator must be 'grpo' or 'dr_grpo', got {estimator!r}"
        )
    if eps < 0:
        raise ValueError(f"group_advantages: eps must be >= 0, got {eps}")
    if num_groups < 1:
        raise ValueError(f"group_advantages: num_groups must be >= 1, got {num_groups}")
    rewards = jnp.asarray(rewards, jnp.float32)
    group_ids = jnp.asarray(group_ids, jnp.int32)
    if rewards.ndim != 1 or rewards.shape != group_ids.shape:
        raise ValueError(
            f"group_advantages: rewards and group_ids must both be [N], got {rewards.shape} and "
            f"{group_ids.shape}"
        )
    if not isinstance(group_ids, jax.core.Tracer):
        check_group_ids(group_ids, num_groups)
    active = jnp.ones(rewards.shape, bool) if where is None else jnp.asarray(where) > 0
    rewards = jnp.where(active, rewards, 0.0)

    def per_group_sum(x):
        return jax.ops.segment_sum(x, group_ids, num_segments=num_groups)

    if weights is None:
        weight = None
        count = per_group_sum(active.astype(jnp.float32))
        mean = per_group_sum(rewards) / jnp.maximum(count, 1.0)
    else:
        weight = jnp.where(active, jnp.asarray(weights, jnp.float32), 0.0)
        count = per_group_sum(weight)
        mean = per_group_sum(weight * rewards) / jnp.maximum(count, 1e-9)
    centered = jnp.where(active, rewards - mean[group_ids], 0.0)
    shifted = centered
    if baseline is not None:
        if jnp.shape(baseline) != rewards.shape:
            raise ValueError(
                f"group_advantages: baseline must be [N] like rewards {rewards.shape}, got "
                f"{jnp.shape(baseline)}"
            )
        shifted = jnp.where(active, rewards - jnp.asarray(baseline, jnp.float32), 0.0)
    if estimator == "dr_grpo" or not normalize_std:
        return shifted
    squares = jnp.square(centered) if weight is None else weight * jnp.square(centered)
    var = per_group_sum(squares) / jnp.maximum(count - 1.0, 1.0)
    std = jnp.sqrt(var)[group_ids]
    # A constant group has std == 0 (and centered == 0): its advantage is 0 even when eps == 0.
    normalized = shifted / jnp.where(std > 0, std + eps, 1.0)
    # A group of one response (one session, however many segments) has no spread: 0.
    return jnp.where(active & (count[group_ids] > 1 + 1e-6), normalized, 0.0)


def check_group_ids(group_ids: ArrayLike, num_groups: int) -> None:
    """Host-side range check of concrete group ids (``jit`` cannot raise on values).

    Args:
      group_ids: int [N], concrete (NumPy or a ``jax.Array`` outside ``jit``).
      num_groups: the number of groups.

    Raises:
      ValueError: an id outside ``[0, num_groups)``, naming the range found.
    """
    host_ids = np.asarray(group_ids)
    if host_ids.size:
        low, high = int(host_ids.min()), int(host_ids.max())
        if low < 0 or high >= num_groups:
            raise ValueError(
                f"group_advantages: group_ids must lie in [0, {num_groups}), got [{low}, {high}]"
            )
