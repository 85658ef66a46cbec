"""Pulled trajectory groups → one fixed-shape ``TrainBatch``, with lag tagging and the staleness policy.

Lag of a completion token = trainer version − the version of the weights that generated it
(docs/DESIGN.md §2). A group whose oldest token lags more than ``max_staleness`` versions is dropped or kept
by ``stale_policy``; either way it is counted. A group holding a token older than ``min_version``
(weights this trainer never published, e.g. a server's random initial weights) is always dropped.

Every batch has the same shape ``[rows, seq_len]`` with ``rows = batch_groups · group_size`` and
``seq_len`` = longest prompt + longest completion, so the jitted step compiles once; missing rows
(dropped groups) are padding with an all-zero loss mask.

Alignment follows ``sat_jax.train_step``: per-token arrays are indexed at the TARGET token, so the
completion token at position t has ``loss_mask[b, t] = 1`` and its ``behavior_logp[b, t]``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from rollout_server.client import routing_array
from rollout_server.proto import rollout_pb2
from sat_jax.advantages import group_advantages
from sat_jax.train_step import TrainBatch

# Lag histogram bins 0, 1, ..., LAG_BINS - 2 and a last bin for everything older.
LAG_BINS = 9


@dataclasses.dataclass(frozen=True, kw_only=True)
class BatchSpec:
    """The fixed shape of every batch and how groups become rows.

    Attributes:
      batch_groups: groups per batch.
      group_size: trajectories per group.
      seq_len: T, tokens per row (prompt + completion + padding).
      routing_lk: (L, K) of the recorded routing ids, or None to carry no routing.
      routing_dtype: "uint8" (≤ 256 experts) or "uint16"; fixed so the step compiles once.
      max_staleness: the largest lag a kept group may have under the "drop" policy.
      stale_policy: "drop" or "keep".
      estimator, normalize_std: ``group_advantages`` options.
    """

    batch_groups: int
    group_size: int
    seq_len: int
    routing_lk: tuple[int, int] | None
    max_staleness: int
    routing_dtype: str = "uint8"
    stale_policy: str = "drop"
    estimator: str = "grpo"
    normalize_std: bool = True

    @property
    def rows(self) -> int:
        return self.batch_groups * self.group_size


@dataclasses.dataclass(frozen=True, kw_only=True)
class BatchStats:
    """Host-side facts about one assembled batch (lags over the trained completion tokens).

    Attributes:
      groups: groups in the batch; stale_dropped: groups dropped for staleness (incl. pre-sync);
      stale_kept: groups over ``max_staleness`` kept by the "keep" policy.
      lags: int [N] lag of every trained completion token (for the histogram).
      lag_hist: int [LAG_BINS] counts of lag 0, 1, ..., and ≥ LAG_BINS − 1.
      reward_mean, response_len_mean: over the trained trajectories (0 when none).
      tokens: trained completion tokens; prompt_ids: the trained groups' stable prompt ids.
    """

    groups: int
    stale_dropped: int
    stale_kept: int
    lags: np.ndarray
    lag_hist: np.ndarray
    reward_mean: float
    response_len_mean: float
    tokens: int
    prompt_ids: tuple[str, ...]

    @property
    def lag_mean(self) -> float:
        return float(self.lags.mean()) if self.lags.size else 0.0

    @property
    def lag_max(self) -> int:
        return int(self.lags.max()) if self.lags.size else 0


def group_lag(group: rollout_pb2.Group, trainer_version: int) -> int:
    """The largest token lag of a group (0 for a group without completion tokens)."""
    versions = [v for t in group.trajectories for v in t.versions]
    return trainer_version - min(versions) if versions else 0


def select_groups(
    groups: Sequence[rollout_pb2.Group], spec: BatchSpec, trainer_version: int, min_version: int
) -> tuple[list[rollout_pb2.Group], int, int]:
    """Applies the staleness policy: ``(kept groups, stale_dropped, stale_kept)``."""
    kept, dropped, stale_kept = [], 0, 0
    for group in groups:
        versions = [v for t in group.trajectories for v in t.versions]
        if versions and min(versions) < min_version:
            dropped += 1
        elif group_lag(group, trainer_version) > spec.max_staleness:
            if spec.stale_policy == "drop":
                dropped += 1
            else:
                kept.append(group)
                stale_kept += 1
        else:
            kept.append(group)
    return kept, dropped, stale_kept


def assemble_batch(
    groups: Sequence[rollout_pb2.Group],
    spec: BatchSpec,
    *,
    trainer_version: int,
    min_version: int = 0,
) -> tuple[TrainBatch, BatchStats]:
    """Builds the padded ``TrainBatch`` (NumPy arrays) of the groups the staleness policy keeps.

    Args:
      groups: pulled groups, at most ``spec.batch_groups`` of ``spec.group_size`` trajectories.
      spec: the batch shape and policies.
      trainer_version: version of the weights being trained.
      min_version: tokens of older versions are from weights this trainer never had: dropped.

    Returns:
      ``(batch, stats)``: tokens [R, T] int32, loss_mask / behavior_logp / advantages [R, T]
      float32, routing [R, T, L, K] (when ``spec.routing_lk``); rows past the kept trajectories
      are padding (mask 0).

    Raises:
      ValueError: too many groups, a group of the wrong size, or a trajectory longer than
        ``seq_len`` or with mismatched per-token fields.
    """
    if len(groups) > spec.batch_groups:
        raise ValueError(f"{len(groups)} groups for a batch of {spec.batch_groups}")
    kept, dropped, stale_kept = select_groups(groups, spec, trainer_version, min_version)
    R, T = spec.rows, spec.seq_len
    tokens = np.zeros((R, T), np.int32)
    mask = np.zeros((R, T), np.float32)
    behavior = np.zeros((R, T), np.float32)
    lag_bt = np.zeros((R, T), np.int64)
    routing = None
    if spec.routing_lk is not None:
        L, K = spec.routing_lk
        # Padding positions replay a valid, duplicate-free expert set; they are masked anyway.
        routing = np.broadcast_to(np.arange(K, dtype=np.uint16), (R, T, L, K)).copy()
    rewards = np.zeros(R, np.float32)
    group_ids = np.zeros(R, np.int32)
    active = np.zeros(R, bool)
    lengths = []
    for g, group in enumerate(kept):
        if len(group.trajectories) != spec.group_size:
            raise ValueError(
                f"group {group.group_id} has {len(group.trajectories)} trajectories, "
                f"expected {spec.group_size}"
            )
        for i, traj in enumerate(group.trajectories):
            row = g * spec.group_size + i
            _fill_row(row, traj, spec, tokens, mask, behavior, lag_bt, routing, trainer_version)
            rewards[row], group_ids[row], active[row] = traj.reward, g, True
            lengths.append(len(traj.completion_ids))
    per_row = np.asarray(
        group_advantages(
            rewards,
            group_ids,
            num_groups=spec.batch_groups,
            estimator=spec.estimator,
            normalize_std=spec.normalize_std,
            where=active,
        )
    )
    batch = TrainBatch(
        tokens=tokens,
        loss_mask=mask,
        behavior_logp=behavior,
        advantages=(per_row[:, None] * mask).astype(np.float32),
        routing=None if routing is None else routing.astype(spec.routing_dtype),
    )
    lags = lag_bt[mask > 0]
    stats = BatchStats(
        groups=len(kept),
        stale_dropped=dropped,
        stale_kept=stale_kept,
        lags=lags,
        lag_hist=np.bincount(np.clip(lags, 0, LAG_BINS - 1), minlength=LAG_BINS),
        reward_mean=float(rewards[active].mean()) if active.any() else 0.0,
        response_len_mean=float(np.mean(lengths)) if lengths else 0.0,
        tokens=int(mask.sum()),
        prompt_ids=tuple(g.prompt_id for g in kept),
    )
    return batch, stats


def _fill_row(
    row: int,
    traj: rollout_pb2.Trajectory,
    spec: BatchSpec,
    tokens: np.ndarray,
    mask: np.ndarray,
    behavior: np.ndarray,
    lag_bt: np.ndarray,
    routing: np.ndarray | None,
    trainer_version: int,
) -> None:
    p, c = len(traj.prompt_ids), len(traj.completion_ids)
    if p + c > spec.seq_len:
        raise ValueError(f"trajectory of {p} + {c} tokens exceeds seq_len {spec.seq_len}")
    if len(traj.behavior_logprobs) != c or len(traj.versions) != c:
        raise ValueError(
            f"trajectory has {c} completion tokens but {len(traj.behavior_logprobs)} log-probs "
            f"and {len(traj.versions)} versions"
        )
    tokens[row, :p] = traj.prompt_ids
    tokens[row, p : p + c] = traj.completion_ids
    mask[row, p : p + c] = 1.0
    behavior[row, p : p + c] = traj.behavior_logprobs
    lag_bt[row, p : p + c] = trainer_version - np.asarray(traj.versions, np.int64)
    if routing is not None:
        ids = routing_array(traj)
        if ids.shape[1:] != routing.shape[2:] or ids.shape[0] > spec.seq_len:
            raise ValueError(
                f"routing shape {ids.shape} does not fit [T, L, K] = {routing.shape[1:]}"
            )
        routing[row, : ids.shape[0]] = ids
