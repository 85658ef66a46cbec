"""The OpenAI schema of the HTTP endpoint: requests checked into plain records, replies built from
generated tokens (docs/DESIGN.md §6.6).

A request is checked field by field before anything runs: an unknown field, a wrong type, a value
the engine cannot honour (a temperature other than the server's: the behavior log-probs are those
of the server's one sampler) is an `ApiError` with the OpenAI error body and a 4xx status. Tool
calls are the model's chat format, Hermes / Qwen's `<tool_call>{json}</tool_call>` blocks, parsed
into OpenAI `tool_calls`; the template renders them back when the conversation continues.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import secrets
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from sat_jax.decoding import SamplingConfig
from sat_jax.json_automaton import UnsupportedSchema
from sat_jax.json_mask import parse_response_format, token_bytes
from sat_jax.tasks.envs.calculator import find_tool_calls

MAX_STOPS = 4
MAX_STOP_CHARS = 64
MAX_N = 16
_ROLES = ("system", "developer", "user", "assistant", "tool")
# A label for the provider's abuse monitoring: nothing to honour in the reply.
_IGNORED = ("user",)
_UNSUPPORTED = "is not supported by this server"
# Fields accepted only at the values this server honours (a default, or what it does anyway);
# any other value is a 400 with the reason, never accepted and ignored.
_DEFAULT_ONLY: dict[str, tuple[tuple[Any, ...], str]] = {
    "presence_penalty": ((0, 0.0), _UNSUPPORTED),
    "frequency_penalty": ((0, 0.0), _UNSUPPORTED),
    "logit_bias": (({},), _UNSUPPORTED),
    "top_logprobs": ((0,), _UNSUPPORTED),
    "reasoning_effort": ((), _UNSUPPORTED),
    "modalities": ((["text"],), _UNSUPPORTED),
    "seed": (
        (),
        "cannot be honoured: the engine samples every slot from one PRNG key stream, so a "
        "request's seed cannot fix its tokens",
    ),
    "store": ((False,), "is not supported: this server stores no completions"),
    "metadata": (({},), "is not supported: it tags stored completions and none are stored"),
    "parallel_tool_calls": (
        (True,),
        "is not supported: every tool call the model writes in a reply is returned",
    ),
    "service_tier": (("auto", "default"), "is not supported: this server has one tier"),
}
# With `server.http_sampling: override`, what a client asks of the sampler is not refused: the
# request is served with the server's one sampler (its behavior log-probs are the ones that
# train) and the reply says which fields were overridden.
SAMPLER_FIELDS = (
    "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "logit_bias",
)  # fmt: skip
_CHAT_FIELDS = {
    "model", "messages", "tools", "tool_choice", "max_tokens", "max_completion_tokens",
    "temperature", "top_p", "top_k", "n", "stop", "logprobs", "stream", "stream_options",
    "session_id", "return_token_ids", "chat_template_kwargs", "response_format", *_IGNORED,
    *_DEFAULT_ONLY,
}  # fmt: skip
_COMPLETION_FIELDS = {
    "model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "n", "stop", "logprobs",
    "stream", "stream_options", "echo", "suffix", "best_of", "return_token_ids", *_IGNORED,
    "response_format", *_DEFAULT_ONLY,
}  # fmt: skip


class ApiError(Exception):
    """An error the endpoint answers with `{"error": {...}}` (the OpenAI error body)."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str = ""):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.code = code or {400: "invalid_request_error", 401: "invalid_api_key"}.get(
            status, "error"
        )

    def body(self) -> dict[str, Any]:
        kind = {
            401: "authentication_error",
            404: "not_found_error",
            409: "conflict_error",
            413: "invalid_request_error",
            429: "rate_limit_error",
            500: "server_error",
            504: "server_error",
        }
        return {
            "error": {
                "message": self.message,
                "type": kind.get(self.status, "invalid_request_error"),
                "param": self.param,
                "code": self.code,
            }
        }


