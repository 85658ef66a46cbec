"""Weight pushes off the trainer's critical path: a host copy of the params on the loop's thread,
then the save and ``UpdateWeights`` on a background thread (docs/DESIGN.md §7.1, §7.3).

The loop copies the params to host memory right after a step (``host_copy``), before the next step
is dispatched: that step donates the device buffers. The copy keeps the params' sharding: each
process copies only its own devices' shards (cast to the serving dtype first). The save
(``sat_jax.params_io.save_weights``) writes flat weights when this is the only process and the
weights directory is local (a few milliseconds: orbax's fixed cost, tens of milliseconds, was most
of a small model's push); with several processes and a local directory, sharded weights, each
process writing its own shards' files and process 0 naming them all in an index once every
process's part is written (``save_version``: the parts' completion goes through the distributed
runtime's key-value store, not orbax, so no lock or barrier is shared with a checkpoint
committing in the background); an orbax checkpoint for a URL. Nothing is gathered.
``WeightPusher.submit`` hands the copy to the pusher thread and returns at once; the thread runs
at most one push at a time, and a newer version replaces one still waiting (counted as
superseded), so the servers always get the newest weights and versions only increase. With
several processes process 0 picks the versions pushed and posts each pick to the others, which
keep their copies until a pick names them or a newer one; process 0 announces a version only
once every process's part of it is written. A failed push (on any process: process 0 learns a
part failed from its outcome) is re-raised in the loop at its next ``submit``, ``check`` or
``wait``. Synchronous mode calls ``wait`` after every ``submit``.

Under LoRA (``model.lora.rank`` > 0) a push writes only the adapters: ``TrainState.params`` are
the adapters, and the frozen base is written once per trainer start, at the first sync, as
``<weights_dir>/base-v<version>`` (``save_base``); every ``UpdateWeights`` names it as its
``base_path``, and a server loads it only when it does not hold it already (docs/DESIGN.md §5).

When the servers serve 8-bit weights (``server.weight_dtype`` int8 or fp8) a push carries them
already quantized (``push_format``): ``host_copy`` quantizes the serving-dtype cast on device with
the server's own function (``sat_jax.quant.quantize_params``: 8-bit values and float32 scales,
about half the bytes) and the save records the format in the version's index; a server of that
format installs it as it is, bit-identical to quantizing on install (docs/DESIGN.md §6.1). LoRA
pushes and pushes to an orbax URL stay full precision.
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from sat_jax import params_io, quant
from train.remote import ServerPool

log = logging.getLogger("train")

# Weights directories kept besides the newest: a restarting server reloads the one it last had.
KEEP_WEIGHTS = 2
# Under LoRA: the frozen base of each trainer start, kept beside the adapters' versions.
BASE_PREFIX = "base-v"


def push_format(weight_dtype: str, weights_dir: str, *, lora: bool = False) -> str:
    """The format the trainer pushes whole params in: ``weight_dtype`` (``server.weight_dtype``)
    when it is 8-bit, the push is whole params and ``weights_dir`` is local (flat or sharded
    weights, whose index records the format); "bfloat16" (full precision, the server quantizes
    on install) otherwise: unquantized servers, LoRA (the server merges the adapters into the
    full-precision base, then quantizes), an orbax URL.

    Raises:
      ValueError: ``weight_dtype`` is not one of ``quant.FORMATS`` (naming the key).
    """
    quant.check_format(weight_dtype, "server.weight_dtype")
    if lora or params_io.weights_format(weights_dir) == "orbax":
        return "bfloat16"
    return weight_dtype


def host_copy(params: Any, dtype: Any = None, weight_dtype: str = "bfloat16") -> Any:
    """The params in host memory, safe after the device buffers are donated, without a gather.

    A jax array becomes a jax array of the same sharding in the devices' ``pinned_host`` memory
    (each process holds only its own shards); anything else becomes a NumPy array that owns its
    memory. No collective: each process copies what it has. The jax arrays are cast in one
    program and copied in one batched transfer (per leaf, the dispatches were most of a small
    model's copy: 2.9 ms of host time for 27 leaves, on the loop's thread before the next step).

    Args:
      params: a pytree of arrays.
      dtype: the serving dtype to cast floating-point leaves to (on device, before the copy);
        None keeps each leaf's dtype.
      weight_dtype: "int8" or "fp8": the cast is then quantized on device
        (``quant.quantize_params``, one program with the cast) and the copy holds
        ``quant.QTensor`` leaves (``push_format``); "bfloat16" copies the cast as it is.
    """
    if quant.is_quantized(weight_dtype):
        params = _cast_quantize(params, None if dtype is None else np.dtype(dtype), weight_dtype)
        dtype = None  # cast already; the 8-bit values keep their dtype
    leaves, treedef = jax.tree.flatten(params)
    on_device = [i for i, x in enumerate(leaves) if isinstance(x, jax.Array)]
    arrays = [leaves[i] for i in on_device]
    if dtype is not None and any(_casts(x, dtype) for x in arrays):
        arrays = _cast(arrays, np.dtype(dtype))
    hosts = [x.sharding.with_memory_kind("pinned_host") for x in arrays]
    copied = dict(zip(on_device, jax.device_put(arrays, hosts, may_alias=False), strict=True))
    out = [
        copied[i] if i in copied else np.array(x.astype(dtype) if _casts(x, dtype) else x)
        for i, x in enumerate(leaves)
    ]
    return jax.tree.unflatten(treedef, out)


def _casts(x: Any, dtype: Any) -> bool:
    return dtype is not None and jnp.issubdtype(x.dtype, jnp.floating) and x.dtype != dtype


@functools.partial(jax.jit, static_argnums=(1, 2))
def _cast_quantize(params: Any, dtype: np.dtype | None, fmt: str) -> Any:
    """``quant.quantize_params`` of ``params`` with floating leaves cast to ``dtype`` first."""
    if dtype is not None:
        params = jax.tree.map(lambda x: x.astype(dtype) if _casts(x, dtype) else x, params)
    return quant.quantize_params(params, fmt)


@functools.partial(jax.jit, static_argnums=1)
def _cast(arrays: list[jax.Array], dtype: np.dtype) -> list[jax.Array]:
    return [x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x for x in arrays]


def push_weights(
    pool: ServerPool | None,
    params: Any,
    version: int,
    weights_dir: str,
    *,
    new_admission_epoch: bool = False,
    base_path: str = "",
    group: PushGroup | None = None,
    wait_s: float = 0.0,
) -> None:
    """Saves ``params`` as ``<weights_dir>/v<version>`` (``save_version``) and makes every server
    load it; removes weights directories older than the last ``KEEP_WEIGHTS`` versions (but not
    one a server is loading, is sent next or holds: ``ServerPool.pinned_versions``), and what a
    flat save of an older version left behind when the process died in it (``v<N>.tmp-*``).

    Every process calls it (each writes its own shards); only the one with ``pool`` (process 0)
    hands the version to the servers' senders (``ServerPool.update_weights``, which returns at
    once unless ``wait_s`` > 0: then it waits that long at most for the servers' installs) and
    removes old directories, once every process's part is written. Under LoRA ``params`` are the
    adapters and ``base_path`` the base they apply to (``save_base``)."""
    path = os.path.abspath(os.path.join(weights_dir, f"v{version}"))
    # Not fsynced (durable=False): a server's restart checks the CRC of what its state names.
    save_version(path, params, group=group, durable=False)
    if pool is None:
        return
    pool.update_weights(
        version,
        path,
        new_admission_epoch=new_admission_epoch,
        base_path=base_path,
        wait_s=wait_s,
    )
    # A version a server is loading, is told to load, or holds (its restart reloads it) stays.
    pinned = pool.pinned_versions() if hasattr(pool, "pinned_versions") else set()
    for old in os.listdir(weights_dir):
        number, _, tmp = old[1:].partition(".tmp-")
        if not (old.startswith("v") and number.isdigit()):
            continue
        stale = int(number) < version - KEEP_WEIGHTS and int(number) not in pinned
        if stale or (tmp and int(number) < version):
            shutil.rmtree(os.path.join(weights_dir, old), ignore_errors=True)


def save_version(
    path: str, params: Any, *, group: PushGroup | None = None, durable: bool = True
) -> None:
    """Writes ``params`` at ``path`` in the format ``params_io.weights_format`` picks: flat (one
    process), orbax (a URL), or sharded: every process of ``group`` (default: the job's, made
    here; every process must then call this in the same order) writes its own shards and returns;
    process 0 returns once every process's part is written and ``params_io.finish_shards`` has
    named them.

    Raises:
      RuntimeError: (process 0) another process's part failed, naming it.
    """
    if params_io.weights_format(path) != "shards":
        params_io.save_weights(path, params, durable=durable)
        return
    group = group or PushGroup.of_job()
    parts = group.save_everywhere(
        lambda: params_io.save_shards(path, params, durable=durable, process=group.index)
    )
    if group.lead:
        fmt = quant.tree_format(params)
        params_io.finish_shards(path, parts, durable=durable, weight_dtype=fmt)


def base_dir(weights_dir: str, version: int) -> str:
    """Where ``save_base`` writes the base of the sync at ``version``."""
    return os.path.abspath(os.path.join(weights_dir, f"{BASE_PREFIX}{version}"))


def save_base(
    base: Any, version: int, weights_dir: str, *, lead: bool = True, group: PushGroup | None = None
) -> str:
    """Saves LoRA's frozen base (a host copy, in the serving dtype) as ``base_dir(weights_dir,
    version)`` (``save_version``) and returns that path. Every process calls it; the lead
    (process 0) then removes older bases but the newest one before it (a server that restarts
    meanwhile reloads the base it last had)."""
    path = base_dir(weights_dir, version)
    save_version(path, base, group=group)
    if lead:
        older = sorted(
            int(d[len(BASE_PREFIX) :])
            for d in os.listdir(weights_dir)
            if d.startswith(BASE_PREFIX)
            and d[len(BASE_PREFIX) :].isdigit()
            and int(d[len(BASE_PREFIX) :]) < version
        )
        for v in older[:-1]:
            shutil.rmtree(base_dir(weights_dir, v), ignore_errors=True)
    return path


tree_bytes = params_io.tree_bytes


class KeyValue(Protocol):
    """A key-value store every process reaches (``DistributedKeyValue``; tests give a fake)."""

    def set(self, key: str, value: str) -> None: ...

    def get(self, key: str, timeout_ms: int) -> str | None:
        """The value of ``key`` once it is set; None when ``timeout_ms`` passed first."""

    def delete(self, key: str) -> None:
        """Removes ``key`` and every key under ``key/``."""


class DistributedKeyValue:
    """``KeyValue`` on the JAX distributed runtime's coordination service."""

    def __init__(self, client: Any):
        self._client = client

    def set(self, key: str, value: str) -> None:
        self._client.key_value_set(key, value)

    def get(self, key: str, timeout_ms: int) -> str | None:
        try:
            return self._client.blocking_key_value_get(key, timeout_ms)
        except jax.errors.JaxRuntimeError as e:  # a timeout is DEADLINE_EXCEEDED
            if "DEADLINE_EXCEEDED" not in str(e):
                raise
            return None

    def delete(self, key: str) -> None:
        self._client.key_value_delete(key)


