"""Generating a group's samples (docs/DESIGN.md §6.1, §6.6): each admitted group's G samples go
to the JetStream driver as single-turn requests, as multi-turn episodes whose turns the
environment continues (`task.env`), or to external agents as HTTP sessions; finished samples come
back on one queue, failed ones are sampled again (a few times, then the group is dropped), and a
complete group becomes its `records.Group` with rewards and texts.

`Generation` holds this plumbing and the groups running. It is a component of
`rollout_server.rollout.RolloutLoop`, which starts groups (`start`, `submit`) and decides what a
finished or dropped group means: `collect` reports them (`Collected`) and the loop takes them out
of `running`. The driver's and the sessions' callbacks only hand over (they run on JetStream's
detokenize thread or an HTTP handler); everything else runs on the loop's thread.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import time
from collections.abc import Callable
from typing import Any, Protocol

from rollout_api import records
from rollout_api.admission import RateMeter
from rollout_server.driver import FinishedSample, RolloutDriver, RolloutRequest, TurnEnd
from rollout_server.engine import MoEEngine
from rollout_server.segments import segments_of
from sat_jax.config import RolloutConfig
from sat_jax.decoding import SamplingConfig
from sat_jax.tasks import Prompt, Tokenizer
from sat_jax.tasks.envs import EnvError, Episode, EpisodeRunner
from sat_jax.tasks.rewards import RewardFn

log = logging.getLogger(__name__)

_MAX_FAILURES = 3  # failed samples per group before the group is dropped
_TURN = object()  # marks an ended turn in the loop's queue
_WAKE = object()  # ends the loop's wait for finished samples (`Generation.wake`)
_RATE_WINDOW_S = 5.0  # the busy time one capacity measurement spans (`RateMeter`)


@dataclasses.dataclass
class RunningGroup:
    """A group being generated: its prompt record and ids, and the samples finished so far."""

    record: dict[str, Any]
    prompt_ids: list[int]
    samples: dict[int, FinishedSample] = dataclasses.field(default_factory=dict)
    failures: int = 0
    # Multi-turn: each sample's episode, and the samples whose environment failed mid-episode.
    episodes: dict[int, Episode] = dataclasses.field(default_factory=dict)
    env_failed: set[int] = dataclasses.field(default_factory=set)
    seq: int = 0  # the state snapshot that holds its dispatch (`StateStore.submit`)


class SessionSource(Protocol):
    """Where admitted samples go when external agents play them (`sessions.SessionManager`)."""

    def offer(
        self,
        prompt: Prompt,
        tag: tuple[int, int],
        done: Callable[[tuple[int, int], FinishedSample | None], None],
    ) -> Any: ...


@dataclasses.dataclass
class Collected:
    """What one `Generation.collect` found: groups whose every sample finished, and groups
    that will not finish (too many failed samples). Both are still in `Generation.running`:
    the owner takes them out."""

    finished: list[RunningGroup] = dataclasses.field(default_factory=list)
    dropped: list[RunningGroup] = dataclasses.field(default_factory=list)

    def ended(self, group_id: int) -> bool:
        """Whether `group_id` is among them (later samples of it are ignored)."""
        return any(g.record["group_id"] == group_id for g in self.finished + self.dropped)


def prompt_of(record: dict[str, Any]) -> Prompt:
    """The `Prompt` of a dispatched group's record."""
    return Prompt(id=record["id"], text=record["text"], answer=record["answer"])


