"""The fleet's membership, the trainer's side (docs/DESIGN.md §6.5): which rollout servers are
*up* (pulled, pushed to) or *down*, failure streaks and their grace, probing a down server and
bringing it back, the ``servers_file``, and the run's giving up. ``train.remote.ServerPool`` holds
a ``Membership`` (the fleet) beside its other parts, which reach the servers through it.

A server whose calls keep failing for ``grace_s`` leaves with one log line (``failed``); a down
server is probed (Health) with exponential backoff capped at ``retry_max_s`` and, when it answers
live, the ``rejoin`` hook brings it back (the pool's pushes first send it the current weights;
without the hook it joins at once). Servers listed in ``servers_file`` (re-read every few
seconds) join the same way and leave when their line goes. A server that answers "draining"
(SIGTERM) is noted once (``note_draining``). No server answering for ``server_wait_s`` raises
``ServersDownError``. With ``background``, probes and the file run on a thread of the fleet's own
(``start``), so a rejoining server's weight load never holds a Pull; without, ``maintain`` runs
them on the caller's thread when due (tests, with a fake clock).

The fleet's ``lock`` (reentrant) guards every ``Member`` field, and the pool's parts share it:
each part's own state is guarded by it too, so one part may call another under it.
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
from train.member import FIRST_BACKOFF_S, Member
from train.servers_file import POLL_S, ServersFile

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
_MAINTAIN_S = 0.2  # the background thread's turn


class ServersDownError(RuntimeError):
    """No rollout server answered for ``server_wait_s`` seconds."""


class MessageTooLargeError(RuntimeError):
    """A request or reply exceeded the gRPC message limit (``server.max_message_bytes``)."""


@dataclasses.dataclass(frozen=True)
class FleetHooks:
    """What the rest of the pool does when the fleet changes (each called under the lock but
    ``upkeep``).

    Attributes:
      rejoin: a down server answered a probe at weights ``version``: bring it back (default: it
        joins at once).
      went_down: a server is out of the rotation (it may come back restarted).
      removed: a server left the fleet for good (its line left ``servers_file``).
      upkeep: runs at the end of every ``maintain`` round (outside the lock).
    """

    rejoin: Callable[[Member, int], None] | None = None
    went_down: Callable[[Member], None] = lambda server: None
    removed: Callable[[Member], None] = lambda server: None
    upkeep: Callable[[], None] = lambda: None


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

    Attributes:
      lock: guards every ``Member`` and is shared by the pool's parts (reentrant).
      servers: every server, up or down (the list is only ever changed in place).
      metadata: the gRPC metadata every call carries (the token).
      error: a fatal error of a background thread, raised by ``raise_background_error``.
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
        self.metadata = bearer_metadata(token)
        self._certificates = root_certificates
        self._max_message_bytes = max_message_bytes
        self.retry_max_s = retry_max_s
        self._server_wait_s = server_wait_s
        self._grace_s = grace_s
        self._file = ServersFile(servers_file, clock) if servers_file else None
        self._on_retry = on_retry
        self._retry_lock = threading.Lock()
        self.clock, self.sleep = clock, sleep
        self._connect = connect
        self._hooks = FleetHooks()
        self.lock = threading.RLock()
        self.servers: list[Member] = []
        self._count = 0  # servers ever added: the next index
        for address in addresses:
            self._add(address, up=True)
        self._failing_since: float | None = None  # no server has answered since
        self.error: BaseException | None = None
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, background: bool, hooks: FleetHooks | None = None) -> None:
        """Sets the ``hooks``, reads ``servers_file`` once and, with ``background``, starts the
        thread that probes and re-reads it (the pool calls this last in its constructor: the
        thread may rejoin a server at once)."""
        self._hooks = hooks or FleetHooks()
        if self._file is not None:
            self._read_servers_file()
        if background:
            self._thread = threading.Thread(target=self._run, name="server-pool", daemon=True)
            self._thread.start()

    @property
    def background(self) -> bool:
        """Whether the upkeep runs on the fleet's own thread (else callers ``maintain``)."""
        return self._thread is not None

    @property
    def addresses(self) -> tuple[str, ...]:
        """Every server's address, up or down."""
        with self.lock:
            return tuple(s.address for s in self.servers)

    def up(self) -> list[Member]:
        """The servers up now (call under the lock)."""
        return [s for s in self.servers if s.up]

    def close(self) -> None:
        """Stops the background thread and closes the channels."""
        self._closed.set()
        if self._thread is not None:
            self._thread.join(timeout=_PROBE_S + 5)
        with self.lock:
            for s in self.servers:
                s.channel.close()

    def metrics(self) -> dict[str, float]:
        """``servers_up``, ``servers_lagging`` (while any is) and ``pulled_<i>``: the groups
        pulled from each server so far (``i`` numbers the servers in the order first seen)."""
        with self.lock:
            out: dict[str, float] = {"servers_up": sum(s.up for s in self.servers)}
            if any(s.lagging for s in self.servers):
                out["servers_lagging"] = sum(s.up and s.lagging for s in self.servers)
            out.update({f"pulled_{s.index}": s.pulled for s in self.servers})
            return out

    def versions(self) -> list[int]:
        """The weights version of every server that answers (waiting for at least one; a server
        that does not answer within ``grace_s`` leaves, and joins when it does).

        Raises:
          ServersDownError: no server answered for ``server_wait_s``.
        """
        answered: dict[int, int] = {}
        backoff = self.first_backoff()
        while True:
            self.raise_background_error()
            if self._thread is None:
                self.maintain()
            with self.lock:
                waiting = [s for s in self.servers if s.up and s.index not in answered]
            for server in waiting:
                started = self.clock()
                try:
                    reply = server.stub.Health(
                        rollout_pb2.HealthRequest(), timeout=_HEALTH_S, metadata=self.metadata
                    )
                except grpc.RpcError as e:
                    self.raise_unless_transient(server, "Health", e)
                    self.failed(server, f"Health: {e.code().name}", started)
                    continue
                with self.lock:
                    self.answered(server)
                    server.server_id = reply.server_id or server.server_id
                answered[server.index] = int(reply.version)
            with self.lock:
                left = [s for s in self.servers if s.up and s.index not in answered]
            if answered and not left:
                return list(answered.values())
            if not answered and not left:
                self.wait_for_a_server()
                continue
            self.check_servers_down()
            self.sleep(backoff)
            backoff = min(2 * backoff, self.retry_max_s)

    # Health.

    def maintain(self) -> None:
        """One round of the fleet's upkeep: re-reads ``servers_file`` when due, probes the down
        servers whose backoff has passed and brings back those that answer; then the hooks'
        ``upkeep``."""
        now = self.clock()
        if self._file is not None and self._file.due():
            self._read_servers_file()
        with self.lock:
            due = [s for s in self.servers if not s.up and not s.joining and s.next_probe <= now]
        for server in due:
            self._probe(server)
        self._hooks.upkeep()

    def _run(self) -> None:
        while not self._closed.wait(_MAINTAIN_S):
            try:
                self.maintain()
            except BaseException as e:  # e.g. on_retry gave up: surfaces in the next pull
                self.error = e
                return

    def _probe(self, server: Member) -> None:
        """Health of a down server; when it answers, ``_rejoin``."""
        try:
            reply = server.stub.Health(
                rollout_pb2.HealthRequest(), timeout=_PROBE_S, metadata=self.metadata
            )
            if not reply.live:
                raise _NotLive()
        except (grpc.RpcError, _NotLive) as e:
            code = e.code().name if isinstance(e, grpc.RpcError) else "not live"
            with self.lock:
                self.note_failure()
                self.schedule_probe(server, f"Health: {code}")
            self._retry_hook()
            return
        with self.lock:
            self.answered(server)
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
        """Brings ``server``, which answered at weights ``version``, back into the rotation (the
        ``rejoin`` hook: the pool pushes it the current weights first)."""
        with self.lock:
            if self._hooks.rejoin is not None:
                self._hooks.rejoin(server, version)
            elif server in self.servers:
                self.join(server, f"at weights version {version}")

    def join(self, server: Member, how: str) -> None:
        """``server`` is up again (call under the lock)."""
        server.up, server.failing_since, server.reason = True, None, ""
        server.draining = server.joining = server.lagging = False
        server.backoff = self.first_backoff()
        log.info(
            "rollout server %s joined %s (%d up)",
            server.address,
            how,
            sum(s.up for s in self.servers),
        )

    def _leave(self, server: Member, reason: str) -> None:
        if not server.up:
            return
        self.take_out(server)
        server.reason = reason
        log.warning(
            "rollout server %s left the rotation: %s (%d up); probing it until it answers",
            server.address,
            reason,
            sum(s.up for s in self.servers),
        )

    def take_out(self, server: Member) -> None:
        """Marks ``server`` down, its first probe one backoff from now (call under the lock)."""
        server.up, server.failing_since = False, None
        server.joining = server.lagging = False
        server.backoff = self.first_backoff()
        server.next_probe = self.clock() + server.backoff
        self._hooks.went_down(server)

    def drained(self, server: Member) -> None:
        """A Pull found a draining ``server`` with nothing left: it leaves at once (no grace, no
        failure streak; logged once, by ``note_draining``)."""
        with self.lock:
            self.answered(server)
            self.note_draining(server)
            if server.up:
                self.take_out(server)

    def first_backoff(self) -> float:
        """The wait before the first retry (or probe)."""
        return min(FIRST_BACKOFF_S, self.retry_max_s)

    def note_draining(self, server: Member) -> None:
        """``server`` drains (SIGTERM, a preemption notice): no more weights go to it and its
        share goes to the others with the next push; it stays in the pull rotation until a Pull
        finds nothing left (``drained``). One log line, the first time (call under the lock)."""
        if server.draining:
            return
        server.draining = True
        log.warning(
            "rollout server %s is draining (it got SIGTERM: a preemption notice): it leaves "
            "once its groups are pulled, and is probed until it answers again (%d up)",
            server.address,
            sum(s.up and not s.draining for s in self.servers),
        )

    def schedule_probe(self, server: Member, reason: str) -> None:
        """The next probe of a down server, after its backoff (which doubles, up to
        ``retry_max_s``); a new reason is logged once (call under the lock)."""
        if reason != server.reason and not server.draining:
            log.warning("rollout server %s stays out: %s", server.address, reason)
            server.reason = reason
        server.next_probe = self.clock() + server.backoff
        server.backoff = min(2 * server.backoff, self.retry_max_s)

    def failed(self, server: Member, reason: str, started: float) -> None:
        """A call to an up server, made at ``started``, failed: the server leaves once it has
        failed for ``grace_s`` (a call that hung that long leaves at once)."""
        with self.lock:
            self.note_failure()
            now = self.clock()
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

    def answered(self, server: Member) -> None:
        """``server`` answered: its failure streak, and the fleet's silence, end (under the
        lock)."""
        server.failing_since = None
        self._failing_since = None

    def note_failure(self) -> None:
        """A call failed: the fleet's silence starts now unless it started before (under the
        lock)."""
        if self._failing_since is None:
            self._failing_since = self.clock()

    def check_servers_down(self) -> None:
        """Raises ServersDownError once no server has answered for ``server_wait_s``."""
        with self.lock:
            self.note_failure()
            silent = self.clock() - self._failing_since
            addresses = [s.address for s in self.servers]
        if silent > self._server_wait_s:
            raise ServersDownError(
                f"no rollout server answered for {self._server_wait_s:.0f}s "
                f"(train.client.wait_s): {addresses or 'none listed'}"
            )

    def wait_for_a_server(self) -> None:
        """No server is up: waits a little (for the probes), or raises ServersDownError."""
        self.check_servers_down()
        with self.lock:
            due = [s.next_probe for s in self.servers if not s.up]
        wait = min(due, default=self.clock() + POLL_S) - self.clock()
        self.sleep(min(max(wait, 0.05), self.retry_max_s, _MAINTAIN_S * 5))

    def raise_background_error(self) -> None:
        """Raises what stopped a background thread (a refused call, ``on_retry`` giving up)."""
        if self.error is not None:
            raise self.error

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
            next_probe=self.clock(),
            backoff=self.first_backoff(),
        )
        self._count += 1
        self.servers.append(server)
        return server

    def _read_servers_file(self) -> None:
        """Adds the new lines of ``servers_file`` (down: probed at once, then they join) and
        removes the servers whose lines are gone."""
        listed = self._file.read()
        if listed is None:
            return
        with self.lock:
            static = {s.address for s in self.servers if not s.from_file}
            known = {s.address: s for s in self.servers if s.from_file}
            for address in dict.fromkeys(listed):
                if address not in known and address not in static:
                    self._add(address, up=False, from_file=True)
                    log.info("rollout server %s listed in %s", address, self._file.path)
            for address, server in known.items():
                if address not in listed:
                    if server.up:
                        self._leave(server, f"removed from {self._file.path}")
                    self.servers.remove(server)
                    self._hooks.removed(server)
                    server.channel.close()

    def raise_unless_transient(self, server: Member, rpc: str, error: grpc.RpcError) -> None:
        """Raises ``error`` unless it is transient (the server may answer later): a message
        over the limit as ``MessageTooLargeError``."""
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
