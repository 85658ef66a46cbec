"""The trainer's side of the rollout servers: pulling groups and pushing weights over gRPC.

Knows the servers only through the generated proto client. A server that does not answer is
retried with exponential backoff (capped at ``retry_max_s``) and a log line per failure; the pool
gives up only when no server has answered for ``server_wait_s``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import grpc

from rollout_server.client import connect
from rollout_server.proto import rollout_pb2

log = logging.getLogger("train")

# Status codes that mean "not reachable right now"; anything else is a real error.
_TRANSIENT = (
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
)


class ServersDownError(RuntimeError):
    """No rollout server answered for ``server_wait_s`` seconds."""


class ServerPool:
    """One or more rollout servers, pulled from in turn.

    Args:
      addresses: "host:port" of each server.
      token: the shared token for ``UpdateWeights`` ("" = none).
      retry_max_s: the longest wait between retries of a down server.
      server_wait_s: how long all servers may stay down before ``ServersDownError``.
      on_retry: called before each retry; may raise to stop waiting (e.g. when a local server
        process has exited).
    """

    def __init__(
        self,
        addresses: Sequence[str],
        *,
        token: str = "",
        retry_max_s: float = 10.0,
        server_wait_s: float = 600.0,
        on_retry: Callable[[], None] | None = None,
    ):
        if not addresses:
            raise ValueError("ServerPool needs at least one address")
        self.addresses = tuple(addresses)
        self._token = token
        self._retry_max_s = retry_max_s
        self._server_wait_s = server_wait_s
        self._on_retry = on_retry
        self._conns = [connect(a) for a in self.addresses]
        self._next = 0
        self._last_ok = time.monotonic()

    def close(self) -> None:
        for channel, _ in self._conns:
            channel.close()

    def __enter__(self) -> ServerPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def pull(self, max_groups: int, timeout_s: float) -> list[rollout_pb2.Group]:
        """Up to ``max_groups`` groups from the next server that answers (possibly none)."""
        backoff = 0.5
        for _ in self._forever():
            i = self._next
            self._next = (self._next + 1) % len(self._conns)
            # With several servers, a short wait on each keeps one slow server from stalling us.
            wait = timeout_s if len(self._conns) == 1 else min(timeout_s, 1.0)
            try:
                response = self._conns[i][1].Pull(
                    rollout_pb2.PullRequest(max_groups=max_groups, timeout_s=wait),
                    timeout=wait + 30.0,
                )
            except grpc.RpcError as e:
                backoff = self._failed(i, "Pull", e, backoff)
                continue
            self._last_ok = time.monotonic()
            return list(response.groups)
        raise AssertionError("unreachable")

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
        """
        request = rollout_pb2.UpdateWeightsRequest(
            version=version,
            checkpoint_path=checkpoint_path,
            token=self._token,
            new_admission_epoch=new_admission_epoch,
        )
        for i, (_, stub) in enumerate(self._conns):
            backoff = 0.5
            for _ in self._forever():
                try:
                    stub.UpdateWeights(request, timeout=120.0)
                    self._last_ok = time.monotonic()
                    break
                except grpc.RpcError as e:
                    backoff = self._failed(i, "UpdateWeights", e, backoff)

    def versions(self) -> list[int]:
        """Each server's current weights version (waiting for down servers)."""
        out = []
        for i, (_, stub) in enumerate(self._conns):
            backoff = 0.5
            for _ in self._forever():
                try:
                    out.append(int(stub.Health(rollout_pb2.HealthRequest(), timeout=10.0).version))
                    self._last_ok = time.monotonic()
                    break
                except grpc.RpcError as e:
                    backoff = self._failed(i, "Health", e, backoff)
        return out

    def _forever(self):
        while True:
            yield
            if time.monotonic() - self._last_ok > self._server_wait_s:
                raise ServersDownError(
                    f"no rollout server answered for {self._server_wait_s:.0f}s: {self.addresses}"
                )

    def _failed(self, i: int, rpc: str, error: grpc.RpcError, backoff: float) -> float:
        code = error.code()
        if code not in _TRANSIENT:
            raise error
        if self._on_retry is not None:
            self._on_retry()
        log.warning(
            "rollout server %s is down (%s: %s); retrying in %.1fs",
            self.addresses[i],
            rpc,
            code.name,
            backoff,
        )
        time.sleep(backoff)
        return min(2 * backoff, self._retry_max_s)
