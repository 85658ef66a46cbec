"""Weight pushes off the trainer's critical path: a host copy of the params on the loop's thread,
then the save and ``UpdateWeights`` on a background thread (docs/DESIGN.md §7.1, §7.3).

The loop copies the params to host memory right after a step (``host_copy``), before the next step
is dispatched: that step donates the device buffers. The copy keeps the params' sharding: each
process copies only its own devices' shards (cast to the serving dtype first). The save
(``sat_jax.params_io.save_weights``) writes flat weights when this is the only process and the
weights directory is local (a few milliseconds: orbax's fixed cost, tens of milliseconds, was most
of a small model's push), and otherwise an orbax checkpoint in which every process writes only its
own shards; nothing is gathered. ``WeightPusher.submit``
hands the copy to the pusher thread, which runs at most one push at a time; a push submitted while
another is running waits, and with one process a newer one replaces it (it is counted as
superseded), so the servers always get the newest weights and versions only increase. With several
processes every process must write every version, so nothing is superseded: ``submit`` waits for
the slot instead. A failed push is re-raised in the loop at its next ``submit``, ``check`` or
``wait``. Synchronous mode calls ``wait`` after every ``submit``.

Under LoRA (``model.lora.rank`` > 0) a push writes only the adapters: ``TrainState.params`` are
the adapters, and the frozen base is written once per trainer start, at the first sync, as
``<weights_dir>/base-v<version>`` (``save_base``); every ``UpdateWeights`` names it as its
``base_path``, and a server loads it only when it does not hold it already (docs/DESIGN.md §5).
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from sat_jax import params_io
from train.remote import ServerPool

log = logging.getLogger("train")

# Weights directories kept besides the newest: a restarting server reloads the one it last had.
KEEP_WEIGHTS = 2
# Under LoRA: the frozen base of each trainer start, kept beside the adapters' versions.
BASE_PREFIX = "base-v"


def host_copy(params: Any, dtype: Any = None) -> Any:
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
    """
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
    wait_s: float = 0.0,
) -> None:
    """Saves ``params`` as ``<weights_dir>/v<version>`` (``params_io.save_weights``: flat weights
    with one process and a local directory, orbax otherwise) and makes every server load it;
    removes weights directories older than the last ``KEEP_WEIGHTS`` versions, and what a flat
    save of an older version left behind when the process died in it (``v<N>.tmp-*``).

    Every process calls it (each writes its own shards); only the one with ``pool`` (process 0)
    hands the version to the servers' senders (``ServerPool.update_weights``, which returns at
    once unless ``wait_s`` > 0: then it waits that long at most for the servers' installs) and
    removes old directories, once the save is finalized. Under LoRA ``params`` are the adapters
    and ``base_path`` the base they apply to (``save_base``)."""
    path = os.path.abspath(os.path.join(weights_dir, f"v{version}"))
    # Not fsynced (durable=False): a server's restart checks the CRC of what its state names.
    params_io.save_weights(path, params, durable=False)
    if pool is None:
        return
    pool.update_weights(
        version,
        path,
        new_admission_epoch=new_admission_epoch,
        base_path=base_path,
        wait_s=wait_s,
    )
    for old in os.listdir(weights_dir):
        number, _, tmp = old[1:].partition(".tmp-")
        if not (old.startswith("v") and number.isdigit()):
            continue
        if int(number) < version - KEEP_WEIGHTS or (tmp and int(number) < version):
            shutil.rmtree(os.path.join(weights_dir, old), ignore_errors=True)


def base_dir(weights_dir: str, version: int) -> str:
    """Where ``save_base`` writes the base of the sync at ``version``."""
    return os.path.abspath(os.path.join(weights_dir, f"{BASE_PREFIX}{version}"))


def save_base(base: Any, version: int, weights_dir: str, *, lead: bool = True) -> str:
    """Saves LoRA's frozen base (a host copy, in the serving dtype) as ``base_dir(weights_dir,
    version)`` and returns that path. Every process calls it; the lead (process 0) then removes
    older bases but the newest one before it (a server that restarts meanwhile reloads the base
    it last had)."""
    path = base_dir(weights_dir, version)
    params_io.save_weights(path, base)
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


class WeightPusher:
    """Runs ``push(version, params)`` on a background thread, one push at a time.

    Args:
      push: saves and publishes one version (``push_weights`` bound to a pool and directory).
      supersede: let a newer submitted version replace one still waiting (one process); False:
        ``submit`` waits until the waiting one has started, so every version is pushed (several
        processes, which must all write the same versions).

    Attributes (read them through ``metrics``): the duration of the last finished push, the last
    pushed version, and how many submitted pushes a newer one superseded.
    """

    def __init__(self, push: Callable[[int, Any], None], *, supersede: bool = True):
        self._push = push
        self._supersede = supersede
        self._cond = threading.Condition()
        self._pending: tuple[int, Any] | None = None
        self._busy = False
        self._closed = False
        self._error: BaseException | None = None
        self._failed_version = -1
        self._submitted = -1
        self._pushed = -1
        self._push_s: float | None = None
        self._push_bytes: int | None = None
        self._superseded = 0
        self._thread = threading.Thread(target=self._run, name="weight-pusher", daemon=True)
        self._thread.start()

    def submit(self, version: int, params: Any) -> None:
        """Queues ``params`` (a host copy) as ``version``; returns at once (without superseding:
        once the version queued before it, if any, has started).

        Raises:
          ValueError: ``version`` is not newer than the last submitted one.
          RuntimeError: an earlier push failed (chained to its error) or the pusher is closed.
        """
        with self._cond:
            while not self._supersede and self._pending is not None and self._error is None:
                self._cond.wait()
            self._raise_if_failed_locked()
            if self._closed:
                raise RuntimeError("the weight pusher is closed")
            if version <= self._submitted:
                raise ValueError(
                    f"weights version {version} is not newer than the last pushed {self._submitted}"
                )
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
        """Blocks until every submitted version is pushed (or superseded and the newer pushed).

        Raises:
          RuntimeError: a push failed (chained to its error).
        """
        with self._cond:
            while (self._pending is not None or self._busy) and self._error is None:
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
        """Waits for the pending push, then stops the thread.

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

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._pending is None and not self._closed:
                    self._cond.wait()
                if self._pending is None:
                    return
                (version, params), self._pending = self._pending, None
                self._busy = True
                self._cond.notify_all()
            start = time.monotonic()
            try:
                nbytes = tree_bytes(params)
                self._push(version, params)
            except BaseException as e:  # surfaces in the loop's thread
                with self._cond:
                    self._error, self._failed_version = e, version
                    self._busy, self._pending = False, None
                    self._cond.notify_all()
                return
            with self._cond:
                self._busy = False
                self._pushed, self._push_s = version, time.monotonic() - start
                self._push_bytes = nbytes
                self._cond.notify_all()