@dataclasses.dataclass(frozen=True, kw_only=True)
class Generation:
    """What one request asks the engine for.

    Attributes:
      max_tokens: the most tokens to generate (per choice; per turn in a session).
      n: choices.
      stop: stop strings (the reply ends before the first one).
      logprobs: return each generated token's behavior log-prob.
      stream: answer as server-sent events.
      include_usage: the stream's last chunk carries the usage.
      return_token_ids: the reply carries the prompt's and each choice's token ids (vLLM's
        `prompt_token_ids` and `choices[].token_ids`).
      overridden: the sampler fields the request set and the server's sampler overrode
        (`server.http_sampling: override`).
      response_format: the canonical json_object / json_schema format the reply is decoded
        under (`sat_jax.json_mask.parse_response_format`; constrained decoding, docs/DESIGN.md
        §6.6); None = free text.
    """

    max_tokens: int
    n: int = 1
    stop: tuple[str, ...] = ()
    logprobs: bool = False
    stream: bool = False
    include_usage: bool = False
    return_token_ids: bool = False
    overridden: tuple[str, ...] = ()
    response_format: str | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class ChatRequest:
    """A checked `POST /v1/chat/completions` body."""

    model: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]]
    generation: Generation
    session_id: str = ""
    template_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    tool_choice: str = ""  # "" (auto), REQUIRED, or the name of the function forced


@dataclasses.dataclass(frozen=True, kw_only=True)
class CompletionRequest:
    """A checked `POST /v1/completions` body."""

    model: str
    prompt: str
    generation: Generation


def _need(cond: bool, message: str, param: str) -> None:
    if not cond:
        raise ApiError(400, message, param=param)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return (_is_int(v) or isinstance(v, float)) and math.isfinite(v)


def _check_fields(body: Any, allowed: set[str], override: bool) -> tuple[str, ...]:
    """Refuses unknown fields and values not honoured; with `override`, takes the sampler
    fields out of `body` and returns those that were set."""
    _need(isinstance(body, dict), "the request body must be a JSON object", None)
    overridden: tuple[str, ...] = ()
    if override:
        overridden = tuple(k for k in SAMPLER_FIELDS if body.get(k) is not None)
        for k in SAMPLER_FIELDS:
            body.pop(k, None)
    unknown = sorted(str(k)[:40] for k in body if k not in allowed)
    _need(not unknown, f"Unrecognized request argument supplied: {', '.join(unknown[:4])}", None)
    for key in _IGNORED:
        body.pop(key, None)
    for key, (accepted, why) in _DEFAULT_ONLY.items():
        value = body.get(key)
        # By type too: `True == 1` would let a boolean pass for a number and the reverse.
        ok = value is None or any(type(value) is type(a) and value == a for a in accepted)
        _need(ok, f"{key}={json.dumps(value)[:40]} {why}", key)
    return overridden


def _response_format(value: Any) -> str | None:
    """The canonical format of a request's `response_format` (None: absent or text), decoded by
    constrained decoding, whose masks the trainer replays (docs/DESIGN.md §6.6). A malformed
    one or a json_schema outside the enforced subset (`json_automaton.compile_schema`) is refused
    naming what is wrong."""
    if value is None:
        return None
    try:
        return parse_response_format(value)
    except UnsupportedSchema as e:
        raise ApiError(400, f"response_format: {e}", param="response_format") from None
    except ValueError as e:
        raise ApiError(400, str(e), param="response_format") from None


def _generation(
    body: dict[str, Any],
    sampling: SamplingConfig,
    *,
    max_tokens: int,
    default_tokens: int,
    overridden: tuple[str, ...] = (),
    response_format: str | None = None,
) -> Generation:
    """The shared sampling fields; the server's sampler is the only one (module docstring)."""
    _check_sampler(body, sampling)
    tokens = _max_tokens(body, max_tokens, default_tokens)
    n = body.get("n", 1) if body.get("n") is not None else 1
    _need(_is_int(n) and 1 <= n <= MAX_N, f"n must be an integer in [1, {MAX_N}]", "n")
    stop = _stops(body)
    stream = body.get("stream") or False
    _need(isinstance(stream, bool), "stream must be a boolean", "stream")
    options = body.get("stream_options") or {}
    _need(
        isinstance(options, dict) and set(options) <= {"include_usage"},
        "stream_options may only hold include_usage",
        "stream_options",
    )
    logprobs = body.get("logprobs") or False
    _need(
        isinstance(logprobs, bool) or (_is_int(logprobs) and logprobs in (0, 1)),
        "logprobs must be a boolean",
        "logprobs",
    )
    ids = body.get("return_token_ids") or False
    _need(isinstance(ids, bool), "return_token_ids must be a boolean", "return_token_ids")
    return Generation(
        max_tokens=tokens,
        n=n,
        stop=tuple(stop),
        logprobs=bool(logprobs),
        stream=stream,
        include_usage=bool(options.get("include_usage")),
        return_token_ids=ids,
        overridden=overridden,
        response_format=response_format,
    )


