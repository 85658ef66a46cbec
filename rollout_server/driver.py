"""JetStream's orchestrator `Driver` with a detokenize thread that records RL trajectories.

The detokenize thread receives, in one FIFO, "(slot, request)": the slot now serves that request,
and "(step, ResultTokens)": one generate step for every slot. Ours writes, per request, the
completion tokens (EOS included), behavior log-probs, versions and routing ids into arrays
allocated once when the request gets its slot (`TokenBuffer`: no per-token Python lists), and hands
finished `RolloutRequest`s to their `on_done` callback with views of those arrays. Stock `Decode` requests (plain `ActiveRequest`s)
stream tokens as JetStream does. Any exception is caught per request: JetStream SIGKILLs the whole
process when one of its threads dies.

Multi-turn episodes (`RolloutRequest.episode`) keep their slot across turns. When a turn ends (a
stop token, the per-turn `turn_tokens`, or the episode's `max_tokens`) the request waits and
`on_turn` receives the turn; the rollout loop asks the environment and answers with
`continue_episode` (the observation tokens) or `end_episode`. Both reach this thread through its
own action queue, drained before every step it reads, so the buffer is only ever touched here: a continuation appends the observation
tokens (loss mask 0) and only then schedules the engine's extension, whose steps carry the next
segment number; steps of an older segment (the slot decoded on while the environment ran) are
dropped. With the first step of the new segment the buffer takes the routing the extension
recorded for the observation tokens (`MoEEngine.extension_routing`), so every position of a
trajectory carries the routing that served it and R3 replays observation tokens too.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from rollout_server import jetstream_compat  # noqa: F401  (must precede jetstream imports)

# isort: split
from jetstream.core import orchestrator
from jetstream.core.utils.return_sample import ReturnSample
from jetstream.engine import engine_api

from rollout_server.engine import MoEEngine, unpack_step
from sat_jax.completions import FinishedSample, TokenBuffer, turn_end

log = logging.getLogger(__name__)

_RACE = "must have some requests inserted"
_ACTION_POLL_S = 0.01  # how often an idle detokenize thread looks for episode actions
_NOTHING = object()  # JetStream 0.2.2's free-slot race (see below)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TurnEnd:
    """One ended assistant turn of an episode, as `on_turn` receives it.

    Attributes:
      ids: [n] the turn's generated ids (the stop id included when `finish_reason == "stop"`).
      finish_reason: "stop" (a stop token) or "length" (the turn's or the episode's limit).
      room: completion tokens the episode has left (`max_tokens` minus those so far).
    """

    ids: np.ndarray
    finish_reason: str
    room: int


@dataclasses.dataclass
class RolloutRequest(orchestrator.ActiveRequest):
    """A request from the rollout loop; `on_done(request, sample)` receives its result.

    `buffer` is set when the request gets its slot (None after a failed prefill or insert).

    A multi-turn request (`episode`) has `max_tokens` for the whole episode (generated and
    inserted tokens) and `turn_tokens` per turn; `on_turn(request, turn)` receives each ended turn
    (on the detokenize thread: hand over, do not block), and the request waits for
    `RolloutDriver.continue_episode` or `end_episode`. The fields after `on_turn` are the
    driver's."""

    tag: Any = None
    on_done: Callable[[RolloutRequest, FinishedSample | None], None] | None = None
    buffer: TokenBuffer | None = None
    episode: bool = False
    turn_tokens: int = 0
    on_turn: Callable[[RolloutRequest, TurnEnd], None] | None = None
    slot: int = -1
    segment: int = 0  # the engine segment whose steps this request takes
    waiting: bool = False  # a turn ended; the environment has not answered yet
    turn_start: int = 0  # where the current turn starts in the buffer
    # The episode's finish reason: "length" once any turn was cut by a limit (the turn's or
    # the episode's token budget), else "stop" (docs/DESIGN.md §7.1, overlong episodes).
    episode_finish: str = "stop"
    # (buffer position, count) of inserted tokens whose routing the engine's extension has
    # yet to hand over (taken with the first step after it).
    inserted_routing: tuple[int, int] | None = None
    detokenize_index: int = 0
    # Ends the turn (or the request) like a stop id when it returns True for the turn's ids so
    # far: the HTTP endpoint's `stop` strings (`rollout_server.chat`). None = stop ids only.
    stop_when: Callable[[np.ndarray], bool] | None = None
    # Constrained decoding of the request's first turn (`sat_jax.json_mask`'s canonical
    # format string; None = free), and of a continued turn when set before `continue_episode`.
    response_format: str | None = None


