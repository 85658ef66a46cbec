"""A streamed chat reply (`stream: true`; docs/DESIGN.md §6.6): the engine's new ids handed from
the driver's thread to the event loop (`TokenFeed`), and the server-sent events written from
them (`EventStream`): content deltas as tokens come (`chat.StreamText` holds back stop strings
and tool calls), keep-alive comments, then each choice's tool calls, log-probs and finish, the
usage, and [DONE]. `http_api.HttpApi` starts the work and holds one of each per stream.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
from aiohttp import web

from rollout_server.chat import ApiError, StreamText


class TokenFeed:
    """New ids from the driver's thread, coalesced: one wake-up of the loop per batch it has not
    taken yet, however many tokens the engine produced meanwhile."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self._pending: list[tuple[int, np.ndarray]] = []
        self._lock = threading.Lock()
        self._ready = asyncio.Event()
        self._scheduled = False

    def watcher(self, index: int) -> Callable[[np.ndarray], None]:
        """The `watch` callback of choice `index`: called on the driver's thread with the ids
        so far, it hands over the new ones."""
        seen = 0

        def watch(ids: np.ndarray) -> None:
            nonlocal seen
            new = np.array(ids[seen:])
            seen = len(ids)
            with self._lock:
                self._pending.append((index, new))
                if self._scheduled:
                    return
                self._scheduled = True
            self._loop.call_soon_threadsafe(self._ready.set)

        return watch

    def take(self) -> dict[int, np.ndarray]:
        """The ids handed over since the last take, per choice."""
        with self._lock:
            items = self._pending[:]
            self._pending.clear()
            self._scheduled = False
        merged: dict[int, list[np.ndarray]] = {}
        for index, ids in items:
            merged.setdefault(index, []).append(ids)
        return {i: np.concatenate(parts) for i, parts in merged.items()}

    async def wait(self, work: asyncio.Future, timeout_s: float) -> bool:
        """Waits for new ids or the end of `work`, at most `timeout_s`; False when neither
        came (time for a keep-alive)."""
        self._ready.clear()
        wake = asyncio.ensure_future(self._ready.wait())
        done, _ = await asyncio.wait(
            [wake, work], timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED
        )
        if wake not in done:
            wake.cancel()
        return bool(done)


def chunk(i: int, delta: dict[str, Any], **extra: Any) -> dict[str, Any]:
    """Choice `i`'s chunk of `delta`."""
    return {"index": i, "delta": delta, "logprobs": None, "finish_reason": None, **extra}


class EventStream:
    """The event-stream response of one chat request: every chunk carries `head` (id, object,
    created, model)."""

    def __init__(self, response: web.StreamResponse, head: dict[str, Any]):
        self.response, self._head = response, head

    @classmethod
    async def open(cls, request: web.Request, head: dict[str, Any]) -> EventStream:
        """Sends the headers."""
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await response.prepare(request)
        return cls(response, head)

    async def send(self, choices: list[dict[str, Any]], **extra: Any) -> None:
        data = json.dumps({**self._head, "choices": choices, **extra})
        await self.response.write(f"data: {data}\n\n".encode())

    async def deltas(
        self,
        feed: TokenFeed,
        work: asyncio.Future,
        texts: list[StreamText],
        keepalive_s: float,
    ) -> None:
        """Content deltas as `feed` hands ids over, until `work` is done (what came before its
        end included); a comment every `keepalive_s` without any."""
        while True:
            finished = work.done()  # before taking: what came before the end is taken
            batch = feed.take()
            for index, ids in batch.items():
                if delta := texts[index].feed(ids):
                    await self.send([chunk(index, delta)])
            if finished:
                return
            if batch:
                continue
            if not await feed.wait(work, keepalive_s):
                await self.response.write(b": keep-alive\n\n")

    async def fail(self, e: Exception, log: Any) -> None:
        """A generation that failed mid-stream: its error as the last event, then [DONE]."""
        if not isinstance(e, ApiError):
            log.error("a stream's generation failed: %s: %s", type(e).__name__, e)
            e = ApiError(500, "internal server error", code="server_error")
        await self.response.write(f"data: {json.dumps(e.body())}\n\n".encode())
        await self.response.write(b"data: [DONE]\n\n")

    async def finish(
        self,
        replies: list[Any],
        texts: list[StreamText],
        *,
        logprobs: Callable[[Any], dict[str, Any]] | None,
        token_ids: bool,
        usage: dict[str, int] | None,
        extra: dict[str, Any],
    ) -> None:
        """Per choice what was held back and its tool calls, then its log-probs (with
        `logprobs`) and finish; the usage (when given) and `extra`; [DONE]."""
        for i, r in enumerate(replies):
            delta: dict[str, Any] = texts[i].finish(r.message)
            if r.message.get("tool_calls"):
                delta["tool_calls"] = [
                    {"index": k, **c} for k, c in enumerate(r.message["tool_calls"])
                ]
            if delta:
                await self.send([chunk(i, delta)])
            lp = logprobs(r) if logprobs is not None else None
            ids = {"token_ids": r.ids.tolist()} if token_ids else {}
            await self.send([chunk(i, {}, logprobs=lp, finish_reason=r.finish_reason, **ids)])
        if usage is not None:
            await self.send([], usage=usage, **extra)
        elif extra:
            await self.send([], **extra)
        await self.response.write(b"data: [DONE]\n\n")
        await self.response.write_eof()
