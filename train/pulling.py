"""The next batch (docs/DESIGN.md §7.1, steps 1 to 4): pull groups until a batch's worth
pass the staleness policy, assemble them, and, with several JAX processes, send the batch from
process 0 (the only one that talks to the servers) to every process.

Pulled groups are ``rollout_api.records`` (``ServerPool.pull`` decodes and validates them once),
tracked by their ``key``.

Broadcast (``next_batch`` through ``send_pulled`` / ``receive_pulled``; docs/DESIGN.md §7.1
step 4, §7.3): host to host, through the key-value store of JAX's distributed runtime (the
coordination service ``jax.distributed`` starts; the client orbax uses for its barriers), never
through the devices. Given the step's mesh, process 0 writes each other process only its own rows
of every per-token field (the rows its devices hold under ``batch_shardings``; the other rows
arrive as 0s, which nothing on that process reads: ``shard_batch`` copies only its own devices'
slices), and the [B] fields, the flat lags of the trained tokens and the rest of the
``BatchStats`` (as JSON) whole; without a mesh every process gets the whole batch. Each process's
part is one ``.npz`` under the batch's key, in chunks of ``CHUNK_BYTES``. Keys are distinct per
batch (no ordering between processes is needed, so a background thread may send or receive);
each reader marks the batch read and process 0 deletes a batch's keys once every reader has. A
failure on process 0 while it makes the batch is written under the batch's key instead, so the
other processes raise it rather than wait.
"""

from __future__ import annotations

import dataclasses
import io
import itertools
import json
import logging
import math
import threading
import time
from collections.abc import Callable

import jax
import numpy as np

from rollout_api.records import Group, InvalidGroup
from sat_jax.step import TrainBatch, batch_shardings
from train import batching, checkpointing
from train.remote import ServerPool

log = logging.getLogger("train")

CHUNK_BYTES = 16 << 20  # one value in the coordination service's key-value store
_WAITING_LOG_S = 5.0  # "waiting for rollout groups" at most this often
_WAIT_MS = 10_000  # a reader's wait per try for the batch (it gives up only when cancelled)
_KEYS = itertools.count()  # next_batch's broadcast keys: the same sequence on every process


class Cancelled(Exception):
    """The batch was no longer wanted (``cancel`` was set): the loop stopped."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class PulledBatch:
    """One assembled batch and what the loop records about it.

    Attributes:
      batch: the ``TrainBatch`` as NumPy arrays (``batching.assemble_batch``).
      stats: its ``BatchStats``, including how many pulled groups were dropped as stale or
        skipped as duplicates.
      pulled: every group pulled for it, to acknowledge once it is trained (process 0 only;
        empty on the others).
      host_s: seconds of host work after its groups were in (process 0: assembling and, with
        several processes, sending it; the others: receiving and decoding it, waits excluded).
    """

    batch: TrainBatch
    stats: batching.BatchStats
    pulled: tuple[Group | InvalidGroup, ...] = ()
    host_s: float = 0.0


def pull_batch(
    pool: ServerPool,
    spec: batching.BatchSpec,
    progress: checkpointing.Progress,
    *,
    timeout_s: float,
    stall_s: float,
    cancel: threading.Event | None = None,
    clock: Callable[[], float] = time.monotonic,
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
      stall_s: how long the servers may answer without sending a group the batch keeps.
      cancel: set by another thread to stop between two pulls (the groups pulled so far stay
        leased, so their servers deliver them again to the next trainer that asks).
      clock: seconds, monotonic (the stall's clock; tests pass a fake one).

    Raises:
      RuntimeError: for ``stall_s`` seconds the servers answered but sent no group the batch
        kept: none at all, or only stale ones (their weights are not the pushed ones).
      Cancelled: ``cancel`` was set.
    """
    seen_groups = set(progress.recent_group_keys)
    selection = batching.Selection.empty()
    last_kept = clock()
    stale_since = 0  # groups dropped as stale since a group was last kept
    logged = -math.inf
    filter_off = spec.filter_groups == "none"
    while len(selection.kept) < spec.batch_groups:
        if cancel is not None and cancel.is_set():
            raise Cancelled(f"batch for version {progress.version}")
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
        if chosen.kept or (pulled and not chosen.stale_dropped):
            last_kept, stale_since = clock(), 0
            continue
        stale_since += chosen.stale_dropped
        if not pulled and clock() - logged >= _WAITING_LOG_S:  # the pool may answer empty often
            logged = clock()
            log.info(
                "waiting for rollout groups (%d of %d)", len(selection.kept), spec.batch_groups
            )
        if clock() - last_kept > stall_s:
            _raise_stalled(stall_s, stale_since, progress)
    return selection


