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
(`history_mismatch`), or, with `SessionLimits.fork`, starts a new segment of the sample
re-prefilled from the new history (`rollout_server.segments`). The finished sample reaches the
loop like an episode's, with the loss mask 0 on every inserted token.

Everything here runs on the HTTP server's asyncio loop; the driver's callbacks (turns, ends) and
the rollout loop's offers hop onto it, and work that is not small (rendering, tokenizing,
building replies, rewards) goes to the generator's thread pool. The lifecycle is built for real
networks (docs/DESIGN.md §6.6): a request equal to the last accepted one is its retry and gets
that reply; a turn is recorded when it ends, whatever the model wrote and whether or not its
client is still there; `end` is idempotent and can discard. A session taken and then silent for
`idle_s` (no request in flight), or stuck generating past `stuck_after_s`, is dropped and
counted: its sample reaches the loop as a failed one and is sampled again, so a group never
waits forever.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import functools
import json
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
    forced_prefix,
    make_stop_when,
    template_messages,
    token_logprobs,
    truncate_at_stop,
)
from rollout_server.driver import FinishedSample, RolloutDriver, RolloutRequest, TurnEnd
from rollout_server.engine import MoEEngine
from rollout_server.session_state import (
    Done,
    Reply,
    Session,
    SessionLimits,
    history_delta,
    record_turn,
    request_key,
)
from sat_jax.json_mask import mask_for
from sat_jax.tasks import Prompt

log = logging.getLogger(__name__)


def _finish(reason: str, message: dict[str, Any]) -> str:
    if message.get("tool_calls"):
        return "tool_calls"
    return "stop" if reason == "stop" else "length"