def _check_sampler(body: dict[str, Any], sampling: SamplingConfig) -> None:
    """Refuses a sampler field that differs from the server's sampler."""
    for key, served in (
        ("temperature", sampling.temperature),
        ("top_p", sampling.top_p),
        ("top_k", sampling.top_k),
    ):
        value = body.get(key)
        if value is None:
            continue
        _need(_is_number(value), f"{key} must be a number", key)
        _need(
            math.isclose(value, served, rel_tol=1e-6) or (key == "top_k" and value == served),
            f"{key}={value} differs from this server's sampler ({key}={served}): the behavior "
            "log-probs are those of the server's one sampler (rollout.temperature, top_p, top_k)",
            key,
        )


def _max_tokens(body: dict[str, Any], max_tokens: int, default_tokens: int) -> int:
    """`max_completion_tokens`, else `max_tokens`, else `default_tokens`; checked."""
    tokens = body.get("max_completion_tokens")
    if tokens is None:  # absent or null: max_tokens (the older name) decides
        tokens = body.get("max_tokens")
    if tokens is None:
        tokens = default_tokens
    _need(
        _is_int(tokens) and 1 <= tokens <= max_tokens,
        f"max_tokens must be an integer in [1, {max_tokens}]",
        "max_tokens",
    )
    return tokens


def _stops(body: dict[str, Any]) -> list[str]:
    """The stop strings (a string or a list of them), checked."""
    stop = body.get("stop")
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    _need(
        isinstance(stop, list)
        and len(stop) <= MAX_STOPS
        and all(isinstance(s, str) and 1 <= len(s) <= MAX_STOP_CHARS for s in stop),
        f"stop must be a string or a list of at most {MAX_STOPS} strings of 1 to "
        f"{MAX_STOP_CHARS} characters",
        "stop",
    )
    return stop


def parse_chat(
    body: Any,
    sampling: SamplingConfig,
    *,
    max_tokens: int,
    default_tokens: int,
    max_messages: int,
    session_id: str = "",
    override: bool = False,
) -> ChatRequest:
    """Checks a chat completion body.

    Raises:
      ApiError: 400 naming the field.
    """
    overridden = _check_fields(body, _CHAT_FIELDS, override)
    model = body.get("model")
    _need(isinstance(model, str) and model, "model is required", "model")
    messages = body.get("messages")
    _need(
        isinstance(messages, list) and 1 <= len(messages) <= max_messages,
        f"messages must be a list of 1 to {max_messages} messages",
        "messages",
    )
    messages = [normalize_message(m, f"messages[{i}]") for i, m in enumerate(messages)]
    tools = _tools(body)
    overridden += _strict_tools(tools, override)
    choice = body.get("tool_choice")
    forced = _forced_tool(choice, tools)
    fmt = _response_format(body.get("response_format"))
    _need(
        fmt is None or not forced,
        "response_format json_object / json_schema cannot be combined with a forced tool_choice "
        "(the reply is either the JSON value or the tool call)",
        "response_format",
    )
    # The URL's session id wins over the body's: a client's extra body cannot move a request to
    # another session than the base URL it was given.
    sid = session_id or body.get("session_id") or ""
    kwargs = body.get("chat_template_kwargs") or {}
    _need(
        isinstance(kwargs, dict)
        and set(kwargs) <= {"enable_thinking"}
        and all(isinstance(v, bool) for v in kwargs.values()),
        "chat_template_kwargs may only hold enable_thinking (a boolean)",
        "chat_template_kwargs",
    )
    _need(isinstance(sid, str) and len(sid) <= 128, "session_id must be a string", "session_id")
    return ChatRequest(
        model=model,
        messages=messages,
        tools=[] if choice == "none" else tools,
        generation=_generation(
            body,
            sampling,
            max_tokens=max_tokens,
            default_tokens=default_tokens,
            overridden=overridden,
            response_format=fmt,
        ),
        session_id=sid,
        template_kwargs=dict(kwargs),
        tool_choice=forced,
    )


