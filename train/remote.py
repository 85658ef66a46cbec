"""The trainer's side of the rollout servers (docs/DESIGN.md §6.2 protocol; §7.1 steps 1
and 6, pull and push): pulling groups and pushing weights over gRPC.

Knows the servers only through the generated proto client. Every RPC goes through one retry loop
(``ServerPool._call``): a server that does not answer is retried with exponential backoff (capped
at ``retry_max_s``) and a log line per failure; the pool gives up when the servers have failed
without a single answer for ``server_wait_s``. A reply or request over the gRPC message limit
(``server.max_message_bytes``) is not retried: it would fail the same way every time.

A Pull's groups are decoded and validated here, once (``rollout_api.records.decode_pulled``):
the pool hands out ``Group`` records, and an ``InvalidGroup`` for each group that does not fit
the trainer's model, which the trainer counts and rejects.

Every call carries the shared token as gRPC metadata (``authorization: Bearer <token>``) and the
run id; with a CA (``train.tls_ca``) the channels are TLS. Pulled groups are leased by their
server until acknowledged (docs/DESIGN.md §6.2): ``ack`` queues their ids, which ride on the next
Pull to the same server; ``flush_acks`` sends the rest with the Ack RPC.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import grpc
from google.protobuf.message import Message

from rollout_api.client import bearer_metadata, connect
from rollout_api.proto import rollout_pb2
from rollout_api.records import Group, GroupLimits, InvalidGroup, decode_pulled

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
# Deadline of one RPC beyond what the request itself waits for.
_PULL_SLACK_S = 30.0
_UPDATE_WEIGHTS_S = 120.0
_HEALTH_S = 10.0


class ServersDownError(RuntimeError):
    """No rollout server answered for ``server_wait_s`` seconds."""


class MessageTooLargeError(RuntimeError):
    """A request or reply exceeded the gRPC message limit (``server.max_message_bytes``)."""


class ServerPool:
    """One or more rollout servers, pulled from in turn.

    Args:
      addresses: "host:port" of each server.
      token: the shared token every call carries ("" = none).
      run_id: this trainer run's id (stable across its restarts; the servers let only the
        attached run start an admission epoch).
      root_certificates: PEM CA certificates: connect over TLS (None = plaintext).
      max_message_bytes: the gRPC message limit both ways (``server.max_message_bytes``).
      retry_max_s: the longest wait between retries of a down server.
      server_wait_s: how long one call may keep failing (no server answering) before
        ``ServersDownError``; counted from its first failure, not from the last answer.
      on_retry: called before each retry; may raise to stop waiting (e.g. when a local server
        process has exited).
      clock: the monotonic clock, in seconds, that ``server_wait_s`` is measured with.
      sleep: waits between retries (tests pass a fake clock's, so retries take no time).
    """

    def __init__(
        self,
        addresses: Sequence[str],
        *,
        token: str,
        run_id: str = "",
        root_certificates: bytes | None = None,
        max_message_bytes: int,
        retry_max_s: float,
        server_wait_s: float,
        on_retry: Callable[[], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ):
        if not addresses:
            raise ValueError("ServerPool needs at least one address")
        self.addresses = tuple(addresses)
        self._token = token
        self._metadata = bearer_metadata(token)
        self._run_id = run_id
        self._max_message_bytes = max_message_bytes
        self._retry_max_s = retry_max_s
        self._server_wait_s = server_wait_s
        self._on_retry = on_retry
        self._clock, self._sleep = clock, sleep
        self._conns = [
            connect(a, max_message_bytes, root_certificates=root_certificates)
            for a in self.addresses
        ]
        self._next = 0
        self._origin: dict[str, int] = {}  # group key -> the server it came from, until acked
        # Per server, not yet sent: ids to acknowledge, and to acknowledge as rejected.
        self._acks: list[list[int]] = [[] for _ in self.addresses]
        self._rejects: list[list[int]] = [[] for _ in self.addresses]

    def close(self) -> None:
        """Closes the channels (call ``flush_acks`` first to send pending acknowledgements)."""
        for channel, _ in self._conns:
            channel.close()

    def __enter__(self) -> ServerPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def pull(
        self, max_groups: int, timeout_s: float, *, limits: GroupLimits | None = None
    ) -> list[Group | InvalidGroup]:
        """Up to ``max_groups`` groups from the next server that answers (possibly none), decoded
        and validated against ``limits``.

        Args:
          max_groups: the most groups to take.
          timeout_s: how long the server may wait for a first group.
          limits: the trainer's model (vocabulary, experts, routing (L, K)); None = check only
            that each group is well formed.

        Returns:
          The groups in the server's order: a ``Group`` record for each valid one, an
          ``InvalidGroup`` (what is wrong) for each other one.

        Raises:
          ServersDownError, MessageTooLargeError, grpc.RpcError: as in ``_call``.
        """
        # With several servers, a short wait on each keeps one slow server from stalling us.
        wait = timeout_s if len(self._conns) == 1 else min(timeout_s, 1.0)
        sent: dict[int, tuple[list[int], list[int]]] = {}

        def request(i: int) -> rollout_pb2.PullRequest:
            sent[i] = list(self._acks[i]), list(self._rejects[i])
            return rollout_pb2.PullRequest(
                max_groups=max_groups,
                timeout_s=wait,
                ack_group_ids=sent[i][0],
                reject_group_ids=sent[i][1],
                run_id=self._run_id,
            )

        i, response = self._call("Pull", request, deadline_s=wait + _PULL_SLACK_S, server=None)
        del self._acks[i][: len(sent[i][0])]  # delivered with the Pull
        del self._rejects[i][: len(sent[i][1])]
        pulled = decode_pulled(response.groups, limits)
        for g in pulled:
            self._origin[g.key] = i
        return pulled

    def ack(self, groups: Sequence[Group | InvalidGroup], *, rejected: bool = False) -> None:
        """Acknowledges pulled ``groups`` (sent with the next Pull to their server, or by
        ``flush_acks``); groups not pulled through this pool are ignored. ``rejected``: they
        will not be trained (stale, duplicate, invalid), so their server generates replacements."""
        pending = self._rejects if rejected else self._acks
        for g in groups:
            i = self._origin.pop(g.key, None)
            if i is not None:
                pending[i].append(g.group_id)

    def flush_acks(self) -> None:
        """Sends every pending acknowledgement now (the Ack RPC, retried like any call)."""
        for i, (ids, rejects) in enumerate(zip(self._acks, self._rejects, strict=True)):
            if ids or rejects:
                request = rollout_pb2.AckRequest(
                    group_ids=ids, reject_group_ids=rejects, run_id=self._run_id
                )
                self._call("Ack", request, deadline_s=_HEALTH_S, server=i)
                self._acks[i], self._rejects[i] = [], []

    def update_weights(
        self, version: int, checkpoint_path: str, *, new_admission_epoch: bool = False
    ) -> None:
        """Makes every server load ``checkpoint_path`` as ``version`` (retrying down servers).

        Args:
          version: the weights version (>= each server's current one).
          checkpoint_path: the weights directory, as the servers see it.
          new_admission_epoch: the servers stop counting the groups they dispatched so far
            against their staleness budget (set when this trainer connects: it drops those).

        Raises:
          grpc.RpcError: a server refused the update (e.g. a version older than its own).
          ServersDownError, MessageTooLargeError: as in ``_call``.
        """
        request = rollout_pb2.UpdateWeightsRequest(
            version=version,
            checkpoint_path=checkpoint_path,
            token=self._token,
            new_admission_epoch=new_admission_epoch,
            run_id=self._run_id,
        )
        for i in range(len(self._conns)):
            self._call("UpdateWeights", request, deadline_s=_UPDATE_WEIGHTS_S, server=i)

    def versions(self) -> list[int]:
        """Each server's current weights version (waiting for down servers)."""
        request = rollout_pb2.HealthRequest()
        return [
            int(self._call("Health", request, deadline_s=_HEALTH_S, server=i)[1].version)
            for i in range(len(self._conns))
        ]

    def _call(
        self,
        rpc: str,
        request: Message | Callable[[int], Message],
        *,
        deadline_s: float,
        server: int | None,
    ) -> tuple[int, Message]:
        """(the server that answered, its response of ``rpc``), retried until one answers; with
        ``server=None``, each attempt goes to the next server in turn. ``request`` may be a
        function of the server's index.

        Raises:
          ServersDownError: every attempt failed for ``server_wait_s``.
          MessageTooLargeError: the request or the reply is over ``max_message_bytes``.
          grpc.RpcError: a non-transient error (the server refused the request).
        """
        backoff, failing_since = min(0.5, self._retry_max_s), None
        while True:
            i = server
            if i is None:
                i, self._next = self._next, (self._next + 1) % len(self._conns)
            message = request(i) if callable(request) else request
            try:
                stub = self._conns[i][1]
                return i, getattr(stub, rpc)(message, timeout=deadline_s, metadata=self._metadata)
            except grpc.RpcError as e:
                self._raise_unless_transient(i, rpc, e)
                code = e.code()
            now = self._clock()
            failing_since = now if failing_since is None else failing_since
            if now - failing_since > self._server_wait_s:
                raise ServersDownError(
                    f"no rollout server answered for {self._server_wait_s:.0f}s: {self.addresses}"
                )
            if self._on_retry is not None:
                self._on_retry()
            log.warning(
                "rollout server %s is down (%s: %s); retrying in %.1fs",
                self.addresses[i],
                rpc,
                code.name,
                backoff,
            )
            self._sleep(backoff)
            backoff = min(2 * backoff, self._retry_max_s)

    def _raise_unless_transient(self, i: int, rpc: str, error: grpc.RpcError) -> None:
        code, details = error.code(), error.details() or ""
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED and _TOO_LARGE in details:
            raise MessageTooLargeError(
                f"{rpc} with rollout server {self.addresses[i]}: a message is over the gRPC limit "
                f"of {self._max_message_bytes} bytes ({details}); raise server.max_message_bytes "
                "(it sets the limit of the trainer and of the servers)"
            ) from error
        if code not in _TRANSIENT:
            raise error
