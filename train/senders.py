"""Weights to the rollout servers, one sender per server (docs/DESIGN.md §6.5): each server has
at most one ``UpdateWeights`` in flight and holds the newest version wanted for it; when its call
finishes, the sender sends that one if it is newer than what the server confirmed. A push
(``ServerPool.update_weights``) only sets what every sender wants and returns: no loop thread
waits on a server's load, a slow or deaf server delays nobody else, and a server whose load takes
several steps gets the newest version next, skipping those pushed meanwhile.

A new admission epoch (``Push.new_epoch``) sticks to what a server is wanted until an install
confirms one: a newer push that arrives while the epoch's push waits or fails carries it on. A
failed call is retried by the sender with exponential backoff (the pool's pushes,
``train.fleet_weights``, decide in ``on_result`` whether to retry, count the server current or
stop). Each sender measures its server's install time (an exponential average), from which the
pool derives when a call is overdue.

The senders share the pool's lock, the fleet's (every field of ``SendState`` is guarded by it),
and call the pushes back under it; the ``UpdateWeights`` call itself runs without it.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable

import grpc

from rollout_api.proto import rollout_pb2

log = logging.getLogger("train")

_POLL_S = 0.2  # a sender re-checks its clock this often while it waits out a backoff


@dataclasses.dataclass(frozen=True)
class Push:
    """A weights version to send: the directory, LoRA's base ("" = whole params) and whether it
    starts a new admission epoch."""

    version: int
    path: str
    base_path: str = ""
    new_epoch: bool = False


@dataclasses.dataclass(eq=False)
class SendState:
    """One server's sender (guarded by the pool's lock).

    Attributes:
      wanted: the newest push not confirmed yet (None = nothing to send).
      sending: the push whose ``UpdateWeights`` is in flight, and since when (``since``).
      installed: the newest version the server confirmed since the pool last reset it (-1 =
        none: a server that (re)joins may have restarted).
      install_s: its measured install time (an exponential average; None = not measured).
      retry_at, backoff: the next retry of a failed call, and the wait after the next failure.
      calls: UpdateWeights calls made (for metrics and tests).
    """

    wanted: Push | None = None
    sending: Push | None = None
    since: float | None = None
    installed: int = -1
    install_s: float | None = None
    retry_at: float = 0.0
    backoff: float = 0.0
    calls: int = 0


class Senders:
    """The per-server senders of a pool (see the module docstring).

    Args:
      lock: the pool's lock; the senders' condition waits on it.
      request: builds the ``UpdateWeightsRequest`` of a push for a server (under the lock, at
        send time: shares and leases are the fleet's of that moment).
      may_send: whether a server may be sent to now (up or joining, not draining).
      on_result: called under the lock once a call ends, with the server, the push and the
        error (None = installed); returns whether to retry that push after a backoff.
      deadline_s: the deadline of a call to a server, from its ``SendState``.
      metadata: the gRPC metadata every call carries.
      clock: the monotonic clock of backoffs and install times.
      first_backoff, max_backoff: the first retry's wait, and the cap of its doubling.
    """

    def __init__(
        self,
        lock: threading.RLock,
        *,
        request: Callable[[object, Push], rollout_pb2.UpdateWeightsRequest],
        may_send: Callable[[object], bool],
        on_result: Callable[[object, Push, grpc.RpcError | None], bool],
        deadline_s: Callable[[SendState], float],
        metadata: tuple,
        clock: Callable[[], float] = time.monotonic,
        first_backoff: float = 0.5,
        max_backoff: float = 30.0,
    ):
        self._cond = threading.Condition(lock)
        self._request, self._may_send, self._on_result = request, may_send, on_result
        self._deadline_s, self._metadata, self._clock = deadline_s, metadata, clock
        self._first_backoff, self._max_backoff = first_backoff, max_backoff
        self._states: dict[object, SendState] = {}
        self._threads: dict[object, threading.Thread] = {}
        self._closed = False

    def state(self, server: object) -> SendState:
        """``server``'s sender state (made on first use; call under the lock)."""
        if server not in self._states:
            self._states[server] = SendState(backoff=self._first_backoff)
        return self._states[server]

    def want(self, server: object, push: Push) -> None:
        """Makes ``push`` what ``server`` is sent next, unless it wants a newer one already or
        confirmed this version (an epoch owed carries on to a newer push). Call under the lock;
        returns at once."""
        st = self.state(server)
        wanted = st.wanted
        if wanted is not None and wanted.version > push.version:
            return
        epoch = push.new_epoch or (wanted is not None and wanted.new_epoch)
        if push.version <= st.installed and not epoch:
            return
        st.wanted = dataclasses.replace(push, new_epoch=epoch)
        self._start(server)
        self._cond.notify_all()

    def reset(self, server: object) -> None:
        """Forgets what ``server`` confirmed and wanted (it left: it may come back restarted);
        a call in flight finishes unheeded. Call under the lock."""
        st = self.state(server)
        st.wanted, st.installed = None, -1
        st.retry_at, st.backoff = 0.0, self._first_backoff

    def forget(self, server: object) -> None:
        """``server`` left the fleet for good: its sender stops. Call under the lock."""
        self._states.pop(server, None)
        self._cond.notify_all()

    def wake(self) -> None:
        """Re-checks every sender now (the clock moved, a server came back)."""
        with self._cond:
            self._cond.notify_all()

    def wait_for(self, predicate: Callable[[], bool], timeout_s: float) -> bool:
        """Waits (on the real clock, at most ``timeout_s``) until ``predicate()``, checked under
        the lock after every call that ends; returns whether it holds."""
        with self._cond:
            return self._cond.wait_for(predicate, timeout=timeout_s)

    def close(self) -> None:
        """Stops the senders (a call in flight is not waited for: its thread is a daemon)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            threads = list(self._threads.values())
        for t in threads:
            t.join(timeout=0.5)

    def _start(self, server: object) -> None:
        thread = self._threads.get(server)
        if thread is not None and thread.is_alive():
            return
        thread = threading.Thread(
            target=self._run, args=(server,), name="weights-sender", daemon=True
        )
        self._threads[server] = thread
        thread.start()

    def _due(self, server: object) -> Push | None:
        st = self._states.get(server)
        if st is None or st.wanted is None or st.sending is not None:
            return None
        if self._clock() < st.retry_at or not self._may_send(server):
            return None
        return st.wanted

    def _run(self, server: object) -> None:
        while True:
            with self._cond:
                while True:
                    if self._closed or server not in self._states:
                        self._threads.pop(server, None)
                        return
                    push = self._due(server)
                    if push is not None:
                        break
                    self._cond.wait(_POLL_S)
                st = self._states[server]
                st.sending, st.since = push, self._clock()
                st.calls += 1
                request = self._request(server, push)
                deadline = self._deadline_s(st)
            error: grpc.RpcError | None = None
            try:
                server.stub.UpdateWeights(request, timeout=deadline, metadata=self._metadata)
            except grpc.RpcError as e:
                error = e
            with self._cond:
                self._finished(server, push, error)
                self._cond.notify_all()

    def _finished(self, server: object, push: Push, error: grpc.RpcError | None) -> None:
        st = self._states.get(server)
        if st is None:
            return
        started, st.sending, st.since = st.since, None, None
        if error is None:
            took = self._clock() - (started or self._clock())
            st.install_s = took if st.install_s is None else 0.7 * st.install_s + 0.3 * took
            self.confirmed(server, push.version, epoch=push.new_epoch)
            st.retry_at, st.backoff = 0.0, self._first_backoff
        retry = self._on_result(server, push, error)
        if error is None:
            return
        wanted = st.wanted
        if not retry:
            # Refused for good (or not to be sent): the same push is not sent again; a newer
            # one wanted meanwhile still goes.
            if wanted is not None and wanted.version <= push.version:
                st.wanted = None
            return
        if wanted is None:  # nothing newer meanwhile: the same push again
            st.wanted = push
        elif push.new_epoch and not wanted.new_epoch:  # the epoch is still owed
            st.wanted = dataclasses.replace(wanted, new_epoch=True)
        st.retry_at = self._clock() + st.backoff
        st.backoff = min(2 * st.backoff, self._max_backoff)

    def confirmed(self, server: object, version: int, *, epoch: bool = False) -> None:
        """``server`` holds ``version`` (an install, or a refusal because it holds a newer one):
        what it wants is done unless newer (an owed epoch is done if ``epoch``). Call under the
        lock."""
        st = self.state(server)
        st.installed = max(st.installed, version)
        wanted = st.wanted
        if wanted is None:
            return
        if wanted.version <= version and (epoch or not wanted.new_epoch):
            st.wanted = None
        elif epoch and wanted.new_epoch:
            st.wanted = dataclasses.replace(wanted, new_epoch=False)
