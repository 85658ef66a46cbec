"""The trainer's side of the rollout loop (docs/DESIGN.md §6.2–§6.4): Pull, Ack and UpdateWeights.

A Pull acknowledges what it carries, notes the trainer's version, and leases finished groups
(`Deliveries.hand_out`, oldest admitted first); an Ack removes groups for good and counts them as
consumed; an UpdateWeights swaps the engine's weights, tells admission the new version and share,
and may start an admission epoch. Each reply that reveals a change waits, outside the loop's lock,
until that change is on disk (`StateStore.wait`, docs/DESIGN.md §6.4).

The trainer run that starts an admission epoch is the attached run: another run may start one
only once the attached one has been silent for `lease_s` (`RunNotAttachedError`), so two trainers
never take turns resetting the server's epoch.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from rollout_api.proto import rollout_pb2
from rollout_server.engine import MoEEngine
from rollout_server.loop_core import LoopCore

log = logging.getLogger(__name__)

_HOLD_POLL_S = 0.01  # a Pull whose groups are held back looks again this often


class RunNotAttachedError(RuntimeError):
    """A new admission epoch from a trainer run other than the attached one, which is still
    active."""


class TrainerLink:
    """Pull, Ack and UpdateWeights over a `LoopCore` (see the module docstring).

    Args:
      core: the rollout loop's shared parts.
      engine: the generate engine that new weights are swapped into.
      lease_s: how long a pulled group waits for its acknowledgement (`Deliveries`), and how
        long the attached run must be silent before another may start an admission epoch.

    Attributes:
      groups_rejected: groups acknowledged as not trained (admission replaces them).
      push_bytes, push_bytes_total: the weights read by the last UpdateWeights, and by all.
    """

    def __init__(self, core: LoopCore, engine: MoEEngine, lease_s: float):
        self._core, self._engine, self._lease_s = core, engine, lease_s
        self._run_seen = core.clock()  # the attached run's last call (or the start)
        self.groups_rejected = 0
        self.push_bytes = self.push_bytes_total = 0

    def pull(
        self,
        max_groups: int,
        timeout_s: float,
        *,
        ack: Sequence[int] = (),
        reject: Sequence[int] = (),
        give_back: Sequence[int] = (),
        run_id: str = "",
        trainer_version: int = 0,
    ) -> list[rollout_pb2.Group]:
        """Acknowledges `ack` and `reject` and takes `give_back` back (as `ack` does), notes
        the trainer's version (0 = not sent), then leases up to `max_groups` finished groups,
        oldest admitted first (`ServerAdmission.hand_out`, which may hold younger ones back while
        an older group must still reach this batch), waiting up to `timeout_s` for the first.

        Choosing the groups, taking them off the queue and leasing them happen under the loop's
        lock, in one step (`Deliveries.hand_out`): in between, admission would see them in no
        count and start a group too many. The reply waits (outside the lock) until the
        acknowledgements and the returned groups' dispatches are on disk (docs/DESIGN.md §6.4).
        """
        if give_back:
            self._give_back(give_back)
        seq = self._ack(ack, reject, run_id)[1] if ack or reject else 0
        self._touch(run_id)
        deadline = self._core.clock() + timeout_s
        with self._core.lock:
            self._core.admission.saw_trainer(trainer_version)
        groups: list[rollout_pb2.Group] = []
        while self._wait_for_a_group(deadline):
            with self._core.lock:
                groups, dispatched = self._core.deliveries.hand_out(
                    self._core.generation.running, max_groups
                )
            seq = max(seq, dispatched)
            if groups or self._core.clock() >= deadline:
                break
            # Held back for an older group still running: it finishes soon (generation is bounded).
            self._core.sleep(min(_HOLD_POLL_S, max(deadline - self._core.clock(), 0.0)))
        self._core.store.wait(seq)
        return groups

    def _wait_for_a_group(self, deadline: float) -> bool:
        """Waits until `deadline` (on the loop's clock) for a queued group. It looks every
        quarter second whether the server drains (every 50 ms once it does): then it waits only
        while a group still runs (one may also fail and never be queued)."""
        while True:
            left = max(deadline - self._core.clock(), 0.0)
            if self._core.deliveries.queue.wait(min(left, 0.05 if self._core.draining else 0.25)):
                return True
            if self._core.clock() >= deadline:
                return False
            if self._core.draining:
                with self._core.lock:
                    if not self._core.generation.running:
                        return False

    def ack(
        self,
        group_ids: Sequence[int],
        *,
        reject: Sequence[int] = (),
        give_back: Sequence[int] = (),
        run_id: str = "",
    ) -> int:
        """Takes the leased groups `give_back` back (queued again at the front, as when their
        lease ends: the trainer did not keep them), then removes the groups `group_ids` and
        `reject` for good (leased ones, ones whose lease expired and that wait in the queue
        again, and ones this server re-generates after a restart although the trainer already
        has them) and counts them as consumed; unknown ids (already acknowledged) are ignored.
        Returns how many were removed.

        Every removed group leaves admission's count (`ServerAdmission.done`), so a rejected one
        (the trainer will not train it) is replaced as soon as the rule allows, which is not
        before newer weights when the trainer is already too far ahead of the ones held here.
        A group outstanding before the epoch began (`ServerAdmission.excluded`) was never
        counted: it leaves without freeing a place.

        Returns once the acknowledgement is on disk (docs/DESIGN.md §6.4).
        """
        if give_back:
            self._give_back(give_back)
        acked, seq = self._ack(group_ids, reject, run_id)
        self._core.store.wait(seq)
        return acked

    def _give_back(self, group_ids: Sequence[int]) -> None:
        """Ends the leases of `group_ids` (`Deliveries.give_back`); the next Pull leases them
        for the batch it names."""
        with self._core.lock:
            back = self._core.deliveries.give_back(group_ids)
        if back:
            self._core.generation.wake()

    def _ack(self, group_ids: Sequence[int], reject: Sequence[int], run_id: str) -> tuple[int, int]:
        """`ack` without waiting: (groups removed, the snapshot a reply must wait for)."""
        self._touch(run_id)
        rejected = set(reject)
        ids = set(group_ids) | rejected
        with self._core.lock:
            done = self._core.deliveries.remove(ids)
            # Leased before a restart and re-issued since (the trainer's acknowledgement waited
            # for this server to come back): the trainer has them, stop generating them again.
            done += [i for i in ids if self._core.generation.running.pop(i, None) is not None]
            done += self._core.prompts.withdraw(ids)
            if done:
                self._core.state.consumed += len(done)
                self._core.admission.done(done, trained=set(group_ids) - rejected)
                self.groups_rejected += sum(i in rejected for i in done)
                self._core.prompts.settled(done)
                seq = self._core.save_locked()
        if not done:  # the ids may be of an acknowledgement whose write is in flight
            return 0, self._core.store.submitted if ids else 0
        self._core.generation.wake()  # they left admission's count
        return len(done), seq

    def release(self, groups: Sequence[rollout_pb2.Group]) -> None:
        """Ends the leases of `groups` now (their Pull's reply was never sent): they are queued
        again, at the front, in order."""
        with self._core.lock:
            self._core.deliveries.release(groups)

    def expire_leases(self) -> None:
        """Queues again the groups whose lease ended (`Deliveries.expire`)."""
        with self._core.lock:
            expired = self._core.deliveries.expire()
        if expired:
            log.warning("%d pulled groups were not acknowledged in time; queued again", expired)

    def _touch(self, run_id: str) -> None:
        if run_id and run_id == self._core.state.run_id:
            self._run_seen = self._core.clock()

    def install_weights(
        self,
        version: int,
        checkpoint_path: str,
        params: Any,
        *,
        new_epoch: bool = False,
        run_id: str = "",
        share: float = 1.0,
        share_until: int = 0,
        base_path: str = "",
        push_bytes: int = 0,
        trainer_version: int = 0,
    ) -> None:
        """Swaps `params` into the engine as `version` and records them so a restart reloads them.

        `checkpoint_path` (and, under LoRA, `base_path`: the base its adapters apply to) is what
        a restart reloads; `push_bytes`, the bytes of weights read for this update, goes to the
        Stats.

        Admission is held while this runs, so no group is admitted between the swap and the
        new budget. The first trainer weights, or `new_epoch`, start an admission epoch
        (`ServerAdmission.begin_epoch`: what is outstanding now is not counted), and the run that
        starts one (`run_id`) becomes the attached run. `share` (0 = unset = 1) is this server's
        part of the fleet's batch from now on, leased until trainer version `share_until` (0 = no
        lease); `trainer_version` (0 = not sent) the trainer's version now, at or past `version`.

        Raises:
          RunNotAttachedError: `new_epoch` from a run other than the attached one while that one
            has called within the last `lease_s` seconds (nothing changes).
          ValueError: from `MoEEngine.swap_params` (params of another structure, bad version).
        """
        with self._core.lock:
            new_epoch = new_epoch or not self._core.state.checkpoint_path
            self._check_attached_locked(new_epoch, run_id)
            self._engine.swap_params(version, params)
            self._core.admission.install(version, share, share_until)
            if new_epoch:
                self._core.admission.begin_epoch(version, self._core.outstanding_ids_locked())
                self._core.state.epoch_version, self._core.state.run_id = version, run_id
            self._core.admission.saw_trainer(trainer_version)
            self._core.state.version, self._core.state.checkpoint_path = version, checkpoint_path
            self._core.state.base_path = base_path
            self.push_bytes = push_bytes
            self.push_bytes_total += push_bytes
            self._touch(run_id)
            seq = self._core.save_locked()
        self._core.generation.wake()
        self._core.store.wait(seq)

    def check_attached(self, new_epoch: bool, run_id: str) -> None:
        """Raises `RunNotAttachedError` if an update from `run_id` (starting a new admission
        epoch or not) would be refused by `install_weights`."""
        with self._core.lock:
            self._check_attached_locked(new_epoch or not self._core.state.checkpoint_path, run_id)

    def _check_attached_locked(self, new_epoch: bool, run_id: str) -> None:
        attached = self._core.state.run_id
        if not (new_epoch and attached and run_id != attached):
            return
        idle = self._core.clock() - self._run_seen
        if idle < self._lease_s:
            raise RunNotAttachedError(
                f"the server is attached to trainer run {attached!r} (last call {idle:.0f}s "
                f"ago); another run may start an admission epoch once it has been silent for "
                f"{self._lease_s:.0f}s"
            )
