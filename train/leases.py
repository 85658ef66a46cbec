"""The leases of pulled groups, the trainer's side (docs/DESIGN.md §6.2, §6.5): which server each
pulled group came from and for which batch, until the trainer acknowledges it; the
acknowledgements, rejections and hand-backs not yet sent to each server; and the tally of the
batch being pulled (``next_batch_version``).

A pulled group is leased by its server until acknowledged. ``ack`` queues its id on its server
(``Member.acks``, or ``rejects``: it will not be trained, so its server generates a replacement);
the queue rides on that server's next Pull (``pending``, ``sent``; for a down server, once it is
back; dropped if it comes back as another server, a new ``server_id``), and ``flush`` sends the
rest with the Ack RPC. A group handed back (``Member.returns``: pulled beyond a batch, or after
its batch was made) is leased again by its server for the batch its next Pull names.

A group rejected or handed back from the batch being pulled gives its place in that batch back
to its server's quota (``rollout_api.admission.FleetQuota``), so the batch takes that server's
next group instead.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import grpc

from rollout_api.admission import FleetQuota
from rollout_api.proto import rollout_pb2
from rollout_api.records import Group, InvalidGroup
from train.member import Member
from train.membership import Membership

log = logging.getLogger("train")

_ACK_S = 10.0  # deadline of an Ack
_MAX_IDS = 4096  # the most acknowledgements one call carries


class Leases:
    """The pulled groups' leases and the batch being pulled (see the module docstring).

    Every method but ``flush`` and ``send_left`` is called under the fleet's lock (``ack`` and
    ``next_batch_version`` take it).

    Args:
      fleet: the servers (their stubs, the metadata, the lock).
      run_id: the trainer run's id, carried by every Ack.
      quota: the fleet's batch quota, given back a place for a rejected group (None = none).
      batch_groups: groups per trainer step (0 = a batch is never complete).

    Attributes:
      trainer_version: the newest version a Pull named (the batch being pulled).
      kept: the groups pulled for that batch and not rejected nor handed back.
    """

    def __init__(
        self, fleet: Membership, *, run_id: str, quota: FleetQuota | None, batch_groups: int
    ):
        self._fleet = fleet
        self._run_id = run_id
        self._quota = quota
        self._batch_groups = batch_groups
        self.trainer_version = 0
        self.kept = 0
        self._origin: dict[str, Member] = {}  # group key -> the server it came from, until acked
        self._pulled_for: dict[str, int] = {}  # group key -> the trainer version it was pulled for

    def begin(self, trainer_version: int) -> None:
        """A Pull names ``trainer_version``: a newer one starts that batch's tally."""
        if trainer_version > self.trainer_version:
            self.trainer_version, self.kept = trainer_version, 0

    def next_batch_version(self) -> int:
        """The version the next groups pulled will be trained at, as far as the pool knows: the
        newest version a Pull named, or the one after it once that batch has all its
        ``batch_groups`` (pulled and not rejected). 0 = no Pull named a version yet."""
        with self._fleet.lock:
            done = self._batch_groups and self.kept >= self._batch_groups
            return (
                self.trainer_version + 1 if self.trainer_version and done else self.trainer_version
            )

    def pulled_for(self, group: Group | InvalidGroup, default: int) -> int:
        """The trainer version ``group`` was pulled for (``default``: not pulled here)."""
        return self._pulled_for.get(group.key, default)

    @staticmethod
    def pending(server: Member, items: list[tuple[str, int]]) -> list[tuple[str, int]]:
        """The acknowledgements of ``items`` to send ``server`` now (at most 4096): those for
        another incarnation of it (another ``server_id``) are dropped."""
        if server.server_id:
            items[:] = [a for a in items if not a[0] or a[0] == server.server_id]
        return list(items[:_MAX_IDS])

    @staticmethod
    def sent(
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

    def delivered(
        self, server: Member, pulled: Sequence[Group | InvalidGroup], trainer_version: int
    ) -> None:
        """``server``'s Pull for the batch of ``trainer_version`` brought ``pulled``: each is
        leased until acknowledged."""
        for g in pulled:
            self._origin[g.key] = server
            self._pulled_for[g.key] = trainer_version
            server.server_id = g.server_id or server.server_id
        if trainer_version == self.trainer_version:
            self.kept += len(pulled)

    def ack(self, groups: Sequence[Group | InvalidGroup], *, rejected: bool = False) -> None:
        """Queues acknowledgements of ``groups`` (``rejected``: as rejected); see
        ``ServerPool.ack``."""
        with self._fleet.lock:
            self.forget(groups, "rejects" if rejected else "acks")

    def forget(self, groups: Sequence[Group | InvalidGroup], pending: str) -> None:
        """Queues ``groups`` on their servers' ``pending`` list ("acks", "rejects" or
        "returns"); one rejected or handed back from the batch being pulled gives its place in
        that batch back to its server's quota. Groups not pulled here are ignored."""
        for g in groups:
            server = self._origin.pop(g.key, None)
            version = self._pulled_for.pop(g.key, None)
            if server is None:
                continue
            getattr(server, pending).append((g.server_id, g.group_id))
            if pending != "acks" and version == self.trainer_version:
                self.kept -= 1
                if self._quota is not None and version == self._quota.version:
                    self._quota.took(server.address, -1)

    def flush(self, *, warn_down: bool = True) -> None:
        """Sends every pending acknowledgement to the servers up now; see
        ``ServerPool.flush_acks``."""
        with self._fleet.lock:
            servers = self._fleet.servers
            targets = [s for s in servers if s.up and (s.acks or s.rejects or s.returns)]
            down = sum(len(s.acks) + len(s.rejects) for s in servers if not s.up)
        if down and warn_down:
            log.warning("%d acknowledgements for rollout servers that are down not sent", down)
        for server in targets:
            with self._fleet.lock:
                acks = self.pending(server, server.acks)
                rejects = self.pending(server, server.rejects)
                returns = self.pending(server, server.returns)
            request = rollout_pb2.AckRequest(
                group_ids=[i for _, i in acks],
                reject_group_ids=[i for _, i in rejects],
                return_group_ids=[i for _, i in returns],
                run_id=self._run_id,
            )
            try:
                server.stub.Ack(request, timeout=_ACK_S, metadata=self._fleet.metadata)
            except grpc.RpcError as e:
                self._fleet.raise_unless_transient(server, "Ack", e)
                log.warning("Ack to rollout server %s failed: %s", server.address, e.code().name)
                continue
            with self._fleet.lock:
                self.sent(server, acks, rejects, request.return_group_ids)

    def send_left(self, server: Member) -> None:
        """Sends a drained ``server`` the acknowledgements it waits for, in one Ack (its last
        Pull did not carry them). Those that fail wait for it to come back, as for any server
        down."""
        with self._fleet.lock:
            acks = self.pending(server, server.acks)
            rejects = self.pending(server, server.rejects)
        if not (acks or rejects):
            return
        request = rollout_pb2.AckRequest(
            group_ids=[i for _, i in acks],
            reject_group_ids=[i for _, i in rejects],
            run_id=self._run_id,
        )
        try:
            server.stub.Ack(request, timeout=_ACK_S, metadata=self._fleet.metadata)
        except grpc.RpcError:
            return
        with self._fleet.lock:
            self.sent(server, acks, rejects)