def _raise_stalled(stall_s: float, stale: int, progress: checkpointing.Progress) -> None:
    """The stall of ``pull_batch``: no group kept for ``stall_s`` seconds, ``stale`` of the
    groups pulled meanwhile dropped as stale."""
    if stale:
        raise RuntimeError(
            f"every rollout group pulled for {stall_s:.0f}s was stale ({stale} dropped, trainer "
            f"version {progress.version}): the servers are likely not installing the pushed "
            "weights (see their UpdateWeights errors and server.checkpoint_root)"
        )
    raise RuntimeError(
        f"no rollout group for {stall_s:.0f}s although the servers answer: is their "
        "admission closed (a server of another run, or weights never pushed)?"
    )


def next_batch(
    pool: ServerPool | None,
    spec: batching.BatchSpec,
    progress: checkpointing.Progress,
    *,
    timeout_s: float,
    stall_s: float,
    key: str | None = None,
    cancel: threading.Event | None = None,
    mesh: jax.sharding.Mesh | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> PulledBatch:
    """Pulls and assembles the next batch on process 0 and gives it to every process.

    Args:
      pool: the servers on process 0; None on every other process.
      spec: the batch shape and staleness policy.
      progress: the trainer version, ``min_version`` and recently trained group keys.
      timeout_s, stall_s, cancel: as in ``pull_batch``.
      key: the batch's broadcast key, the same on every process and distinct per batch (None:
        the next of a sequence that every process draws from in the same order, for callers that
        make every batch on one thread).
      mesh: the mesh the step shards the batch over: each other process then receives only the
        rows of the per-token fields its devices hold (0s elsewhere); None = the whole batch.
      clock: seconds, monotonic, for ``host_s`` (tests pass a fake one).

    Returns:
      The batch on every process (its ``pulled`` on process 0 only): the same ``PulledBatch``,
      or with ``mesh`` the same [B] fields, stats and own rows.

    Raises:
      ValueError: ``pool`` is given on a process other than 0, or missing on process 0.
      RuntimeError: from ``pull_batch``; on the other processes, a failure of process 0's.
      Cancelled: ``cancel`` was set.
    """
    if (pool is not None) != (jax.process_index() == 0):
        raise ValueError(
            f"process {jax.process_index()}: only process 0 pulls (pool given: {pool is not None})"
        )
    several = jax.process_count() > 1
    if several and key is None:
        key = f"sat_jax/batch/{next(_KEYS)}"
    if pool is None:
        return receive_pulled(key, cancel=cancel)
    try:
        selection = pull_batch(
            pool, spec, progress, timeout_s=timeout_s, stall_s=stall_s, cancel=cancel
        )
        pulled_at = clock()
        batch, stats = batching.assemble_batch(selection, spec, trainer_version=progress.version)
    except BaseException as e:
        if several:  # the others wait for this batch: tell them why it will not come
            send_failure(key, e)
        raise
    pulled = PulledBatch(batch=batch, stats=stats, pulled=selection.pulled)
    if several:
        send_pulled(key, pulled, mesh)
    return dataclasses.replace(pulled, host_s=clock() - pulled_at)


def encode_pulled(pulled: PulledBatch, rows: dict[str, np.ndarray] | None = None) -> bytes:
    """The batch's host arrays, its lags and the rest of its stats as one ``.npz`` (no pickle).

    Args:
      pulled: the batch.
      rows: per field, the rows (of dimension 0) to send; the fields not named go whole.
    """
    arrays = {"lags": np.asarray(pulled.stats.lags)}
    arrays["stats"] = np.frombuffer(pulled.stats.to_json(), np.uint8)
    for k, v in vars(pulled.batch).items():
        if v is None:
            continue
        v = np.asarray(v)
        if rows is not None and k in rows:
            arrays[f"rows/{k}"] = rows[k]
            arrays[f"shape/{k}"] = np.asarray(v.shape, np.int64)
            v = v[rows[k]]
        arrays[f"batch/{k}"] = v
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    return buffer.getvalue()


def decode_pulled(data: bytes) -> PulledBatch:
    """The inverse of ``encode_pulled`` (``pulled`` empty: only process 0 acknowledges); a field
    sent by rows is as long as the whole, with 0s in the rows not sent."""
    with np.load(io.BytesIO(data), allow_pickle=False) as npz:
        fields = {}
        for name in npz.files:
            if not name.startswith("batch/"):
                continue
            k, value = name.removeprefix("batch/"), npz[name]
            if f"rows/{k}" in npz.files:
                whole = np.zeros(tuple(npz[f"shape/{k}"]), value.dtype)
                whole[npz[f"rows/{k}"]] = value
                value = whole
            fields[k] = value
        if "microbatches" in fields:  # static (a Python int), not an array
            fields["microbatches"] = int(fields["microbatches"])
        stats = batching.BatchStats.from_json(npz["stats"].tobytes(), lags=npz["lags"])
    return PulledBatch(batch=TrainBatch(**fields), stats=stats)


def process_rows(batch: TrainBatch, mesh: jax.sharding.Mesh) -> dict[int, dict[str, np.ndarray]]:
    """Per process, the rows of each per-token field (≥ 2 dimensions) that its devices hold
    under ``batch_shardings`` on ``mesh``, sorted; the [B] fields are left out (sent whole)."""
    shardings = batch_shardings(batch, mesh)
    owned: dict[int, dict[str, set[int]]] = {}
    for k, x in vars(batch).items():
        if x is None or np.ndim(x) < 2:
            continue
        n = np.shape(x)[0]
        for device, index in getattr(shardings, k).devices_indices_map(np.shape(x)).items():
            part = owned.setdefault(device.process_index, {}).setdefault(k, set())
            part.update(range(*index[0].indices(n)))
    return {
        p: {k: np.fromiter(sorted(r), np.int64, len(r)) for k, r in fields.items()}
        for p, fields in owned.items()
    }


def send_pulled(key: str, pulled: PulledBatch, mesh: jax.sharding.Mesh | None = None) -> None:
    """Writes ``pulled`` under ``key`` for the other processes (process 0): with ``mesh``, to each
    its own rows (``process_rows``), else the whole batch once; chunk by chunk and the chunk
    counts last; then deletes the keys of earlier batches every reader has marked read."""
    client = _client()
    others = range(1, jax.process_count())
    if mesh is None:
        parts = {"all": encode_pulled(pulled)}
    else:
        rows = process_rows(pulled.batch, mesh)
        parts = {f"p{p}": encode_pulled(pulled, rows.get(p, {})) for p in others}
    counts = {}
    for part, data in parts.items():
        chunks = range(0, max(len(data), 1), CHUNK_BYTES)
        for i, at in enumerate(chunks):
            client.key_value_set_bytes(f"{key}/{part}/chunk/{i}", data[at : at + CHUNK_BYTES])
        counts[part] = len(chunks)
    client.key_value_set_bytes(f"{key}/count", json.dumps(counts).encode())
    _sent.append(key)
    _forget_read(client)


def send_failure(key: str, error: BaseException) -> None:
    """Tells the other processes that process 0 will not send the batch under ``key``."""
    message = f"{type(error).__name__}: {error}"
    _client().key_value_set_bytes(f"{key}/count", b"error " + message.encode())


def receive_pulled(key: str, *, cancel: threading.Event | None = None) -> PulledBatch:
    """The batch process 0 sends under ``key`` (a process other than 0): its own part, or the
    whole batch; waits for it however long process 0 pulls, until ``cancel`` is set.

    Raises:
      RuntimeError: process 0 failed to make this batch (its error in the message).
      Cancelled: ``cancel`` was set.
    """
    client = _client()
    while True:
        if cancel is not None and cancel.is_set():
            raise Cancelled(key)
        try:
            count = client.blocking_key_value_get_bytes(f"{key}/count", _WAIT_MS)
            break
        except jax.errors.JaxRuntimeError as e:  # a timeout is DEADLINE_EXCEEDED: wait on
            if "DEADLINE_EXCEEDED" not in str(e):
                raise
    if count.startswith(b"error "):
        raise RuntimeError(
            f"process 0 failed to make the batch {key}: {count[6:].decode(errors='replace')}"
        )
    counts = json.loads(count)
    part = "all" if "all" in counts else f"p{jax.process_index()}"
    data = b"".join(
        client.blocking_key_value_get_bytes(f"{key}/{part}/chunk/{i}", _WAIT_MS)
        for i in range(counts[part])
    )
    client.key_value_set_bytes(f"{key}/read/{jax.process_index()}", b"")
    start = time.perf_counter()
    pulled = decode_pulled(data)
    return dataclasses.replace(pulled, host_s=time.perf_counter() - start)


_sent: list[str] = []  # keys process 0 wrote and has not deleted yet


def _forget_read(client) -> None:
    """Deletes the keys of every sent batch that all other processes have read."""
    readers = jax.process_count() - 1
    for key in list(_sent):
        if len(client.key_value_dir_get(f"{key}/read/")) >= readers:
            client.key_value_delete(key)
            _sent.remove(key)


def _client():
    """The distributed runtime's client (``jax.distributed.initialize`` made it); JAX exposes no
    public accessor, and orbax reads the same attribute."""
    from jax._src import distributed

    client = distributed.global_state.client
    if client is None:
        raise RuntimeError(
            "several JAX processes but no distributed runtime client: call "
            "jax.distributed.initialize() before the trainer"
        )
    return client