@dataclasses.dataclass(frozen=True)
class _Continue:
    request: RolloutRequest
    tokens: np.ndarray


@dataclasses.dataclass(frozen=True)
class _End:
    request: RolloutRequest


class RolloutDriver(orchestrator.Driver):
    """`orchestrator.Driver` whose detokenize thread also builds trajectories.

    Args: those of `orchestrator.Driver`; the generate engines must be `MoEEngine`s.
    """

    def __init__(self, *args, **kwargs):
        self.tokens_generated = 0
        # Called (on the generate thread) with the error of a failed generate loop; None = log.
        self.on_fatal: Callable[[BaseException], None] | None = None
        self._counter_lock = threading.Lock()
        # Per detokenize thread: `continue_episode` / `end_episode` actions. Not JetStream's
        # detokenize backlog: the generate thread keeps that one full (8 steps), so an action
        # put there would wait behind it and block the rollout loop's thread.
        self._episode_actions: dict[int, queue.SimpleQueue] = collections.defaultdict(
            queue.SimpleQueue
        )
        self._actions_lock = threading.Lock()
        super().__init__(*args, **kwargs)

    @classmethod
    def interleaved(cls, engine: MoEEngine) -> RolloutDriver:
        """The server's driver: one engine both prefills and generates (interleaved mode), on
        the params ``engine.load_params()`` gives, without JetStream's padding."""
        params = engine.load_params()
        return cls(
            prefill_engines=[engine],
            generate_engines=[engine],
            prefill_params=[params],
            generate_params=[params],
            interleaved_mode=True,
            jax_padding=False,
        )

    def _actions(self, idx: int) -> queue.SimpleQueue:
        with self._actions_lock:
            return self._episode_actions[idx]

    def continue_episode(self, request: RolloutRequest, tokens: Any) -> None:
        """Continues a waiting episode after `tokens` (the observation ids, at least one): they
        join the trajectory with loss mask 0 and the slot decodes on after them. Thread-safe."""
        tokens = np.asarray(tokens, np.int32)
        self._actions(request.detokenize_index).put(_Continue(request, tokens))

    def end_episode(self, request: RolloutRequest) -> None:
        """Ends a waiting episode: `on_done` receives its sample (finish reason "length" when any
        of its turns was cut by a limit, else "stop") and the slot is freed. Thread-safe."""
        self._actions(request.detokenize_index).put(_End(request))

    def prefill_backlog_size(self) -> int:
        """Requests waiting for a prefill."""
        return self._prefill_backlog.qsize()

    def idle_slots(self) -> int:
        """Slots holding no request with no request waiting for a prefill to take them."""
        free = sum(slots.qsize() for slots in self._generate_slots)
        return max(0, free - self._prefill_backlog.qsize())

    def _process_prefill_content(
        self, request: orchestrator.ActiveRequest, tokenizer: Any, is_bos: bool, max_length: int
    ) -> tuple[np.ndarray, int]:
        """JetStream's padding, without its BOS: prompt ids are exactly the tokenizer's
        (`Tokenizer.encode_prompt` adds a BOS when the tokenizer has one; docs/DESIGN.md §11)."""
        if not isinstance(request.prefill_content, str):
            # JetStream pads an array (its BOS concatenation used to make a list one).
            request.prefill_content = np.asarray(request.prefill_content, np.int32)
        fmt = getattr(request, "response_format", None)
        for engine in self._prefill_engines:  # the format of the prefill this thread runs next
            if hasattr(engine, "formats"):
                engine.formats.next_prefill(fmt)
        return super()._process_prefill_content(request, tokenizer, False, max_length)

    def _generate_thread(self, idx: int) -> None:
        """JetStream's generate loop, restarted after its one known race.

        JetStream 0.2.2 reads the free-slot count once per iteration, and when this (detokenize)
        thread frees the last busy slot between that read and the loop's end, its assertion "At
        this point we must have some requests inserted into the slots" fires and JetStream
        SIGKILLs the process (seen twice in ~7 `make run`s, when a batch drains at admission
        close). When it fires every slot is free and nothing is in flight, so starting the loop
        again with a fresh decode state loses nothing.

        Any other error (e.g. out of memory inside `generate()` while two weight copies exist)
        ends the loop: it is logged and handed to `on_fatal` (the server then stops and exits
        with its state saved) instead of reaching JetStream's thread wrapper, which SIGKILLs the
        process.
        """
        slots = self._generate_slots[idx]
        capacity = self._generate_engines[idx].max_concurrent_decodes
        while self.live:
            try:
                return super()._generate_thread(idx)
            except Exception as e:
                race = isinstance(e, AssertionError) and _RACE in str(e)
                if race and slots.qsize() >= capacity:
                    log.warning("generate loop %d hit the free-slot race; restarting it", idx)
                    continue
                log.error("generate loop %d failed", idx, exc_info=e)
                if self.on_fatal is not None:
                    self.on_fatal(e)
                return None
        return None

    def _detokenize_thread(self, idx: int) -> None:
        backlog = self._detokenize_backlogs[idx]
        engine: MoEEngine = self._generate_engines[idx]
        free_slots = self._generate_slots[idx]
        stops = engine.tokenizer.stop_ids
        cfg = engine.config
        actions = self._actions(idx)
        live: dict[int, orchestrator.ActiveRequest] = {}
        while self.live:
            try:
                item = backlog.get(timeout=_ACTION_POLL_S)
            except queue.Empty:
                item = _NOTHING
            # Episode actions first: an extension scheduled now lands before the next step.
            while True:
                try:
                    action = actions.get_nowait()
                except queue.Empty:
                    break
                self._episode_action(action, live, free_slots, engine)
            if item is None:
                break
            if item is _NOTHING:
                continue
            if not isinstance(item[1], engine_api.ResultTokens):
                slot, request = item
                live[slot] = request
                if isinstance(request, RolloutRequest):
                    self._take_slot(request, slot, idx, engine)
                continue
            try:
                data = np.asarray(item[1].data)  # waits for the step
                engine.decode_clock.ready()
                step = unpack_step(data, cfg.num_moe_layers, cfg.num_experts_per_tok)
            except Exception:
                log.exception("cannot read a generate step; dropping it")
                continue
            emitted = 0
            for slot, request in list(live.items()):
                if isinstance(request, RolloutRequest) and request.episode:
                    if request.waiting or step["segment"][slot] != request.segment:
                        continue  # steps after the turn's end, before its extension
                try:
                    done = self._advance(request, slot, step, stops, engine)
                except Exception:
                    log.exception("request in slot %d failed; freeing the slot", slot)
                    self._fail(request)
                    done = True
                emitted += int(step["valid"][slot])
                if done:
                    del live[slot]
                    free_slots.put(slot, block=False)
            with self._counter_lock:
                self.tokens_generated += emitted

    @staticmethod
    def _take_slot(request: RolloutRequest, slot: int, idx: int, engine: MoEEngine) -> None:
        """`request` now has `slot` (of detokenize thread `idx`): its buffer is allocated."""
        request.slot, request.detokenize_index = slot, idx
        try:
            prompt_ids, prompt_routing = engine.slot_prompt(slot)
        except KeyError:  # a failed prefill/insert: the slot emits nothing
            request.buffer = None
        else:
            request.buffer = TokenBuffer(
                prompt_ids, prompt_routing, request.max_tokens, masked=request.episode
            )
            # The engine constrains the first turn to the format its prefill carried.
            request.buffer.set_format(request.response_format)

    def _advance(
        self,
        request: orchestrator.ActiveRequest,
        slot: int,
        step: dict[str, Any],
        stops: frozenset[int],
        engine: MoEEngine,
    ) -> bool:
        """Adds this step's token of `slot` to `request`; True when the request is complete."""
        if not step["valid"][slot]:
            # The slot emits nothing: its prefill or insert failed (validation keeps max_tokens
            # within the engine's decode limit, so it is never a normal end).
            if isinstance(request, RolloutRequest):
                self._fail(request)
                return True
            return self._finish(request, "length")
        token = int(step["token"][slot])
        if isinstance(request, RolloutRequest):
            buffer = request.buffer
            if request.inserted_routing is not None:
                self._take_inserted_routing(request, slot, engine)
            buffer.add(
                token,
                step["logp"][slot],
                step["version"][slot],
                step["routing"][slot],
                step["kept"][slot],
            )
            if token not in stops and request.stop_when is not None:
                if request.stop_when(buffer.tokens[request.turn_start : buffer.size]):
                    stops = frozenset({token})  # a stop string ended it: as a stop id would
            # A request that is not an episode is one turn of `max_tokens`.
            episode = request.episode
            reason = turn_end(
                token,
                buffer.size,
                request.turn_start if episode else 0,
                stops=stops,
                turn_tokens=request.turn_tokens if episode else request.max_tokens,
                max_tokens=request.max_tokens,
            )
            if reason is None:
                return False
            return self._end_turn(request, reason) if episode else self._finish(request, reason)
        channel = request.return_channel
        if channel is None or channel.cancelled():
            return True  # the client went away: free the slot now
        count = int(step["length"][slot])
        if token in stops:  # JetStream drops the stop token from streams
            channel.close()
            return True
        text = engine.tokenizer.decode([token])
        channel.add_result([ReturnSample(text=[text], token_ids=[token])])
        if count >= request.max_tokens:
            channel.close()
            return True
        return False

    @staticmethod
    def _take_inserted_routing(request: RolloutRequest, slot: int, engine: MoEEngine) -> None:
        """Writes into `request`'s buffer the routing the engine's extension recorded for the
        tokens it inserted (taken with the first step after the extension)."""
        at, n = request.inserted_routing
        request.inserted_routing = None
        routing = engine.extension_routing(slot, request.segment)
        if routing.shape[0] != n:
            raise ValueError(f"extension routing of {routing.shape[0]} tokens, not {n}")
        request.buffer.set_routing(at, routing)

    def _end_turn(self, request: RolloutRequest, reason: str) -> bool:
        """Hands an ended turn to `on_turn`; the request keeps its slot and waits."""
        buffer = request.buffer
        request.waiting = True
        if reason == "length":
            request.episode_finish = "length"
        turn = TurnEnd(
            ids=buffer.tokens[request.turn_start : buffer.size].copy(),
            finish_reason=reason,
            room=request.max_tokens - buffer.size,
        )
        if request.on_turn is None:
            return self._finish(request, reason)
        request.on_turn(request, turn)
        return False

    def _episode_action(
        self,
        item: _Continue | _End,
        live: dict[int, orchestrator.ActiveRequest],
        free_slots: Any,
        engine: MoEEngine,
    ) -> None:
        """Carries out `continue_episode` / `end_episode` for a request still in its slot."""
        request = item.request
        slot = request.slot
        if live.get(slot) is not request or not request.waiting:
            log.warning("episode action for a request no longer waiting in slot %d; ignored", slot)
            return
        try:
            if isinstance(item, _End):
                self._finish(request, request.episode_finish)
                done = True
            else:
                buffer = request.buffer
                start = len(buffer.prompt_ids) + buffer.size
                request.inserted_routing = (buffer.size, len(item.tokens))
                buffer.insert(item.tokens)
                buffer.set_format(request.response_format)  # the next turn's, as the engine's
                request.segment += 1
                request.waiting, request.turn_start = False, buffer.size
                engine.schedule_extend(
                    slot,
                    item.tokens,
                    start=start,
                    generated=buffer.size,
                    segment=request.segment,
                    response_format=request.response_format,
                )
                done = False
        except Exception:
            log.exception("episode in slot %d failed; freeing the slot", slot)
            self._fail(request)
            done = True
        if done:
            del live[slot]
            free_slots.put(slot, block=False)

    def _finish(self, request: orchestrator.ActiveRequest, reason: str) -> bool:
        if not isinstance(request, RolloutRequest):
            if request.return_channel is not None:
                request.return_channel.close()
            return True
        sample = request.buffer.sample(reason)
        if request.on_done is not None:
            request.on_done(request, sample)
        return True

    def _fail(self, request: orchestrator.ActiveRequest) -> None:
        try:
            if isinstance(request, RolloutRequest):
                if request.on_done is not None:
                    request.on_done(request, None)
            elif request.return_channel is not None:
                request.return_channel.set_exception(RuntimeError("generation failed"))
        except Exception:
            log.exception("cannot report a failed request")
