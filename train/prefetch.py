"""The next batch, made while the step runs (docs/DESIGN.md §7.1).

``BatchSource`` makes one batch at a time: pull, decode, select and assemble on process 0, the
host-to-host broadcast to the other processes of their own rows (``pulling.next_batch``), and the host→device
transfer of each process's own shards (``shard_batch``). With ``background`` it does all of that on
a thread of its own, so the loop starts batch k+1 right after dispatching step k and takes it,
ready on the devices, once step k is done; without, ``take`` makes the batch on the caller's thread
(synchronous mode, whose next batch does not exist before the push it waits for).

The loop passes the progress the batch will be trained with (the version after the batch in
flight, whose group keys count as trained), so the staleness policy, the lags and the duplicate
check are those of the serial loop. The thread only makes batches: it never touches the train
state, acknowledges only the groups it rejects (as ``pull_batch`` always has), and any error it
meets (a pull that fails, a server that died mid-Pull, a bad batch) is raised by ``take``, as the
same exception object, in the loop. With several processes nothing it does is a collective (the
broadcast goes through the distributed runtime's key-value store under a key per batch), so
threads on different processes need no common order.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
import time
from collections.abc import Callable
from typing import Any

import jax

from sat_jax.step import TrainBatch, shard_batch
from train import batching, checkpointing, pulling
from train.remote import ServerPool

_SOURCES = itertools.count()  # one key prefix per source, drawn in the same order on every process


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReadyBatch:
    """A batch ready for the step.

    Attributes:
      pulled: the host batch, its stats and (process 0) the groups to acknowledge after the step.
      batch: the same batch as global arrays on the mesh (each process made only its own shards).
      host_s: seconds of host work on the batch after its groups were in: the batch's own
        ``host_s`` (assembly, the broadcast) and the host→device transfer's dispatch.
    """

    pulled: pulling.PulledBatch
    batch: TrainBatch
    host_s: float = 0.0


@dataclasses.dataclass
class _Job:
    progress: checkpointing.Progress
    key: str
    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    result: ReadyBatch | None = None
    error: BaseException | None = None


class BatchSource:
    """Makes the loop's batches, one at a time, ahead of the step with ``background``.

    Args:
      pool: the servers on process 0, None on the other processes.
      spec: the batch shape and staleness policy.
      mesh: the mesh the step's batch is sharded over.
      timeout_s, stall_s: as in ``pulling.pull_batch``.
      background: make each batch on a thread (True) or in ``take`` (False).
      clock: seconds, monotonic, for ``ReadyBatch.host_s`` (tests pass a fake one).
    """

    def __init__(
        self,
        pool: ServerPool | None,
        spec: batching.BatchSpec,
        mesh: jax.sharding.Mesh,
        *,
        timeout_s: float,
        stall_s: float,
        background: bool,
        clock: Callable[[], float] = time.perf_counter,
    ):
        self._pool, self._spec, self._mesh, self._clock = pool, spec, mesh, clock
        self._timeout_s, self._stall_s = timeout_s, stall_s
        self._background = background
        self._cancel = threading.Event()
        self._prefix = f"sat_jax/batches/{next(_SOURCES)}"
        self._count = itertools.count()
        self._job: _Job | None = None

    @property
    def pending(self) -> bool:
        """A batch is started and not yet taken."""
        return self._job is not None

    def start(self, progress: checkpointing.Progress) -> None:
        """Starts the batch to be trained with ``progress`` (its version, ``min_version`` and the
        group keys that count as trained). Call it on the same thread, in the same order, on
        every process.

        Raises:
          RuntimeError: a batch is started and not taken, or the source is closed.
        """
        if self._job is not None:
            raise RuntimeError("BatchSource.start: the batch started before is not taken yet")
        if self._cancel.is_set():
            raise RuntimeError("BatchSource.start: the source is closed")
        self._job = _Job(progress=progress, key=f"{self._prefix}/{next(self._count)}")
        if self._background:
            threading.Thread(
                target=self._run, args=(self._job,), name="batch-prefetch", daemon=True
            ).start()

    def take(self) -> ReadyBatch:
        """The started batch, once made; re-raises the error that stopped it.

        Raises:
          RuntimeError: no batch is started; or, from the batch: see ``pulling.next_batch``.
        """
        job, self._job = self._job, None
        if job is None:
            raise RuntimeError("BatchSource.take: no batch started")
        if not self._background:
            return self._make(job)
        job.done.wait()
        if job.error is not None:
            raise job.error
        return job.result

    def close(self) -> None:
        """Stops the batch being made, if any, at its next pull (not waiting for it: a pull may
        wait for groups up to ``timeout_s``). The groups it pulled stay leased: their servers
        deliver them again."""
        self._cancel.set()
        self._job = None

    def __enter__(self) -> BatchSource:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _run(self, job: _Job) -> None:
        try:
            job.result = self._make(job)
        except BaseException as e:  # raised in the loop by take
            job.error = e
        finally:
            job.done.set()

    def _make(self, job: _Job) -> ReadyBatch:
        pulled = pulling.next_batch(
            self._pool,
            self._spec,
            job.progress,
            timeout_s=self._timeout_s,
            stall_s=self._stall_s,
            key=job.key,
            cancel=self._cancel,
            mesh=self._mesh,
            clock=self._clock,
        )
        start = self._clock()
        batch = shard_batch(pulled.batch, self._mesh)
        return ReadyBatch(pulled=pulled, batch=batch, host_s=pulled.host_s + self._clock() - start)