_groups = itertools.count()  # every process makes its groups in the same order: same prefixes


class PushGroup:
    """The trainer's processes as a weights save sees them: this process's index, how many there
    are, and keys under one prefix of a store they all reach.

    Args:
      index, count: this process's index and the number of processes.
      kv: the store.
      prefix: the keys' prefix (``of_job``: one per group made, in order, the same on every
        process).
    """

    def __init__(self, index: int, count: int, kv: KeyValue, prefix: str):
        self.index, self.count, self.kv, self.prefix = index, count, kv, prefix
        self._saves = itertools.count()

    @classmethod
    def of_job(cls) -> PushGroup:
        """This JAX job's processes, on its distributed runtime's key-value store."""
        from train import pulling

        kv = DistributedKeyValue(pulling._client())
        return cls(jax.process_index(), jax.process_count(), kv, f"sat_jax/weights/{next(_groups)}")

    @property
    def lead(self) -> bool:
        """Whether this is process 0 (it announces versions and decides which are saved)."""
        return self.index == 0

    def post(self, key: str, value: str) -> None:
        """Sets ``<prefix>/<key>``."""
        self.kv.set(f"{self.prefix}/{key}", value)

    def get(self, key: str, stop: Callable[[], bool] = lambda: False) -> str | None:
        """``<prefix>/<key>`` once it is set; None if ``stop()`` (asked every second) says so
        first."""
        while not stop():
            value = self.kv.get(f"{self.prefix}/{key}", WAIT_MS)
            if value is not None:
                return value
        return None

    def delete(self, key: str) -> None:
        """Removes ``<prefix>/<key>`` and the keys under it."""
        self.kv.delete(f"{self.prefix}/{key}")

    def save_everywhere(self, save: Callable[[], str]) -> list[str]:
        """This process's part of the group's next save (every process calls it once per save,
        in the same order): runs ``save()`` (which returns what names the part); a process other
        than 0 posts the outcome and returns ``[its part]`` at once; process 0 waits for every
        process's outcome and returns all the parts in process order.

        Raises:
          Whatever ``save`` raised (posted first, so process 0 does not wait on it).
          RuntimeError: (process 0) another process's part failed, naming it and its error.
        """
        key = f"save/{next(self._saves)}"
        try:
            part = save()
        except BaseException as e:
            if not self.lead:
                self.post(f"{key}/{self.index}", f"error {type(e).__name__}: {e}")
            raise
        if not self.lead:
            self.post(f"{key}/{self.index}", f"ok {part}")
            return [part]
        parts, failed = [part], []
        for process in range(1, self.count):
            status, _, rest = (self.get(f"{key}/{process}") or "").partition(" ")
            parts.append(rest)
            if status != "ok":
                failed.append(f"process {process}: {rest}")
        self.delete(key)
        if failed:
            raise RuntimeError(f"a process failed to save its part ({'; '.join(failed)})")
        return parts


