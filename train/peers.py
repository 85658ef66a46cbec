"""Trainer processes watching each other (docs/DESIGN.md §7.3): when one is lost, every other one
stops at once with an error naming it, instead of hanging or aborting without saying which.

What JAX does alone (0.10): the coordination service declares a process dead after
``heartbeat_timeout_seconds`` (100 s by default) without a heartbeat and then ends every other
one with SIGABRT and a C++ log ("another task died"); a collective with a dead process fails
sooner, in the one thread that runs it, after which the process's exit waits in JAX's shutdown
barrier for that same heartbeat. Neither names the lost process where an operator looks.

``watch`` adds one TCP connection per pair of trainer processes (addresses exchanged through the
coordination service's key-value store), read on a thread of each process. A process that dies in
any way its kernel survives (kill -9, a crash, the OOM killer) closes its connections, and every
other process logs ``trainer process K of N (host H, pid P) is lost`` and exits with
``PEER_LOST_EXIT`` at once, whatever its main thread waits on (a collective, a barrier, a Pull). A
process that leaves ``watch`` normally says goodbye first, so its exit is no loss; one that leaves
it with an exception does not, and the others stop too (they could not go on without it). A host
that vanishes without closing its connections is left to JAX's heartbeat. Relaunching every
process resumes from the last whole checkpoint (§7.3).
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import socket
import struct
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

log = logging.getLogger("train")

PEER_LOST_EXIT = 75  # EX_TEMPFAIL: relaunch every process to resume from the last checkpoint
_KEY = "sat_jax/peer_watch/{}"
_BYE = b"B"


class PeerWatch:
    """The pairwise connections of one trainer process, and the thread that reads them.

    Args:
      client: the JAX distributed client (its ``key_value_set`` and ``blocking_key_value_get``).
      process_id, num_processes: this process and how many there are.
      host_ip: the address the other processes reach this one at.
      timeout_s: how long ``start`` waits for the others.
      on_lost: called once, on the watching thread, with the message naming the lost process
        (default: log it and exit with ``PEER_LOST_EXIT``).
    """

    def __init__(
        self,
        client: Any,
        process_id: int,
        num_processes: int,
        *,
        host_ip: str,
        timeout_s: float = 300.0,
        on_lost: Callable[[str], None] | None = None,
    ):
        self._client, self._id, self._n = client, process_id, num_processes
        self._host_ip, self._timeout_s = host_ip, timeout_s
        self._on_lost = on_lost or _exit_lost
        self._conns: dict[int, socket.socket] = {}
        self._names: dict[int, str] = {}
        self._closing = threading.Event()
        self.lost = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="peer-watch", daemon=True)

    def start(self) -> None:
        """Connects to every other process (to the lower ids; the higher ones connect here) and
        starts watching.

        Raises:
          OSError, RuntimeError: another process did not show up within ``timeout_s``.
        """
        listener = socket.create_server(("", 0), backlog=max(self._n, 1))
        try:
            port = listener.getsockname()[1]
            me = f"{self._host_ip}:{port} {socket.gethostname()} {os.getpid()}"
            self._client.key_value_set(_KEY.format(self._id), me)
            for j in range(self._n):
                if j != self._id:
                    value = self._client.blocking_key_value_get(
                        _KEY.format(j), int(self._timeout_s * 1000)
                    )
                    address, host, pid = value.split(" ")
                    self._names[j] = f"host {host}, pid {pid}"
                    if j < self._id:
                        ip, peer_port = address.rsplit(":", 1)
                        conn = socket.create_connection((ip, int(peer_port)), self._timeout_s)
                        conn.sendall(struct.pack("!I", self._id))
                        self._conns[j] = conn
            listener.settimeout(self._timeout_s)
            while len(self._conns) < self._n - 1:
                conn, _ = listener.accept()
                conn.settimeout(self._timeout_s)
                (j,) = struct.unpack("!I", _read_exactly(conn, 4))
                self._conns[j] = conn
        finally:
            listener.close()
        for conn in self._conns.values():
            conn.settimeout(None)
        self._thread.start()

    def close(self, *, goodbye: bool) -> None:
        """Stops watching; ``goodbye``: tell the others this process ends normally first."""
        self._closing.set()
        for conn in self._conns.values():
            with contextlib.suppress(OSError):
                if goodbye:
                    conn.sendall(_BYE)
                conn.shutdown(socket.SHUT_WR)
        self._thread.join(timeout=5)
        for conn in self._conns.values():
            conn.close()

    def _watch(self) -> None:
        open_ = dict(self._conns)
        while open_ and not self._closing.is_set():
            readable, _, _ = select.select(list(open_.values()), [], [], 0.5)
            for conn in readable:
                j = next(k for k, c in open_.items() if c is conn)
                try:
                    data = conn.recv(16)
                except OSError:
                    data = b""
                if data.startswith(_BYE):
                    del open_[j]  # it ends normally; its close is no loss
                elif not data and not self._closing.is_set():
                    self.lost.set()
                    self._on_lost(
                        f"trainer process {j} of {self._n} ({self._names[j]}) is lost: its "
                        f"connection to process {self._id} closed without a goodbye (killed, "
                        "crashed or failed). This process stops too; relaunch every trainer "
                        "process to resume from the last checkpoint"
                    )
                    return


def _read_exactly(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            raise ConnectionError("a trainer process closed its connection during the handshake")
        data += chunk
    return data


def _exit_lost(message: str) -> None:
    """Logs ``message`` and ends the process with ``PEER_LOST_EXIT`` now: its collectives and
    barriers cannot finish without the lost process, and JAX's own exit would wait for the
    heartbeat timeout in its shutdown barrier."""
    log.error(message)
    for handler in logging.getLogger().handlers + log.handlers:
        with contextlib.suppress(Exception):
            handler.flush()
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(PEER_LOST_EXIT)


def _local_ip(coordinator_address: str) -> str:
    """The address of this host's interface toward the coordinator (no packet is sent)."""
    host = coordinator_address.rsplit(":", 1)[0].strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))
        return s.getsockname()[0]


@contextlib.contextmanager
def watch(*, timeout_s: float = 300.0, lost_wait_s: float = 10.0) -> Iterator[PeerWatch | None]:
    """Watches the other trainer processes while the block runs (nothing with one process).

    Leaving the block normally says goodbye. Leaving it with an exception first waits up to
    ``lost_wait_s`` for a loss to be seen (a collective with a dead process fails in this
    thread about when its connection closes: the named error wins), then re-raises without a
    goodbye, which stops the other processes too.
    """
    import jax

    if jax.process_count() == 1:
        yield None
        return
    from jax._src import distributed  # the client jax.distributed.initialize made

    state = distributed.global_state
    peer_watch = PeerWatch(
        state.client,
        jax.process_index(),
        jax.process_count(),
        host_ip=_local_ip(state.coordinator_address),
        timeout_s=timeout_s,
    )
    peer_watch.start()
    try:
        yield peer_watch
    except BaseException:
        peer_watch.lost.wait(lost_wait_s)
        peer_watch.close(goodbye=False)
        raise
    peer_watch.close(goodbye=True)