class Generation:
    """The samples of the groups running (see the module docstring).

    Args:
      driver: the running `RolloutDriver`.
      engine: its generate engine (prompt limits, the episode length).
      cfg: group size, sampling lengths.
      tokenizer: encodes prompts (`encode_prompt`) and decodes completions.
      reward_fn: (completion text, answer) -> float, for single-turn samples.
      episodes: runs multi-turn episodes; None = single-turn samples.
      sessions: hands each sample to an external agent instead (None = none).
      clock: the monotonic clock, in seconds, of the capacity measure (the loop's).

    It measures the server's capacity (`rollout_api.admission.RateMeter`: tokens per second
    with every slot busy, from the driver's token count and the samples in flight, at most the
    engine's `max_concurrent_decodes`; an engine that names none, a test's fake, measures
    nothing). It takes no lock: the owner guards `running` with its own (its other threads
    read it and remove acknowledged groups), and calls `collect` from one thread.
    """

    def __init__(
        self,
        *,
        driver: RolloutDriver,
        engine: MoEEngine,
        cfg: RolloutConfig,
        tokenizer: Tokenizer,
        reward_fn: RewardFn,
        episodes: EpisodeRunner | None,
        sessions: SessionSource | None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self._driver, self._engine, self._cfg = driver, engine, cfg
        self._tokenizer, self._reward_fn = tokenizer, reward_fn
        self._episodes, self._sessions = episodes, sessions
        self._truncates = SamplingConfig.from_rollout(cfg).truncates
        self.running: dict[int, RunningGroup] = {}
        self._done: queue.SimpleQueue = queue.SimpleQueue()
        self._clock = clock
        slots = getattr(engine, "max_concurrent_decodes", 0)
        self._meter = RateMeter(int(slots), window_s=_RATE_WINDOW_S) if slots else None

    @property
    def capacity_tokens_per_s(self) -> float:
        """The measured capacity: tokens per second with every slot busy (0 = not measured yet;
        see `RateMeter`)."""
        return 0.0 if self._meter is None else self._meter.rate

    def measure(self) -> None:
        """One observation for the capacity measure (the loop calls it every turn, under its
        lock): the driver's token count and the samples in flight now (each holds a slot, or
        waits for one)."""
        if self._meter is None:
            return
        size = self._cfg.group_size
        busy = sum(size - len(g.samples) for g in self.running.values())
        self._meter.observe(self._clock(), self._driver.tokens_generated, busy)

    def wake(self) -> None:
        """Ends the loop thread's wait in `collect` now. Other threads call it after a change
        that may open admission (new weights, an acknowledgement) and to stop the loop: an idle
        server, with no sample to finish, would otherwise notice only when the wait times out,
        a delay in series with every batch whenever the staleness bound held generation back."""
        self._done.put((_WAKE, None))

    def start(self, record: dict[str, Any]) -> RunningGroup:
        """Adds the group of a dispatched prompt `record` to `running` (under the owner's lock;
        `submit` then starts its samples).

        Raises:
          ValueError: its prompt does not fit the prefill (or cannot be encoded).
          EnvError: the environment cannot start it.
        """
        group = RunningGroup(record=record, prompt_ids=self._opening(record))
        self.running[record["group_id"]] = group
        return group

    def submit(self, group: RunningGroup) -> None:
        """Starts every sample of `group` (outside the owner's lock)."""
        for i in range(self._cfg.group_size):
            self._submit(group, i)

    def _opening(self, record: dict[str, Any]) -> list[int]:
        """The prompt ids of a group's record: encoded, or the opening as the environment
        renders it (each episode's sample checks its own).

        Raises:
          ValueError: it does not fit the prefill (or cannot be encoded).
          EnvError: the environment cannot start it.
        """
        if self._episodes is None:
            ids = self._tokenizer.encode_prompt(record["text"])
        else:
            ids = self._episodes.start(prompt_of(record))[1]
        self._engine.check_prompt_length(len(ids))
        return ids

    def _submit(self, group: RunningGroup, index: int) -> None:
        """Starts sample `index` of `group`: offered as an HTTP session, started as an episode,
        or placed on the driver's prefill queue (the loop's thread collects it)."""
        if self._sessions is not None:
            group.episodes[index] = self._sessions.offer(
                prompt_of(group.record), (group.record["group_id"], index), self._session_done
            )
            return
        ids, episode = group.prompt_ids, None
        if self._episodes is not None:
            try:
                episode, ids = self._episodes.start(prompt_of(group.record))
                self._engine.check_prompt_length(len(ids))
            except (ValueError, EnvError) as e:
                log.warning("cannot start an episode of prompt %s: %s", group.record["id"], e)
                self._done.put(((group.record["group_id"], index), None))
                return
            group.episodes[index] = episode
        request = RolloutRequest(
            max_tokens=self._cfg.max_new_tokens
            if episode is None
            else self._engine.max_decode_length,
            return_channel=None,
            prefill_content=list(ids),
            is_client_side_tokenization=True,
            tag=(group.record["group_id"], index),
            on_done=self._on_done,
            episode=episode is not None,
            turn_tokens=self._cfg.max_new_tokens,
            on_turn=self._on_turn,
        )
        self._driver.place_request_on_prefill_queue(request)

    def _session_done(self, tag: tuple[int, int], sample: FinishedSample | None) -> None:
        self._done.put((tag, sample))

    def _on_done(self, request: RolloutRequest, sample: FinishedSample | None) -> None:
        # Called on JetStream's detokenize thread: only hand over.
        self._done.put((request.tag, sample))

    def _on_turn(self, request: RolloutRequest, turn: TurnEnd) -> None:
        # Called on JetStream's detokenize thread: the environment runs on the loop's thread.
        self._done.put((_TURN, (request, turn)))

    def _after_turn(self, request: RolloutRequest, turn: TurnEnd, ended: Collected) -> None:
        """Asks the sample's environment about its ended turn and continues or ends the
        episode; a sample whose group is gone (acknowledged, dropped, or `ended` in this
        collect) just ends, freeing its slot, and one whose environment fails ends and is
        sampled again."""
        group_id, index = request.tag
        group = None if ended.ended(group_id) else self.running.get(group_id)
        episode = None if group is None else group.episodes.get(index)
        ids = None
        if episode is not None:
            try:
                ids = self._episodes.after_turn(
                    episode, turn.ids, finish_reason=turn.finish_reason, room=turn.room
                )
            except (EnvError, ValueError) as e:
                log.warning("episode of prompt %s failed: %s", group.record["id"], e)
                group.env_failed.add(index)
        if ids is None:
            self._driver.end_episode(request)
        else:
            self._driver.continue_episode(request, ids)

    def collect(self, timeout_s: float) -> Collected:
        """Takes what the driver, the episodes and the sessions handed over (waiting up to
        `timeout_s` for the first): an ended turn goes to its environment, a finished sample to
        its group, a failed one is sampled again, up to `_MAX_FAILURES` times a group. Reports
        the groups now complete and those dropped (too many failed samples)."""
        out = Collected()
        try:
            items = [self._done.get(timeout=timeout_s)]
        except queue.Empty:
            return out
        while True:
            try:
                items.append(self._done.get_nowait())
            except queue.Empty:
                break
        for tag, sample in items:
            if tag is _WAKE:
                continue
            if tag is _TURN:
                self._after_turn(*sample, out)
                continue
            group_id, index = tag
            group = self.running.get(group_id)
            if group is not None and not out.ended(group_id):
                self._take(group, index, sample, out)
        return out

    def _take(
        self, group: RunningGroup, index: int, sample: FinishedSample | None, out: Collected
    ) -> None:
        """Files one sample of `group`: kept, sampled again after a failure, or the end of the
        group (complete, or dropped after `_MAX_FAILURES` failures), reported in `out`."""
        if index in group.env_failed:
            group.env_failed.discard(index)
            sample = None
        if sample is None:  # generation failed: sample again, a few times
            group.failures += 1
            if group.failures <= _MAX_FAILURES:
                self._submit(group, index)
                return
            log.error("dropping prompt %s: %d failed samples", group.record["id"], group.failures)
            out.dropped.append(group)
            return
        group.samples[index] = sample
        if len(group.samples) == self._cfg.group_size:
            out.finished.append(group)

    def group_record(self, group: RunningGroup, server_id: str) -> records.Group:
        """The group's record, under `server_id`: the engine's arrays as they are, with rewards
        and texts. A forked HTTP session (docs/DESIGN.md §6.6) gives one trajectory per segment,
        oldest first, each with the session's reward, and the record says which sample each
        is a segment of (`records.Group.sessions`; () when no sample forked)."""
        record = group.record
        trajectories, sessions = [], []
        for i in range(self._cfg.group_size):
            episode = group.episodes.get(i)
            reward = None if episode is None else episode.reward
            for segment in segments_of(group.samples[i]):
                trajectories.append(self._trajectory(segment, record, reward))
                sessions.append(i)
        return records.Group(
            server_id=server_id,
            group_id=record["group_id"],
            prompt_id=record["id"],
            prompt_text=record["text"],
            answer=record["answer"],
            trajectories=tuple(trajectories),
            sessions=tuple(sessions) if len(sessions) > self._cfg.group_size else (),
        )

    def _trajectory(
        self, s: FinishedSample, record: dict[str, Any], reward: float | None
    ) -> records.Trajectory:
        """One sample's (or segment's) trajectory; `reward` None = scored by the reward
        function (a single-turn sample)."""
        text = self._tokenizer.decode(s.completion_ids)
        return records.Trajectory(
            prompt_ids=s.prompt_ids,
            completion_ids=s.completion_ids,
            behavior_logprobs=s.logprobs,
            versions=s.versions,
            routing=s.routing,
            # Sent only when the sampler truncates: otherwise every count is the whole
            # sampleable vocabulary, and the trainer scores over it anyway.
            kept_counts=s.kept_counts if self._truncates else None,
            reward=self._reward(text, record) if reward is None else reward,
            finish_reason=s.finish_reason,
            completion_text=text,
            loss_mask=s.loss_mask,
            response_formats=s.response_formats,
            format_index=s.format_index,
        )

    def _reward(self, text: str, record: dict[str, Any]) -> float:
        """The reward; a reward function that raises scores 0 (logged) instead of losing the
        group."""
        try:
            return float(self._reward_fn(text, record["answer"]))
        except Exception:
            log.exception("reward failed for prompt %s; scoring 0", record["id"])
            return 0.0
