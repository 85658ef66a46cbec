"""A session's state and its rules (docs/DESIGN.md §6.6), for `sessions.SessionManager`: the
`Session` record, its limits, the reply of a turn (`Reply`), when two requests are one
(`request_key`: a retry), what a new request adds to the held conversation (`history_delta`:
the template's delta ids, a fork, or a `history_mismatch`), and how an ended turn moves the
session on (`record_turn`, which never raises).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
from collections.abc import Callable
from typing import Any

import numpy as np

from rollout_server.chat import (
    ApiError,
    ChatRequest,
    Generation,
    history_view,
    normalize_message,
    template_messages,
)
from rollout_server.driver import FinishedSample, RolloutRequest, TurnEnd
from rollout_server.segments import Segments
from sat_jax.tasks import Prompt

log = logging.getLogger("rollout_server.sessions")

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
      content_logprobs: OpenAI's `logprobs.content` when the request asked for log-probs (built
        off the event loop with the reply), else None.
      remaining_tokens: a session's token budget left after this turn (None for a stateless
        reply).
      prompt_token_ids: the ids before the reply (a session's whole context), when the request
        asked for them (`return_token_ids`).
    """

    ids: np.ndarray
    logprobs: np.ndarray
    versions: np.ndarray
    finish_reason: str
    message: dict[str, Any]
    prompt_tokens: int
    content_logprobs: list[dict[str, Any]] | None = None
    remaining_tokens: int | None = None
    prompt_token_ids: list[int] | None = None


@dataclasses.dataclass(eq=False)
class Session:
    """One admitted sample played over HTTP (module docstring).

    `state`: offered, taken (no request yet), generating, waiting (a turn ended), ending (ended
    by the runner, the reaper or a discard; the slot is being freed), ended.
    """

    id: str
    prompt: Prompt
    tag: tuple[int, int]
    done: Done
    state: str = "offered"
    messages: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    tools: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    template_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)  # fixed at start
    request: RolloutRequest | None = None
    closed: bool = True  # the last turn ended with the template's end-of-turn token
    room: int = 0  # tokens the session may still add (generated and inserted)
    context: int = 0  # tokens in the slot's cache: prompt, turns and deltas
    ids: list[int] = dataclasses.field(default_factory=list)  # those tokens
    turns: int = 0
    last_seen: float = 0.0
    reward: float = 0.0
    last_text: str = ""
    dropped: bool = False
    reported: bool = False  # `done` was called
    turn: asyncio.Future | None = None  # the turn in flight: its Reply, or an ApiError
    gen: Generation | None = None  # the turn in flight's
    prefix: str = ""  # the turn in flight's forced prefix (`tool_choice`)
    key: Any = None  # the last accepted request (its retry gets `reply`)
    reply: Reply | None = None
    ended_by: tuple[str, float | None] | None = None  # ("reward", given) or ("discard", None)
    ending: asyncio.Future | None = None  # resolves once `end` has its reward
    segments: Segments = dataclasses.field(default_factory=Segments)  # forks so far
    last: tuple[FinishedSample | None] | None = None  # the current request's sample, once done

    def info(self) -> dict[str, Any]:
        """What every session response carries about it."""
        return {
            "session_id": self.id,
            "state": self.state,
            "turns": self.turns,
            "remaining_tokens": max(0, self.room),
        }


@dataclasses.dataclass(frozen=True, kw_only=True)
class SessionLimits:
    """`server.http_max_sessions` (taken and not ended) and `server.http_session_idle_s`;
    `stuck_s`: a session generating or ending with no progress for this long is ended by the
    reaper whatever it waits for (0 = 3 × idle_s). `fork` (`server.http_session_fork`): a
    history that diverges from the session's starts a new segment instead of a 400, up to
    `max_segments` segments a session."""

    max_sessions: int
    idle_s: float
    stuck_s: float = 0.0
    fork: bool = False
    max_segments: int = 8

    @property
    def stuck_after_s(self) -> float:
        return self.stuck_s or 3 * self.idle_s


