"""The rollout loop: prompts (grain) → G samples each → rewards → finished groups handed out.

Each turn of the loop's thread reads admit → dispatch → collect → hand out: while admission
(`rollout_api.admission.ServerAdmission`) allows, the next prompt (`prompt_book.PromptBook`:
re-issued ones first) starts a group in `generation.Generation`, which reports the groups whose
samples all finished; those go to `delivery.Deliveries`, which the trainer's Pulls lease them
from. The components, the persisted state and the one lock they share are a
`loop_core.LoopCore`, which the loop's thread and the trainer's side (`TrainerLink`) both hold.

Admission (docs/DESIGN.md §6.3): a new group starts only while the groups outstanding (running,
queued, leased) stay under (max_staleness + 1 − lead) · share · batch_groups, where lead is how
many versions the trainer (its version rides on every Pull) is ahead of the weights this server
holds, and `share` this server's part of the fleet's batch (sent with every push, ∝ the capacity
this server measures and reports on every Pull reply); finished groups are handed out
oldest-admitted first; and queued + running stays within the queue's capacity, so the queue never
overflows. An admission epoch starts at the first trainer weights a server installs and at every
`UpdateWeights` with `new_admission_epoch` (the trainer sets it when it connects, e.g. after a
resume): the groups outstanding then are not counted, so one the trainer rejects buys no
replacement. With `wait_for_weights` nothing is dispatched before the first trainer weights.

Delivery (docs/DESIGN.md §6.2) is `rollout_server.delivery` (leases, groups queued again) and
the trainer's calls are `rollout_server.trainer_link.TrainerLink` (Pull, Ack, UpdateWeights),
which this class answers through. `drain` (SIGTERM, a preemption notice; docs/DESIGN.md §6.5) closes admission for
good: the groups running finish and, with the queued ones, are still handed out; what is not
acknowledged when the server stops is in the saved state and re-issued by a restart.

Every dispatch and every acknowledgement hands the state (the prompt book's, admission's
`get_state`, the counters) to the store's writer (`persistence.StateStore`, group commit: written
outside the loop's lock), so a restarted server re-issues unacknowledged prompts before drawing
new ones. A reply that reveals a change (an Ack, a Pull's acknowledgements and the dispatch of the
groups it returns, an UpdateWeights) waits, outside the lock, until the change is on disk
(docs/DESIGN.md §6.4). A failed save (e.g. a full disk) changes nothing in memory: it is logged and
retried on the loop's next turn until one succeeds.

Time is the injected `clock` (and `sleep`) everywhere: leases, the attached run's silence, a
Pull's wait, the capacity measure and the throughput log.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import grain

from rollout_api import records
from rollout_api.admission import ServerAdmission
from rollout_server.driver import RolloutDriver
from rollout_server.engine import MoEEngine
from rollout_server.generation import Collected, Generation, RunningGroup, SessionSource
from rollout_server.group_queue import GroupQueue
from rollout_server.loop_core import LoopCore
from rollout_server.persistence import RolloutState, StateStore
from rollout_server.prompt_book import PromptBook
from rollout_server.trainer_link import TrainerLink
from sat_jax.config import RolloutConfig
from sat_jax.tasks import Tokenizer
from sat_jax.tasks.envs import EnvError, EpisodeRunner
from sat_jax.tasks.rewards import RewardFn

log = logging.getLogger(__name__)


class RolloutLoop:
    """Runs in its own thread beside the JetStream driver threads (see the module docstring).

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
        or restored from the state); False = generate with the engine's initial weights too
        (`ServerConfig.wait_for_weights`).
      max_response_bytes: a Pull returns fewer groups rather than exceed this many bytes
        (a single larger group is still returned, and then fails at the gRPC limit); the server
        derives it from `ServerConfig.max_message_bytes`.
      lease_s: how long a pulled group waits for its acknowledgement before it is queued again.
      state: the state `store` holds, loaded once by the caller (the server restores the
        weights it names first); None = load it from `store`.
      rows_skipped: prompt-file rows the pipeline skipped (no prompt or answer column), reported
        in `stats()`.
      clock: the monotonic clock, in seconds, of everything the loop times: leases, the attached
        run's silence, a Pull's wait, the throughput (tests pass a fake one to expire a lease
        without waiting).
      sleep: waits that many seconds of `clock` (a fake clock's `sleep` moves it).
      episodes: runs multi-turn episodes (`task.env`); None = single-turn samples scored by
        `reward_fn`. Each sample is then an episode in one slot: `rollout.max_new_tokens`
        bounds each turn and the engine's `max_decode_length` the episode; its reward is the
        episode's, its trajectory carries the loss mask.
      sessions: hands each admitted sample to an external agent as an HTTP session instead
        (`rollout_server.sessions`, docs/DESIGN.md §6.6): its `offer(prompt, tag, done)`
        returns the session (which has the `reward`, like an episode) and later calls
        `done(tag, sample or None)`; a None sample is sampled again, as a failed one is.

    The measured capacity (`capacity_tokens_per_s`, `Generation`) goes out with every Pull
    reply and the Stats; the trainer sets this server's share by it (docs/DESIGN.md §6.3).
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
        state: RolloutState | None = None,
        rows_skipped: int = 0,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        episodes: EpisodeRunner | None = None,
        sessions: SessionSource | None = None,
    ):
        self._driver, self._engine, self._cfg = driver, engine, cfg
        self._wait_for_weights = wait_for_weights
        state = store.load() if state is None else state
        generation = Generation(
            driver=driver,
            engine=engine,
            cfg=cfg,
            tokenizer=tokenizer,
            reward_fn=reward_fn,
            episodes=episodes,
            sessions=sessions,
            clock=clock,
        )
        self._core = LoopCore.restore(
            state,
            store,
            cfg,
            generation,
            PromptBook(prompts, state),
            lease_s=lease_s,
            max_response_bytes=max_response_bytes,
            clock=clock,
            sleep=sleep,
        )
        self.trainer = TrainerLink(self._core, engine, lease_s)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rollout-loop", daemon=True)
        self._started = clock()
        self.groups_produced = self.prompts_skipped = self.groups_failed = 0
        self.rows_skipped = rows_skipped
        if self._core.prompts.reissue:
            log.info("re-issuing %d prompts not pulled before the restart", len(state.unfinished))

    # The trainer's calls (`TrainerLink`).

    def pull(self, max_groups: int, timeout_s: float, **kwargs: Any) -> list:
        """`TrainerLink.pull`."""
        return self.trainer.pull(max_groups, timeout_s, **kwargs)

    def ack(self, group_ids: Sequence[int], **kwargs: Any) -> int:
        """`TrainerLink.ack`."""
        return self.trainer.ack(group_ids, **kwargs)

    def release(self, groups: Sequence[Any]) -> None:
        """`TrainerLink.release`."""
        self.trainer.release(groups)

    def install_weights(self, version: int, checkpoint_path: str, params: Any, **kwargs) -> None:
        """`TrainerLink.install_weights`."""
        self.trainer.install_weights(version, checkpoint_path, params, **kwargs)

    def check_attached(self, new_epoch: bool, run_id: str) -> None:
        """`TrainerLink.check_attached`."""
        self.trainer.check_attached(new_epoch, run_id)

    @property
    def persisted(self) -> RolloutState:
        """The state the loop persists, as of now (live: tests and the server read it)."""
        with self._core.lock:
            self._core.sync_locked()
        return self._core.state

    @property
    def queue(self) -> GroupQueue:
        """The finished groups waiting to be pulled (`Deliveries.queue`)."""
        return self._core.deliveries.queue

    @property
    def admission(self) -> ServerAdmission:
        """The admission state (live; tests read it)."""
        return self._core.admission

    @property
    def capacity_tokens_per_s(self) -> float:
        """The measured capacity (`Generation.capacity_tokens_per_s`)."""
        return self._core.generation.capacity_tokens_per_s

    # Life cycle.

    def start(self) -> None:
        """Starts the loop's thread."""
        self._thread.start()

    def stop(self) -> None:
        """Stops the loop, waits (up to 10 s) for its thread and saves the state once more (every
        change not yet written, or a failed save, is on disk once this returns, unless that write
        fails too)."""
        self._stop.set()
        self._core.generation.wake()
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        with self._core.lock:
            seq = self._core.save_locked()
        self._core.store.wait(seq)

    def alive(self) -> bool:
        """Whether the loop's thread runs and has not been asked to stop."""
        return self._thread.is_alive() and not self._stop.is_set()

    def drain(self) -> None:
        """Closes admission for good (a preemption notice, docs/DESIGN.md §6.5): the groups
        running finish and, like the ones queued, wait to be pulled; a Pull no longer waits once
        nothing runs. What the trainer has not acknowledged when the server stops stays in the
        persisted state and is re-issued by a restart, so nothing is lost."""
        with self._core.lock:
            self._core.draining = True
            log.info(
                "draining: admission closed; %d groups running, %d queued, %d leased",
                len(self._core.generation.running),
                len(self.queue),
                len(self._core.deliveries.leased),
            )

    @property
    def draining(self) -> bool:
        """Whether `drain` was called."""
        return self._core.draining

    def drained(self) -> bool:
        """Draining, and every group made was acknowledged: none running, queued or leased."""
        with self._core.lock:
            return self._core.draining and not self._core.outstanding_ids_locked()

    # Counters.

    def stats(self) -> dict[str, Any]:
        """The counters of `StatsResponse` (version, groups, tokens, admission_open, ...)."""
        with self._core.lock:
            elapsed = max(self._core.clock() - self._started, 1e-9)
            tokens = self._driver.tokens_generated
            engine = self._engine
            return {
                "version": engine.version,
                "groups_produced": self.groups_produced,
                "groups_consumed": self._core.state.consumed,
                "groups_queued": len(self.queue),
                "groups_running": len(self._core.generation.running),
                "groups_leased": len(self._core.deliveries.leased),
                "tokens_generated": tokens,
                "tokens_per_s": tokens / elapsed,
                "prompts_drawn": self._core.prompts.drawn,
                "prompts_skipped": self.prompts_skipped,
                "groups_rejected": self.trainer.groups_rejected,
                "push_bytes": self.trainer.push_bytes,
                "push_bytes_total": self.trainer.push_bytes_total,
                "rows_skipped": self.rows_skipped,
                "prefill_calls": engine.prefill_calls,
                "prefill_tokens": engine.prefill_tokens,
                "inserted_tokens": engine.extend_tokens,
                "admission_open": self._admission_open_locked(),
                "capacity_tokens_per_s": self.capacity_tokens_per_s,
            }

    def _admission_open_locked(self) -> bool:
        if self._core.draining:
            return False
        if self._wait_for_weights and not self._core.state.checkpoint_path:
            return False
        outstanding = self._core.outstanding_ids_locked()
        return (
            self._core.admission.may_admit(outstanding) and len(outstanding) < self.queue.capacity
        )

    def admission_budget(self) -> int:
        """How many more groups admission allows now (`ServerAdmission.budget`; ≤ 0 = closed)."""
        with self._core.lock:
            return self._core.admission.budget(self._core.outstanding_ids_locked())

    # The loop: admit → dispatch → collect → hand out.

    def _run(self) -> None:
        last_log, last_tokens = self._core.clock(), 0
        while not self._stop.is_set():
            try:
                self._turn()
            except Exception:  # keep the loop alive; the error is in the log
                log.exception("rollout loop step failed")
                self._core.sleep(0.5)
            now = self._core.clock()
            if now - last_log >= 60:
                tokens = self._driver.tokens_generated
                log.info(
                    "throughput: %.1f tokens/s, %d groups produced, %d queued, %d running, "
                    "version %d",
                    (tokens - last_tokens) / (now - last_log),
                    self.groups_produced,
                    len(self.queue),
                    len(self._core.generation.running),
                    self._engine.version,
                )
                last_log, last_tokens = now, tokens

    def _turn(self) -> None:
        """One turn of the loop's thread: finished groups to the queue (where Pulls lease them),
        then the housekeeping (capacity, leases, a failed save), then as many new groups as
        admission allows."""
        self._collect(timeout_s=self._COLLECT_S)
        self._measure()
        self.trainer.expire_leases()
        self._core.retry_failed_save()
        while not self._stop.is_set() and self._may_dispatch():
            self._dispatch_next()

    def _measure(self) -> None:
        """One observation of the capacity measure (`Generation.measure`)."""
        with self._core.lock:
            self._core.generation.measure()

    def _may_dispatch(self) -> bool:
        with self._core.lock:
            return self._admission_open_locked()

    def _dispatch_next(self) -> None:
        """Starts the next prompt's group (a re-issued prompt first), unless its prompt cannot
        start (too long, the environment refuses it): then it is skipped and counted."""
        with self._core.lock:
            record = self._core.prompts.next()
            try:
                group = self._core.generation.start(record)
            except (ValueError, EnvError) as e:
                self.prompts_skipped += 1
                log.warning(
                    "skipping prompt %s (%d skipped so far): %s",
                    record["id"],
                    self.prompts_skipped,
                    e,
                )
                self._core.save_locked()
                return
            self._core.admission.admit(record["group_id"])
            self._core.prompts.dispatched(record)
            group.seq = self._core.save_locked()
        self._core.generation.submit(group)

    def _collect(self, timeout_s: float) -> None:
        """Collects what generation finished (`Generation.collect`, waiting up to `timeout_s`):
        complete groups are queued, dropped ones forgotten."""
        collected: Collected = self._core.generation.collect(timeout_s)
        for group in collected.finished:
            self._queue_group(group)
        for group in collected.dropped:
            self._drop_group(group)

    def _queue_group(self, group: RunningGroup) -> None:
        """Queues a finished group as its proto message: the server's one conversion of its
        records to the wire (`records.to_proto`). A group whose samples do not make a valid record
        (an engine bug) is logged and dropped, as one with too many failed samples is."""
        try:
            record = self._core.generation.group_record(group, self._core.state.server_id)
            message = records.to_proto(record)
        except ValueError:
            log.exception("dropping prompt %s: its samples make no valid group", group.record["id"])
            self._drop_group(group)
            return
        with self._core.lock:
            # Acknowledged meanwhile (re-issued after a restart): the trainer has it already.
            if self._core.generation.running.pop(group.record["group_id"], None) is None:
                return
            self._core.deliveries.put(message, group.seq, self._core.store.durable)
            self.groups_produced += 1

    def _drop_group(self, group: RunningGroup) -> None:
        """Forgets a running group that will not be queued: it leaves admission's count (a
        replacement may start) and the prompts to re-issue."""
        group_id = group.record["group_id"]
        with self._core.lock:
            if self._core.generation.running.pop(group_id, None) is None:
                return
            self._core.prompts.settled([group_id])
            self._core.admission.done([group_id])
            self.groups_failed += 1
            self._core.save_locked()