def _tools(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The request's function tools, checked."""
    tools = body.get("tools") or []
    _need(
        isinstance(tools, list)
        and all(
            isinstance(t, dict)
            and t.get("type") == "function"
            and isinstance(t.get("function"), dict)
            and isinstance(t["function"].get("name"), str)
            for t in tools
        ),
        'tools must be a list of {"type": "function", "function": {"name": ...}}',
        "tools",
    )
    return tools


STRICT_TOOLS = "tools[].function.strict"


def _strict_tools(tools: list[dict[str, Any]], override: bool) -> tuple[str, ...]:
    """A function tool's `strict: true` asks that the call's arguments follow its schema, which
    the server does not enforce (tool calls are sampled unconstrained): refused like a sampler
    field, or with `override` served unconstrained and named in the reply's
    `sampling.overridden`."""
    strict = [t["function"]["name"][:40] for t in tools if t["function"].get("strict")]
    if not strict:
        return ()
    _need(
        override,
        f"tools[].function.strict=true ({', '.join(strict[:4])}) is not honoured: tool-call "
        "arguments are sampled unconstrained (server.http_sampling=override serves the request "
        "and reports it in sampling.overridden)",
        "tools",
    )
    return (STRICT_TOOLS,)


def _forced_tool(choice: Any, tools: list[dict[str, Any]]) -> str:
    """What `tool_choice` forces: a function's name, `REQUIRED`, or "" (auto / none)."""
    forced = ""
    if isinstance(choice, dict):  # {"type": "function", "function": {"name": ...}}
        fn = choice.get("function") if choice.get("type") == "function" else None
        forced = fn.get("name") if isinstance(fn, dict) else None
        names = {t["function"]["name"] for t in tools}
        _need(
            isinstance(forced, str) and forced in names,
            "tool_choice names a function that is not in tools",
            "tool_choice",
        )
    elif choice == "required":
        _need(bool(tools), "tool_choice required needs tools", "tool_choice")
        forced = REQUIRED
    else:
        _need(
            choice in (None, "auto", "none"),
            "tool_choice must be auto, none, required or a named function",
            "tool_choice",
        )
    return forced


def parse_completion(
    body: Any,
    sampling: SamplingConfig,
    *,
    max_tokens: int,
    default_tokens: int,
    override: bool = False,
) -> CompletionRequest:
    """Checks a (legacy) completion body: one prompt string.

    Raises:
      ApiError: 400 naming the field.
    """
    overridden = _check_fields(body, _COMPLETION_FIELDS, override)
    _need(
        _response_format(body.get("response_format")) is None,
        "response_format json_object / json_schema is served on /v1/chat/completions only",
        "response_format",
    )
    model = body.get("model")
    _need(isinstance(model, str) and model, "model is required", "model")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    _need(isinstance(prompt, str) and prompt, "prompt must be one non-empty string", "prompt")
    _need(not body.get("echo"), "echo is not supported", "echo")
    _need(body.get("suffix") is None, "suffix is not supported", "suffix")
    _need(body.get("best_of") in (None, 1), "best_of is not supported", "best_of")
    if body.get("logprobs") is not None:  # an int here: the number of alternatives
        _need(body["logprobs"] in (0, 1, True, False), "logprobs must be 0 or 1", "logprobs")
    return CompletionRequest(
        model=model,
        prompt=prompt,
        generation=_generation(
            body,
            sampling,
            max_tokens=max_tokens,
            default_tokens=default_tokens,
            overridden=overridden,
        ),
    )


def normalize_message(message: Any, where: str) -> dict[str, Any]:
    """A message as the chat template and the session rule see it: role, content as a string
    (text parts joined; None = ""), and `tool_calls` / `tool_call_id` / `name` when present (the
    client's extra None-valued fields, e.g. `refusal`, dropped).

    Raises:
      ApiError: 400 for anything else.
    """
    _need(isinstance(message, dict), f"{where} must be an object", where)
    role = message.get("role")
    _need(role in _ROLES, f"{where}.role must be one of {', '.join(_ROLES)}", where)
    content = message.get("content")
    if isinstance(content, list):
        _need(
            all(isinstance(p, dict) and p.get("type") == "text" for p in content),
            f"{where}.content: only text parts are supported",
            where,
        )
        content = "".join(str(p.get("text", "")) for p in content)
    content = "" if content is None else content
    _need(isinstance(content, str), f"{where}.content must be a string", where)
    out: dict[str, Any] = {"role": "system" if role == "developer" else role, "content": content}
    calls = message.get("tool_calls")
    if calls:
        _need(role == "assistant" and isinstance(calls, list), f"{where}.tool_calls", where)
        out["tool_calls"] = [
            _normalize_call(c, f"{where}.tool_calls[{i}]") for i, c in enumerate(calls)
        ]
    for key in ("tool_call_id", "name", "reasoning_content"):
        if message.get(key) is not None:
            _need(isinstance(message[key], str), f"{where}.{key} must be a string", where)
            out[key] = message[key]
    if not out.get("reasoning_content"):
        out.pop("reasoning_content", None)
    return out


def history_view(message: Mapping[str, Any]) -> dict[str, Any]:
    """A message as the session rule compares it: without `reasoning_content`, which a client
    may send back or drop (the session's ids hold the reasoning either way)."""
    return {k: v for k, v in message.items() if k != "reasoning_content"}


def _normalize_call(call: Any, where: str) -> dict[str, Any]:
    ok = isinstance(call, dict) and isinstance(call.get("function"), dict)
    _need(ok, f"{where} must be a function call", where)
    fn = call["function"]
    name, arguments = fn.get("name"), fn.get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            raise ApiError(400, f"{where}.function.arguments is not JSON", param=where) from None
    _need(isinstance(name, str) and isinstance(arguments, dict), f"{where}: bad function", where)
    # Arguments as a mapping: what HF chat templates render (`| tojson`).
    return {
        "id": str(call.get("id", "")),
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def template_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Messages as a chat template takes them (tool calls as HF's {name, arguments})."""
    out = []
    for m in messages:
        m = dict(m)
        if "tool_calls" in m:
            m["tool_calls"] = [
                {"type": "function", "id": c["id"], "function": c["function"]}
                for c in m["tool_calls"]
            ]
        out.append(m)
    return out


def truncate_at_stop(text: str, stops: Sequence[str]) -> tuple[str, bool]:
    """`text` before the first stop string, and whether one was found."""
    cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
    return (text, False) if cut < 0 else (text[:cut], True)


def make_stop_when(tokenizer: Any, stops: Sequence[str]):
    """The driver's `stop_when` for stop strings: decodes the turn's last tokens (enough for
    the longest stop string) and looks for one."""
    if not stops:
        return None
    window = 2 * max(len(s) for s in stops) + 8

    def stop_when(ids: np.ndarray) -> bool:
        tail = tokenizer.decode(ids[-window:])
        return any(s in tail for s in stops)

    return stop_when


_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*?)</function>\s*", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.DOTALL)


def _schema_types(tools: Sequence[Mapping[str, Any]]) -> dict[tuple[str, str], str]:
    """(function, parameter) -> its JSON-schema type, from the request's tools."""
    out = {}
    for t in tools:
        fn = t.get("function") or {}
        props = (fn.get("parameters") or {}).get("properties") or {}
        for name, schema in props.items() if isinstance(props, dict) else ():
            if isinstance(schema, dict) and isinstance(schema.get("type"), str):
                out[(fn.get("name"), name)] = schema["type"]
    return out


def _xml_call(body: str, types: dict[tuple[str, str], str]) -> dict[str, Any] | None:
    """Qwen3-Coder's `<function=NAME><parameter=P>value</parameter>...</function>` as
    {"name", "arguments"}: a value is a string unless its schema type is another one and it
    parses as JSON (as vLLM's qwen3_coder parser converts it)."""
    match = _FUNCTION.fullmatch(body)
    if match is None:
        return None
    name, inner = match.group(1).strip(), match.group(2)
    arguments: dict[str, Any] = {}
    for key, value in _PARAMETER.findall(inner):
        key = key.strip()
        if types.get((name, key), "string") != "string":
            try:
                value = json.loads(value)
            except (ValueError, RecursionError):
                pass
        arguments[key] = value
    if _PARAMETER.sub("", inner).strip():  # text that is no parameter: not a call
        return None
    return {"name": name, "arguments": arguments}


def _tool_calls(text: str, tools: Sequence[Mapping[str, Any]] = ()) -> list[dict[str, Any]] | None:
    """The reply's `<tool_call>` blocks as OpenAI tool calls, or None when any block is not a
    call: a Hermes JSON object `{"name": str, "arguments": object}` (its `arguments` may also be
    a JSON string of an object; absent = {}), or a Qwen3-Coder XML `<function=...>` block. Such a
    reply stays content, as vLLM's parsers leave it."""
    calls = []
    types = _schema_types(tools)
    for body in find_tool_calls(text):
        if body is not None and body.lstrip().startswith("<function="):
            call = _xml_call(body, types)
        else:
            try:
                call = json.loads(body) if body is not None else None
            except (ValueError, RecursionError):
                return None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return None
        arguments = call.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except (ValueError, RecursionError):
                return None
        if not isinstance(arguments, dict):  # null, a number, a list, "1+1"
            return None
        calls.append(
            {
                "id": f"call_{secrets.token_hex(12)}",
                "type": "function",
                "function": {"name": call["name"], "arguments": json.dumps(arguments)},
            }
        )
    return calls or None


def split_reasoning(text: str) -> tuple[str | None, str]:
    """(reasoning, content) of a reply in Qwen3's format (vLLM's qwen3 reasoning parser): the
    text before `</think>` (without `<think>`) and the text after it; a `<think>` never closed
    (the turn was cut) is all reasoning; no think tags: no reasoning."""
    end = text.find("</think>")
    if end < 0:
        if text.lstrip().startswith("<think>"):
            return text.lstrip()[len("<think>") :].strip(), ""
        return None, text
    reasoning = text[:end]
    at = reasoning.find("<think>")
    if at >= 0:
        reasoning = reasoning[at + len("<think>") :]
    return reasoning.strip(), text[end + len("</think>") :].lstrip()


def assistant_message(
    text: str, *, tools: bool | Sequence[Mapping[str, Any]], reasoning: bool = False
) -> dict[str, Any]:
    """The reply as an OpenAI assistant message: with `tools` (the request's tool schemas),
    the `<tool_call>` blocks after the reasoning become `tool_calls` (each with a fresh id) and
    the text before them the content; a reply with any block that is not a well-formed call stays
    all content. With `reasoning`, the thinking goes to `reasoning_content`. Never raises."""
    out: dict[str, Any] = {"role": "assistant"}
    if reasoning:
        thought, text = split_reasoning(text)
        if thought is not None:
            out["reasoning_content"] = thought
    visible_at = text.rfind("</think>")
    visible_at = 0 if visible_at < 0 else visible_at + len("</think>")
    if tools and "<tool_call>" in text[visible_at:]:
        calls = _tool_calls(text, tools if not isinstance(tools, bool) else ())
        if calls:
            head = text[: text.find("<tool_call>", visible_at)].strip()
            return {**out, "content": head or None, "tool_calls": calls}
    return {**out, "content": text}


def token_logprobs(tokenizer: Any, ids: np.ndarray, logprobs: np.ndarray) -> list[dict]:
    """OpenAI `logprobs.content`: each generated token with its behavior log-prob."""
    out = []
    for i, lp in zip(ids.tolist(), logprobs.tolist(), strict=True):
        text = tokenizer.decode([i])
        out.append(
            {
                "token": text,
                "logprob": lp,
                "bytes": token_bytes(tokenizer, i, text),
                "top_logprobs": [],
                "token_id": i,
            }
        )
    return out


_OPEN_CALL = "<tool_call>"
REQUIRED = "\x00required"  # `ChatRequest.tool_choice` for "required" (no function is named so)


def forced_prefix(tool_choice: str, *, xml: bool) -> str:
    """The text a reply is made to begin with for `tool_choice` (inserted as observation
    tokens, no loss on them): a call's opening, with the function's name when one is named; in
    Qwen3-Coder's XML format (`xml`) or Hermes JSON."""
    if not tool_choice:
        return ""
    if tool_choice == REQUIRED:
        return "<tool_call>\n"
    if xml:
        return f"<tool_call>\n<function={tool_choice}>\n"
    return f'<tool_call>\n{{"name": {json.dumps(tool_choice)}, "arguments": '


class StreamText:
    """A choice's deltas as a stream, from its ids as they are generated.

    Text is sent as soon as it is certain: not a partial UTF-8 character (decoded as U+FFFD), not
    the last `len(longest stop) - 1` characters (they may begin a stop string; nothing from a
    stop string on is ever sent), and with tools nothing from a `<tool_call>` after the reasoning
    on, nor a tail that may begin one (calls go out parsed, when the reply is known). With
    `reasoning` (Qwen3's format), the text in `<think>...</think>` goes out as
    `reasoning_content` deltas and what follows as `content`. `finish` sends what the final
    message holds beyond what was sent.
    """

    def __init__(
        self, tokenizer: Any, stops: Sequence[str], tools: bool, reasoning=False, prefix=""
    ):
        self.tok, self.stops, self.tools = tokenizer, tuple(stops), tools
        self.reasoning = reasoning
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.ids: list[int] = []
        self.decoded = 0  # ids decoded into `text`
        self.text = prefix  # a forced prefix (`forced_prefix`) begins the reply
        self.sent = {"reasoning_content": "", "content": ""}
        self.stopped = False

    def feed(self, ids: Sequence[int]) -> dict[str, str]:
        """The delta to send after `ids` (the next generated ids), possibly {}."""
        self.ids.extend(int(i) for i in ids)
        tail = self.tok.decode(self.ids[self.decoded :])
        if not tail or tail.endswith("\ufffd"):  # a character still incomplete
            return {}
        self.text += tail
        self.decoded = len(self.ids)
        return self._delta()

    def _parts(self) -> dict[str, str]:
        """The certain text so far, split into its reasoning and its content."""
        text, found = truncate_at_stop(self.text, self.stops)
        if not found:
            text = text[: max(0, len(text) - self.hold)]
        self.stopped = found
        parts = {"reasoning_content": "", "content": text}
        if self.reasoning:
            end = text.find("</think>")
            opened = text.lstrip()
            if end >= 0:
                thought = text[:end]
                at = thought.find("<think>")
                parts["reasoning_content"] = thought[at + 7 if at >= 0 else 0 :].lstrip()
                parts["content"] = text[end + len("</think>") :].lstrip()
            elif opened.startswith("<think>"):
                parts["reasoning_content"] = _hold_prefix(opened[7:].lstrip(), "</think>")
                parts["content"] = ""
            elif "<think>".startswith(opened):  # may still open a think block
                parts["content"] = ""
        content = parts["content"]
        if self.tools:
            reasoning = content.rfind("</think>")
            at = content.find(_OPEN_CALL, 0 if reasoning < 0 else reasoning + len("</think>"))
            content = content[:at] if at >= 0 else _hold_prefix(content, _OPEN_CALL)
        parts["content"] = content
        return parts

    def _delta(self) -> dict[str, str]:
        if self.stopped:
            return {}
        out = {}
        for key, text in self._parts().items():
            sent = self.sent[key]
            if len(text) > len(sent) and text.startswith(sent):
                out[key], self.sent[key] = text[len(sent) :], text
        return out

    def finish(self, message: Mapping[str, Any]) -> dict[str, str]:
        """The rest of the final `message`'s content and reasoning (what was sent is a prefix
        of each; where it is not, nothing more is sent)."""
        out = {}
        for key, sent in self.sent.items():
            final = message.get(key) or ""
            if final.startswith(sent) and len(final) > len(sent):
                out[key] = final[len(sent) :]
        return out


def _hold_prefix(text: str, tag: str) -> str:
    """`text` without a tail that may begin `tag`."""
    for k in range(len(tag) - 1, 0, -1):
        if text.endswith(tag[:k]):
            return text[:-k]
    return text
