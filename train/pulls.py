"""One Pull of one rollout server, the trainer's side (docs/DESIGN.md §6.2, §6.5): its request,
its deadline, the call, what its outcome means for the server, and booking its reply. The
schedulers (``train.rotation``: in turn; ``train.pull_scheduler``: concurrent, with quotas)
decide which server to pull and for how many groups; this module makes the Pull, on the caller's
thread (``call``) or on a thread of its own (``launch``), whose groups wait in ``carried``.

- A Pull carries its server's pending acknowledgements, rejections and hand-backs
  (``train.leases``) and names the trainer's version (admission shrinks a server's run-ahead when
  its weights are behind, §6.3).
- Its deadline is its wait plus 8× the server's measured overhead (at least 2 s; 30 s until
  measured). One past it (or cancelled with its transport) from a measured server is deaf
  (paused, stuck), not gone: fenced (``train.fleet_weights``), no failure streak.
- A server that answers "draining" (SIGTERM) with nothing left leaves at once, and the
  acknowledgements its Pulls did not carry go in one Ack. Any other transient failure counts
  toward its failure streak (``train.membership``); a non-transient one (a refusal, a message over
  ``server.max_message_bytes``) is raised.
- A reply's groups are decoded and validated here, once (``rollout_api.records.decode_pulled``):
  a ``Group`` for each valid one, an ``InvalidGroup`` for each other. Its capacity, its groups'
  count (toward the server's quota and ``pulled_<i>``) and the call's overhead are booked.
"""

from __future__ import annotations

import threading

import grpc

from rollout_api.admission import FleetQuota
from rollout_api.client import is_draining
from rollout_api.proto import rollout_pb2
from rollout_api.records import Group, GroupLimits, InvalidGroup, decode_pulled
from train.fleet_weights import FleetWeights
from train.leases import Leases
from train.member import Member
from train.membership import Membership

# A Pull's deadline beyond what it waits for: this until its server's overhead is measured,
# then a multiple of it, at least _SLACK_MIN_S.
_SLACK_S = 30.0
_SLACK_MIN_S = 2.0

Pulled = list[Group | InvalidGroup]


