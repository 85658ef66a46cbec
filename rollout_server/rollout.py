"""The rollout loop: prompts (grain) → G samples each → rewards → finished groups in a queue.
Generating the samples (the driver, episodes, sessions, the group records and the capacity
measure) is `rollout_server.generation.GroupGeneration`, which `RolloutLoop` extends with
admission, delivery and persistence.

Admission (docs/DESIGN.md §6.3) is `rollout_api.admission.ServerAdmission`, one pure module that
states its guarantees: a new group starts only while the groups outstanding (running, queued,
leased) stay under (max_staleness + 1 − lead) · share · batch_groups, where lead is how many
versions the trainer (its version rides on every Pull) is ahead of the weights this server holds,
and `share` this server's part of the fleet's batch (sent with every push, ∝ the capacity this
server measures and reports on every Pull reply); finished groups are
handed out oldest-admitted first; and queued + running stays within the queue's capacity, so the
queue never overflows. An admission epoch starts at the first trainer weights a server installs
and at every `UpdateWeights` with `new_admission_epoch` (the trainer sets it when it connects,
e.g. after a resume): the groups outstanding then are not counted (`epoch_excluded`), so one the
trainer rejects buys no replacement. With `wait_for_weights` nothing is dispatched before the
first trainer weights.

Delivery (docs/DESIGN.md §6.2): `pull` leases groups; only `ack` removes them for good and counts
them as consumed. A lease not acknowledged within `lease_s` (a Pull abandoned by its client, a
trainer killed before acknowledging) puts the groups back at the front of the queue, so every
group reaches the trainer at least once; the trainer drops repeats by (server_id, group_id).
Leased groups count as queued for admission and for the queue's capacity.

`drain` (SIGTERM, a preemption notice; docs/DESIGN.md §6.5) closes admission for good: the groups
running finish and, with the queued ones, are still handed out; what is not acknowledged when the
server stops is in the saved state and re-issued by a restart.

Every dispatch and every acknowledgement hands the prompt position and the prompts not yet
acknowledged to the store's writer (`persistence.StateStore`, group commit: written outside the
loop's lock), so a restarted server re-issues them before drawing new ones. A reply that reveals a
change (an Ack, a Pull's acknowledgements and the dispatch of the groups it returns, an
UpdateWeights) waits, outside the lock, until the change is on disk (docs/DESIGN.md §6.4). A failed
save (e.g. a full disk) changes nothing in memory: it is logged and retried on the loop's next turn
until one succeeds.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import grain

from rollout_api import records
from rollout_api.admission import ServerAdmission
from rollout_api.proto import rollout_pb2
from rollout_server.driver import RolloutDriver
from rollout_server.engine import MoEEngine
from rollout_server.generation import GroupGeneration, RunningGroup, SessionSource
from rollout_server.group_queue import GroupQueue
from rollout_server.persistence import RolloutState, StateStore, new_server_id
from sat_jax.config import RolloutConfig
from sat_jax.tasks import Tokenizer
from sat_jax.tasks.envs import EnvError, EpisodeRunner
from sat_jax.tasks.rewards import RewardFn

log = logging.getLogger(__name__)

_HOLD_POLL_S = 0.01  # a Pull whose groups are held back looks again this often


class RunNotAttachedError(RuntimeError):
    """A new admission epoch from a trainer run other than the attached one, which is still
    active."""


class RolloutLoop(GroupGeneration):
    """Runs in its own thread beside the JetStream driver threads; the samples of its groups
    are `GroupGeneration`'s (`rollout_server.generation`).

    Args:
      driver: the running `RolloutDriver`.
      engine: its generate engine (for the weights version and limits).
      prompts: an endless grain pipeline of `sat_jax.tasks.Prompt`.
      reward_fn: (completion text, answer) -> float.
      tokenizer: encodes prompts (`encode_prompt`, the ids the policy sees) and decodes
        completions (special tokens skipped).
      cfg: group size, sampling length and admission parameters.
      store: where the loop's state persists.
      wait_for_weights: admit nothing until trainer weights are installed (by `install_weights`
        or restored from `store`); False = generate with the engine's initial weights too
        (`ServerConfig.wait_for_weights`).
      max_response_bytes: a Pull returns fewer groups rather than exceed this many bytes
        (a single larger group is still returned, and then fails at the gRPC limit); the server
        derives it from `ServerConfig.max_message_bytes`.
      lease_s: how long a pulled group waits for its acknowledgement before it is queued again.
      rows_skipped: prompt-file rows the pipeline skipped (no prompt or answer column), reported
        in `stats()`.
      clock: the monotonic clock, in seconds, that leases, the attached run's silence and the
        throughput are measured with (tests pass a fake one to expire a lease without waiting).
      episodes: runs multi-turn episodes (`task.env`); None = single-turn samples scored by
        `reward_fn`. Each sample is then an episode in one slot: `rollout.max_new_tokens`
        bounds each turn and the engine's `max_decode_length` the episode; its reward is the
        episode's, its trajectory carries the loss mask.
      sessions: hands each admitted sample to an external agent as an HTTP session instead
        (`rollout_server.sessions`, docs/DESIGN.md §6.6): its `offer(prompt, tag, done)`
        returns the session (which has the `reward`, like an episode) and later calls
        `done(tag, sample or None)`; a None sample is sampled again, as a failed one is.

    The measured capacity (`capacity_tokens_per_s`, `GroupGeneration`) goes out with every
    Pull reply and the Stats; the trainer sets this server's share by it (docs/DESIGN.md §6.3).
    """

    # The longest the loop's thread waits for a finished sample before it looks again at
    # admission, leases and failed saves; a change that may open admission wakes it at once.
    _COLLECT_S = 0.02

    def __init__(
        self,
        *,
        driver: RolloutDriver,
        engine: MoEEngine,
        prompts: grain.IterDataset,
        reward_fn: RewardFn,
        tokenizer: Tokenizer,
        cfg: RolloutConfig,
        store: StateStore,
        wait_for_weights: bool,
        max_response_bytes: int,
        lease_s: float,
        rows_skipped: int = 0,
        clock: Callable[[], float] = time.monotonic,
        episodes: EpisodeRunner | None = None,
        sessions: SessionSource | None = None,
    ):
        super().__init__(
            driver=driver,
            engine=engine,
            cfg=cfg,
            tokenizer=tokenizer,
            reward_fn=reward_fn,
            episodes=episodes,
            sessions=sessions,
            clock=clock,
        )
        self._store = store
        self.queue = GroupQueue(cfg.queue_groups)
        self._wait_for_weights = wait_for_weights
        self._max_response_bytes = max_response_bytes
        self._lease_s = lease_s
        # group id -> (the group, when its lease ends), in lease order.
        self._leased: dict[int, tuple[rollout_pb2.Group, float]] = {}
        # Queued groups whose dispatch was not on disk yet when they finished: id -> snapshot.
        self._undurable: dict[int, int] = {}
        self._run_seen = self._clock()  # the attached run's last call (or the start)
        self._state = store.load()
        self._admission = ServerAdmission(
            max_staleness=cfg.max_staleness,
            batch_groups=cfg.batch_groups,
            capacity=cfg.queue_groups,
            share=self._state.share,
            share_until=self._state.share_until,
            weights_version=self._state.version,
            trainer_version=max(self._state.trainer_version, self._state.version),
            reported=max(self._state.trainer_version, self._state.version),
            trained_since=self._state.trained_since,
            excluded=set(self._state.epoch_excluded),
        )
        if not self._state.server_id:
            self._state.server_id = new_server_id()
        self._iter = iter(prompts)
        if self._state.iterator is not None:
            self._iter.set_state(self._state.iterator)
        self._reissue = collections.deque(self._state.unfinished)
        self._unfinished: dict[int, dict[str, Any]] = {}
        self._stop = threading.Event()
        self._draining = False  # `drain`: admission closed for good
        self._thread = threading.Thread(target=self._run, name="rollout-loop", daemon=True)
        self.groups_produced = 0
        self.prompts_drawn = 0
        self.prompts_skipped = 0  # longer than the prefill (or not encodable)
        self.groups_rejected = 0  # acknowledged as not trained (replaced by admission)
        self.push_bytes = 0  # weights read by the last UpdateWeights
        self.push_bytes_total = 0
        self.rows_skipped = rows_skipped
        self.groups_failed = 0
        self._started = self._clock()
        if self._reissue:
            log.info("re-issuing %d prompts not pulled before the restart", len(self._reissue))

    @property
    def persisted(self) -> RolloutState:
        """The state the loop persists (live: tests and the server read it)."""
        return self._state

    # Life cycle.

    def start(self) -> None:
        """Starts the loop's thread."""
        self._thread.start()

    def stop(self) -> None:
        """Stops the loop, waits (up to 10 s) for its thread and saves the state once more (every
        change not yet written, or a failed save, is on disk once this returns, unless that write
        fails too)."""
        self._stop.set()
        self._wake()
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        with self._lock:
            seq = self._save_locked()
        self._store.wait(seq)

    def alive(self) -> bool:
        """Whether the loop's thread runs and has not been asked to stop."""
        return self._thread.is_alive() and not self._stop.is_set()

    def drain(self) -> None:
        """Closes admission for good (a preemption notice, docs/DESIGN.md §6.5): the groups
        running finish and, like the ones queued, wait to be pulled; a Pull no longer waits once
        nothing runs. What the trainer has not acknowledged when the server stops stays in the
        persisted state and is re-issued by a restart, so nothing is lost."""
        with self._lock:
            self._draining = True
            log.info(
                "draining: admission closed; %d groups running, %d queued, %d leased",
                len(self._running),
                len(self.queue),
                len(self._leased),
            )

    @property
    def draining(self) -> bool:
        """Whether `drain` was called."""
        return self._draining

    def drained(self) -> bool:
        """Draining, and every group made was acknowledged: none running, queued or leased."""
        with self._lock:
            return self._draining and not (self._running or self._leased or len(self.queue))

    # Counters.

    def stats(self) -> dict[str, Any]:
        """The counters of `StatsResponse` (version, groups, tokens, admission_open, ...)."""
        with self._lock:
            elapsed = max(self._clock() - self._started, 1e-9)
            tokens = self._driver.tokens_generated
            return {
                "version": self._engine.version,
                "groups_produced": self.groups_produced,
                "groups_consumed": self._state.consumed,
                "groups_queued": len(self.queue),
                "groups_running": len(self._running),
                "groups_leased": len(self._leased),
                "tokens_generated": tokens,
                "tokens_per_s": tokens / elapsed,
                "prompts_drawn": self.prompts_drawn,
                "prompts_skipped": self.prompts_skipped,
                "groups_rejected": self.groups_rejected,
                "push_bytes": self.push_bytes,
                "push_bytes_total": self.push_bytes_total,
                "rows_skipped": self.rows_skipped,
                "prefill_calls": self._engine.prefill_calls,
                "prefill_tokens": self._engine.prefill_tokens,
                "inserted_tokens": self._engine.extend_tokens,
                "admission_open": self._admission_open_locked(),
                "capacity_tokens_per_s": self.capacity_tokens_per_s,
            }

    def _admission_open_locked(self) -> bool:
        if self._draining:
            return False
        if self._wait_for_weights and not self._state.checkpoint_path:
            return False
        outstanding = self._outstanding_ids_locked()
        return self._admission.may_admit(outstanding) and len(outstanding) < self.queue.capacity

    def admission_budget(self) -> int:
        """How many more groups admission allows now (`ServerAdmission.budget`; ≤ 0 = closed)."""
        with self._lock:
            return self._admission.budget(self._outstanding_ids_locked())

    @property
    def admission(self) -> ServerAdmission:
        """The admission state (live; tests read it)."""
        return self._admission

    # The trainer's side.

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
        the trainer's version
        (0 = not sent), then leases up to `max_groups` finished groups, oldest admitted first
        (`ServerAdmission.hand_out`, which may hold younger ones back while an older group must
        still reach this batch), waiting up to `timeout_s` for the first.

        Choosing the groups, taking them off the queue and leasing them happen under the loop's
        lock, in one step: in between, admission would see them in no count and start a group
        too many. The reply waits (outside the lock) until the acknowledgements and the returned
        groups' dispatches are on disk (docs/DESIGN.md §6.4).
        """
        if give_back:
            self._give_back(give_back)
        seq = self._ack(ack, reject, run_id)[1] if ack or reject else 0
        self._touch(run_id)
        deadline = time.monotonic() + timeout_s
        with self._lock:
            self._admission.saw_trainer(trainer_version)
        groups: list[rollout_pb2.Group] = []
        while self._wait_for_a_group(max(deadline - time.monotonic(), 0.0)):
            with self._lock:
                groups = self._hand_out_locked(max_groups)
                for g in groups:
                    seq = max(seq, self._undurable.pop(g.group_id, 0))
            if groups or time.monotonic() >= deadline:
                break
            # Held back for an older group still running: it finishes soon (generation is bounded).
            time.sleep(min(_HOLD_POLL_S, max(deadline - time.monotonic(), 0.0)))
        self._store.wait(seq)
        return groups

    def _hand_out_locked(self, max_groups: int) -> list[rollout_pb2.Group]:
        """Leases what `ServerAdmission.hand_out` picks, in its order, within the response
        size limit."""
        queued = {g.group_id: g for g in self.queue.snapshot()}
        ids = self._admission.hand_out(list(queued), self._running, max_groups)
        # Keep the response under the gRPC message limit; the rest stays queued.
        total, keep = 0, 0
        for i in ids:
            total += queued[i].ByteSize() + 16
            if keep and total > self._max_response_bytes:
                break
            keep += 1
        chosen = set(ids[:keep])
        self.queue.remove_if(lambda g: g.group_id in chosen)
        groups = [queued[i] for i in ids[:keep]]
        until = self._clock() + self._lease_s
        for g in groups:
            self._leased[g.group_id] = (g, until)
        self._admission.lease(g.group_id for g in groups)
        return groups

    def _wait_for_a_group(self, timeout_s: float) -> bool:
        """Waits up to `timeout_s` for a queued group. It looks every quarter second whether
        the server drains (every 50 ms once it does): then it waits only while a group still
        runs (one may also fail and never be queued)."""
        deadline = time.monotonic() + timeout_s
        while True:
            left = max(deadline - time.monotonic(), 0.0)
            if self.queue.wait(min(left, 0.05 if self._draining else 0.25)):
                return True
            if time.monotonic() >= deadline:
                return False
            if self._draining:
                with self._lock:
                    if not self._running:
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
        `reject` for good (leased ones, ones whose lease
        expired and that wait in the queue again, and ones this server re-generates after a
        restart although the trainer already has them) and counts them as consumed; unknown ids
        (already acknowledged) are ignored. Returns how many were removed.

        Every removed group leaves admission's count (`ServerAdmission.done`), so a rejected one
        (the trainer will not train it) is replaced as soon as the rule allows, which is not
        before newer weights when the trainer is already too far ahead of the ones held here.
        A group outstanding before the epoch began (`epoch_excluded`) was never counted: it
        leaves without freeing a place.

        Returns once the acknowledgement is on disk (docs/DESIGN.md §6.4).
        """
        if give_back:
            self._give_back(give_back)
        acked, seq = self._ack(group_ids, reject, run_id)
        self._store.wait(seq)
        return acked

    def _give_back(self, group_ids: Sequence[int]) -> None:
        """Ends the leases of `group_ids` (unknown or not leased ones are ignored): queued again
        at the front; the next Pull leases them for the batch it names."""
        with self._lock:
            back = [self._leased.pop(i)[0] for i in dict.fromkeys(group_ids) if i in self._leased]
            if back:
                self.queue.unget(back)
                self._admission.unlease(g.group_id for g in back)
        if back:
            self._wake()

    def _ack(self, group_ids: Sequence[int], reject: Sequence[int], run_id: str) -> tuple[int, int]:
        """`ack` without waiting: (groups removed, the snapshot a reply must wait for)."""
        self._touch(run_id)
        rejected = set(reject)
        ids = set(group_ids) | rejected
        with self._lock:
            done = [i for i in ids if self._leased.pop(i, None) is not None]
            requeued = self.queue.remove_if(lambda g: g.group_id in ids)
            done += [g.group_id for g in requeued]
            # Leased before a restart and re-issued since (the trainer's acknowledgement waited
            # for this server to come back): the trainer has them, stop generating them again.
            done += [i for i in ids if self._running.pop(i, None) is not None]
            again = {r["group_id"] for r in self._reissue} & ids
            if again:
                self._reissue = collections.deque(
                    r for r in self._reissue if r["group_id"] not in again
                )
                done += sorted(again)
            if done:
                self._state.consumed += len(done)
                self._admission.done(done, trained=set(group_ids) - rejected)
                self._state.trainer_version = self._admission.trainer_version
                self._state.trained_since = self._admission.trained_since
                self._state.epoch_excluded = sorted(self._admission.excluded)
                self.groups_rejected += sum(i in rejected for i in done)
                for i in done:
                    self._unfinished.pop(i, None)
                seq = self._save_locked()
        if not done:  # the ids may be of an acknowledgement whose write is in flight
            return 0, self._store.submitted if ids else 0
        self._wake()  # they left admission's count
        return len(done), seq

    def release(self, groups: Sequence[rollout_pb2.Group]) -> None:
        """Ends the leases of `groups` now (their Pull's reply was never sent): they are queued
        again, at the front, in order."""
        with self._lock:
            back = [g for g in groups if self._leased.pop(g.group_id, None) is not None]
            if back:
                self.queue.unget(back)
                self._admission.unlease(g.group_id for g in back)

    def _expire_leases(self) -> None:
        now = self._clock()
        with self._lock:
            expired = [g for g, until in self._leased.values() if until <= now]
            if not expired:
                return
            for g in expired:
                del self._leased[g.group_id]
            self.queue.unget(expired)
            self._admission.unlease(g.group_id for g in expired)
        log.warning("%d pulled groups were not acknowledged in time; queued again", len(expired))

    def _touch(self, run_id: str) -> None:
        if run_id and run_id == self._state.run_id:
            self._run_seen = self._clock()

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
        lease); `trainer_version` (0 = not sent) the trainer's
        version now, at or past `version`.

        Raises:
          RunNotAttachedError: `new_epoch` from a run other than the attached one while that one
            has called within the last `lease_s` seconds (nothing changes).
          ValueError: from `MoEEngine.swap_params` (params of another structure, bad version).
        """
        with self._lock:
            new_epoch = new_epoch or not self._state.checkpoint_path
            self._check_attached_locked(new_epoch, run_id)
            self._engine.swap_params(version, params)
            share = share if share > 0 else 1.0
            self._admission.install(version, share, share_until)
            if new_epoch:
                self._admission.begin_epoch(version, self._outstanding_ids_locked())
                self._state.epoch_version = version
                self._state.run_id = run_id
            self._admission.saw_trainer(trainer_version)
            self._state.epoch_excluded = sorted(self._admission.excluded)
            self._state.trainer_version = self._admission.trainer_version
            self._state.trained_since = self._admission.trained_since
            self._state.share, self._state.share_until = share, self._admission.share_until
            self._state.version, self._state.checkpoint_path = version, checkpoint_path
            self._state.base_path = base_path
            self.push_bytes = push_bytes
            self.push_bytes_total += push_bytes
            self._touch(run_id)
            seq = self._save_locked()
        self._wake()
        self._store.wait(seq)

    def _outstanding_ids_locked(self) -> set[int]:
        """Ids of the groups queued, leased or running."""
        queued = {g.group_id for g in self.queue.snapshot()}
        return queued | set(self._leased) | set(self._running)

    def check_attached(self, new_epoch: bool, run_id: str) -> None:
        """Raises `RunNotAttachedError` if an update from `run_id` (starting a new admission
        epoch or not) would be refused by `install_weights`."""
        with self._lock:
            self._check_attached_locked(new_epoch or not self._state.checkpoint_path, run_id)

    def _check_attached_locked(self, new_epoch: bool, run_id: str) -> None:
        attached = self._state.run_id
        if not (new_epoch and attached and run_id != attached):
            return
        idle = self._clock() - self._run_seen
        if idle < self._lease_s:
            raise RunNotAttachedError(
                f"the server is attached to trainer run {attached!r} (last call {idle:.0f}s "
                f"ago); another run may start an admission epoch once it has been silent for "
                f"{self._lease_s:.0f}s"
            )

    # The loop.

    def _run(self) -> None:
        last_log = self._clock()
        last_tokens = 0
        while not self._stop.is_set():
            try:
                self._collect(timeout_s=self._COLLECT_S)
                self._measure()
                self._expire_leases()
                self._retry_failed_save()
                while not self._stop.is_set() and self._may_dispatch():
                    self._dispatch_next()
            except Exception:  # keep the loop alive; the error is in the log
                log.exception("rollout loop step failed")
                time.sleep(0.5)
            now = self._clock()
            if now - last_log >= 60:
                tokens = self._driver.tokens_generated
                log.info(
                    "throughput: %.1f tokens/s, %d groups produced, %d queued, %d running, "
                    "version %d",
                    (tokens - last_tokens) / (now - last_log),
                    self.groups_produced,
                    len(self.queue),
                    len(self._running),
                    self._engine.version,
                )
                last_log, last_tokens = now, tokens

    def _may_dispatch(self) -> bool:
        with self._lock:
            return self._admission_open_locked()

    def _dispatch_next(self) -> None:
        with self._lock:
            if self._reissue:
                record = self._reissue.popleft()
            else:
                prompt = next(self._iter)
                self.prompts_drawn += 1
                record = {
                    "group_id": self._state.next_group_id,
                    "id": prompt.id,
                    "text": prompt.text,
                    "answer": prompt.answer,
                }
                self._state.next_group_id += 1
                self._state.iterator = self._iter.get_state()
            try:
                ids = self._opening(record)
            except (ValueError, EnvError) as e:
                self.prompts_skipped += 1
                log.warning(
                    "skipping prompt %s (%d skipped so far): %s",
                    record["id"],
                    self.prompts_skipped,
                    e,
                )
                self._save_locked()
                return
            group = RunningGroup(record=record, prompt_ids=ids)
            self._admission.admit(record["group_id"])
            self._running[record["group_id"]] = group
            self._unfinished[record["group_id"]] = record
            group.seq = self._save_locked()
        for i in range(self._cfg.group_size):
            self._submit(group, i)

    def _queue_group(self, group_id: int, group: RunningGroup) -> None:
        """Queues a finished group as its proto message: the server's one conversion of its
        records to the wire (`records.to_proto`). A group whose samples do not make a valid record
        (an engine bug) is logged and dropped, as one with too many failed samples is."""
        try:
            message = records.to_proto(self._group_record(group, self._state.server_id))
        except ValueError:
            log.exception("dropping prompt %s: its samples make no valid group", group.record["id"])
            self._drop_group(group_id)
            return
        with self._lock:
            del self._running[group_id]
            durable = self._store.durable
            self._undurable = {i: s for i, s in self._undurable.items() if s > durable}
            if group.seq > durable:  # its Pull waits for it
                self._undurable[group_id] = group.seq
            self.queue.put(message)
            self.groups_produced += 1

    def _drop_group(self, group_id: int) -> None:
        """Forgets a running group that will not be queued: it leaves admission's count (a
        replacement may start) and the prompts to re-issue."""
        with self._lock:
            del self._running[group_id]
            self._unfinished.pop(group_id, None)
            self._admission.done([group_id])
            self.groups_failed += 1
            self._save_locked()

    def _save_locked(self) -> int:
        """Hands a snapshot of the state to the store's writer and returns its number, which a
        reply revealing the change waits for (`StateStore.wait`, outside the lock). A failed write
        is logged and retried (`_retry_failed_save`); the state in memory stays as it is."""
        self._state.unfinished = list(self._reissue) + list(self._unfinished.values())
        return self._store.submit(self._state)

    def _retry_failed_save(self) -> None:
        self._store.wait(self._store.retry())
