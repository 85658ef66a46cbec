"""The next batch: pull groups until a batch's worth pass the staleness policy, assemble it, and,
with several JAX processes, broadcast it from process 0 (the only one that talks to the servers)
to every process.

Broadcast (``broadcast_pulled``): the batch's arrays and the per-token lags go as one pytree of
fixed-shape arrays (``multihost_utils.broadcast_one_to_all``); the small rest (counters, reward
and length means, prompt ids) as JSON bytes, padded to a power of two so that only a few shapes
ever compile. Every process then holds the same ``PulledBatch``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from train import batching, checkpointing
from train.remote import ServerPool

log = logging.getLogger("train")

_MIN_BLOB = 1024  # bytes; the JSON part is padded to max(this, the next power of two)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PulledBatch:
    """One assembled batch and what the loop records about it.

    Attributes:
      batch: the ``TrainBatch`` as NumPy arrays (``batching.assemble_batch``).
      stats: its ``BatchStats``.
      dropped: groups pulled for it but dropped by the staleness policy.
      duplicates: groups pulled for it but skipped as already trained.
    """

    batch: Any
    stats: batching.BatchStats
    dropped: int
    duplicates: int


def pull_batch(
    pool: ServerPool,
    spec: batching.BatchSpec,
    progress: checkpointing.Progress,
    *,
    timeout_s: float,
    stall_s: float,
) -> tuple[list[Any], int, int]:
    """Pulls until ``spec.batch_groups`` groups pass the staleness policy and were not trained
    before; returns ``(groups, stale_dropped, duplicates)``.

    Raises:
      RuntimeError: the servers answered but sent no group for ``stall_s`` seconds.
    """
    seen = set(progress.recent_prompt_ids)
    kept: list[Any] = []
    dropped = duplicates = 0
    last_group = time.monotonic()
    while len(kept) < spec.batch_groups:
        pulled = pool.pull(spec.batch_groups - len(kept), timeout_s)
        fresh = [g for g in pulled if g.prompt_id not in seen]
        duplicates += len(pulled) - len(fresh)
        ok, n_dropped, _ = batching.select_groups(
            fresh, spec, progress.version, progress.min_version
        )
        kept += ok
        dropped += n_dropped
        if pulled:
            last_group = time.monotonic()
            continue
        log.info("waiting for rollout groups (%d of %d)", len(kept), spec.batch_groups)
        if time.monotonic() - last_group > stall_s:
            raise RuntimeError(
                f"no rollout group for {stall_s:.0f}s although the servers answer: is their "
                "admission closed (a server of another run, or weights never pushed)?"
            )
    return kept, dropped, duplicates


def next_batch(
    pool: ServerPool | None,
    spec: batching.BatchSpec,
    progress: checkpointing.Progress,
    *,
    timeout_s: float,
    stall_s: float,
) -> PulledBatch:
    """Pulls and assembles the next batch on process 0 and gives it to every process.

    Args:
      pool: the servers on process 0; None on every other process.
      spec: the batch shape and staleness policy.
      progress: the trainer version, ``min_version`` and recently trained prompt ids.
      timeout_s, stall_s: as in ``pull_batch``.

    Returns:
      The same ``PulledBatch`` on every process.

    Raises:
      ValueError: ``pool`` is given on a process other than 0, or missing on process 0.
      RuntimeError: from ``pull_batch``.
    """
    if (pool is not None) != (jax.process_index() == 0):
        raise ValueError(
            f"process {jax.process_index()}: only process 0 pulls (pool given: {pool is not None})"
        )
    pulled = None
    if pool is not None:
        groups, dropped, duplicates = pull_batch(
            pool, spec, progress, timeout_s=timeout_s, stall_s=stall_s
        )
        batch, stats = batching.assemble_batch(
            groups, spec, trainer_version=progress.version, min_version=progress.min_version
        )
        pulled = PulledBatch(batch=batch, stats=stats, dropped=dropped, duplicates=duplicates)
    if jax.process_count() == 1:
        return pulled
    return broadcast_pulled(pulled, spec)


def broadcast_pulled(pulled: PulledBatch | None, spec: batching.BatchSpec) -> PulledBatch:
    """Process 0's ``pulled`` on every process (a collective: every process calls it, process 0
    with its batch, the others with None)."""
    source = jax.process_index() == 0
    if source:
        lag_bt = np.zeros(pulled.batch.tokens.shape, np.int32)
        lag_bt[pulled.batch.loss_mask > 0] = pulled.stats.lags
        arrays = (pulled.batch, lag_bt)
        s = pulled.stats
        meta = {
            "groups": s.groups,
            "stale_dropped": s.stale_dropped,
            "stale_kept": s.stale_kept,
            "reward_mean": s.reward_mean,
            "response_len_mean": s.response_len_mean,
            "tokens": s.tokens,
            "prompt_ids": list(s.prompt_ids),
            "dropped": pulled.dropped,
            "duplicates": pulled.duplicates,
        }
        blob = json.dumps(meta).encode()
    else:  # shapes and dtypes only: an empty batch of the same spec
        empty, _ = batching.assemble_batch([], spec, trainer_version=0)
        arrays = (empty, np.zeros(empty.tokens.shape, np.int32))
        blob = b""
    batch, lag_bt = multihost_utils.broadcast_one_to_all(arrays, is_source=source)
    meta = json.loads(broadcast_bytes(blob, is_source=source))
    lags = lag_bt[batch.loss_mask > 0].astype(np.int64)
    stats = batching.BatchStats(
        groups=meta["groups"],
        stale_dropped=meta["stale_dropped"],
        stale_kept=meta["stale_kept"],
        lags=lags,
        lag_hist=np.bincount(np.clip(lags, 0, batching.LAG_BINS - 1), minlength=batching.LAG_BINS),
        reward_mean=meta["reward_mean"],
        response_len_mean=meta["response_len_mean"],
        tokens=meta["tokens"],
        prompt_ids=tuple(meta["prompt_ids"]),
    )
    return PulledBatch(
        batch=batch, stats=stats, dropped=meta["dropped"], duplicates=meta["duplicates"]
    )


def broadcast_bytes(data: bytes, *, is_source: bool) -> bytes:
    """``data`` of the source process on every process (the others pass anything, e.g. b"")."""
    size = multihost_utils.broadcast_one_to_all(np.int32(len(data)), is_source=is_source)
    capacity = max(_MIN_BLOB, 1 << (int(size) - 1).bit_length())
    buffer = np.zeros(capacity, np.uint8)
    if is_source:
        buffer[: len(data)] = np.frombuffer(data, np.uint8)
    buffer = multihost_utils.broadcast_one_to_all(buffer, is_source=is_source)
    return buffer[: int(size)].tobytes()