def request_key(req: ChatRequest) -> str:
    """What makes two requests of a session the same request (a client's retry)."""
    return json.dumps(
        [req.messages, req.tools, dataclasses.asdict(req.generation)], sort_keys=True, default=str
    )


def history_delta(
    s: Session, req: ChatRequest, tokenizer: Any, limits: SessionLimits
) -> list[int] | None:
    """The template's delta ids of the new messages (the session rule, module docstring);
    None when the history diverges and `limits.fork` makes that a new segment (tools and
    template arguments stay fixed: they are refused either way)."""
    n = len(s.messages)
    if req.tools != s.tools:
        raise ApiError(400, "tools differ from the session's", code="history_mismatch")
    if req.template_kwargs and req.template_kwargs != s.template_kwargs:
        raise ApiError(
            400,
            "chat_template_kwargs differ from the session's first request's (they are fixed "
            "per session)",
            param="chat_template_kwargs",
            code="history_mismatch",
        )
    given = [history_view(m) for m in req.messages]
    held = [history_view(m) for m in s.messages]
    diverges = len(given) <= n or given[:n] != held
    if limits.fork and (diverges or any(m["role"] == "assistant" for m in given[n:])):
        if len(s.segments) >= limits.max_segments:
            raise ApiError(
                400,
                f"the messages diverge from the session's and would start its segment "
                f"{len(s.segments) + 1}; a session holds at most {limits.max_segments} "
                "segments",
                param="messages",
                code="history_mismatch",
            )
        return None
    if diverges:
        first = next(
            (i for i, (a, b) in enumerate(zip(given, held, strict=False)) if a != b),
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
        extra = {"template_kwargs": s.template_kwargs} if s.template_kwargs else {}
        return tokenizer.observation_ids(
            template_messages(new), tools=s.tools, close_turn=not s.closed, **extra
        )
    except Exception as e:
        raise ApiError(400, f"the chat template cannot render the messages: {e}") from None


def record_turn(gen: Any, s: Session, turn: TurnEnd, lps, versions) -> Reply:
    """The turn's reply (`gen`: the `sessions.Generator`), and the session moved on by it. Never raises: whatever the model
    wrote, the session waits for its next request afterwards."""
    tok = gen.tokenizer
    room = int(turn.room)
    try:
        reply = gen.reply(
            turn.ids,
            lps,
            versions,
            turn.finish_reason,
            s.gen,
            tools=s.tools,
            prompt_tokens=s.context,
            remaining=room,
            prompt_ids=list(s.ids) if s.gen.return_token_ids else None,
            prefix=s.prefix,
        )
        recorded = normalize_message(reply.message, "reply")
    except Exception:  # a tokenizer's own failure: the text as content, the turn kept
        log.exception("session %s: building the reply failed; sent as plain content", s.id)
        text = ""
        with contextlib.suppress(Exception):
            text = tok.decode(turn.ids)
        message = {"role": "assistant", "content": text}
        reply = Reply(
            ids=np.asarray(turn.ids, np.int32),
            logprobs=np.asarray(lps, np.float32),
            versions=np.asarray(versions, np.int64),
            finish_reason="stop" if turn.finish_reason == "stop" else "length",
            message=message,
            prompt_tokens=s.context,
            remaining_tokens=room,
        )
        recorded = dict(message)
    try:
        ended_by_id = turn.finish_reason == "stop" and int(turn.ids[-1]) in tok.stop_ids
        s.closed = ended_by_id and tok.closes_turn(int(turn.ids[-1]))
    except Exception:
        s.closed = True
    s.messages.append(recorded)
    s.context += len(turn.ids)
    s.ids.extend(int(i) for i in turn.ids)
    s.room, s.turns = room, s.turns + 1
    s.last_text = reply.message.get("content") or ""
    with contextlib.suppress(Exception):
        s.last_text = tok.decode(turn.ids)
    return reply
