"""The OpenAI-compatible HTTP endpoint of sat-serve (`server.http_port`; docs/DESIGN.md §6.6).

    POST /v1/chat/completions     chat (tools, tool_choice, n, stop, logprobs, stream, usage,
                                  return_token_ids, chat_template_kwargs)
    POST /v1/completions          one prompt string, no chat template
    GET  /v1/models               the one served model (another `model` is 404)
    POST /tokenize                a prompt's or a chat's ids (vLLM's)
    GET  /health                  open: no token
    POST /sessions                an agent runner takes admitted sessions (`server.http_sessions`)
    POST /sessions/{id}/v1/chat/completions   a session's request (or `session_id` in the body)
    POST /sessions/{id}/end       ends a session: its reward, none, or {"discard": true}

Every request but `/health` carries `Authorization: Bearer <server.token>` when a token is set;
bodies over `server.http_max_body_bytes` are refused before they are read, and every error is
the OpenAI error body (a defect: 500 `server_error` and one log line). Requests run on the same
engine, slots and weights as the rollouts; their log-probs are the behavior log-probs the engine
records. Streams are real (per-token deltas as the engine produces them). With `server.tls_cert`
the port serves TLS.

aiohttp serves it (already a dependency of the stack through JetStream's and grpc's tooling, and
one asyncio server in the process's own loop: no second server thread). Handlers are cancelled
when their client leaves; rendering, tokenizing and reply building that is not small runs on the
generator's thread pool, never on the loop.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import logging
import ssl
import time
import uuid
from typing import Any

from aiohttp import web

from rollout_server.chat import (
    ApiError,
    StreamText,
    parse_chat,
    parse_completion,
)
from rollout_server.http_sessions import SessionRoutes
from rollout_server.http_stream import EventStream, TokenFeed, chunk
from rollout_server.sessions import Generator, Reply, SessionManager

log = logging.getLogger(__name__)

OPEN_PATHS = ("/health",)  # served without the bearer token
KEEPALIVE_S = 15.0  # a stream with no token for this long gets a comment (proxies' idle cuts)


@dataclasses.dataclass(frozen=True, kw_only=True)
class HttpLimits:
    """The endpoint's bounds (`server.http_*`).

    Attributes:
      max_body_bytes: the largest request body read.
      max_messages: messages per chat request.
      max_requests: stateless requests generating at once (more get 429).
      reap_every_s: how often idle sessions are looked for.
      sampling_override: a request's sampler fields are served with the server's sampler and
        reported, not refused (`server.http_sampling: override`).
      reasoning_parser: "qwen3": a reply's `<think>...</think>` goes to `reasoning_content`
        (`server.http_reasoning_parser`); "" = it stays in `content`.
    """

    max_body_bytes: int
    max_messages: int
    max_requests: int
    reap_every_s: float = 1.0
    sampling_override: bool = False
    reasoning_parser: str = ""


def server_ssl_context(cert: str, key: str) -> ssl.SSLContext:
    """The HTTP port's TLS (`server.tls_cert`, `server.tls_key`; the gRPC port's files)."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(cert, key)
    return context


