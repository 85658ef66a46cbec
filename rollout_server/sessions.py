"""RL sessions over HTTP: admitted samples played by external agents, token in / token out
(docs/DESIGN.md §6.6).

The rollout loop admits groups as it always does; with `server.http_sessions` each sample of a
group becomes a session here (`offer`) instead of an in-server episode. An agent runner takes
sessions (`take`: the prompt, the reference answer and a session id), runs its agent against the
OpenAI endpoint with the session id on each request, and ends the session with a reward (or lets
the task's reward function score the last reply). The session is one engine request in one slot,
exactly an in-server episode's: the first chat request is its prefill, every later one extends
the KV cache by the chat template's delta of the new messages (`HFTokenizer.observation_ids`),
never by re-rendering the history. The session keeps the conversation as it was rendered (the
request's messages and the replies it was given), and a request must extend it: its messages
start with that conversation, then only new non-assistant messages; anything else is refused
(`history_mismatch`). The finished sample reaches the loop like an episode's, with the loss mask
0 on every inserted token.

Everything here runs on the HTTP server's asyncio loop; the driver's callbacks (turns, ends) and
the rollout loop's offers hop onto it. A session taken and then silent for `idle_s` (no request
in flight) is dropped and counted: its sample reaches the loop as a failed one and is sampled
again, so a group never waits forever.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import secrets
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from rollout_server.chat import (
    ApiError,
    ChatRequest,
    Generation,
    assistant_message,
    make_stop_when,
    normalize_message,
    template_messages,
    truncate_at_stop,
)
from rollout_server.driver import FinishedSample, RolloutDriver, RolloutRequest, TurnEnd
from rollout_server.engine import MoEEngine
from sat_jax.tasks import Prompt

log = logging.getLogger(__name__)

Done = Callable[[tuple[int, int], FinishedSample | None], None]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Reply:
    """One generated reply (a choice, or a session's turn).

    Attributes:
      ids: [n] the generated ids (the stop id included when one ended it).
      logprobs: [n] their behavior log-probs; versions: [n] their weights versions.
      finish_reason: "stop", "length" or "tool_calls" (OpenAI's).
      message: the assistant message (content cut before a stop string; tool calls parsed).
      prompt_tokens: the tokens before the reply (a session's whole context so far).
    """

    ids: np.ndarray
    logprobs: np.ndarray
    versions: np.ndarray
    finish_reason: str
    message: dict[str, Any]
    prompt_tokens: int


def _finish(reason: str, message: dict[str, Any]) -> str:
    if message.get("tool_calls"):
        return "tool_calls"
    return "stop" if reason == "stop" else "length"


class Generator:
    """Stateless requests on the shared engine: one engine request per choice, awaited.

    Args:
      driver, engine: the server's.
      tokenizer: the engine's (HF, with a chat template for chat requests).
    """

    def __init__(self, driver: RolloutDriver, engine: MoEEngine, tokenizer: Any):
        self.driver, self.engine, self.tokenizer = driver, engine, tokenizer

    def prompt_ids(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[int]:
        """The chat template's render of `messages` (with `tools`), checked to fit a prefill.

        Raises:
          ApiError: 400, the template fails or the prompt is too long.
        """
        try:
            ids = self.tokenizer.encode_messages(template_messages(messages), tools=tools)
        except Exception as e:  # a template's own error (jinja2 raises its own types)
            raise ApiError(400, f"the chat template cannot render the messages: {e}") from None
        self.check_length(len(ids))
        return ids

    def check_length(self, n: int) -> None:
        try:
            self.engine.check_prompt_length(n)
        except ValueError as e:
            raise ApiError(400, str(e), code="context_length_exceeded") from None

    async def generate(
        self, ids: list[int], gen: Generation, *, tools: bool, call_prefix: str
    ) -> Reply:
        """One reply to the prompt `ids`."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()

        def on_done(request: RolloutRequest, sample: FinishedSample | None) -> None:
            loop.call_soon_threadsafe(_resolve, future, sample)

        request = RolloutRequest(
            max_tokens=gen.max_tokens,
            return_channel=None,
            prefill_content=list(ids),
            is_client_side_tokenization=True,
            on_done=on_done,
            stop_when=make_stop_when(self.tokenizer, gen.stop),
        )
        self.driver.place_request_on_prefill_queue(request)
        sample = await future
        if sample is None:
            raise ApiError(500, "generation failed", code="server_error")
        return self.reply(
            sample.completion_ids,
            sample.logprobs,
            sample.versions,
            sample.finish_reason,
            gen,
            tools=tools,
            call_prefix=call_prefix,
            prompt_tokens=len(ids),
        )

    def reply(self, ids, logprobs, versions, reason, gen, *, tools, call_prefix, prompt_tokens):
        text, _ = truncate_at_stop(self.tokenizer.decode(ids), gen.stop)
        message = assistant_message(text, tools=tools, call_prefix=call_prefix)
        return Reply(
            ids=np.array(ids, np.int32),
            logprobs=np.array(logprobs, np.float32),
            versions=np.array(versions, np.int64),
            finish_reason=_finish(reason, message),
            message=message,
            prompt_tokens=prompt_tokens,
        )


def _resolve(future: asyncio.Future, value: Any) -> None:
    if not future.done():
        future.set_result(value)


@dataclasses.dataclass(eq=False)
class Session:
    """One admitted sample played over HTTP (module docstring)."""

    id: str
    prompt: Prompt
    tag: tuple[int, int]
    done: Done
    state: str = "offered"  # offered, taken (no request yet), waiting, generating, ended
    messages: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    tools: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    request: RolloutRequest | None = None
    closed: bool = True  # the last turn ended with the template's end-of-turn token
    room: int = 0
    context: int = 0  # tokens in the slot's cache: prompt, turns and deltas
    turns: int = 0
    last_seen: float = 0.0
    reward: float = 0.0
    last_text: str = ""
    dropped: bool = False
    turn: asyncio.Future | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class SessionLimits:
    """`server.http_max_sessions` (taken and not ended) and `server.http_session_idle_s`."""

    max_sessions: int
    idle_s: float


class SessionManager:
    """The sessions of admitted samples (module docstring); `offer` is the rollout loop's hook.

    Args:
      generator: the engine side (prompt rendering and its checks).
      reward_fn: `(text, answer) -> float`, for a session ended without a reward.
      limits: open sessions and idle time.
      turn_tokens: the default per-turn limit (`rollout.max_new_tokens`).
      clock: seconds, monotonic (tests step it).
    """

    def __init__(
        self,
        generator: Generator,
        reward_fn: Callable[[str, str], float],
        limits: SessionLimits,
        *,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.gen, self.reward_fn, self.limits, self.clock = generator, reward_fn, limits, clock
        self._offered: collections.deque[Session] = collections.deque()
        self._offer_lock = threading.Lock()
        self._sessions: dict[str, Session] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self.abandoned = 0  # sessions dropped after idle_s
        self.finished = 0

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """Attaches the asyncio loop the HTTP server runs on (before it serves)."""
        self._loop, self._wake = loop, asyncio.Event()

    @property
    def open_sessions(self) -> int:
        return len(self._sessions)

    # The rollout loop's side (its thread).

    def offer(self, prompt: Prompt, tag: tuple[int, int], done: Done) -> Session:
        """A new session of `prompt` for a runner to take; `done(tag, sample or None)` later."""
        session = Session(id=secrets.token_urlsafe(16), prompt=prompt, tag=tag, done=done)
        with self._offer_lock:
            self._offered.append(session)
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._wake.set)
        return session

    # The runner's side.

    async def take(self, max_sessions: int, timeout_s: float) -> list[Session]:
        """Up to `max_sessions` offered sessions, waiting up to `timeout_s` for the first.

        Raises:
          ApiError: 429 when `limits.max_sessions` are open.
        """
        room = self.limits.max_sessions - len(self._sessions)
        if room <= 0:
            raise ApiError(
                429, f"{self.limits.max_sessions} sessions are open (server.http_max_sessions)"
            )
        # The wait is a real one, on the event loop's clock (`clock` only measures idleness).
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            with self._offer_lock:
                taken = [
                    self._offered.popleft()
                    for _ in range(min(room, max_sessions, len(self._offered)))
                ]
            if taken or loop.time() >= deadline:
                break
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), max(0.0, deadline - loop.time()))
            except TimeoutError:
                pass
        for s in taken:
            s.state, s.last_seen = "taken", self.clock()
            self._sessions[s.id] = s
        return taken

    def get(self, session_id: str) -> Session:
        session = self._sessions.get(session_id)
        if session is None:
            raise ApiError(
                404, "no such session (unknown, ended or dropped)", code="session_not_found"
            )
        return session

    async def chat(self, req: ChatRequest) -> Reply:
        """The session's next turn: its first request prefills, later ones extend.

        Raises:
          ApiError: 404 unknown session, 409 a request in flight, 400 a history edit or a
            conversation that no longer fits.
        """
        s = self.get(req.session_id)
        if s.state == "generating":
            raise ApiError(409, "a request of this session is in flight", code="session_busy")
        gen = req.generation
        if gen.n != 1:
            raise ApiError(400, "a session is one conversation: n must be 1", param="n")
        s.last_seen = self.clock()
        if s.request is None:
            ids = self.gen.prompt_ids(req.messages, req.tools)
            self._start(s, ids, gen)
            s.context = len(ids)
        else:
            ids = self._delta(s, req)
            if len(ids) + 1 > s.room:
                raise ApiError(
                    400, "the session's token budget is spent", code="context_length_exceeded"
                )
            s.request.turn_tokens = min(gen.max_tokens, s.room - len(ids))
            s.request.stop_when = make_stop_when(self.gen.tokenizer, gen.stop)
            self.gen.driver.continue_episode(s.request, ids)
            s.context += len(ids)
        s.messages, s.tools = list(req.messages), list(req.tools)
        s.state = "generating"
        s.turn = asyncio.get_running_loop().create_future()
        try:
            turn: TurnEnd | None = await s.turn
        except asyncio.CancelledError:
            # The client went away mid-turn: the session is dropped when its turn ends.
            s.dropped = True
            raise
        s.turn = None
        if turn is None:
            raise ApiError(500, "generation failed", code="server_error")
        return self._record_turn(s, turn, gen)

    def _start(self, s: Session, ids: list[int], gen: Generation) -> None:
        loop = asyncio.get_running_loop()
        engine = self.gen.engine

        def on_turn(request: RolloutRequest, turn: TurnEnd) -> None:  # detokenize thread
            # The turn's log-probs and versions, copied before the buffer moves on.
            buf = request.buffer
            lps = buf.logprobs[request.turn_start : buf.size].copy()
            versions = buf.versions[request.turn_start : buf.size].copy()
            loop.call_soon_threadsafe(self._on_turn, s, (turn, lps, versions))

        def on_done(request: RolloutRequest, sample: FinishedSample | None) -> None:
            loop.call_soon_threadsafe(self._on_done, s, sample)

        s.request = RolloutRequest(
            max_tokens=engine.max_decode_length,
            return_channel=None,
            prefill_content=list(ids),
            is_client_side_tokenization=True,
            tag=s.tag,
            on_done=on_done,
            episode=True,
            turn_tokens=gen.max_tokens,
            on_turn=on_turn,
            stop_when=make_stop_when(self.gen.tokenizer, gen.stop),
        )
        self.gen.driver.place_request_on_prefill_queue(s.request)

    def _delta(self, s: Session, req: ChatRequest) -> list[int]:
        """The template's delta ids of the new messages (the session rule, module docstring)."""
        n = len(s.messages)
        if req.tools != s.tools:
            raise ApiError(400, "tools differ from the session's", code="history_mismatch")
        if len(req.messages) <= n or req.messages[:n] != s.messages:
            first = next(
                (
                    i
                    for i, (a, b) in enumerate(zip(req.messages, s.messages, strict=False))
                    if a != b
                ),
                min(n, len(req.messages)),
            )
            raise ApiError(
                400,
                f"the messages do not extend the session's conversation (they differ at "
                f"message {first}: a request must resend the earlier messages and the replies "
                "it was given unchanged, then add new messages)",
                param="messages",
                code="history_mismatch",
            )
        new = req.messages[n:]
        if any(m["role"] == "assistant" for m in new):
            raise ApiError(
                400,
                "new messages may not be assistant messages: a session's assistant turns are "
                "the model's",
                param="messages",
                code="history_mismatch",
            )
        try:
            return self.gen.tokenizer.observation_ids(
                template_messages(new), tools=s.tools, close_turn=not s.closed
            )
        except Exception as e:
            raise ApiError(400, f"the chat template cannot render the messages: {e}") from None

    def _record_turn(self, s: Session, turn_data, gen: Generation) -> Reply:
        turn, lps, versions = turn_data
        tok = self.gen.tokenizer
        reply = self.gen.reply(
            turn.ids,
            lps,
            versions,
            turn.finish_reason,
            gen,
            tools=bool(s.tools),
            call_prefix=f"call_{s.turns}_",
            prompt_tokens=s.context,
        )
        ended_by_id = turn.finish_reason == "stop" and int(turn.ids[-1]) in tok.stop_ids
        s.closed = ended_by_id and tok.closes_turn(int(turn.ids[-1]))
        s.messages.append(normalize_message(reply.message, "reply"))
        s.context += len(turn.ids)
        s.room, s.turns, s.state = turn.room, s.turns + 1, "waiting"
        s.last_text, s.last_seen = tok.decode(turn.ids), self.clock()
        return reply

    def _on_turn(self, s: Session, turn_data) -> None:
        if s.dropped:  # abandoned mid-turn: free the slot; the loop samples it again
            s.turn, s.state = None, "ending"
            self.abandoned += 1
            self.gen.driver.end_episode(s.request)
        elif s.turn is not None:
            _resolve(s.turn, turn_data)

    def _on_done(self, s: Session, sample: FinishedSample | None) -> None:
        if s.turn is not None:
            _resolve(s.turn, None)
        self._sessions.pop(s.id, None)
        s.state = "ended"
        s.done(s.tag, None if s.dropped else sample)

    def end(self, session_id: str, reward: float | None) -> Session:
        """Ends a session: its sample joins its group, with `reward` (None = the task's reward
        function of the last reply).

        Raises:
          ApiError: 404 unknown, 409 a request in flight.
        """
        s = self.get(session_id)
        if s.state == "generating":
            raise ApiError(409, "a request of this session is in flight", code="session_busy")
        if s.request is None:  # never played: sampled again
            self._drop(s)
            return s
        if reward is None:
            try:
                reward = float(self.reward_fn(s.last_text, s.prompt.answer))
            except Exception:
                log.exception("reward failed for prompt %s; scoring 0", s.prompt.id)
                reward = 0.0
        s.reward, s.state = float(reward), "ending"
        self.finished += 1
        self.gen.driver.end_episode(s.request)
        return s

    def _drop(self, s: Session) -> None:
        s.dropped, s.state = True, "ended"
        self._sessions.pop(s.id, None)
        if s.request is None:
            s.done(s.tag, None)
        else:  # its sample (then None) reaches the loop through `_on_done`
            self._sessions[s.id] = s  # until the slot is freed
            s.state = "ending"
            self.gen.driver.end_episode(s.request)

    def reap(self) -> int:
        """Drops the sessions silent for `limits.idle_s` with no request in flight; returns
        how many (also counted in `abandoned`)."""
        now = self.clock()
        idle = [
            s
            for s in self._sessions.values()
            if s.state in ("taken", "waiting") and now - s.last_seen > self.limits.idle_s
        ]
        for s in idle:
            log.warning(
                "session of prompt %s idle for %.0fs; dropped", s.prompt.id, now - s.last_seen
            )
            self._drop(s)
        self.abandoned += len(idle)
        return len(idle)
