"""The fleet's membership, the trainer's side (docs/DESIGN.md §6.5): which rollout servers are
*up* (pulled, pushed to) or *down*, failure streaks and their grace, probing a down server and
bringing it back, the ``servers_file``, and the run's giving up. ``train.remote.ServerPool`` is a
``Membership`` that also pulls, acknowledges and pushes.

A server whose calls keep failing for ``grace_s`` leaves with one log line (``_failed``); a down
server is probed (Health) with exponential backoff capped at ``retry_max_s`` and, when it answers
live, ``_rejoin`` brings it back (``ServerPool`` first pushes it the current weights). Servers
listed in ``servers_file`` (re-read every few seconds) join the same way and leave when their line
goes. A server that answers "draining" (SIGTERM) is noted once (``_note_draining``). No server
answering for ``server_wait_s`` raises ``ServersDownError``. With ``background``, probes and the
file run on a thread of the pool's own (``_start``), so a rejoining server's weight load never
holds a Pull; without, ``maintain`` runs them on the caller's thread when due (tests, with a fake
clock).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Sequence

import grpc

from rollout_api.client import bearer_metadata, connect
from rollout_api.proto import rollout_pb2

log = logging.getLogger("train")

# Status codes that mean "not reachable right now"; anything else is a real error.
_TRANSIENT = (
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
)
# gRPC reports a message over the size limit (either way) as RESOURCE_EXHAUSTED with this text.
_TOO_LARGE = "larger than max"
_HEALTH_S = 10.0  # deadline of a Health call to an up server
_PROBE_S = 5.0  # deadline of a probe of a down server
_FIRST_BACKOFF_S = 0.5
_FILE_POLL_S = 3.0  # how often servers_file is re-read
_MAINTAIN_S = 0.2  # the background thread's turn


class ServersDownError(RuntimeError):
    """No rollout server answered for ``server_wait_s`` seconds."""


class MessageTooLargeError(RuntimeError):
    """A request or reply exceeded the gRPC message limit (``server.max_message_bytes``)."""


@dataclasses.dataclass(eq=False)
class Member:
    """One rollout server as the pool sees it (mutable; guarded by the pool's lock)."""

    address: str
    index: int  # stable for the pool's life: its metric is pulled_<index>
    channel: grpc.Channel
    stub: object
    from_file: bool = False
    up: bool = True
    failing_since: float | None = None  # first failure of the current streak, while up
    next_probe: float = 0.0
    backoff: float = _FIRST_BACKOFF_S
    reason: str = ""  # why it is down (logged when it changes)
    draining: bool = False  # it drains (SIGTERM): no weights, no share; probes quiet until back
    joining: bool = False  # answered a probe: its sender brings it up to date, then it joins
    lagging: bool = False  # its calls are overdue (deaf): fenced, no share, still pulled
    pull_overhead_s: float | None = None  # a Pull's time beyond its wait (an average)
    pulling: bool = False  # a launched Pull is in flight (``ServerPool._launch_pull``)
    pull_result: str = ""  # how the last launched Pull ended: "ok", "failed" or "deaf"
    pull_asked: int = 0  # the groups the launched Pull asked for, and its batch's version
    pull_for: int = 0
    pull_started: float = 0.0  # when the launched Pull started, its wait and deadline (s)
    pull_wait: float = 0.0
    pull_deadline: float = 0.0
    grants: list[tuple[float, int]] = dataclasses.field(default_factory=list)  # (share, until)
    server_id: str = ""
    pulled: int = 0
    rate: float = 0.0  # its capacity, as its last Pull reply said (0 = not known)
    # Not yet sent: (server_id, group_id) to acknowledge, and to acknowledge as rejected.
    acks: list[tuple[str, int]] = dataclasses.field(default_factory=list)
    rejects: list[tuple[str, int]] = dataclasses.field(default_factory=list)
    # Not yet sent: (server_id, group_id) of leased groups to hand back unleased.
    returns: list[tuple[str, int]] = dataclasses.field(default_factory=list)


class Membership:
    """The servers and which of them are up (see the module docstring).

    Args:
      addresses: "host:port" of each server (may be empty with a ``servers_file``).
      token: the shared token every call carries ("" = none).
      root_certificates: PEM CA certificates: connect over TLS (None = plaintext).
      max_message_bytes: the gRPC message limit both ways (``server.max_message_bytes``).
      retry_max_s: the longest wait between retries, and between probes of a down server.
      server_wait_s: how long no server may answer (counted from the first failure after the last
        answer) before ``ServersDownError``.
      grace_s: how long a server's calls may keep failing before it leaves the rotation.
      servers_file: a file of "host:port" lines, re-read every few seconds: new lines join, removed
        ones leave ("" = none).
      on_retry: called after a failed call or probe; may raise to stop (e.g. when a local server
        process has exited for good).
      clock: the monotonic clock, in seconds, of grace, backoff and ``server_wait_s``.
      sleep: waits between retries (tests pass a fake clock's, so retries take no time).
      connect: opens a server's (channel, stub) from its address, the message limit and the
        certificates (``rollout_api.client.connect``; tests pass fakes).
    """

    def __init__(
        self,
        addresses: Sequence[str],
        *,
        token: str,
        root_certificates: bytes | None,
        max_message_bytes: int,
        retry_max_s: float,
        server_wait_s: float,
        grace_s: float,
        servers_file: str,
        on_retry: Callable[[], None] | None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        connect: Callable[..., tuple[grpc.Channel, object]] = connect,
    ):
        if not addresses and not servers_file:
            raise ValueError("ServerPool needs at least one address or a servers_file")
        self._metadata = bearer_metadata(token)
        self._certificates = root_certificates
        self._max_message_bytes = max_message_bytes
        self._retry_max_s = retry_max_s
        self._server_wait_s = server_wait_s
        self._grace_s = grace_s
        self._servers_file = servers_file
        self._on_retry = on_retry
        self._retry_lock = threading.Lock()
        self._clock, self._sleep = clock, sleep
        self._connect = connect
        self._lock = threading.RLock()
        self._servers: list[Member] = []
        self._count = 0  # servers ever added: the next index
        for address in addresses:
            self._add(address, up=True)
        self._failing_since: float | None = None  # no server has answered since
        self._file_read_at: float | None = None
        self._file_error = ""
        self._error: BaseException | None = None  # raised by the background thread
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None

    def _start(self, background: bool) -> None:
        """Reads ``servers_file`` once and, with ``background``, starts the thread that probes
        and re-reads it (the subclass calls this last in its constructor: the thread may rejoin
        a server at once)."""
        if self._servers_file:
            self._read_servers_file()
        if background:
            self._thread = threading.Thread(target=self._run, name="server-pool", daemon=True)
            self._thread.start()

    @property
    def addresses(self) -> tuple[str, ...]:
        """Every server's address, up or down."""
        with self._lock:
            return tuple(s.address for s in self._servers)

    def close(self) -> None:
        """Stops the background thread and closes the channels (call ``flush_acks`` first to
        send pending acknowledgements)."""
        self._closed.set()
        if self._thread is not None:
            self._thread.join(timeout=_PROBE_S + 5)
        with self._lock:
            for s in self._servers:
                s.channel.close()

    def versions(self) -> list[int]:
        """The weights version of every server that answers (waiting for at least one; a server
        that does not answer within ``grace_s`` leaves, and joins when it does).

        Raises:
          ServersDownError: no server answered for ``server_wait_s``.
        """
        answered: dict[int, int] = {}
        backoff = self._first_backoff()
        while True:
            self._raise_background_error()
            if self._thread is None:
                self.maintain()
            with self._lock:
                waiting = [s for s in self._servers if s.up and s.index not in answered]
            for server in waiting:
                started = self._clock()
                try:
                    reply = server.stub.Health(
                        rollout_pb2.HealthRequest(), timeout=_HEALTH_S, metadata=self._metadata
                    )
                except grpc.RpcError as e:
                    self._raise_unless_transient(server, "Health", e)
                    self._failed(server, f"Health: {e.code().name}", started)
                    continue
                with self._lock:
                    self._answered(server)
                    server.server_id = reply.server_id or server.server_id
                answered[server.index] = int(reply.version)
            with self._lock:
                left = [s for s in self._servers if s.up and s.index not in answered]
            if answered and not left:
                return list(answered.values())
            if not answered and not left:
                self._wait_for_a_server()
                continue
            self._check_servers_down()
            self._sleep(backoff)
            backoff = min(2 * backoff, self._retry_max_s)

    # Health.

    def maintain(self) -> None:
        """One round of the fleet's upkeep: re-reads ``servers_file`` when due, probes the down
        servers whose backoff has passed and brings back those that answer."""
        now = self._clock()
        if self._servers_file and (
            self._file_read_at is None or now - self._file_read_at >= _FILE_POLL_S
        ):
            self._read_servers_file()
        with self._lock:
            due = [s for s in self._servers if not s.up and not s.joining and s.next_probe <= now]
        for server in due:
            self._probe(server)

    def _run(self) -> None:
        while not self._closed.wait(_MAINTAIN_S):
            try:
                self.maintain()
            except BaseException as e:  # e.g. on_retry gave up: surfaces in the next pull
                self._error = e
                return

    def _probe(self, server: Member) -> None:
        """Health of a down server; when it answers, ``_rejoin``."""
        try:
            reply = server.stub.Health(
                rollout_pb2.HealthRequest(), timeout=_PROBE_S, metadata=self._metadata
            )
            if not reply.live:
                raise _NotLive()
        except (grpc.RpcError, _NotLive) as e:
            code = e.code().name if isinstance(e, grpc.RpcError) else "not live"
            with self._lock:
                self._note_failure()
                self._schedule_probe(server, f"Health: {code}")
            self._retry_hook()
            return
        with self._lock:
            self._answered(server)
            if server.server_id and reply.server_id and reply.server_id != server.server_id:
                dropped = len(server.acks) + len(server.rejects)
                if dropped:
                    log.warning(
                        "rollout server %s came back as another server (id %s, was %s): %d "
                        "acknowledgements for the old one dropped",
                        server.address,
                        reply.server_id,
                        server.server_id,
                        dropped,
                    )
                server.acks, server.rejects, server.returns = [], [], []
                server.rate = 0.0  # another server: its capacity is measured again
            server.server_id = reply.server_id or server.server_id
        self._rejoin(server, int(reply.version))

    def _rejoin(self, server: Member, version: int) -> None:
        """Brings ``server``, which answered at weights ``version``, back into the rotation
        (``ServerPool`` pushes it the current weights first)."""
        with self._lock:
            if server in self._servers:
                self._join(server, f"at weights version {version}")

    def _join(self, server: Member, how: str) -> None:
        server.up, server.failing_since, server.reason = True, None, ""
        server.draining = server.joining = server.lagging = False
        server.backoff = self._first_backoff()
        log.info(
            "rollout server %s joined %s (%d up)",
            server.address,
            how,
            sum(s.up for s in self._servers),
        )

    def _leave(self, server: Member, reason: str) -> None:
        if not server.up:
            return
        self._take_out(server)
        server.reason = reason
        log.warning(
            "rollout server %s left the rotation: %s (%d up); probing it until it answers",
            server.address,
            reason,
            sum(s.up for s in self._servers),
        )

    def _take_out(self, server: Member) -> None:
        """Marks ``server`` down, its first probe one backoff from now."""
        server.up, server.failing_since = False, None
        server.joining = server.lagging = False
        server.backoff = self._first_backoff()
        server.next_probe = self._clock() + server.backoff
        self._went_down(server)

    def _went_down(self, server: Member) -> None:
        """``server`` is out of the rotation (it may come back restarted); ``ServerPool``
        resets its sender."""

    def _removed(self, server: Member) -> None:
        """``server`` left the fleet for good (its line left ``servers_file``)."""

    def _first_backoff(self) -> float:
        return min(_FIRST_BACKOFF_S, self._retry_max_s)

    def _note_draining(self, server: Member) -> None:
        """``server`` drains (SIGTERM, a preemption notice): no more weights go to it and its
        share goes to the others with the next push; it stays in the pull rotation until a Pull
        finds nothing left (``_drained``). One log line, the first time."""
        if server.draining:
            return
        server.draining = True
        log.warning(
            "rollout server %s is draining (it got SIGTERM: a preemption notice): it leaves "
            "once its groups are pulled, and is probed until it answers again (%d up)",
            server.address,
            sum(s.up and not s.draining for s in self._servers),
        )

    def _schedule_probe(self, server: Member, reason: str) -> None:
        """The next probe of a down server, after its backoff (which doubles, up to
        ``retry_max_s``); a new reason is logged once."""
        if reason != server.reason and not server.draining:
            log.warning("rollout server %s stays out: %s", server.address, reason)
            server.reason = reason
        server.next_probe = self._clock() + server.backoff
        server.backoff = min(2 * server.backoff, self._retry_max_s)

    def _failed(self, server: Member, reason: str, started: float) -> None:
        """A call to an up server, made at ``started``, failed: the server leaves once it has
        failed for ``grace_s`` (a call that hung that long leaves at once)."""
        with self._lock:
            self._note_failure()
            now = self._clock()
            if server.up and server.failing_since is None:
                server.failing_since = started
                log.warning(
                    "rollout server %s is down (%s); it leaves the rotation unless it answers "
                    "within %.0fs",
                    server.address,
                    reason,
                    self._grace_s,
                )
            if server.up and now - server.failing_since >= self._grace_s:
                self._leave(server, reason)
        self._retry_hook()

    def _retry_hook(self) -> None:
        """``on_retry``, on one thread at a time (the loop's pulls and the probes both call it:
        a crashed local child must be started once)."""
        if self._on_retry is not None:
            with self._retry_lock:
                self._on_retry()

    def _answered(self, server: Member) -> None:
        server.failing_since = None
        self._failing_since = None

    def _note_failure(self) -> None:
        if self._failing_since is None:
            self._failing_since = self._clock()

    def _check_servers_down(self) -> None:
        """Raises ServersDownError once no server has answered for ``server_wait_s``."""
        with self._lock:
            self._note_failure()
            silent = self._clock() - self._failing_since
            addresses = [s.address for s in self._servers]
        if silent > self._server_wait_s:
            raise ServersDownError(
                f"no rollout server answered for {self._server_wait_s:.0f}s "
                f"(train.client.wait_s): {addresses or 'none listed'}"
            )

    def _wait_for_a_server(self) -> None:
        """No server is up: waits a little (for the probes), or raises ServersDownError."""
        self._check_servers_down()
        with self._lock:
            due = [s.next_probe for s in self._servers if not s.up]
        wait = min(due, default=self._clock() + _FILE_POLL_S) - self._clock()
        self._sleep(min(max(wait, 0.05), self._retry_max_s, _MAINTAIN_S * 5))

    def _raise_background_error(self) -> None:
        if self._error is not None:
            raise self._error

    def _add(self, address: str, *, up: bool, from_file: bool = False) -> Member:
        channel, stub = self._connect(
            address, self._max_message_bytes, root_certificates=self._certificates
        )
        server = Member(
            address=address,
            index=self._count,
            channel=channel,
            stub=stub,
            from_file=from_file,
            up=up,
            next_probe=self._clock(),
            backoff=self._first_backoff(),
        )
        self._count += 1
        self._servers.append(server)
        return server

    def _read_servers_file(self) -> None:
        """Adds the new lines of ``servers_file`` (down: probed at once, then they join) and
        removes the servers whose lines are gone."""
        self._file_read_at = self._clock()
        try:
            with open(self._servers_file) as f:
                lines = [line.split("#", 1)[0].strip() for line in f]
        except OSError as e:
            if str(e) != self._file_error:
                log.warning("cannot read train.client.servers_file: %s; keeping its servers", e)
                self._file_error = str(e)
            return
        self._file_error = ""
        listed = []
        for line in lines:
            host, sep, port = line.rpartition(":")
            if not line:
                continue
            if not sep or not host or not port.isdigit():
                log.warning(
                    "train.client.servers_file %s: %r is not host:port", self._servers_file, line
                )
                continue
            listed.append(line)
        with self._lock:
            static = {s.address for s in self._servers if not s.from_file}
            known = {s.address: s for s in self._servers if s.from_file}
            for address in dict.fromkeys(listed):
                if address not in known and address not in static:
                    self._add(address, up=False, from_file=True)
                    log.info("rollout server %s listed in %s", address, self._servers_file)
            for address, server in known.items():
                if address not in listed:
                    if server.up:
                        self._leave(server, f"removed from {self._servers_file}")
                    self._servers.remove(server)
                    self._removed(server)
                    server.channel.close()

    def _raise_unless_transient(self, server: Member, rpc: str, error: grpc.RpcError) -> None:
        code, details = error.code(), error.details() or ""
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED and _TOO_LARGE in details:
            raise MessageTooLargeError(
                f"{rpc} with rollout server {server.address}: a message is over the gRPC limit "
                f"of {self._max_message_bytes} bytes ({details}); raise server.max_message_bytes "
                "(it sets the limit of the trainer and of the servers)"
            ) from error
        if code not in _TRANSIENT:
            raise error


class _NotLive(Exception):
    """A server answered Health with live = false (its loop or driver stopped)."""
