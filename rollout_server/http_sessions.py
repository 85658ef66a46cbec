"""The session routes of the HTTP endpoint (`server.http_sessions`; docs/DESIGN.md §6.6):
`POST /sessions` (an agent runner takes admitted sessions) and `POST /sessions/{id}/end` (a
reward, none, or a discard), their bodies checked before the `SessionManager` acts.
"""

from __future__ import annotations

import math
from typing import Any

from rollout_server.chat import ApiError
from rollout_server.sessions import Reply, SessionManager

MAX_TAKE = 256
MAX_TAKE_TIMEOUT_S = 60.0


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


class SessionRoutes:
    """The bodies of the session routes over `sessions` (errors are `ApiError`s)."""

    def __init__(self, sessions: SessionManager):
        self.sessions = sessions

    def info(self, sid: str, reply: Reply | None = None) -> dict[str, Any]:
        """What a session response says of session `sid` (after `reply`)."""
        s = self.sessions.find(sid)
        info = s.info() if s is not None else {"session_id": sid}
        if reply is not None and reply.remaining_tokens is not None:
            info["remaining_tokens"] = reply.remaining_tokens
        return info

    async def take(self, body: Any) -> dict[str, Any]:
        """`POST /sessions`: up to `max_sessions` sessions, waiting up to `timeout_s`."""
        if not isinstance(body, dict) or set(body) - {"max_sessions", "timeout_s"}:
            raise ApiError(400, "the body takes max_sessions and timeout_s")
        n, timeout = body.get("max_sessions", 1), body.get("timeout_s", 0.0)
        if not (isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= MAX_TAKE):
            raise ApiError(400, f"max_sessions must be in [1, {MAX_TAKE}]", param="max_sessions")
        if not (_number(timeout) and math.isfinite(timeout) and 0 <= timeout <= MAX_TAKE_TIMEOUT_S):
            raise ApiError(
                400, f"timeout_s must be in [0, {MAX_TAKE_TIMEOUT_S}]", param="timeout_s"
            )
        taken = await self.sessions.take(n, float(timeout))
        sessions = [
            {
                "session_id": s.id,
                "group_id": s.tag[0],
                "prompt": {"id": s.prompt.id, "text": s.prompt.text},
                "answer": s.prompt.answer,
                "remaining_tokens": s.room,
            }
            for s in taken
        ]
        return {"sessions": sessions}

    async def end(self, sid: str, body: Any) -> dict[str, Any]:
        """`POST /sessions/{sid}/end`: its reward, none, or `{"discard": true}`."""
        if not isinstance(body, dict) or set(body) - {"reward", "discard"}:
            raise ApiError(400, "the body takes reward or discard")
        discard = body.get("discard", False)
        if not isinstance(discard, bool):
            raise ApiError(400, "discard must be a boolean", param="discard")
        reward = body.get("reward")
        if discard and reward is not None:
            raise ApiError(400, "a discarded session has no reward", param="reward")
        if reward is not None and not (_number(reward) and math.isfinite(reward)):
            raise ApiError(400, "reward must be a finite number", param="reward")
        s = await self.sessions.end(sid, reward, discard=discard)
        return {**s.info(), "reward": None if s.dropped else s.reward, "discarded": s.dropped}