# How long one wait on the store lasts before a waiting thread checks whether it should stop.
WAIT_MS = 1000


class WeightPusher:
    """Runs ``push(version, params)`` on a background thread, one push at a time; ``submit``
    never waits.

    One process (no ``group``, or a group of one): a version submitted while a push runs waits,
    and a newer one replaces it (counted as superseded). Several processes (``group``): process 0
    does the same, and before each push posts the version it picked (``decision/<n>``); every
    other process keeps each submitted host copy until a decision names it or a newer one (then
    drops it, superseded), and pushes exactly the versions process 0 picked, in its order.
    ``push`` saves (each process its own part, ``save_version``) and, on process 0, announces
    once every process's part is written, so all processes write the same versions and none is
    announced before every part of it is in. Saves take no orbax lock or barrier, so a
    checkpoint committing in the background delays neither.

    Args:
      push: saves and, on process 0, publishes one version (``push_weights`` bound to a pool,
        a directory and ``group``).
      group: the trainer's processes; None for one process.
      orbax_barriers: the pushes write orbax checkpoints with global barriers (several processes,
        a URL): the loop drains them before a checkpoint (``train.main.finish_step``).

    Attributes (read them through ``metrics``): the duration of the last finished push, the last
    pushed version, and how many submitted versions were superseded.
    """

    def __init__(
        self,
        push: Callable[[int, Any], None],
        *,
        group: PushGroup | None = None,
        orbax_barriers: bool = False,
    ):
        self._push = push
        self._group = group if group is not None and group.count > 1 else None
        self.orbax_barriers = orbax_barriers
        self._cond = threading.Condition()
        self._pending: tuple[int, Any] | None = None  # process 0: the newest not yet pushed
        self._held: dict[int, Any] = {}  # other processes: copies no decision has named yet
        self._closed = False
        self._error: BaseException | None = None
        self._failed_version = -1
        self._submitted = -1
        self._pushed = -1
        self._push_s: float | None = None
        self._push_bytes: int | None = None
        self._superseded = 0
        follows = self._group is not None and not self._group.lead
        run = self._follow if follows else self._lead
        self._thread = threading.Thread(target=run, name="weight-pusher", daemon=True)
        self._thread.start()

    def submit(self, version: int, params: Any) -> None:
        """Queues ``params`` (a host copy) as ``version``; returns at once.

        Raises:
          ValueError: ``version`` is not newer than the last submitted one.
          RuntimeError: an earlier push failed (chained to its error) or the pusher is closed.
        """
        with self._cond:
            self._raise_if_failed_locked()
            if self._closed:
                raise RuntimeError("the weight pusher is closed")
            if version <= self._submitted:
                raise ValueError(
                    f"weights version {version} is not newer than the last pushed {self._submitted}"
                )
            if self._group is not None and not self._group.lead:
                self._held[version] = params
            else:
                if self._pending is not None:
                    self._superseded += 1
                self._pending = (version, params)
            self._submitted = version
            self._cond.notify_all()

    def check(self) -> None:
        """Raises RuntimeError (chained to the cause) if a push has failed."""
        with self._cond:
            self._raise_if_failed_locked()

    def wait(self) -> None:
        """Blocks until the last submitted version is pushed (on a process other than 0: once
        process 0 has picked it, which it does once it has nothing newer).

        Raises:
          RuntimeError: a push failed (chained to its error).
        """
        with self._cond:
            while self._pushed < self._submitted and self._error is None:
                self._cond.wait()
            self._raise_if_failed_locked()

    def metrics(self) -> dict[str, float | None]:
        """``push_s`` (the last finished push, save + UpdateWeights; None before the first),
        ``push_bytes`` (the bytes of weights it wrote: the adapters alone under LoRA),
        ``pushed_version`` and ``pushes_superseded``."""
        with self._cond:
            return {
                "push_s": self._push_s,
                "push_bytes": self._push_bytes,
                "pushed_version": self._pushed if self._pushed >= 0 else None,
                "pushes_superseded": self._superseded,
            }

    def close(self) -> None:
        """Waits for the last submitted version, then stops the thread.

        Raises:
          RuntimeError: a push failed (chained to its error).
        """
        try:
            self.wait()
        finally:
            with self._cond:
                self._closed = True
                self._cond.notify_all()
            self._thread.join(timeout=10)

    def __enter__(self) -> WeightPusher:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is None:
            self.close()
            return
        try:  # already failing: flush what we can, but do not hide the original error
            self.close()
        except RuntimeError as e:
            log.error("weight push failed while stopping: %s", e.__cause__ or e)

    def _raise_if_failed_locked(self) -> None:
        if self._error is not None:
            raise RuntimeError(
                f"pushing weights version {self._failed_version} failed: {self._error!r}"
            ) from self._error

    def _lead(self) -> None:
        """Process 0 (or the only one): pushes the newest pending version, posting it first as
        the next decision when there are other processes."""
        for n in itertools.count():
            with self._cond:
                while self._pending is None and not self._closed:
                    self._cond.wait()
                if self._pending is None:
                    return
                (version, params), self._pending = self._pending, None
            if self._group is not None:
                self._group.post(f"decision/{n}", str(version))
            if not self._pushed_ok(version, params):
                return
            if self._group is not None:  # every process has read it: it posted its part
                self._group.delete(f"decision/{n}")

    def _follow(self) -> None:
        """A process other than 0: pushes each version process 0 decides, dropping the held
        copies older than it."""
        assert self._group is not None
        for n in itertools.count():
            got = self._group.get(f"decision/{n}", stop=lambda: self._closed)
            if got is None:
                return
            version = int(got)
            with self._cond:
                while self._submitted < version and not self._closed:
                    self._cond.wait()
                params = self._held.pop(version, None)
                older = [v for v in self._held if v < version]
                for v in older:
                    del self._held[v]
                self._superseded += len(older)
            if params is None and self._closed:
                return
            if params is None:
                error = RuntimeError(f"process 0 pushes version {version}, never submitted here")
                self._fail(version, error)
                return
            if not self._pushed_ok(version, params):
                return

    def _pushed_ok(self, version: int, params: Any) -> bool:
        """Runs one push and records its outcome; False if it failed."""
        start = time.monotonic()
        try:
            nbytes = tree_bytes(params)
            self._push(version, params)
        except BaseException as e:  # surfaces in the loop's thread
            self._fail(version, e)
            return False
        with self._cond:
            self._pushed, self._push_s = version, time.monotonic() - start
            self._push_bytes = nbytes
            self._cond.notify_all()
        return True

    def _fail(self, version: int, error: BaseException) -> None:
        with self._cond:
            self._error, self._failed_version = error, version
            self._pending = None
            self._held.clear()
            self._cond.notify_all()