class Pulls:
    """Pulls of single servers (see the module docstring). Guarded by the fleet's lock.

    Args:
      fleet, leases, weights: the pool's other parts.
      run_id: the trainer run's id, carried by every Pull.
      quota: the fleet's batch quota, told what each Pull took (None = none).

    Attributes:
      carried: groups pulled by launched Pulls and not handed out yet.
      replied: notified (on the fleet's lock) whenever a launched Pull ends.
    """

    def __init__(
        self,
        fleet: Membership,
        leases: Leases,
        weights: FleetWeights,
        *,
        run_id: str,
        quota: FleetQuota | None,
    ):
        self._fleet, self._leases, self._weights = fleet, leases, weights
        self._run_id, self._quota = run_id, quota
        self.carried: Pulled = []
        self.replied = threading.Condition(fleet.lock)

    def call(
        self,
        server: Member,
        max_groups: int,
        wait: float,
        limits: GroupLimits | None,
        trainer_version: int,
    ) -> Pulled | str:
        """One Pull of ``server`` on this thread: its groups, or how it ended without them:
        "drained", "deaf" or "failed" (see ``_rpc``)."""
        with self._fleet.lock:
            request, acks, rejects = self._request(server, max_groups, wait, trainer_version)
        started = self._fleet.clock()
        reply = self._rpc(server, request, acks, rejects, wait + self._slack(server))
        if isinstance(reply, str):
            return reply
        pulled = decode_pulled(reply.groups, limits)
        with self._fleet.lock:
            self._book(server, request, acks, rejects, pulled, trainer_version, reply, started)
        return pulled

    def launch(
        self,
        server: Member,
        max_groups: int,
        wait: float,
        limits: GroupLimits | None,
        trainer_version: int,
    ) -> bool:
        """Starts one Pull of ``server`` on a thread of its own, unless one is in flight
        (returns whether it started). Its groups go to ``carried``; its outcome to
        ``server.pull_result`` ("ok", "failed" or "deaf"), and ``replied`` is notified either
        way."""
        with self._fleet.lock:
            if server.pulling:
                return False
            server.pulling, server.pull_result = True, ""
            server.pull_asked, server.pull_for = max_groups, trainer_version
            server.pull_started, server.pull_wait = self._fleet.clock(), wait
            server.pull_deadline = wait + self._slack(server)
            request, acks, rejects = self._request(server, max_groups, wait, trainer_version)

        def run() -> None:
            result = "failed"
            try:
                result = self._pull_once(server, request, acks, rejects, limits, trainer_version)
            except BaseException as fatal:  # refused, or too large: raised in the loop
                self._fleet.error = fatal
            finally:
                if result:  # not ended with its groups (``_pull_once`` ended that one)
                    with self.replied:
                        server.pulling, server.pull_result = False, result
                        self.replied.notify_all()

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
        """A launched Pull: "failed", "deaf", "ok" (it answered draining), or "" once its groups
        are in ``carried`` and the Pull is marked ended, both under the lock, so a pull that
        takes them finds the server free for its next Pull."""
        started = self._fleet.clock()
        reply = self._rpc(server, request, acks, rejects, server.pull_deadline)
        if isinstance(reply, str):
            return "ok" if reply == "drained" else reply
        pulled = decode_pulled(reply.groups, limits)
        with self._fleet.lock:
            self._book(server, request, acks, rejects, pulled, trainer_version, reply, started)
            self.carried.extend(pulled)
            if server.lagging:
                self._weights.unfence_if_current(server)
            server.pulling, server.pull_result = False, "ok"
            self.replied.notify_all()
        return ""

    def _request(
        self, server: Member, max_groups: int, wait: float, trainer_version: int
    ) -> tuple[rollout_pb2.PullRequest, list[tuple[str, int]], list[tuple[str, int]]]:
        """A Pull carrying ``server``'s pending acknowledgements, rejections and hand-backs, and
        the first two (under the lock)."""
        acks = self._leases.pending(server, server.acks)
        rejects = self._leases.pending(server, server.rejects)
        returns = self._leases.pending(server, server.returns)
        request = rollout_pb2.PullRequest(
            max_groups=max_groups,
            timeout_s=wait,
            ack_group_ids=[i for _, i in acks],
            reject_group_ids=[i for _, i in rejects],
            return_group_ids=[i for _, i in returns],
            run_id=self._run_id,
            trainer_version=trainer_version,
        )
        return request, acks, rejects

    def _rpc(
        self,
        server: Member,
        request: rollout_pb2.PullRequest,
        acks: list[tuple[str, int]],
        rejects: list[tuple[str, int]],
        deadline: float,
    ) -> rollout_pb2.PullResponse | str:
        """The Pull call: its reply, or how it ended without one: "drained" (the server drains
        and had nothing left: it left), "deaf" (fenced) or "failed" (toward its failure streak).

        Raises:
          MessageTooLargeError, grpc.RpcError: a non-transient failure.
        """
        started = self._fleet.clock()
        try:
            return server.stub.Pull(request, timeout=deadline, metadata=self._fleet.metadata)
        except grpc.RpcError as e:
            self._fleet.raise_unless_transient(server, "Pull", e)
            if is_draining(e):  # it answered: no failure streak, no grace, no backoff
                with self._fleet.lock:  # it took the acknowledgements before it answered
                    self._leases.sent(server, acks, rejects, request.return_group_ids)
                self._fleet.drained(server)
                self._leases.send_left(server)
                return "drained"
            if self._deaf(server, e):
                return "deaf"
            self._fleet.failed(server, f"Pull: {e.code().name}", started)
            return "failed"

    def _book(
        self,
        server: Member,
        request: rollout_pb2.PullRequest,
        acks: list[tuple[str, int]],
        rejects: list[tuple[str, int]],
        pulled: Pulled,
        trainer_version: int,
        reply: rollout_pb2.PullResponse,
        started: float,
    ) -> None:
        """Books a Pull's reply (under the lock): its acknowledgements delivered, its groups
        leased, the server's capacity, quota and measured overhead."""
        self._fleet.answered(server)
        self._leases.sent(server, acks, rejects, request.return_group_ids)
        self._leases.delivered(server, pulled, trainer_version)
        server.pulled += len(pulled)
        if reply.capacity_tokens_per_s > 0:
            server.rate = reply.capacity_tokens_per_s
        if self._quota is not None:
            self._quota.took(server.address, len(pulled))
        # Its overhead: beyond the wait an empty reply spent at the server; all of it for a
        # reply with groups.
        took = self._fleet.clock() - started
        overhead = took if pulled else max(took - request.timeout_s, 0.0)
        prev = server.pull_overhead_s
        server.pull_overhead_s = overhead if prev is None else 0.8 * prev + 0.2 * overhead

    def _slack(self, server: Member) -> float:
        """A Pull's deadline beyond its wait: a multiple of the server's measured overhead."""
        if server.pull_overhead_s is None:
            return _SLACK_S
        return min(max(8 * server.pull_overhead_s, _SLACK_MIN_S), _SLACK_S)

    def _deaf(self, server: Member, error: grpc.RpcError) -> bool:
        """Whether a failed Pull was deaf: past its deadline (or cancelled with its transport)
        from a server whose overhead is measured; it is fenced."""
        no_answer = (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED)
        if error.code() not in no_answer or server.pull_overhead_s is None:
            return False
        with self._fleet.lock:
            self._weights.fence(server, "a Pull is overdue")
        return True
