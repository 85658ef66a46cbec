"""JetStream's orchestrator `Driver` with a detokenize thread that records RL trajectories.

The detokenize thread receives, in one FIFO, "(slot, request)": the slot now serves that request,
and "(step, ResultTokens)": one generate step for every slot. Ours accumulates, per request, the
completion tokens (EOS included), behavior log-probs, versions and routing ids, and hands finished
`RolloutRequest`s to their `on_done` callback. Stock `Decode` requests (plain `ActiveRequest`s)
stream tokens as JetStream does. Any exception is caught per request: JetStream SIGKILLs the whole
process when one of its threads dies.
"""

from __future__ import annotations

import dataclasses
import logging
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

log = logging.getLogger(__name__)

_RACE = "must have some requests inserted"  # JetStream 0.2.2's free-slot race (see below)


@dataclasses.dataclass(frozen=True, kw_only=True)
class FinishedSample:
    """One completed sample of a rollout request.

    Attributes:
      prompt_ids: [P] int32, exactly the tokenizer's prompt ids.
      completion_ids: [C] int32, the stop id included when `finish_reason == "eos"`.
      logprobs: [C] float32 behavior log-probs.
      versions: [C] int64 weights version per completion token.
      routing: [P + C, L, K] expert ids in the model's routing dtype.
      finish_reason: "eos" or "length".
    """

    prompt_ids: np.ndarray
    completion_ids: np.ndarray
    logprobs: np.ndarray
    versions: np.ndarray
    routing: np.ndarray
    finish_reason: str


@dataclasses.dataclass
class RolloutRequest(orchestrator.ActiveRequest):
    """A request from the rollout loop; `on_done(request, sample)` receives its result."""

    tag: Any = None
    on_done: Callable[[RolloutRequest, FinishedSample | None], None] | None = None
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)
    routing: list[np.ndarray] = dataclasses.field(default_factory=list)
    prompt: tuple[np.ndarray, np.ndarray] | None = None


class RolloutDriver(orchestrator.Driver):
    """`orchestrator.Driver` whose detokenize thread also builds trajectories.

    Args: those of `orchestrator.Driver`; the generate engines must be `MoEEngine`s.
    """

    def __init__(self, *args, **kwargs):
        self.tokens_generated = 0
        # Called (on the generate thread) with the error of a failed generate loop; None = log.
        self.on_fatal: Callable[[BaseException], None] | None = None
        self._counter_lock = threading.Lock()
        super().__init__(*args, **kwargs)

    def prefill_backlog_size(self) -> int:
        """Requests waiting for a prefill."""
        return self._prefill_backlog.qsize()

    def _process_prefill_content(
        self, request: orchestrator.ActiveRequest, tokenizer: Any, is_bos: bool, max_length: int
    ) -> tuple[np.ndarray, int]:
        """JetStream's padding, without its BOS: prompt ids are exactly the tokenizer's
        (`Tokenizer.encode_prompt` adds a BOS when the tokenizer has one; docs/DESIGN.md §11)."""
        if not isinstance(request.prefill_content, str):
            # JetStream pads an array (its BOS concatenation used to make a list one).
            request.prefill_content = np.asarray(request.prefill_content, np.int32)
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
        live: dict[int, orchestrator.ActiveRequest] = {}
        while self.live:
            item = backlog.get(block=True)
            if item is None:
                break
            if not isinstance(item[1], engine_api.ResultTokens):
                slot, request = item
                live[slot] = request
                if isinstance(request, RolloutRequest):
                    try:
                        request.prompt = engine.slot_prompt(slot)
                    except KeyError:
                        request.prompt = None  # a failed prefill/insert: the slot emits nothing
                continue
            try:
                step = unpack_step(
                    np.asarray(item[1].data), cfg.num_moe_layers, cfg.num_experts_per_tok
                )
            except Exception:
                log.exception("cannot read a generate step; dropping it")
                continue
            emitted = 0
            for slot, request in list(live.items()):
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
            return self._finish(request, "length", engine)
        token = int(step["token"][slot])
        if isinstance(request, RolloutRequest):
            request.tokens.append(token)
            request.logprobs.append(float(step["logp"][slot]))
            request.versions.append(int(step["version"][slot]))
            request.routing.append(step["routing"][slot].copy())
            if token in stops:
                return self._finish(request, "eos", engine)
            if len(request.tokens) >= request.max_tokens:
                return self._finish(request, "length", engine)
            return False
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

    def _finish(self, request: orchestrator.ActiveRequest, reason: str, engine: MoEEngine) -> bool:
        if not isinstance(request, RolloutRequest):
            if request.return_channel is not None:
                request.return_channel.close()
            return True
        prompt_ids, prompt_routing = request.prompt
        k = engine.config.num_experts_per_tok
        gen_routing = (
            np.stack(request.routing)
            if request.routing
            else np.zeros((0, engine.config.num_moe_layers, k), np.int32)
        )
        sample = FinishedSample(
            prompt_ids=np.asarray(prompt_ids, np.int32),
            completion_ids=np.asarray(request.tokens, np.int32),
            logprobs=np.asarray(request.logprobs, np.float32),
            versions=np.asarray(request.versions, np.int64),
            routing=np.concatenate([prompt_routing, gen_routing.astype(prompt_routing.dtype)]),
            finish_reason=reason,
        )
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