def content_chars(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> int:
    """The characters a render of `messages` and `tools` holds at least (their text)."""
    n = 0
    for m in messages:
        n += len(m.get("content") or "")
        for c in m.get("tool_calls") or ():
            n += len(json.dumps(c["function"]))
    return n + sum(len(json.dumps(t)) for t in tools)


INLINE_BELOW = 8192  # characters to render or tokens to decode done on the loop (`off_loop`)


class Generator:
    """Stateless requests on the shared engine: one engine request per choice, awaited.

    Rendering, tokenizing and reply building (decode, tool-call parsing, log-prob formatting)
    run on a small thread pool, never on the event loop (`off_loop`).

    Args:
      driver, engine: the server's.
      tokenizer: the engine's (HF, with a chat template for chat requests).
      workers: the pool's threads.
    """

    def __init__(self, driver: RolloutDriver, engine: MoEEngine, tokenizer: Any, *, workers=4):
        self.driver, self.engine, self.tokenizer = driver, engine, tokenizer
        self._workers = workers
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()
        self._longest_piece: int | None = None
        self.reasoning = False  # Qwen3's <think> to reasoning_content (HttpLimits)

    async def off_loop(
        self, fn: Callable[..., Any], *args: Any, _size: int | None = None, **kwargs: Any
    ) -> Any:
        """`fn(*args, **kwargs)` on the pool, awaited; on the loop at once when its work is
        known to be small (`_size`, characters or tokens, under `INLINE_BELOW`): a hop to the
        pool and back costs more than rendering a short delta or decoding a short turn."""
        if _size is not None and _size < INLINE_BELOW:
            return fn(*args, **kwargs)
        with self._pool_lock:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(
                    self._workers, thread_name_prefix="http-cpu"
                )
        call = functools.partial(fn, *args, **kwargs)
        return await asyncio.get_running_loop().run_in_executor(self._pool, call)

    def close(self) -> None:
        with self._pool_lock:
            if self._pool is not None:
                self._pool.shutdown(wait=False, cancel_futures=True)
                self._pool = None

    def longest_piece(self) -> int:
        """The most characters one token decodes to (at most): its vocabulary piece's length
        (byte-level pieces have one character per byte). 0 = unknown."""
        if self._longest_piece is None:
            try:
                vocab = self.tokenizer._tok.get_vocab()
                self._longest_piece = max(len(p) for p in vocab) if vocab else 0
            except Exception:  # a tokenizer without a vocabulary to look at
                self._longest_piece = 0
        return self._longest_piece

    def bound_length(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> None:
        """Refuses, before tokenizing, a prompt whose text alone needs more tokens than a
        prefill holds (each token is at most `longest_piece` characters).

        Raises:
          ApiError: 400 context_length_exceeded.
        """
        piece = self.longest_piece()
        if not piece:
            return
        at_least = -(-content_chars(messages, tools) // piece)
        limit = self.engine.core.max_prefill_length
        if at_least > limit:
            raise ApiError(
                400,
                f"the prompt has at least {at_least} tokens; max_prefill_length is {limit}",
                code="context_length_exceeded",
            )

    def prompt_ids(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]],
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """The chat template's render of `messages` (with `tools` and the template's own
        `template_kwargs`), checked to fit a prefill.

        Raises:
          ApiError: 400, the template fails or the prompt is too long.
        """
        self.bound_length(messages, tools)
        try:
            extra = {"template_kwargs": template_kwargs} if template_kwargs else {}
            ids = self.tokenizer.encode_messages(template_messages(messages), tools=tools, **extra)
        except Exception as e:  # a template's own error (jinja2 raises its own types)
            raise ApiError(400, f"the chat template cannot render the messages: {e}") from None
        self.check_length(len(ids))
        return ids

    async def render(self, req: ChatRequest) -> list[int]:
        """`prompt_ids` of `req`'s messages, tools and template kwargs (off the loop unless
        small)."""
        return await self.off_loop(
            self.prompt_ids,
            req.messages,
            req.tools,
            req.template_kwargs,
            _size=content_chars(req.messages, req.tools),
        )

    async def render_with_prefix(self, req: ChatRequest) -> tuple[list[int], str]:
        """`req` rendered, then the forced prefix of its `tool_choice` (`prefix`): the ids to
        prefill, checked to fit, and the prefix's text."""
        ids = await self.render(req)
        text, prefix_ids = self.prefix(req)
        ids = [*ids, *prefix_ids]
        self.check_length(len(ids))
        return ids, text

    def prefix(self, req: ChatRequest) -> tuple[str, list[int]]:
        """The forced prefix of `req.tool_choice` (text and ids; ("", []) for none), in the
        format of the chat template (Qwen3-Coder's XML when it renders `<function=`)."""
        if not req.tool_choice:
            return "", []
        template = getattr(getattr(self.tokenizer, "_tok", None), "chat_template", "") or ""
        text = forced_prefix(req.tool_choice, xml="<function=" in str(template))
        hf = getattr(self.tokenizer, "_tok", None)
        ids = hf(text, add_special_tokens=False)["input_ids"] if hf else self.tokenizer.encode(text)
        return text, list(ids)

    async def warm(self, fmt: str | None) -> None:
        """Builds format `fmt`'s mask and its first row on the pool (None: nothing): the
        tokenizer's trie (seconds on a ~150k vocabulary, once per process) and the format's
        automaton are cached before the request reaches the engine, whose generate thread would
        otherwise build them while every slot waits (docs/DESIGN.md §6.6)."""
        if fmt is not None:
            await self.off_loop(self._warm, fmt)

    def _warm(self, fmt: str) -> None:
        formats = self.engine.formats
        mask = mask_for(fmt, formats.tokenizer, formats.vocab_size)
        mask.allowed(mask.start())

    def check_length(self, n: int) -> None:
        try:
            self.engine.check_prompt_length(n)
        except ValueError as e:
            raise ApiError(400, str(e), code="context_length_exceeded") from None

    async def generate(
        self,
        ids: list[int],
        gen: Generation,
        *,
        tools: bool,
        watch: Watch | None = None,
        prefix: str = "",
    ) -> Reply:
        """One reply to the prompt `ids`; `watch` sees its ids as they are generated."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()

        def on_done(request: RolloutRequest, sample: FinishedSample | None) -> None:
            loop.call_soon_threadsafe(_resolve, future, sample)

        await self.warm(gen.response_format)
        request = RolloutRequest(
            max_tokens=gen.max_tokens,
            return_channel=None,
            prefill_content=list(ids),
            is_client_side_tokenization=True,
            on_done=on_done,
            stop_when=watched(make_stop_when(self.tokenizer, gen.stop), watch),
            response_format=gen.response_format,
        )
        self.driver.place_request_on_prefill_queue(request)
        # The engine request runs to its end whatever happens to this handler.
        sample = await asyncio.shield(future)
        if sample is None:
            raise ApiError(500, "generation failed", code="server_error")
        return await self.off_loop(
            self.reply,
            sample.completion_ids,
            sample.logprobs,
            sample.versions,
            sample.finish_reason,
            gen,
            tools=tools,
            prompt_tokens=len(ids),
            prompt_ids=list(ids) if gen.return_token_ids else None,
            prefix=prefix,
            _size=len(sample.completion_ids) * (4 if gen.logprobs else 1),
        )

    def reply(
        self,
        ids,
        logprobs,
        versions,
        reason,
        gen,
        *,
        tools,
        prompt_tokens,
        remaining=None,
        prompt_ids=None,
        prefix="",
    ) -> Reply:
        """The reply of generated `ids`. Never raises on the model's output: a text that does
        not parse as tool calls is content (`assistant_message`)."""
        text, _ = truncate_at_stop(prefix + self.tokenizer.decode(ids), gen.stop)
        message = assistant_message(text, tools=tools, reasoning=self.reasoning)
        ids = np.array(ids, np.int32)
        logprobs = np.array(logprobs, np.float32)
        content = token_logprobs(self.tokenizer, ids, logprobs) if gen.logprobs else None
        return Reply(
            ids=ids,
            logprobs=logprobs,
            versions=np.array(versions, np.int64),
            finish_reason=_finish(reason, message),
            message=message,
            prompt_tokens=prompt_tokens,
            content_logprobs=content,
            remaining_tokens=remaining,
            prompt_token_ids=prompt_ids,
        )


Watch = Callable[[np.ndarray], None]


def watched(stop_when: Callable[[np.ndarray], bool] | None, watch: Watch | None):
    """The driver's `stop_when` that also shows `watch` the turn's ids so far (the driver calls
    it after each generated id but a stop id: a stream's per-token deltas, with no change to the
    driver). `watch` runs on the driver's detokenize thread: it must only hand the ids over."""
    if watch is None:
        return stop_when

    def check(ids: np.ndarray) -> bool:
        try:
            watch(ids)
        except Exception:  # a stream's trouble never stops the generation
            log.exception("a stream's watcher failed")
        return stop_when(ids) if stop_when is not None else False

    return check


def _resolve(future: asyncio.Future | None, value: Any) -> None:
    if future is not None and not future.done():
        future.set_result(value)


class SessionManager:
    """The sessions of admitted samples (module docstring); `offer` is the rollout loop's hook.

    Args:
      generator: the engine side (prompt rendering and its checks).
      reward_fn: `(text, answer) -> float`, for a session ended without a reward.
      limits: open sessions and idle time.
      clock: seconds, monotonic (tests step it).
    """

    ENDED_KEPT = 4096  # ended sessions remembered (an ended id gets 409, an equal /end its reply)

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
        self._ended: collections.OrderedDict[str, Session] = collections.OrderedDict()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._tasks: set[asyncio.Task] = set()  # turns being recorded
        self.abandoned = 0  # sessions dropped after idle_s
        self.stuck = 0  # sessions ended by the reaper past stuck_after_s
        self.discarded = 0  # sessions ended with {"discard": true}
        self.finished = 0
        self.retries = 0  # requests answered as an equal earlier one's retry
        self.disconnects = 0  # clients gone while their turn was generating
        self.forks = 0  # new segments started by a diverging history
        self.polling = 0  # takes waiting for offers

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

    def _room(self) -> int:
        return self.limits.max_sessions - len(self._sessions)

    async def take(self, max_sessions: int, timeout_s: float) -> list[Session]:
        """Up to `max_sessions` offered sessions, waiting up to `timeout_s` for the first. However
        many takes wait at once, no more than `limits.max_sessions` are ever open: the room is
        counted again each time offers are handed out.

        Raises:
          ApiError: 429 when `limits.max_sessions` are open.
        """
        if self._room() <= 0:
            raise ApiError(
                429, f"{self.limits.max_sessions} sessions are open (server.http_max_sessions)"
            )
        # The wait is a real one, on the event loop's clock (`clock` only measures idleness).
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            with self._offer_lock:
                n = min(max(0, self._room()), max_sessions, len(self._offered))
                taken = [self._offered.popleft() for _ in range(n)]
            for s in taken:  # open at once: a concurrent take sees the room they use
                s.state, s.last_seen = "taken", self.clock()
                s.room = self.gen.engine.max_decode_length
                self._sessions[s.id] = s
            if taken or loop.time() >= deadline or self._room() <= 0:
                break
            self._wake.clear()
            self.polling += 1
            try:
                await asyncio.wait_for(self._wake.wait(), max(0.0, deadline - loop.time()))
            except TimeoutError:
                pass
            finally:
                self.polling -= 1
        return taken

    def get(self, session_id: str) -> Session:
        """The open session `session_id`.

        Raises:
          ApiError: 409 session_ended for one that has ended, 404 for one never known.
        """
        session = self._sessions.get(session_id)
        if session is not None:
            return session
        if session_id in self._ended:
            raise ApiError(409, "the session has ended", code="session_ended")
        raise ApiError(404, "no such session (unknown or forgotten)", code="session_not_found")

    def find(self, session_id: str) -> Session | None:
        """The session, open or ended (remembered), or None."""
        return self._sessions.get(session_id) or self._ended.get(session_id)

    async def chat(
        self,
        req: ChatRequest,
        *,
        watch: Watch | None = None,
        accepted: asyncio.Future | None = None,
    ) -> Reply:
        """The session's next turn: its first request prefills, later ones extend. A request
        equal to the last accepted one is its retry: it gets that request's reply (awaiting the
        turn when it is still generating), and nothing is generated again. `watch` sees the
        turn's ids as they are generated, and `accepted` resolves when the request is accepted
        (a stream's headers go out then).

        Raises:
          ApiError: 404 unknown session, 409 another request in flight or the session ended,
            400 a history edit or a conversation that no longer fits.
        """
        s = self.get(req.session_id)
        gen = req.generation
        if gen.n != 1:
            raise ApiError(400, "a session is one conversation: n must be 1", param="n")
        key = request_key(req)
        if s.state in ("ending", "ended"):
            raise ApiError(409, "the session is ending", code="session_ended")
        if key == s.key and s.state in ("generating", "waiting"):
            self.retries += 1
            return s.reply if s.state == "waiting" else await self._await_turn(s)
        if s.state == "generating":
            raise ApiError(409, "a request of this session is in flight", code="session_busy")
        previous = (s.state, s.key, s.reply)
        # Accepted from here unless its checks fail: the session is busy while it renders.
        s.state, s.key, s.reply, s.gen = "generating", key, None, gen
        s.turn = asyncio.get_running_loop().create_future()
        try:
            ids, prefix, fork = await self._render(s, req)
            if s.state != "generating" or s.dropped:  # ended or reaped while it rendered
                raise ApiError(409, "the session has ended", code="session_ended")
        except BaseException as e:
            if s.state == "generating" and not s.dropped:
                s.state, s.key, s.reply = previous
            future, s.turn = s.turn, None
            _resolve(future, e if isinstance(e, ApiError) else ApiError(500, "server error"))
            raise
        s.last_seen = self.clock()  # only an accepted request refreshes the idle clock
        s.messages, s.tools, s.prefix = list(req.messages), list(req.tools), prefix
        _resolve(accepted, None)
        self._launch(s, req, ids, fork, watch)
        return await self._await_turn(s)

    async def _render(self, s: Session, req: ChatRequest) -> tuple[list[int], str, bool]:
        """The ids an accepted `req` sends to the engine, its forced prefix, and whether it
        forks: the prefill of a first request or of a fork's new history, else the template's
        delta of the new messages (and the prefix's ids).

        Raises:
          ApiError: a history edit (no fork), or a delta that does not fit the budget.
        """
        await self.gen.warm(req.generation.response_format)
        if s.request is None:
            return (*await self.gen.render_with_prefix(req), False)
        prefix, prefix_ids = self.gen.prefix(req)
        size = content_chars(req.messages[len(s.messages) :], req.tools)
        delta = await self.gen.off_loop(
            history_delta, s, req, self.gen.tokenizer, self.limits, _size=size
        )
        if delta is None:  # a fork: the new history is the new segment's prompt
            forked = dataclasses.replace(req, template_kwargs=s.template_kwargs)
            return (*await self.gen.render_with_prefix(forked), True)
        ids = [*delta, *prefix_ids]
        if len(ids) + 1 > s.room:
            raise ApiError(
                400, "the session's token budget is spent", code="context_length_exceeded"
            )
        return ids, prefix, False

    def _launch(
        self, s: Session, req: ChatRequest, ids: list[int], fork: bool, watch: Watch | None
    ) -> None:
        """Sends an accepted request's `ids` to the engine: a new engine request (the first, or
        a fork's new segment, the segment so far ended), or the session's continued."""
        gen = req.generation
        if s.request is None or fork:
            if fork:  # the segment so far ends (its sample arrives through `_on_done`)
                self.forks += 1
                s.segments.fork(s.request)
                self.gen.driver.end_episode(s.request)
            else:
                s.template_kwargs = dict(req.template_kwargs)
            self._start(s, ids, gen, watch)
            s.context, s.ids, s.closed = len(ids), list(ids), True
            return
        s.request.turn_tokens = min(gen.max_tokens, s.room - len(ids))
        s.request.stop_when = watched(make_stop_when(self.gen.tokenizer, gen.stop), watch)
        s.request.response_format = gen.response_format  # the turn's constrained decoding
        self.gen.driver.continue_episode(s.request, ids)
        s.context += len(ids)
        s.ids.extend(int(i) for i in ids)
        s.room -= len(ids)

    async def _await_turn(self, s: Session) -> Reply:
        """The turn in flight's reply. The turn is shielded: a client that leaves (its handler
        is cancelled) is counted, and the turn ends and is kept for its retry."""
        try:
            out = await asyncio.shield(s.turn)
        except asyncio.CancelledError:
            self.disconnects += 1
            log.info("the client of session %s left mid-turn; the reply is kept", s.id)
            raise
        if isinstance(out, ApiError):
            raise out
        return out

    def _start(self, s: Session, ids: list[int], gen: Generation, watch: Watch | None) -> None:
        loop = asyncio.get_running_loop()
        engine = self.gen.engine

        def on_turn(request: RolloutRequest, turn: TurnEnd) -> None:  # detokenize thread
            # The turn's log-probs and versions, copied before the buffer moves on.
            buf = request.buffer
            lps = buf.logprobs[request.turn_start : buf.size].copy()
            versions = buf.versions[request.turn_start : buf.size].copy()
            loop.call_soon_threadsafe(self._on_turn, s, (turn, lps, versions))

        def on_done(request: RolloutRequest, sample: FinishedSample | None) -> None:
            loop.call_soon_threadsafe(self._on_done, s, request, sample)

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
            stop_when=watched(make_stop_when(self.gen.tokenizer, gen.stop), watch),
            response_format=gen.response_format,
        )
        s.room = engine.max_decode_length
        self.gen.driver.place_request_on_prefill_queue(s.request)

    async def _turn_ended(self, s: Session, turn_data) -> None:
        turn, lps, versions = turn_data
        if s.dropped or s.state != "generating":  # reaped or discarded mid-turn: free the slot
            self.gen.driver.end_episode(s.request)
            return
        try:
            size = len(turn.ids) * (4 if s.gen.logprobs else 1)
            reply = await self.gen.off_loop(
                record_turn, self.gen, s, turn, lps, versions, _size=size
            )
        except Exception:  # the pool is gone (shutting down)
            log.exception("session %s: recording its turn failed", s.id)
            reply = ApiError(500, "recording the turn failed", code="server_error")
        if s.dropped or s.state != "generating":
            self.gen.driver.end_episode(s.request)
            return
        s.state, s.last_seen = "waiting", self.clock()
        if isinstance(reply, Reply):
            s.reply = reply
        else:  # nothing to retry: the session is ended and its sample offered again
            self._drop(s)
        future, s.turn = s.turn, None
        _resolve(future, reply)

    def _on_turn(self, s: Session, turn_data) -> None:
        task = asyncio.ensure_future(self._turn_ended(s, turn_data))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _on_done(self, s: Session, request: RolloutRequest, sample: FinishedSample | None) -> None:
        if not s.segments.arrived(request, sample):  # the session's current request: its end
            future, s.turn = s.turn, None
            _resolve(future, ApiError(500, "generation failed", code="server_error"))
            self._forget(s)
            s.last = (sample,)
        if s.last is not None and s.segments.complete:  # every segment's sample is in
            self._report(s, None if s.dropped else s.segments.sample(s.last[0]))

    def _report(self, s: Session, sample: FinishedSample | None) -> None:
        if not s.reported:
            s.reported = True
            s.done(s.tag, sample)

    def _forget(self, s: Session) -> None:
        self._sessions.pop(s.id, None)
        s.state = "ended"
        self._ended[s.id] = s
        while len(self._ended) > self.ENDED_KEPT:
            self._ended.popitem(last=False)

    async def end(self, session_id: str, reward: float | None, *, discard: bool = False) -> Session:
        """Ends a session: its sample joins its group, with `reward` (None = the task's reward
        function of the last reply); with `discard`, nothing trains on it and its sample is
        offered again. Idempotent: an equal end again gets the same answer.

        Raises:
          ApiError: 404 unknown, 409 a request in flight or an end that differs from the first.
        """
        s = self.find(session_id)
        if s is None:
            raise ApiError(404, "no such session (unknown or forgotten)", code="session_not_found")
        asked = ("discard", None) if discard else ("reward", reward)
        if s.ended_by is not None:
            same = asked == s.ended_by or (
                asked[0] == "reward" == s.ended_by[0] and reward == s.reward
            )
            if not same:
                raise ApiError(
                    409,
                    f"the session was already ended with {_describe(s.ended_by, s.reward)}",
                    code="session_ended",
                )
            if s.ending is not None:
                await asyncio.shield(s.ending)
            return s
        if s.state in ("ending", "ended"):  # dropped by the reaper or a failure
            raise ApiError(409, "the session has ended (dropped)", code="session_ended")
        if s.state == "generating":
            raise ApiError(409, "a request of this session is in flight", code="session_busy")
        s.ended_by = asked
        if discard or s.request is None:  # never played, or not the policy's failure
            self.discarded += discard
            self._drop(s)
            return s
        s.state = "ending"
        # Its own task: a client that leaves while the reward is computed ends nothing halfway.
        s.ending = asyncio.ensure_future(self._finish_end(s, reward))
        await asyncio.shield(s.ending)
        return s

    async def _finish_end(self, s: Session, reward: float | None) -> None:
        if reward is None:
            try:
                reward = float(
                    await self.gen.off_loop(self.reward_fn, s.last_text, s.prompt.answer)
                )
            except Exception:
                log.exception("reward failed for prompt %s; scoring 0", s.prompt.id)
                reward = 0.0
        s.reward = float(reward)
        self.finished += 1
        self.gen.driver.end_episode(s.request)

    def _drop(self, s: Session) -> None:
        """Ends `s` with no sample: it is offered again (and its slot freed)."""
        s.dropped = True
        if s.request is None:
            self._forget(s)
            self._report(s, None)
        else:  # its sample (then None) reaches the loop through `_on_done`
            s.state = "ending"
            self.gen.driver.end_episode(s.request)

    def reap(self) -> int:
        """Drops the sessions silent for `limits.idle_s` with no request in flight, and ends
        those generating or ending with no progress for `limits.stuck_after_s` (their sample
        is offered again; a turn that ends later frees its slot). Returns how many were idle
        (also counted in `abandoned`; the stuck ones in `stuck`)."""
        now = self.clock()
        idle, stuck = [], []
        for s in self._sessions.values():
            quiet = now - s.last_seen
            if s.state in ("taken", "waiting") and quiet > self.limits.idle_s:
                idle.append(s)
            elif s.state in ("generating", "ending") and quiet > self.limits.stuck_after_s:
                stuck.append(s)
        for s in idle:
            log.warning(
                "session of prompt %s idle for %.0fs; dropped", s.prompt.id, now - s.last_seen
            )
            self._drop(s)
        for s in stuck:
            log.warning(
                "session of prompt %s %s for %.0fs; ended", s.prompt.id, s.state, now - s.last_seen
            )
            s.dropped = True
            future, s.turn = s.turn, None
            _resolve(future, ApiError(504, "the turn did not end in time", code="session_stuck"))
            if s.request is not None and s.state == "ending":
                self.gen.driver.end_episode(s.request)
            self._forget(s)
            self._report(s, None)
        self.abandoned += len(idle)
        self.stuck += len(stuck)
        return len(idle)


def _describe(ended_by: tuple[str, float | None], reward: float) -> str:
    return "discard" if ended_by[0] == "discard" else f"reward {reward}"
