"""The trainer's side of the rollout servers (docs/DESIGN.md §6.2 protocol; §6.5 the fleet; §7.1
steps 1 and 6, pull and push): pulling groups and pushing weights over gRPC.

Knows the servers only through the generated proto client. The fleet is elastic (docs/DESIGN.md
§6.5): which servers are up, their failure streaks, probes, the ``servers_file`` and giving up
(``ServersDownError``) are ``train.membership.Membership``, which ``ServerPool`` extends; each
server's pushes are its sender (``train.senders``).

- **Pushes** (``update_weights``) set the version every server is wanted to hold and return: each
  server's sender has at most one ``UpdateWeights`` in flight and sends the newest version wanted
  when it ends, so no loop thread waits on a server's load and a slow server delays no other.
  Each push tells a server its share of the fleet's admission budget, in proportion to the
  capacity each reports on its Pull replies (``rollout_api.admission.fleet_shares``), leased until
  a trainer version (``share_until``).
- **Deaf servers** (a push or a Pull overdue) are fenced: lagging, their share to the others and
  their lease ended, still pulled in the background; current again once they hold weights within
  S of the trainer. A (re)joining server joins once its sender has brought it within S: one load.
- **Pulls** name the trainer's version (admission shrinks a server's run-ahead when its weights are
  behind). With ``batch_groups`` (quotas) each server has at most one Pull in flight, all at once,
  each for its share of the batch (``rollout_api.admission.FleetQuota``); a batch is made from
  whichever replies first, and what overflows it or comes after it was made is handed back
  unleased. Without quotas the servers are pulled in turn.
- A server that answers "draining" (SIGTERM) gets no more weights nor share, is pulled until it
  has nothing left and then leaves at once (``_drained``). A reply or request over the gRPC
  message limit (``server.max_message_bytes``) is not retried.

A Pull's groups are decoded and validated here, once (``rollout_api.records.decode_pulled``):
the pool hands out ``Group`` records, and an ``InvalidGroup`` for each group that does not fit
the trainer's model, which the trainer counts and rejects.

Every call carries the shared token as gRPC metadata (``authorization: Bearer <token>``) and the
run id; with a CA (``train.tls_ca``) the channels are TLS. Pulled groups are leased by their
server until acknowledged (docs/DESIGN.md §6.2): ``ack`` queues their ids, which ride on the next
Pull to the same server (for a down server, once it is back; dropped if it comes back as another
server, a new ``server_id``); ``flush_acks`` sends the rest with the Ack RPC.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

import grpc

from rollout_api.admission import FleetQuota, fleet_shares
from rollout_api.client import connect, is_draining
from rollout_api.proto import rollout_pb2
from rollout_api.records import Group, GroupLimits, InvalidGroup, decode_pulled
from train.membership import Member, Membership
from train.senders import Push, Senders

log = logging.getLogger("train")

# Deadline of one RPC beyond what the request itself waits for: a Pull's, until its server's
# overhead is measured (then a multiple of it, at least _PULL_SLACK_MIN_S).
_PULL_SLACK_S = 30.0
_PULL_SLACK_MIN_S = 2.0
_UPDATE_WEIGHTS_S = 120.0
# An UpdateWeights in flight longer than max(this, 2 install times + 2 push periods) is overdue.
_OVERDUE_MIN_S = 5.0
_CLOSE_WAIT_S = 30.0  # the longest ``close`` waits for the last push's installs
_REPLAN_S = 0.1  # a pull waiting on its servers' Pulls re-plans this often (the fallback)
_CONCURRENT_WAIT_S = 0.5  # with several servers, how long a Pull waits at its server
_HOLD_AFTER_S = 0.25  # a Pull this long past its wait without an answer holds the fallback


def _oldest(group: Group | InvalidGroup) -> int:
    """The oldest weights version among a group's generated tokens (-1 for an invalid group:
    it goes first, to be rejected)."""
    if not isinstance(group, Group):
        return -1
    versions = [int(t.versions.min()) for t in group.trajectories if t.versions.size]
    return min(versions, default=-1)


_ACK_S = 10.0
_FALLBACK_MIN_S = 1.0  # the least a batch waits for the servers' quotas (FleetQuota.fallback_s)


class ServerPool(Membership):
    """Rollout servers, each up or down, current or lagging (see the module docstring).

    Args:
      addresses, token, root_certificates, max_message_bytes, retry_max_s, server_wait_s,
        grace_s, servers_file, on_retry, clock, sleep, connect: as in ``Membership``.
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
        super().__init__(
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
        self._token = token
        self._run_id = run_id
        self._next = 0
        self._seats = 0 if max_staleness is None else (max_staleness + 1) * batch_groups
        self._quota = (
            FleetQuota(batch_groups, min_fallback_s=_FALLBACK_MIN_S) if batch_groups else None
        )
        self._max_staleness = max_staleness
        self._trainer_version = 0  # the newest version a Pull named
        self._batch_groups = batch_groups
        self._kept = 0  # groups pulled for `_trainer_version`'s batch and not rejected
        self._origin: dict[str, Member] = {}  # group key -> the server it came from, until acked
        self._pulled_for: dict[str, int] = {}  # group key -> the trainer version it was pulled for
        # The last pushed (version, path, base_path): what a rejoining server gets.
        self._weights: tuple[int, str, str] | None = None
        self._pushed_at: float | None = None
        self._push_period: float | None = None  # between pushes (an exponential average)
        self._carried: list[Group | InvalidGroup] = []  # pulled in the background, not handed out
        self._replied = threading.Condition(self._lock)  # a launched Pull ended
        self._senders = Senders(
            self._lock,
            request=self._sender_request,
            may_send=lambda s: (s.up and not s.draining) or s.joining,
            on_result=self._sent,
            deadline_s=lambda st: max(_UPDATE_WEIGHTS_S, 4 * (st.install_s or 0.0)),
            metadata=self._metadata,
            clock=self._clock,
            first_backoff=self._first_backoff(),
            max_backoff=self._retry_max_s,
        )
        self._start(background)

    def __enter__(self) -> ServerPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Waits (at most ``_CLOSE_WAIT_S``) for the servers up and current to install the last
        pushed version, then stops the senders and the background thread and closes the channels
        (call ``flush_acks`` first to send pending acknowledgements)."""
        with self._lock:
            weights = self._weights
        if weights is not None and self._error is None:
            self.wait_installed(weights[0], _CLOSE_WAIT_S)
        self._senders.close()
        super().close()

    # Pulling and acknowledging.

    def pull(
        self,
        max_groups: int,
        timeout_s: float,
        *,
        limits: GroupLimits | None = None,
        trainer_version: int = 0,
    ) -> list[Group | InvalidGroup]:
        """Up to ``max_groups`` groups from the next server up that answers (possibly none),
        decoded and validated against ``limits``.

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
        if self._quota is not None and trainer_version > 0:
            return self._pull_concurrently(max_groups, timeout_s, limits, trainer_version)
        backoff = self._first_backoff()
        failed: set[int] = set()
        while True:
            self._raise_background_error()
            if self._thread is None:
                self.maintain()
            with self._lock:
                if self._carried:  # what the lagging servers' Pulls brought meanwhile
                    out, self._carried = self._carried[:max_groups], self._carried[max_groups:]
                    return out
                up = [s for s in self._servers if s.up]
                current = [s for s in up if not s.lagging] or up
                lagging = [s for s in up if s not in current and not s.pulling]
                server, limit = self._pick(current, trainer_version)
            for other in lagging:
                self._pull_in_background(other, max_groups, limits, trainer_version)
            if server is None:
                self._wait_for_a_server()
                continue
            # With several servers, a short wait on each keeps one slow server from stalling us.
            wait = timeout_s if len(current) == 1 else min(timeout_s, 1.0)
            with self._lock:
                acks = self._pending(server, server.acks)
                rejects = self._pending(server, server.rejects)
            request = self._pull_request(
                server,
                max_groups if limit is None else min(max_groups, limit),
                wait,
                acks,
                rejects,
                trainer_version,
            )
            started = self._clock()
            try:
                response = server.stub.Pull(
                    request, timeout=wait + self._pull_slack(server), metadata=self._metadata
                )
            except grpc.RpcError as e:
                self._raise_unless_transient(server, "Pull", e)
                if is_draining(e):  # it answered: no failure streak, no grace, no backoff
                    with self._lock:  # it took the acknowledgements before it answered
                        self._sent_with_pull(server, acks, rejects, request.return_group_ids)
                    self._drained(server)
                    continue
                if self._deaf(server, e):
                    continue
                self._failed(server, f"Pull: {e.code().name}", started)
                failed.add(server.index)
                if failed >= {s.index for s in current}:  # every server failed: wait a little
                    self._check_servers_down()
                    self._sleep(backoff)
                    backoff = min(2 * backoff, self._retry_max_s)
                    failed.clear()
                continue
            pulled = decode_pulled(response.groups, limits)
            with self._lock:
                self._delivered(server, request, acks, rejects, pulled, trainer_version, response)
                self._measured_pull(server, self._clock() - started, wait, bool(pulled))
            return pulled

    def _pull_request(
        self,
        server: Member,
        max_groups: int,
        wait: float,
        acks: list[tuple[str, int]],
        rejects: list[tuple[str, int]],
        trainer_version: int,
    ) -> rollout_pb2.PullRequest:
        """A Pull carrying ``acks``, ``rejects`` and the groups ``server`` is owed back."""
        with self._lock:
            returns = self._pending(server, server.returns)
        return rollout_pb2.PullRequest(
            max_groups=max_groups,
            timeout_s=wait,
            ack_group_ids=[i for _, i in acks],
            reject_group_ids=[i for _, i in rejects],
            return_group_ids=[i for _, i in returns],
            run_id=self._run_id,
            trainer_version=trainer_version,
        )

    def _sent_with_pull(
        self,
        server: Member,
        acks: list[tuple[str, int]],
        rejects: list[tuple[str, int]],
        returned: Sequence[int] = (),
    ) -> None:
        """The acknowledgements (and the groups handed back, ``returned``) a Pull or an Ack
        carried reached ``server``: no longer pending."""
        sent_acks, sent_rejects, back = set(acks), set(rejects), set(returned)
        server.acks = [a for a in server.acks if a not in sent_acks]
        server.rejects = [r for r in server.rejects if r not in sent_rejects]
        if back:
            server.returns = [r for r in server.returns if r[1] not in back]

    def _delivered(
        self,
        server: Member,
        request: rollout_pb2.PullRequest,
        acks: list[tuple[str, int]],
        rejects: list[tuple[str, int]],
        pulled: list[Group | InvalidGroup],
        trainer_version: int,
        response: rollout_pb2.PullResponse,
    ) -> None:
        """Books a Pull's reply (under the lock): its acknowledgements delivered, its groups'
        origin and batch, the server's capacity and quota."""
        self._answered(server)
        self._sent_with_pull(server, acks, rejects, request.return_group_ids)
        for g in pulled:
            self._origin[g.key] = server
            self._pulled_for[g.key] = trainer_version
            server.server_id = g.server_id or server.server_id
        if trainer_version == self._trainer_version:
            self._kept += len(pulled)
        server.pulled += len(pulled)
        if response.capacity_tokens_per_s > 0:
            server.rate = response.capacity_tokens_per_s
        if self._quota is not None:
            self._quota.took(server.address, len(pulled))

    def _measured_pull(self, server: Member, took: float, wait: float, full: bool) -> None:
        """A Pull took ``took`` seconds: its overhead (beyond the ``wait`` an empty reply spent at
        the server; all of it for a reply with groups) enters the server's average."""
        overhead = took if full else max(took - wait, 0.0)
        prev = server.pull_overhead_s
        server.pull_overhead_s = overhead if prev is None else 0.8 * prev + 0.2 * overhead

    def _pull_slack(self, server: Member) -> float:
        """A Pull's deadline beyond its wait: a multiple of the server's measured overhead (30 s
        until measured)."""
        if server.pull_overhead_s is None:
            return _PULL_SLACK_S
        return min(max(8 * server.pull_overhead_s, _PULL_SLACK_MIN_S), _PULL_SLACK_S)

    def _deaf(self, server: Member, error: grpc.RpcError) -> bool:
        """A Pull past its deadline (or cancelled with its transport) from a server whose
        overhead is measured: it is deaf (paused, stuck), not gone: fenced, no failure streak.
        Returns whether it was."""
        no_answer = (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED)
        if error.code() not in no_answer or server.pull_overhead_s is None:
            return False
        with self._lock:
            self._fence(server, "a Pull is overdue")
        return True

    def _pull_in_background(
        self, server: Member, max_groups: int, limits: GroupLimits | None, trainer_version: int
    ) -> None:
        """One Pull of a lagging ``server`` that does not wait for groups (``_launch_pull``):
        what it finished is trained, and a deaf one holds no Pull of the loop's."""
        self._launch_pull(server, max_groups, 0.0, limits, trainer_version)

    def _launch_pull(
        self,
        server: Member,
        max_groups: int,
        wait: float,
        limits: GroupLimits | None,
        trainer_version: int,
    ) -> bool:
        """Starts one Pull of ``server`` on a thread of its own, unless one is in flight
        (returns whether it started). Its groups go to ``_carried`` for the next ``pull``;
        its outcome to ``server.pull_result`` ("ok", "failed" or "deaf"), and the pool's
        condition is notified either way."""
        with self._lock:
            if server.pulling:
                return False
            server.pulling, server.pull_result = True, ""
            server.pull_asked, server.pull_for = max_groups, trainer_version
            server.pull_started, server.pull_wait = self._clock(), wait
            server.pull_deadline = wait + self._pull_slack(server)
            acks = self._pending(server, server.acks)
            rejects = self._pending(server, server.rejects)
        request = self._pull_request(server, max_groups, wait, acks, rejects, trainer_version)

        def run() -> None:
            result = "failed"
            try:
                result = self._pull_once(server, request, acks, rejects, limits, trainer_version)
            except BaseException as fatal:  # refused, or too large: raised in the loop
                self._error = fatal
            finally:
                if result:  # not ended with its groups (``_pull_once`` ended that one)
                    with self._replied:
                        server.pulling, server.pull_result = False, result
                        self._replied.notify_all()

        threading.Thread(target=run, name="pull", daemon=True).start()
        return True

    def _pull_once(
        self,
        server: Member,
        request: rollout_pb2.PullRequest,
        acks: list[tuple[str, int]],
        rejects: list[tuple[str, int]],
        limits: GroupLimits | None,
        trainer_version: int,
    ) -> str:
        """One Pull (on a launched thread): "failed" (it counts toward the server's failure
        streak), "deaf" (past its deadline: fenced), "ok" (it answered draining), or "" once its
        groups are in ``_carried`` and the Pull is marked ended, both under the lock, so a
        ``pull`` that takes them finds the server free for its next Pull."""
        started = self._clock()
        try:
            response = server.stub.Pull(
                request, timeout=server.pull_deadline, metadata=self._metadata
            )
        except grpc.RpcError as e:
            self._raise_unless_transient(server, "Pull", e)
            if is_draining(e):
                with self._lock:
                    self._sent_with_pull(server, acks, rejects, request.return_group_ids)
                self._drained(server)
                return "ok"
            if self._deaf(server, e):
                return "deaf"
            self._failed(server, f"Pull: {e.code().name}", started)
            return "failed"
        pulled = decode_pulled(response.groups, limits)
        with self._lock:
            self._delivered(server, request, acks, rejects, pulled, trainer_version, response)
            self._measured_pull(server, self._clock() - started, request.timeout_s, bool(pulled))
            self._carried.extend(pulled)
            if server.lagging:
                self._unfence_if_current(server)
            server.pulling, server.pull_result = False, "ok"
            self._replied.notify_all()
        return ""

    def _pull_concurrently(
        self,
        max_groups: int,
        timeout_s: float,
        limits: GroupLimits | None,
        trainer_version: int,
    ) -> list[Group | InvalidGroup]:
        """``pull`` with quotas: one Pull in flight per server at most, all at once, each for
        that server's quota of the batch (``FleetQuota.order``; after the fallback, any
        number); the groups of whichever replies first. A lagging server's Pull does not wait
        for groups. Groups beyond ``max_groups`` wait in ``_carried`` for the next call (still
        leased: nothing is lost). Returns [] once every Pull this call started has answered
        empty (each waited ``timeout_s`` at its server)."""
        backoff = self._first_backoff()
        launched: list[Member] = []
        while True:
            self._raise_background_error()
            if self._thread is None:
                self.maintain()
            with self._lock:
                out = self._take_carried(max_groups, trainer_version)
                if out:
                    return out
                up = [s for s in self._servers if s.up]
                current = [s for s in up if not s.lagging] or up
                plan = self._plan(current, trainer_version) if current else []
            if not up:
                self._wait_for_a_server()
                continue
            # Quotas ask for what the batch still needs, no more; past the fallback every
            # server is asked for all of it (the first replies make the batch, the rest go back).
            with self._lock:
                need = max_groups - sum(
                    s.pull_asked for s in current if s.pulling and s.pull_for == trainer_version
                )
            # With several servers a short wait on each: an empty reply comes back soon, and a
            # server that does not answer by its deadline is found out soon.
            wait = timeout_s if len(current) == 1 else min(timeout_s, _CONCURRENT_WAIT_S)
            for server, limit in plan:
                n = max_groups if limit is None else min(max(need, 0), limit)
                if n > 0 and self._launch_pull(server, n, wait, limits, trainer_version):
                    launched.append(server)
                    need -= n
            for server in up:
                if server.lagging and server not in current:
                    self._launch_pull(server, max_groups, 0.0, limits, trainer_version)
            with self._replied:
                # Wake on a reply (of this call's Pulls, or of earlier calls' still in flight);
                # re-plan now and then (the fallback opens with time).
                asked = launched or [s for s in up if s.pulling]
                self._replied.wait_for(
                    lambda: (
                        self._carried
                        or self._error is not None
                        or not any(s.pulling for s in asked)
                    ),
                    timeout=_REPLAN_S,
                )
                if self._carried or self._error is not None:
                    continue
                if not launched:  # earlier calls' Pulls only, none answered within the wait
                    return []
                if any(s.pulling for s in launched):
                    continue
                results = {s.pull_result for s in launched}
            if results <= {"failed"}:  # every server asked failed: wait a little
                self._check_servers_down()
                self._sleep(backoff)
                backoff = min(2 * backoff, self._retry_max_s)
                launched = []
                continue
            return []

    def _quota_shares(self, current: list[Member], trainer_version: int) -> dict[str, float]:
        """Each current server's part of the batch of ``trainer_version``: the largest share it
        was granted whose lease still holds (a server whose share shrank still holds what it
        admitted under the larger one, which must be taken at that rate to stay within the
        bound), else its share now."""
        shares = self._shares(current)
        for s in current:
            live = [share for share, until in s.grants if until >= trainer_version]
            if live:
                shares[s.address] = max(shares[s.address], *live)
        return shares

    def _plan(self, current: list[Member], trainer_version: int) -> list[tuple[Member, int | None]]:
        """The servers to pull now, each with the most groups to take (None = no limit but the
        batch's): ``FleetQuota.order`` over ``current``, those with a Pull in flight left out."""
        if trainer_version > self._trainer_version:
            self._trainer_version, self._kept = trainer_version, 0
        now = self._clock()
        self._quota.start(trainer_version, self._quota_shares(current, trainer_version), now)
        by_address = {s.address: s for s in current}
        # A server owed part of this batch whose Pull has run past its wait without an answer
        # (paused: a GC pause, SIGSTOP) holds the fallback until the Pull's deadline: taking its
        # part from the others would advance the trainer past the groups it holds (a short
        # pause costs a stall, not its groups). Past the deadline it is fenced and its part goes
        # to the others. A Pull still within its wait (the server has no group ready) holds
        # nothing: a slow server must not gate the batch.
        hold = any(
            s.pulling
            and self._quota.quota(s.address) > 0
            and s.pull_wait + _HOLD_AFTER_S < now - s.pull_started < s.pull_deadline
            for s in current
        )
        plan: dict[str, int | None] = {}
        for address, limit in self._quota.order(list(by_address), now, fallback=not hold):
            if address in plan:
                if limit is None:
                    plan[address] = None
                continue
            plan[address] = limit
        return [(by_address[a], n) for a, n in plan.items() if not by_address[a].pulling]

    def ack(self, groups: Sequence[Group | InvalidGroup], *, rejected: bool = False) -> None:
        """Acknowledges pulled ``groups`` (sent with the next Pull to their server, or by
        ``flush_acks``); groups not pulled through this pool are ignored. ``rejected``: they
        will not be trained (stale, duplicate, invalid, filtered), so their server generates
        replacements; one pulled for the batch being pulled gives its place in that batch back to
        its server's quota, so the batch takes the server's next (older than the others') group
        instead of leaving it for a later version, where it would be one version staler (a
        server one group behind its share would otherwise stay behind, each of its groups
        trained a version late)."""
        with self._lock:
            self._forget(groups, "rejects" if rejected else "acks")

    def _forget(self, groups: Sequence[Group | InvalidGroup], pending: str) -> None:
        """Queues ``groups`` on their servers' ``pending`` list ("acks", "rejects" or
        "returns"); one rejected or handed back from the batch being pulled gives its place in
        that batch back to its server's quota (under the lock)."""
        for g in groups:
            server = self._origin.pop(g.key, None)
            version = self._pulled_for.pop(g.key, None)
            if server is None:
                continue
            getattr(server, pending).append((g.server_id, g.group_id))
            if pending != "acks" and version == self._trainer_version:
                self._kept -= 1
                if self._quota is not None and version == self._quota.version:
                    self._quota.took(server.address, -1)

    def _take_carried(self, max_groups: int, trainer_version: int) -> list[Group | InvalidGroup]:
        """Up to ``max_groups`` of the groups pulled and not handed out yet, oldest first (under
        the lock). Those pulled for an earlier batch than ``trainer_version`` (a reply that came
        after its batch was made), and those beyond ``max_groups``, the youngest, are handed
        back unleased: their server leases them again for the batch its next Pull names, so its
        admission counts them where they will be trained (a group kept across batches would
        count in none: ``ServerAdmission.in_earlier_batch``)."""
        late = [
            g
            for g in self._carried
            if isinstance(g, Group)
            and self._pulled_for.get(g.key, trainer_version) < trainer_version
        ]
        rest = sorted(
            (g for g in self._carried if g not in late), key=lambda g: (_oldest(g), g.key)
        )
        out, over = rest[:max_groups], rest[max_groups:]
        back = [*late, *(g for g in over if isinstance(g, Group))]
        self._carried = [g for g in over if not isinstance(g, Group)]
        self._forget(back, "returns")
        return out

    def flush_acks(self, *, warn_down: bool = True) -> None:
        """Sends every pending acknowledgement to the servers up now (one Ack each; a server
        that fails or is down keeps its acknowledgements, which its lease time then covers).
        ``warn_down``: log how many wait for servers that are down."""
        with self._lock:
            targets = [s for s in self._servers if s.up and (s.acks or s.rejects or s.returns)]
            down = sum(len(s.acks) + len(s.rejects) for s in self._servers if not s.up)
        if down and warn_down:
            log.warning("%d acknowledgements for rollout servers that are down not sent", down)
        for server in targets:
            with self._lock:
                acks = self._pending(server, server.acks)
                rejects = self._pending(server, server.rejects)
                returns = self._pending(server, server.returns)
            request = rollout_pb2.AckRequest(
                group_ids=[i for _, i in acks],
                reject_group_ids=[i for _, i in rejects],
                return_group_ids=[i for _, i in returns],
                run_id=self._run_id,
            )
            try:
                server.stub.Ack(request, timeout=_ACK_S, metadata=self._metadata)
            except grpc.RpcError as e:
                self._raise_unless_transient(server, "Ack", e)
                log.warning("Ack to rollout server %s failed: %s", server.address, e.code().name)
                continue
            with self._lock:
                self._sent_with_pull(server, acks, rejects, request.return_group_ids)

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
        self._raise_background_error()
        with self._lock:
            now = self._clock()
            if self._pushed_at is not None and (self._weights or (0,))[0] < version:
                gap = now - self._pushed_at
                self._push_period = (
                    gap if self._push_period is None else 0.8 * self._push_period + 0.2 * gap
                )
            self._pushed_at = now
            # Set first: a server rejoining meanwhile is sent the newest (``_rejoin``).
            self._weights = (version, checkpoint_path, base_path)
            push = Push(version, checkpoint_path, base_path, new_admission_epoch)
            for server in self._servers:
                if (server.up and not server.draining) or server.joining:
                    self._senders.want(server, push)
        if wait_s > 0:
            self.wait_installed(version, wait_s)
            self._raise_background_error()

    def wait_installed(self, version: int, timeout_s: float) -> bool:
        """Waits (at most ``timeout_s`` seconds) until every server up, not draining and not
        lagging has confirmed ``version`` or newer, or its last call failed; returns whether
        they all confirmed it."""

        def done() -> bool:
            for s in self._servers:
                if not s.up or s.draining or s.lagging:
                    continue
                st = self._senders.state(s)
                if st.installed < version and (st.sending is not None or st.wanted is not None):
                    if st.sending is not None or st.retry_at <= self._clock():
                        return False
            return True

        self._senders.wait_for(done, timeout_s)
        with self._lock:
            return all(
                self._senders.state(s).installed >= version
                for s in self._servers
                if s.up and not s.draining and not s.lagging
            )

    def settle(self, timeout_s: float = 30.0) -> bool:
        """Waits (at most ``timeout_s`` seconds) until no sender has a call in flight or one it
        may send now (tests: what the senders do after a push or a probe is then done)."""

        def idle() -> bool:
            now = self._clock()
            for s in self._servers:
                st = self._senders.state(s)
                if st.sending is not None:
                    return False
                sendable = (s.up and not s.draining) or s.joining
                if st.wanted is not None and sendable and st.retry_at <= now:
                    return False
            return True

        return self._senders.wait_for(idle, timeout_s)

    def pinned_versions(self) -> set[int]:
        """The weights versions a server is loading, is wanted to load next, or holds (a
        restarting server reloads the one it holds): their directories must stay."""
        with self._lock:
            out: set[int] = set()
            for s in self._servers:
                st = self._senders.state(s)
                out.update(p.version for p in (st.sending, st.wanted) if p is not None)
                if st.installed >= 0:
                    out.add(st.installed)
            return out

    def installed(self, address: str) -> int:
        """The newest weights version the server at ``address`` confirmed (-1 = none yet)."""
        with self._lock:
            server = next(s for s in self._servers if s.address == address)
            return self._senders.state(server).installed

    # The senders' side (under the lock).

    def _sender_request(self, server: Member, push: Push) -> rollout_pb2.UpdateWeightsRequest:
        """``push`` for ``server``, with its share of the fleet now and its lease: up to the
        version the next pulled groups are trained at plus S (a fenced server's has ended)."""
        fleet = [
            s for s in self._servers if ((s.up and not s.draining) or s.joining) and not s.lagging
        ]
        share = self._shares(fleet if server in fleet else [*fleet, server])[server.address]
        if server.lagging:
            until = max(push.version - 1, 0)
        elif self._max_staleness is None:
            until = 0
        else:
            until = max(self.next_batch_version(), push.version) + self._max_staleness
        request = self._update_request(
            push.version, push.path, push.new_epoch, share, push.base_path
        )
        request.share_until = until
        if until > 0 and not server.lagging:
            server.grants = [g for g in server.grants if g[1] >= request.trainer_version]
            server.grants.append((share, until))
        return request

    def _sent(self, server: Member, push: Push, error: grpc.RpcError | None) -> bool:
        """A sender's call to ``server`` ended (``error`` None: installed); returns whether to
        retry it. A joining server joins, and a lagging one is current again, once what it
        holds is within S of the version the next pulled groups are trained at."""
        if error is None:
            self._answered(server)
            self._unfence_if_current(server)
            return False
        if is_draining(error):  # it stays in the pull rotation until it has nothing left
            self._answered(server)
            self._note_draining(server)
            self._senders.state(server).wanted = None
            return False
        code, details = error.code(), error.details() or ""
        if code == grpc.StatusCode.INVALID_ARGUMENT and "older than the current" in details:
            self._answered(server)  # it holds a newer version: nothing to send it
            self._senders.confirmed(server, push.version, epoch=push.new_epoch)
            self._unfence_if_current(server)
            return False
        try:
            self._raise_unless_transient(server, "UpdateWeights", error)
        except BaseException as fatal:  # refused: surfaces in the loop's next call
            self._error = fatal
            if server.joining:
                server.joining = False
                self._schedule_probe(server, f"UpdateWeights: {code.name} {details}")
            return False
        if server.joining:  # it went again: probed until it answers
            server.joining = False
            self._note_failure()
            self._schedule_probe(server, f"UpdateWeights: {code.name} {details}")
            return False
        if code in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED):
            # No answer (a paused server's transport may also be cancelled): deaf, not gone.
            self._fence(server, f"UpdateWeights v{push.version}: {code.name}")
            return True
        self._failed(server, f"UpdateWeights v{push.version}: {code.name}", self._clock())
        return server.up

    def _caught_up(self, server: Member) -> bool:
        """Whether the weights ``server`` confirmed are within S of the version the next pulled
        groups are trained at (the newest pushed, without S)."""
        installed = self._senders.state(server).installed
        if self._weights is None:
            return True
        if self._max_staleness is None:
            return installed >= self._weights[0]
        target = max(self.next_batch_version(), self._weights[0])
        return installed >= target - self._max_staleness

    def _unfence_if_current(self, server: Member) -> None:
        if not self._caught_up(server):
            return
        if server.joining:
            installed = self._senders.state(server).installed
            self._join(server, f"at weights version {installed}")
        elif server.lagging and server.up:
            server.lagging = False
            log.info(
                "rollout server %s is current again (weights version %d); its share returns "
                "with the next push",
                server.address,
                self._senders.state(server).installed,
            )

    def _fence(self, server: Member, why: str) -> None:
        """Marks ``server`` lagging: from the next push its share goes to the others and its
        lease has ended (it admits nothing); it is still pulled, and current again once it
        confirms weights within S of the trainer (``_unfence_if_current``)."""
        if server.lagging or not server.up:
            return
        server.lagging, server.grants = True, []
        if self._quota is not None:  # what it is owed of this batch, the others take
            others = [s for s in self._servers if s.up and not s.lagging]
            self._quota.reassign(server.address, self._shares(others) if others else {})
        log.warning(
            "rollout server %s is lagging (%s): its share goes to the others from the next push; "
            "it is still pulled (%d current)",
            server.address,
            why,
            sum(s.up and not s.lagging for s in self._servers),
        )

    def _went_down(self, server: Member) -> None:
        self._senders.reset(server)

    def _removed(self, server: Member) -> None:
        self._senders.forget(server)

    def maintain(self) -> None:
        """``Membership.maintain``, then fences the servers whose UpdateWeights is overdue: in
        flight longer than max(5 s, 2 of its measured install times + 2 push periods)."""
        super().maintain()
        now = self._clock()
        with self._lock:
            for server in self._servers:
                st = self._senders.state(server)
                if not server.up or server.lagging or st.sending is None or st.since is None:
                    continue
                bound = max(
                    _OVERDUE_MIN_S, 2 * (st.install_s or 0.0) + 2 * (self._push_period or 0.0)
                )
                if now - st.since > bound:
                    self._fence(server, f"UpdateWeights v{st.sending.version} overdue")
        self._senders.wake()

    # Health.

    def metrics(self) -> dict[str, float]:
        """``servers_up`` and ``pulled_<i>``: the groups pulled from each server so far (``i``
        numbers the servers in the order the pool first saw them)."""
        with self._lock:
            out: dict[str, float] = {"servers_up": sum(s.up for s in self._servers)}
            if any(s.lagging for s in self._servers):
                out["servers_lagging"] = sum(s.up and s.lagging for s in self._servers)
            out.update({f"pulled_{s.index}": s.pulled for s in self._servers})
            return out

    def _rejoin(self, server: Member, version: int) -> None:
        """``server`` answered a probe at weights ``version``: its sender sends it the newest
        weights with a new admission epoch (what it generated before counts no more), and it
        joins once it confirms weights within S of the trainer (``_unfence_if_current``): one
        load, whatever is pushed meanwhile (the sender sends the newest next). Until the first
        push it joins as it is."""
        with self._lock:
            weights = self._weights
            if server not in self._servers:
                return  # removed from servers_file meanwhile
            if weights is None:
                self._join(server, f"at weights version {version}")
                return
            current, path, base_path = weights
            if version > current:
                self._schedule_probe(
                    server,
                    f"it holds weights version {version}, newer than this trainer's "
                    f"{current}; it rejoins once the trainer is past it",
                )
                return
            server.joining = True
            self._senders.reset(server)
            self._senders.want(server, Push(current, path, base_path, new_epoch=True))

    def _drained(self, server: Member) -> None:
        """A Pull found a draining ``server`` with nothing left: it leaves at once (no grace, no
        failure streak; logged once, by ``_note_draining``), and the acknowledgements it waits
        for that the Pull did not carry are sent now, in one Ack. Those that fail wait for it to
        come back, as for any server down."""
        with self._lock:
            self._answered(server)
            self._note_draining(server)
            if server.up:
                self._take_out(server)
            acks = self._pending(server, server.acks)
            rejects = self._pending(server, server.rejects)
        if not (acks or rejects):
            return
        request = rollout_pb2.AckRequest(
            group_ids=[i for _, i in acks],
            reject_group_ids=[i for _, i in rejects],
            run_id=self._run_id,
        )
        try:
            server.stub.Ack(request, timeout=_ACK_S, metadata=self._metadata)
        except grpc.RpcError:
            return
        with self._lock:
            server.acks = [a for a in server.acks if a not in set(acks)]
            server.rejects = [r for r in server.rejects if r not in set(rejects)]

    def next_batch_version(self) -> int:
        """The version the next groups this pool pulls will be trained at, as far as it knows:
        the newest version a Pull named, or the one after it once that batch has all its
        ``batch_groups`` (pulled and not rejected). 0 = no Pull named a version yet."""
        with self._lock:
            done = self._batch_groups and self._kept >= self._batch_groups
            return (
                self._trainer_version + 1
                if self._trainer_version and done
                else (self._trainer_version)
            )

    def _pick(self, up: list[Member], trainer_version: int) -> tuple[Member | None, int | None]:
        """The next server to pull and the most groups to take from it (None = no limit): in
        turn, or, with quotas and a trainer version, in ``FleetQuota.order`` (in turn among the
        servers it names)."""
        if not up:
            return None, None
        if trainer_version > self._trainer_version:
            self._trainer_version, self._kept = trainer_version, 0
        if self._quota is None or trainer_version <= 0:
            self._next %= len(up)
            server = up[self._next]
            self._next = (self._next + 1) % len(up)
            return server, None
        now = self._clock()
        shares = self._shares(up)
        self._quota.start(trainer_version, shares, now)
        by_address = {s.address: s for s in up}
        order: dict[str, int | None] = {}
        for address, limit in self._quota.order(list(by_address), now):
            order.setdefault(address, limit)
        names = list(order)
        self._next %= len(names)
        address = names[self._next]
        self._next = (self._next + 1) % len(names)
        return by_address[address], order[address]

    def _shares(self, up: Sequence[Member]) -> dict[str, float]:
        """Each server's part of a batch: ∝ its reported capacity (``fleet_shares``)."""
        return fleet_shares({s.address: s.rate for s in up}, seats=self._seats)

    def _pending(self, server: Member, items: list[tuple[str, int]]) -> list[tuple[str, int]]:
        """The acknowledgements to send ``server`` now (at most 4096): those for another
        incarnation of it (another ``server_id``) are dropped."""
        if server.server_id:
            items[:] = [a for a in items if not a[0] or a[0] == server.server_id]
        return list(items[:4096])

    def _update_request(
        self, version: int, path: str, new_epoch: bool, share: float, base_path: str = ""
    ) -> rollout_pb2.UpdateWeightsRequest:
        """A push of `version`, naming the version the next groups pulled will be trained at
        (`next_batch_version`: a rejoining server's admission must know how far the trainer is
        past the weights it gets)."""
        return rollout_pb2.UpdateWeightsRequest(
            trainer_version=max(self.next_batch_version(), version),
            version=version,
            checkpoint_path=path,
            base_path=base_path,
            token=self._token,
            new_admission_epoch=new_epoch,
            run_id=self._run_id,
            admission_share=share,
        )