class HttpApi:
    """The aiohttp application over a `Generator` (and a `SessionManager` when sessions are on).

    Args:
      generator: the engine side.
      sessions: the RL sessions, or None (the session routes then answer 404).
      limits: the bounds.
      token: the bearer token ("" = none).
      model_name: what `/v1/models` lists.
      default_tokens: max_tokens when a request names none (`rollout.max_new_tokens`).
    """

    def __init__(
        self,
        *,
        generator: Generator,
        sessions: SessionManager | None,
        limits: HttpLimits,
        token: str,
        model_name: str,
        default_tokens: int,
    ):
        self.gen, self.sessions, self.limits = generator, sessions, limits
        self.token, self.model_name, self.default_tokens = token, model_name, default_tokens
        self.in_flight = 0
        generator.reasoning = limits.reasoning_parser == "qwen3"
        self._runner: web.AppRunner | None = None
        self._reaper: asyncio.Task | None = None

    def app(self) -> web.Application:
        app = web.Application(
            client_max_size=self.limits.max_body_bytes, middlewares=[self._middleware]
        )
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/tokenize", self._tokenize)
        app.router.add_post("/sessions", self._take)
        app.router.add_post("/sessions/{sid}/v1/chat/completions", self._chat)
        app.router.add_get("/sessions/{sid}/v1/models", self._models)
        app.router.add_post("/sessions/{sid}/end", self._end)
        return app

    async def start(self, host: str, port: int, ssl_context: ssl.SSLContext | None = None) -> int:
        """Serves on `host:port` (0 = a free port), over TLS with `ssl_context`; returns the
        port."""
        if self.sessions is not None:
            self.sessions.bind(asyncio.get_running_loop())
            self._reaper = asyncio.create_task(self._reap())
        # Handlers are cancelled when their client leaves: a session's turn is shielded from it
        # (it ends and is kept for the retry) and the departure is counted.
        self._runner = web.AppRunner(self.app(), access_log=None, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port, reuse_port=False, ssl_context=ssl_context)
        await site.start()
        return site._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
        if self._runner is not None:
            await self._runner.cleanup()
        self.gen.close()

    async def _reap(self) -> None:
        while True:
            await asyncio.sleep(self.limits.reap_every_s)
            try:
                self.sessions.reap()
            except Exception:
                log.exception("reaping idle sessions failed")

    @web.middleware
    async def _middleware(self, request: web.Request, handler) -> web.StreamResponse:
        try:
            if self.token and request.path not in OPEN_PATHS:
                # Header bytes that are not UTF-8 arrive as surrogate escapes: compared as the
                # bytes they were, they are simply a wrong token.
                given = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
                if not hmac.compare_digest(given, f"Bearer {self.token}".encode()):
                    raise ApiError(401, "bad or missing bearer token")
            return await handler(request)
        except ApiError as e:
            return web.json_response(e.body(), status=e.status)
        except web.HTTPRequestEntityTooLarge:
            e = ApiError(
                413,
                f"the body is larger than {self.limits.max_body_bytes} bytes "
                "(server.http_max_body_bytes)",
            )
            return web.json_response(e.body(), status=413)
        except web.HTTPException as e:  # 404 / 405 of the router
            if e.status < 400:
                raise
            body = ApiError(e.status, e.reason or "error").body()
            return web.json_response(body, status=e.status)
        except (ConnectionResetError, asyncio.CancelledError):  # the client left
            raise
        except Exception as e:  # a defect: one line, and the OpenAI error body
            log.error("%s %s failed: %s: %s", request.method, request.path, type(e).__name__, e)
            body = ApiError(500, "internal server error", code="server_error").body()
            return web.json_response(body, status=500)

    async def _json(self, request: web.Request) -> Any:
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise
        try:
            return json.loads(raw)
        except (ValueError, RecursionError):
            raise ApiError(400, "the body is not valid JSON") from None

    async def _health(self, request: web.Request) -> web.Response:
        """Open (no token): a load balancer's or a framework's liveness probe."""
        return web.json_response({"status": "ok"})

    async def _models(self, request: web.Request) -> web.Response:
        model = {"id": self.model_name, "object": "model", "created": 0, "owned_by": "sat-jax"}
        return web.json_response({"object": "list", "data": [model]})

    def _check_model(self, model: str) -> None:
        if model != self.model_name:
            raise ApiError(
                404,
                f"the model {model[:80]!r} does not exist: this server serves {self.model_name!r}",
                param="model",
                code="model_not_found",
            )

    def _limits(self) -> dict[str, Any]:
        return {
            "max_tokens": self.gen.engine.max_decode_length,
            "default_tokens": self.default_tokens,
            "override": self.limits.sampling_override,
        }

    def _sampling(self, gen: Any) -> dict[str, Any]:
        """The sampler that served a request, and the fields it overrode (override mode)."""
        sampling = self.gen.engine.sampling
        return {
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "top_k": sampling.top_k,
            "overridden": list(gen.overridden),
        }

    def _extras(self, gen: Any, replies: list[Reply]) -> dict[str, Any]:
        """The reply's fields beyond OpenAI's: prompt ids (`return_token_ids`), the sampler."""
        out: dict[str, Any] = {}
        if gen.return_token_ids and replies:
            out["prompt_token_ids"] = replies[0].prompt_token_ids
        if self.limits.sampling_override:
            out["sampling"] = self._sampling(gen)
        return out

    async def _tokenize(self, request: web.Request) -> web.Response:
        """vLLM's `POST /tokenize`: a prompt's ids, or a chat's as the template renders them."""
        body = await self._json(request)
        ok = isinstance(body, dict) and set(body) <= {
            "model", "prompt", "messages", "tools", "add_generation_prompt", "add_special_tokens",
            "chat_template_kwargs",
        }  # fmt: skip
        if not ok or ("prompt" in body) == ("messages" in body):
            raise ApiError(400, "the body takes a prompt or messages (and tools)")
        if "prompt" in body:
            prompt = body["prompt"]
            if not isinstance(prompt, str):
                raise ApiError(400, "prompt must be a string", param="prompt")
            self.gen.bound_length([{"role": "user", "content": prompt}], [])
            ids = await self.gen.off_loop(self.gen.tokenizer.encode, prompt, _size=len(prompt))
        else:
            if body.get("add_generation_prompt", True) is not True:
                raise ApiError(400, "add_generation_prompt must be true", param="messages")
            req = parse_chat(
                {
                    "model": "-",
                    "messages": body["messages"],
                    "tools": body.get("tools"),
                    "chat_template_kwargs": body.get("chat_template_kwargs"),
                },
                self.gen.engine.sampling,
                max_messages=self.limits.max_messages,
                **self._limits(),
            )
            ids = await self.gen.render(req)
        limit = self.gen.engine.core.max_prefill_length
        return web.json_response({"count": len(ids), "max_model_len": limit, "tokens": list(ids)})

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = await self._json(request)
        req = parse_chat(
            body,
            self.gen.engine.sampling,
            max_messages=self.limits.max_messages,
            session_id=request.match_info.get("sid", ""),
            **self._limits(),
        )
        self._check_model(req.model)
        gen = req.generation
        if req.session_id and self.sessions is None:
            raise ApiError(404, "this server runs no sessions (server.http_sessions)")
        if gen.stream:
            return await self._stream_chat(request, req)
        if req.session_id:
            replies = [await self.sessions.chat(req)]
        else:
            ids, prefix = await self.gen.render_with_prefix(req)
            replies = await self._stateless(
                [self.gen.generate(ids, gen, tools=req.tools, prefix=prefix) for _ in range(gen.n)]
            )
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        choices = [
            {
                "index": i,
                "message": r.message,
                "logprobs": self._logprobs(r) if gen.logprobs else None,
                "finish_reason": r.finish_reason,
                **({"token_ids": r.ids.tolist()} if gen.return_token_ids else {}),
            }
            for i, r in enumerate(replies)
        ]
        out = {
            "id": rid,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": req.model,
            "choices": choices,
            "usage": _usage(replies),
            **self._extras(gen, replies),
        }
        if req.session_id:
            out["session"] = self._session_routes().info(req.session_id, replies[0])
        return web.json_response(out)

    async def _stateless(self, coros: list) -> list[Reply]:
        self._reserve(coros)
        return await self._run(coros)

    def _reserve(self, coros: list) -> None:
        """Counts `coros` as generating, or refuses them (429) when too many are."""
        n = len(coros)
        if self.in_flight + n > self.limits.max_requests:
            for c in coros:
                c.close()
            raise ApiError(
                429,
                f"{self.limits.max_requests} requests are generating (server.http_max_requests)",
            )
        self.in_flight += n

    async def _run(self, coros: list) -> list[Reply]:
        try:
            return list(await asyncio.gather(*coros))
        finally:
            self.in_flight -= len(coros)

    def _logprobs(self, r: Reply) -> dict[str, Any]:
        return {"content": r.content_logprobs or []}

    async def _stream_chat(self, request: web.Request, req: Any) -> web.StreamResponse:
        """The reply as server-sent events, as it is generated (`http_stream`): the headers and
        each choice's role at once (once the request is accepted: a refusal is still a 4xx),
        content deltas as the engine produces tokens (stop strings and tool calls held back), a
        comment every `KEEPALIVE_S` without one, then per choice its tool calls, log-probs and
        finish, the usage if asked, and [DONE]. A client that leaves stops only its stream:
        the generation runs on (a session keeps the reply for the request's retry)."""
        gen = req.generation
        feed = TokenFeed(asyncio.get_running_loop())
        work, as_list = await self._stream_work(req, feed)
        head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion.chunk"}
        head |= {"created": int(time.time()), "model": req.model}
        out = await EventStream.open(request, head)
        try:
            await out.send([chunk(i, {"role": "assistant", "content": ""}) for i in range(gen.n)])
            prefix = self.gen.prefix(req)[0]
            tok, reasoning = self.gen.tokenizer, self.gen.reasoning
            texts = [
                StreamText(tok, gen.stop, bool(req.tools), reasoning, prefix) for _ in range(gen.n)
            ]
            await out.deltas(feed, work, texts, KEEPALIVE_S)
            try:
                replies = as_list(work.result())
            except Exception as e:  # failed mid-stream: the error as the last event
                await out.fail(e, log)
                return out.response
            extra = self._extras(gen, replies)
            if req.session_id:
                extra["session"] = self._session_routes().info(req.session_id, replies[0])
            await out.finish(
                replies,
                texts,
                logprobs=self._logprobs if gen.logprobs else None,
                token_ids=gen.return_token_ids,
                usage=_usage(replies) if gen.include_usage else None,
                extra=extra,
            )
        except (ConnectionResetError, asyncio.CancelledError):
            if req.session_id and not work.done():
                self.sessions.disconnects += 1
                log.info(
                    "the client of session %s left its stream; the reply is kept", req.session_id
                )
            raise
        return out.response

    async def _stream_work(self, req: Any, feed: TokenFeed) -> tuple[asyncio.Future, Any]:
        """Starts a streamed request's generation, watched by `feed`: `(work, as_list)`, what
        `as_list(work.result())` gives being the replies. A session's request returns once it
        is accepted (a refusal raises here, an ordinary error answer)."""
        gen = req.generation
        if req.session_id:
            accepted = asyncio.get_running_loop().create_future()
            work = asyncio.ensure_future(
                self.sessions.chat(req, watch=feed.watcher(0), accepted=accepted)
            )
            work.add_done_callback(lambda _: _settle(accepted))
            await asyncio.wait([work, accepted], return_when=asyncio.FIRST_COMPLETED)
            if work.done() and work.exception() is not None:
                raise work.exception()  # refused: an ordinary error answer
            return work, _as_list
        ids, prefix = await self.gen.render_with_prefix(req)
        coros = [
            self.gen.generate(ids, gen, tools=req.tools, watch=feed.watcher(i), prefix=prefix)
            for i in range(gen.n)
        ]
        self._reserve(coros)
        return asyncio.ensure_future(self._run(coros)), list

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._json(request)
        req = parse_completion(body, self.gen.engine.sampling, **self._limits())
        self._check_model(req.model)
        gen = req.generation
        msg = [{"role": "user", "content": req.prompt}]
        self.gen.bound_length(msg, [])
        ids = await self.gen.off_loop(self.gen.tokenizer.encode, req.prompt, _size=len(req.prompt))
        self.gen.check_length(len(ids))
        replies = await self._stateless(
            [self.gen.generate(ids, gen, tools=False) for _ in range(gen.n)]
        )
        rid = f"cmpl-{uuid.uuid4().hex}"
        choices = []
        for i, r in enumerate(replies):
            logprobs = None
            if gen.logprobs:
                content = r.content_logprobs or []
                logprobs = {
                    "tokens": [c["token"] for c in content],
                    "token_logprobs": [c["logprob"] for c in content],
                    "top_logprobs": None,
                    "text_offset": None,
                }
            choices.append(
                {
                    "index": i,
                    "text": r.message["content"],
                    "logprobs": logprobs,
                    "finish_reason": r.finish_reason,
                    **({"token_ids": r.ids.tolist()} if gen.return_token_ids else {}),
                }
            )
        out = {
            "id": rid,
            "object": "text_completion",
            "created": int(time.time()),
            "model": req.model,
            "choices": choices,
            "usage": _usage(replies),
            **self._extras(gen, replies),
        }
        if gen.stream:
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            await response.write(f"data: {json.dumps(out)}\n\n".encode())
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
            return response
        return web.json_response(out)

    async def _take(self, request: web.Request) -> web.Response:
        routes = self._session_routes()
        return web.json_response(await routes.take(await self._json(request)))

    async def _end(self, request: web.Request) -> web.Response:
        routes = self._session_routes()
        body = await self._json(request) if request.can_read_body else {}
        return web.json_response(await routes.end(request.match_info["sid"], body))

    def _session_routes(self) -> SessionRoutes:
        if self.sessions is None:
            raise ApiError(404, "this server runs no sessions (server.http_sessions)")
        return SessionRoutes(self.sessions)


def _settle(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)


def _as_list(reply: Reply) -> list[Reply]:
    return [reply]


def _usage(replies: list[Reply]) -> dict[str, int]:
    prompt = replies[0].prompt_tokens if replies else 0
    completion = sum(len(r.ids) for r in replies)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }
