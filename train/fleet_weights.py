"""The weights the fleet is wanted to hold, the trainer's side (docs/DESIGN.md §6.3, §6.5): a push
sets the version every server up (or joining) is sent next, each server's share of the fleet's
admission budget and its lease, which servers are current or fenced (lagging), and how a
rejoining server is brought up to date.

- **Pushes** (``update``) set the version every server is wanted to hold and return: each
  server's sender (``train.senders``) has at most one ``UpdateWeights`` in flight and sends the
  newest version wanted when it ends, so no loop thread waits on a server's load and a slow
  server delays no other. Each call tells its server its share of the fleet's admission budget,
  in proportion to the capacity each reports on its Pull replies
  (``rollout_api.admission.fleet_shares``), leased until a trainer version (``share_until``).
- **Deaf servers** (a push or a Pull overdue) are fenced (``fence``): lagging, their share to the
  others and their lease ended, still pulled in the background; current again once they hold
  weights within S of the trainer (``unfence_if_current``).
- **Rejoining** (``rejoin``, the fleet's hook): a server that answered a probe is sent the newest
  weights with a new admission epoch and joins once its sender has brought it within S: one load.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import grpc

from rollout_api.admission import FleetQuota, fleet_shares
from rollout_api.client import is_draining
from rollout_api.proto import rollout_pb2
from train.leases import Leases
from train.member import Member
from train.membership import Membership
from train.senders import Push, Senders

log = logging.getLogger("train")

_UPDATE_WEIGHTS_S = 120.0  # the least deadline of an UpdateWeights (4 install times once known)
# An UpdateWeights in flight longer than max(this, 2 install times + 2 push periods) is overdue.
_OVERDUE_MIN_S = 5.0


class FleetWeights:
    """The fleet's pushes, shares, leases and fence (see the module docstring). Its state is
    guarded by the fleet's lock; the senders call it back under that lock.

    Args:
      fleet: the servers.
      leases: the batch being pulled (``next_batch_version``: the leases' horizon).
      token, run_id: carried by every ``UpdateWeights``.
      max_staleness: S (None = shares not rounded, no lease, current once a server holds the
        newest weights).
      seats: the fleet's admission budget in whole groups, (S + 1) · batch_groups (0 = shares
        not rounded).
      quota: the fleet's batch quota: a fenced server's part goes to the others (None = none).
    """

    def __init__(
        self,
        fleet: Membership,
        leases: Leases,
        *,
        token: str,
        run_id: str,
        max_staleness: int | None,
        seats: int,
        quota: FleetQuota | None,
    ):
        self._fleet, self._leases = fleet, leases
        self._token, self._run_id = token, run_id
        self._max_staleness, self._seats, self._quota = max_staleness, seats, quota
        # The last pushed (version, path, base_path): what a rejoining server gets.
        self.last: tuple[int, str, str] | None = None
        self._pushed_at: float | None = None
        self._push_period: float | None = None  # between pushes (an exponential average)
        self.senders = Senders(
            fleet.lock,
            request=self._request,
            may_send=lambda s: (s.up and not s.draining) or s.joining,
            on_result=self._sent,
            deadline_s=lambda st: max(_UPDATE_WEIGHTS_S, 4 * (st.install_s or 0.0)),
            metadata=fleet.metadata,
            clock=fleet.clock,
            first_backoff=fleet.first_backoff(),
            max_backoff=fleet.retry_max_s,
        )

    def shares(self, up: Sequence[Member]) -> dict[str, float]:
        """Each server's part of a batch: ∝ its reported capacity (``fleet_shares``)."""
        return fleet_shares({s.address: s.rate for s in up}, seats=self._seats)

    def update(self, push: Push) -> None:
        """Makes ``push`` what every server up (and every one joining) is sent next; see
        ``ServerPool.update_weights``."""
        with self._fleet.lock:
            now = self._fleet.clock()
            if self._pushed_at is not None and (self.last or (0,))[0] < push.version:
                gap = now - self._pushed_at
                self._push_period = (
                    gap if self._push_period is None else 0.8 * self._push_period + 0.2 * gap
                )
            self._pushed_at = now
            # Set first: a server rejoining meanwhile is sent the newest (``rejoin``).
            self.last = (push.version, push.path, push.base_path)
            for server in self._fleet.servers:
                if (server.up and not server.draining) or server.joining:
                    self.senders.want(server, push)

    def wait_installed(self, version: int, timeout_s: float) -> bool:
        """See ``ServerPool.wait_installed``."""

        def done() -> bool:
            for s in self._fleet.servers:
                if not s.up or s.draining or s.lagging:
                    continue
                st = self.senders.state(s)
                if st.installed < version and (st.sending is not None or st.wanted is not None):
                    if st.sending is not None or st.retry_at <= self._fleet.clock():
                        return False
            return True

        self.senders.wait_for(done, timeout_s)
        with self._fleet.lock:
            return all(
                self.senders.state(s).installed >= version
                for s in self._fleet.servers
                if s.up and not s.draining and not s.lagging
            )

    def settle(self, timeout_s: float) -> bool:
        """See ``ServerPool.settle``."""

        def idle() -> bool:
            now = self._fleet.clock()
            for s in self._fleet.servers:
                st = self.senders.state(s)
                if st.sending is not None:
                    return False
                sendable = (s.up and not s.draining) or s.joining
                if st.wanted is not None and sendable and st.retry_at <= now:
                    return False
            return True

        return self.senders.wait_for(idle, timeout_s)

    def pinned_versions(self) -> set[int]:
        """See ``ServerPool.pinned_versions``."""
        with self._fleet.lock:
            out: set[int] = set()
            for s in self._fleet.servers:
                st = self.senders.state(s)
                out.update(p.version for p in (st.sending, st.wanted) if p is not None)
                if st.installed >= 0:
                    out.add(st.installed)
            return out

    def close(self, wait_s: float) -> None:
        """Waits (at most ``wait_s``) for the servers up and current to install the last push
        (unless a call was refused), then stops the senders."""
        with self._fleet.lock:
            last = self.last
        if last is not None and self._fleet.error is None:
            self.wait_installed(last[0], wait_s)
        self.senders.close()

    # The senders' side (under the lock).

    def _request(self, server: Member, push: Push) -> rollout_pb2.UpdateWeightsRequest:
        """``push`` for ``server``, with its share of the fleet now and its lease: up to the
        version the next pulled groups are trained at plus S (a fenced server's has ended). The
        request names that version too (a rejoining server's admission must know how far the
        trainer is past the weights it gets)."""
        fleet = [
            s
            for s in self._fleet.servers
            if ((s.up and not s.draining) or s.joining) and not s.lagging
        ]
        share = self.shares(fleet if server in fleet else [*fleet, server])[server.address]
        next_batch = self._leases.next_batch_version()
        if server.lagging:
            until = max(push.version - 1, 0)
        elif self._max_staleness is None:
            until = 0
        else:
            until = max(next_batch, push.version) + self._max_staleness
        request = rollout_pb2.UpdateWeightsRequest(
            trainer_version=max(next_batch, push.version),
            version=push.version,
            checkpoint_path=push.path,
            base_path=push.base_path,
            token=self._token,
            new_admission_epoch=push.new_epoch,
            run_id=self._run_id,
            admission_share=share,
            share_until=until,
        )
        if until > 0 and not server.lagging:
            server.grants = [g for g in server.grants if g[1] >= request.trainer_version]
            server.grants.append((share, until))
        return request

    def _sent(self, server: Member, push: Push, error: grpc.RpcError | None) -> bool:
        """A sender's call to ``server`` ended (``error`` None: installed); returns whether to
        retry it. A joining server joins, and a lagging one is current again, once what it
        holds is within S of the version the next pulled groups are trained at."""
        fleet = self._fleet
        if error is None:
            fleet.answered(server)
            self.unfence_if_current(server)
            return False
        if is_draining(error):  # it stays in the pull rotation until it has nothing left
            fleet.answered(server)
            fleet.note_draining(server)
            self.senders.state(server).wanted = None
            return False
        code, details = error.code(), error.details() or ""
        if code == grpc.StatusCode.INVALID_ARGUMENT and "older than the current" in details:
            fleet.answered(server)  # it holds a newer version: nothing to send it
            self.senders.confirmed(server, push.version, epoch=push.new_epoch)
            self.unfence_if_current(server)
            return False
        try:
            fleet.raise_unless_transient(server, "UpdateWeights", error)
        except BaseException as fatal:  # refused: surfaces in the loop's next call
            fleet.error = fatal
            if server.joining:
                server.joining = False
                fleet.schedule_probe(server, f"UpdateWeights: {code.name} {details}")
            return False
        if server.joining:  # it went again: probed until it answers
            server.joining = False
            fleet.note_failure()
            fleet.schedule_probe(server, f"UpdateWeights: {code.name} {details}")
            return False
        if code in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED):
            # No answer (a paused server's transport may also be cancelled): deaf, not gone.
            self.fence(server, f"UpdateWeights v{push.version}: {code.name}")
            return True
        fleet.failed(server, f"UpdateWeights v{push.version}: {code.name}", fleet.clock())
        return server.up

    def _caught_up(self, server: Member) -> bool:
        """Whether the weights ``server`` confirmed are within S of the version the next pulled
        groups are trained at (the newest pushed, without S)."""
        installed = self.senders.state(server).installed
        if self.last is None:
            return True
        if self._max_staleness is None:
            return installed >= self.last[0]
        target = max(self._leases.next_batch_version(), self.last[0])
        return installed >= target - self._max_staleness

    def unfence_if_current(self, server: Member) -> None:
        """A joining ``server`` joins, and a lagging one is current again, once what it holds is
        within S of the trainer (under the lock)."""
        if not self._caught_up(server):
            return
        if server.joining:
            installed = self.senders.state(server).installed
            self._fleet.join(server, f"at weights version {installed}")
        elif server.lagging and server.up:
            server.lagging = False
            log.info(
                "rollout server %s is current again (weights version %d); its share returns "
                "with the next push",
                server.address,
                self.senders.state(server).installed,
            )

    def fence(self, server: Member, why: str) -> None:
        """Marks ``server`` lagging: from the next push its share goes to the others and its
        lease has ended (it admits nothing); it is still pulled, and current again once it
        confirms weights within S of the trainer (``unfence_if_current``). Under the lock."""
        if server.lagging or not server.up:
            return
        server.lagging, server.grants = True, []
        if self._quota is not None:  # what it is owed of this batch, the others take
            others = [s for s in self._fleet.servers if s.up and not s.lagging]
            self._quota.reassign(server.address, self.shares(others) if others else {})
        log.warning(
            "rollout server %s is lagging (%s): its share goes to the others from the next push; "
            "it is still pulled (%d current)",
            server.address,
            why,
            sum(s.up and not s.lagging for s in self._fleet.servers),
        )

    def fence_overdue(self) -> None:
        """Fences the servers whose UpdateWeights is overdue: in flight longer than max(5 s, 2 of
        its measured install times + 2 push periods); then wakes the senders (the fleet's
        upkeep, after each ``maintain`` round)."""
        now = self._fleet.clock()
        with self._fleet.lock:
            for server in self._fleet.servers:
                st = self.senders.state(server)
                if not server.up or server.lagging or st.sending is None or st.since is None:
                    continue
                bound = max(
                    _OVERDUE_MIN_S, 2 * (st.install_s or 0.0) + 2 * (self._push_period or 0.0)
                )
                if now - st.since > bound:
                    self.fence(server, f"UpdateWeights v{st.sending.version} overdue")
        self.senders.wake()

    def rejoin(self, server: Member, version: int) -> None:
        """``server`` answered a probe at weights ``version`` (the fleet's hook): its sender
        sends it the newest weights with a new admission epoch (what it generated before counts
        no more), and it joins once it confirms weights within S of the trainer
        (``unfence_if_current``): one load, whatever is pushed meanwhile (the sender sends the
        newest next). Until the first push it joins as it is."""
        with self._fleet.lock:
            if server not in self._fleet.servers:
                return  # removed from servers_file meanwhile
            if self.last is None:
                self._fleet.join(server, f"at weights version {version}")
                return
            current, path, base_path = self.last
            if version > current:
                self._fleet.schedule_probe(
                    server,
                    f"it holds weights version {version}, newer than this trainer's "
                    f"{current}; it rejoins once the trainer is past it",
                )
                return
            server.joining = True
            self.senders.reset(server)
            self.senders.want(server, Push(current, path, base_path, new_epoch=True))
