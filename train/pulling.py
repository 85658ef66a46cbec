"""The next batch (docs/DESIGN.md §7.1, steps 1 to 4): pull groups until a batch's worth
pass the staleness policy, assemble them, and, with several JAX processes, broadcast the batch from
process 0 (the only one that talks to the servers) to every process.

Pulled groups are ``rollout_api.records`` (``ServerPool.pull`` decodes and validates them once),
tracked by their ``key``.

Broadcast (``broadcast_pulled``, docs/DESIGN.md §7.1 step 4, §7.3): the batch's length bucket T
first; the other processes fill ``batching.empty_batch`` of that bucket (shapes from the spec and
T alone), and the batch's arrays and the flat lags of its trained tokens, padded to R · T, travel
as one pytree (``multihost_utils.broadcast_one_to_all``); the rest of the ``BatchStats`` as its
JSON (``BatchStats.to_json``), padded to a power of two so that only a few shapes ever compile.
Every process then holds the same ``PulledBatch``.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import jax
import numpy as np
from jax.experimental import multihost_utils

from rollout_api.records import Group, InvalidGroup
from sat_jax.step import TrainBatch
from train import batching, checkpointing
from train.remote import ServerPool

log = logging.getLogger("train")

_MIN_BLOB = 1024  # bytes; the JSON part is padded to max(this, the next power of two)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PulledBatch:
    """One assembled batch and what the loop records about it.

    Attributes:
      batch: the ``TrainBatch`` as NumPy arrays (``batching.assemble_batch``).
      stats: its ``BatchStats``, including how many pulled groups were dropped as stale or
        skipped as duplicates.
      pulled: every group pulled for it, to acknowledge once it is trained (process 0 only;
        empty on the others).
    """

    batch: TrainBatch
    stats: batching.BatchStats
    pulled: tuple[Group | InvalidGroup, ...] = ()


def pull_batch(
    pool: ServerPool,
    spec: batching.BatchSpec,
    progress: checkpointing.Progress,
    *,
    timeout_s: float,
    stall_s: float,
) -> batching.Selection:
    """Pulls until ``spec.batch_groups`` groups pass ``batching.select_groups`` (the staleness
    policy, the duplicate check and, with ``spec.filter_groups``, the all-equal-rewards filter);
    returns them with the counts of the rest.

    Dynamic sampling: a filtered group is rejected to its server at once, like a stale one, so
    the server generates a replacement, and the loop pulls on. At most ``spec.filter_budget``
    (``filter_max_rounds · batch_groups``) groups are filtered per batch; past that the rest of
    the batch is filled without the filter (logged as a warning), so a run whose groups all have
    equal rewards behaves as with the filter off instead of pulling forever.

    Args:
      pool: the servers.
      spec: the batch shape and staleness policy.
      progress: the trainer version, ``min_version`` and recently trained prompt ids.
      timeout_s: how long one pull may wait for groups.
      stall_s: how long the servers may answer without sending a group.

    Raises:
      RuntimeError: the servers answered but sent no group for ``stall_s`` seconds.
    """
    seen_groups = set(progress.recent_group_keys)
    selection = batching.Selection.empty()
    last_group = time.monotonic()
    filter_off = spec.filter_groups == "none"
    while len(selection.kept) < spec.batch_groups:
        pulled = pool.pull(
            spec.batch_groups - len(selection.kept),
            timeout_s,
            limits=spec.limits,
            trainer_version=progress.version,
        )
        chosen = batching.select_groups(
            pulled,
            spec,
            trainer_version=progress.version,
            min_version=progress.min_version,
            seen_groups=seen_groups,
            filter_budget=spec.filter_budget - selection.filtered,
        )
        # Groups that will never be trained (stale, duplicate, invalid, filtered) are rejected at
        # once (with the next Pull): a leased group holds a place in the server's admission budget,
        # so holding these until the step would starve the batch of the groups it waits for, and
        # a rejected one leaves the budget, so the server generates a replacement.
        kept = {g.key for g in chosen.kept}
        pool.ack([g for g in pulled if g.key not in kept], rejected=True)
        selection += chosen
        seen_groups.update(g.key for g in pulled)  # a re-delivery in this batch
        if not filter_off and selection.filtered >= spec.filter_budget:
            filter_off = True
            log.warning(
                "batch for version %d: %d pulled groups had all-equal rewards and were filtered, "
                "the budget (train.filter_max_rounds %d x rollout.batch_groups %d); the rest of "
                "this batch is filled without the filter (%d of %d groups in it so far). The task "
                "may be too easy or too hard for the policy, or its rewards constant.",
                progress.version,
                selection.filtered,
                spec.filter_max_rounds,
                spec.batch_groups,
                len(selection.kept),
                spec.batch_groups,
            )
        if pulled:
            last_group = time.monotonic()
            continue
        log.info("waiting for rollout groups (%d of %d)", len(selection.kept), spec.batch_groups)
        if time.monotonic() - last_group > stall_s:
            raise RuntimeError(
                f"no rollout group for {stall_s:.0f}s although the servers answer: is their "
                "admission closed (a server of another run, or weights never pushed)?"
            )
    return selection


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
        selection = pull_batch(pool, spec, progress, timeout_s=timeout_s, stall_s=stall_s)
        batch, stats = batching.assemble_batch(selection, spec, trainer_version=progress.version)
        pulled = PulledBatch(batch=batch, stats=stats, pulled=selection.pulled)
    if jax.process_count() == 1:
        return pulled
    return broadcast_pulled(pulled, spec)


def broadcast_pulled(pulled: PulledBatch | None, spec: batching.BatchSpec) -> PulledBatch:
    """Process 0's ``pulled`` on every process (a collective: every process calls it, process 0
    with its batch, the others with None)."""
    source = jax.process_index() == 0
    length = pulled.batch.tokens.shape[1] if source else 0
    length = int(multihost_utils.broadcast_one_to_all(np.int32(length), is_source=source))
    # The lags ride at a fixed size per bucket (R · T ≥ the trained tokens), as int32 (JAX's
    # default integer width); the first `tokens` of them are the batch's.
    lags = np.zeros(spec.rows * length, np.int32)
    if source:
        batch, blob = pulled.batch, pulled.stats.to_json()
        lags[: pulled.stats.lags.size] = pulled.stats.lags
    else:
        batch, blob = batching.empty_batch(spec, length), b""
    batch, lags = multihost_utils.broadcast_one_to_all((batch, lags), is_source=source)
    tokens = int(np.count_nonzero(np.asarray(batch.loss_mask)))
    stats = batching.BatchStats.from_json(
        broadcast_bytes(blob, is_source=source),
        lags=np.asarray(lags)[:tokens].astype(np.int64),
    )
    return PulledBatch(batch=batch, stats=stats)


def broadcast_bytes(data: bytes, *, is_source: bool) -> bytes:
    """``data`` of the source process on every process (the others pass anything, e.g. b"")."""
    size = multihost_utils.broadcast_one_to_all(np.int32(len(data)), is_source=is_source)
    capacity = max(_MIN_BLOB, 1 << (int(size) - 1).bit_length())
    buffer = np.zeros(capacity, np.uint8)
    if is_source:
        buffer[: len(data)] = np.frombuffer(data, np.uint8)
    buffer = multihost_utils.broadcast_one_to_all(buffer, is_source=is_source)
    return buffer[: int(size)].tobytes()
