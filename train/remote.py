"""The trainer's side of the rollout servers (docs/DESIGN.md §6.2 protocol; §6.5 the fleet; §7.1
steps 1 and 6, pull and push): ``ServerPool``, pulling groups and pushing weights over gRPC.

Knows the servers only through the generated proto client. The pool is a thin front over its
parts, one module per concept, each holding the ones it needs (none subclasses another):

- ``train.membership.Membership``, the fleet: which servers are up, down, draining, joining or
  lagging, their failure streaks, probes, the ``servers_file`` and giving up
  (``ServersDownError``); each server is a ``train.member.Member``.
- ``train.fleet_weights.FleetWeights``, the pushes: the version every server is wanted to hold
  (sent by its sender, ``train.senders``), each server's share and lease, the fence of deaf
  servers and the rejoin of those that answer a probe.
- ``train.pulls.Pulls``: one Pull of one server, its deadline, outcome and booking (groups decoded
  and validated once, ``rollout_api.records.decode_pulled``).
- ``train.rotation.Rotation`` (servers in turn) and ``train.pull_scheduler.PullScheduler``
  (concurrent Pulls with quotas, ``rollout_api.admission.FleetQuota``): which servers a ``pull``
  asks, for how many groups.
- ``train.leases.Leases``: the pulled groups' leases, the acknowledgements not sent yet, and the
  batch being pulled.

One lock, the fleet's (reentrant), guards every ``Member`` and every part's state; the senders
and the launched Pulls' threads take it too. Every call carries the shared token as gRPC metadata
(``authorization: Bearer <token>``) and the run id; with a CA (``train.tls_ca``) the channels are
TLS.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import grpc

from rollout_api.admission import FleetQuota
from rollout_api.client import connect
from rollout_api.records import Group, GroupLimits, InvalidGroup
from train.fleet_weights import FleetWeights
from train.leases import Leases
from train.membership import FleetHooks, Membership
from train.pull_scheduler import PullScheduler
from train.pulls import Pulls
from train.rotation import Rotation
from train.senders import Push

_CLOSE_WAIT_S = 30.0  # the longest ``close`` waits for the last push's installs
_FALLBACK_MIN_S = 1.0  # the least a batch waits for the servers' quotas (FleetQuota.fallback_s)


class ServerPool:
    """Rollout servers, each up or down, current or lagging (see the module docstring).

    Args:
      addresses, token, root_certificates, max_message_bytes, retry_max_s, server_wait_s,
        grace_s, servers_file, on_retry, clock, sleep, connect: as in
        ``train.membership.Membership``.
      run_id: this trainer run's id (stable across its restarts; the servers let only the
        attached run start an admission epoch).
      background: probe down servers and re-read ``servers_file`` on a thread of the pool's own
        (the trainer), so a rejoining server's weight load never holds a Pull; False: ``pull``
        does it when due (``maintain``), on the caller's thread (tests, with a fake clock).
      batch_groups: groups per trainer step: with it, a pull that names the trainer's version
        asks every server at once for its share of the batch (``rollout_api.admission.FleetQuota``),
        and the others for more only after the batch has waited three recent step periods (and
        no server owed part of it has a Pull in flight within its deadline); 0 = the servers in
        turn.
      max_staleness: S, the servers' ``rollout.max_staleness``: with ``batch_groups``, shares are
        whole numbers of the fleet's (S + 1) · batch_groups budget (``fleet_shares``' seats),
        leased until the next pulled batch's version + S, and a server is current (or joins)
        once it holds weights within S of that version; None = shares not rounded, no lease,
        current once it holds the newest weights.
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
        grace_s: float = 5.0,
        servers_file: str = "",
        background: bool = False,
        on_retry: Callable[[], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        connect: Callable[..., tuple[grpc.Channel, object]] = connect,
        batch_groups: int = 0,
        max_staleness: int | None = None,
    ):
        self._fleet = Membership(
            addresses,
            token=token,
            root_certificates=root_certificates,
            max_message_bytes=max_message_bytes,
            retry_max_s=retry_max_s,
            server_wait_s=server_wait_s,
            grace_s=grace_s,
            servers_file=servers_file,
            on_retry=on_retry,
            clock=clock,
            sleep=sleep,
            connect=connect,
        )
        self._wire(token, run_id, batch_groups, max_staleness)
        self._fleet.start(
            background,
            FleetHooks(
                rejoin=self._weights.rejoin,
                went_down=self._weights.senders.reset,
                removed=self._weights.senders.forget,
                upkeep=self._weights.fence_overdue,
            ),
        )

    def _wire(self, token: str, run_id: str, batch_groups: int, max_staleness: int | None) -> None:
        """Builds the parts over the fleet, each holding those it needs."""
        self._quota = (
            FleetQuota(batch_groups, min_fallback_s=_FALLBACK_MIN_S) if batch_groups else None
        )
        seats = 0 if max_staleness is None else (max_staleness + 1) * batch_groups
        self._leases = Leases(
            self._fleet, run_id=run_id, quota=self._quota, batch_groups=batch_groups
        )
        self._weights = FleetWeights(
            self._fleet,
            self._leases,
            token=token,
            run_id=run_id,
            max_staleness=max_staleness,
            seats=seats,
            quota=self._quota,
        )
        self._pulls = Pulls(
            self._fleet, self._leases, self._weights, run_id=run_id, quota=self._quota
        )
        self._rotation = Rotation(self._fleet, self._leases, self._pulls)
        self._scheduler = (
            PullScheduler(self._fleet, self._leases, self._pulls, self._quota, self._weights.shares)
            if self._quota is not None
            else None
        )

    def __enter__(self) -> ServerPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def addresses(self) -> tuple[str, ...]:
        """Every server's address, up or down."""
        return self._fleet.addresses

    def close(self) -> None:
        """Waits (at most ``_CLOSE_WAIT_S``) for the servers up and current to install the last
        pushed version, then stops the senders and the background thread and closes the channels
        (call ``flush_acks`` first to send pending acknowledgements)."""
        self._weights.close(_CLOSE_WAIT_S)
        self._fleet.close()

    def versions(self) -> list[int]:
        """The weights version of every server that answers (``Membership.versions``).

        Raises:
          ServersDownError: no server answered for ``server_wait_s``.
        """
        return self._fleet.versions()

    def maintain(self) -> None:
        """One round of the fleet's upkeep (``Membership.maintain``): re-reads ``servers_file``
        when due, probes the down servers whose backoff has passed, then fences the servers whose
        UpdateWeights is overdue: in flight longer than max(5 s, 2 of its measured install times
        + 2 push periods)."""
        self._fleet.maintain()

    def metrics(self) -> dict[str, float]:
        """``servers_up``, ``servers_lagging`` (while any is) and ``pulled_<i>``: the groups
        pulled from each server so far (``i`` numbers the servers in the order the pool first
        saw them)."""
        return self._fleet.metrics()

    # Pulling and acknowledging.

    def pull(
        self,
        max_groups: int,
        timeout_s: float,
        *,
        limits: GroupLimits | None = None,
        trainer_version: int = 0,
    ) -> list[Group | InvalidGroup]:
        """Up to ``max_groups`` groups, decoded and validated against ``limits``: with quotas and
        a ``trainer_version``, of whichever servers' concurrent Pulls reply first
        (``PullScheduler``; groups beyond ``max_groups`` wait for the next call, still leased);
        else from the next server up that answers, in turn (``Rotation``); possibly none.

        Args:
          max_groups: the most groups to take.
          timeout_s: how long the server may wait for a first group.
          limits: the trainer's model (vocabulary, experts, routing (L, K)); None = check only
            that each group is well formed.
          trainer_version: the version the pulled groups will be trained at; sent to the server
            (its admission shrinks its run-ahead by how far the trainer is ahead of its weights,
            docs/DESIGN.md §6.3) and, with ``batch_groups``, the batch the quotas are counted
            for. 0 = not known.

        Returns:
          The groups in the server's order: a ``Group`` record for each valid one, an
          ``InvalidGroup`` (what is wrong) for each other one.

        Raises:
          ServersDownError: no server answered for ``server_wait_s``.
          MessageTooLargeError: the request or the reply is over ``max_message_bytes``.
          grpc.RpcError: a non-transient error (the server refused the request).
        """
        if self._scheduler is not None and trainer_version > 0:
            return self._scheduler.pull(max_groups, timeout_s, limits, trainer_version)
        return self._rotation.pull(max_groups, timeout_s, limits, trainer_version)

    def ack(self, groups: Sequence[Group | InvalidGroup], *, rejected: bool = False) -> None:
        """Acknowledges pulled ``groups`` (sent with the next Pull to their server, or by
        ``flush_acks``); groups not pulled through this pool are ignored. ``rejected``: they
        will not be trained (stale, duplicate, invalid, filtered), so their server generates
        replacements; one pulled for the batch being pulled gives its place in that batch back to
        its server's quota, so the batch takes the server's next (older than the others') group
        instead of leaving it for a later version, where it would be one version staler (a
        server one group behind its share would otherwise stay behind, each of its groups
        trained a version late)."""
        self._leases.ack(groups, rejected=rejected)

    def flush_acks(self, *, warn_down: bool = True) -> None:
        """Sends every pending acknowledgement to the servers up now (one Ack each; a server
        that fails or is down keeps its acknowledgements, which its lease time then covers).
        ``warn_down``: log how many wait for servers that are down."""
        self._leases.flush(warn_down=warn_down)

    def next_batch_version(self) -> int:
        """The version the next groups this pool pulls will be trained at, as far as it knows:
        the newest version a Pull named, or the one after it once that batch has all its
        ``batch_groups`` (pulled and not rejected). 0 = no Pull named a version yet."""
        return self._leases.next_batch_version()

    # Weights.

    def update_weights(
        self,
        version: int,
        checkpoint_path: str,
        *,
        new_admission_epoch: bool = False,
        base_path: str = "",
        wait_s: float = 0.0,
    ) -> None:
        """Makes ``version`` what every server up (and every one joining) is sent next, and
        returns: each server's sender (``train.senders``) sends it once that server's call in
        flight, if any, has finished, unless a newer version is wanted by then. A server that is
        down gets the newest version when it rejoins. A failed call is retried by its sender with
        backoff (a server whose calls keep failing for ``grace_s`` leaves the rotation); a server
        that refuses the version because it holds a newer one counts as current.

        Args:
          version: the weights version (>= each server's current one).
          checkpoint_path: the weights directory, as the servers see it.
          new_admission_epoch: the servers stop counting the groups they dispatched so far
            against their staleness budget (set when this trainer connects: it drops those).
          base_path: under LoRA, the frozen base that ``checkpoint_path``'s adapters apply to
            (a server loads it only when it does not hold it already); "" = whole params.
          wait_s: > 0: wait (at most this long) until every server up and not lagging has
            installed ``version`` or failed to (``wait_installed``): sync mode, and the first
            push of a run. 0 = return at once.

        Each server's share (``rollout_api.admission.fleet_shares`` over the servers up that are
        not lagging) and its lease (``share_until``) are set when its call is sent. Pending
        acknowledgements do not go first: they ride the next Pull (or ``flush_acks``).

        Raises:
          grpc.RpcError: an earlier call was refused for a reason other than the version (it is
            raised here or in the next ``pull``).
          MessageTooLargeError: as in ``pull``.
        """
        self._fleet.raise_background_error()
        self._weights.update(Push(version, checkpoint_path, base_path, new_admission_epoch))
        if wait_s > 0:
            self.wait_installed(version, wait_s)
            self._fleet.raise_background_error()

    def wait_installed(self, version: int, timeout_s: float) -> bool:
        """Waits (at most ``timeout_s`` seconds) until every server up, not draining and not
        lagging has confirmed ``version`` or newer, or its last call failed; returns whether
        they all confirmed it."""
        return self._weights.wait_installed(version, timeout_s)

    def settle(self, timeout_s: float = 30.0) -> bool:
        """Waits (at most ``timeout_s`` seconds) until no sender has a call in flight or one it
        may send now (tests: what the senders do after a push or a probe is then done)."""
        return self._weights.settle(timeout_s)

    def pinned_versions(self) -> set[int]:
        """The weights versions a server is loading, is wanted to load next, or holds (a
        restarting server reloads the one it holds): their directories must stay."""
        return self._weights.pinned_versions()

    def installed(self, address: str) -> int:
        """The newest weights version the server at ``address`` confirmed (-1 = none yet)."""
        with self._fleet.lock:
            server = next(s for s in self._fleet.servers if s.address == address)
            return self._weights.senders.state(server).installed
