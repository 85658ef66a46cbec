"""Agent frameworks' own OpenAI clients against a live `sat-serve` (README "Agents over HTTP"):
`python -m rollout_server` with `server.http_sampling=override` and sessions on, a tiny local
checkpoint, each test in a session of its own (base_url `/sessions/<id>/v1`, discarded after).
Each framework is used as its users write it, with its default request settings: a plain turn, a
streamed turn and a turn with a tool bound each get a reply through the framework's own parsing;
sampler settings a user adds (temperature, top_p, seed) are served with the server's sampler and
reported in the reply's `sampling`, not refused. The random model may or may not call the tool.

What each sends by default (the request bodies these tests capture and check):
- LangChain (`langchain_openai.ChatOpenAI`): `{"model", "messages", "stream": false}`, no
  sampler field (its `temperature` is None unless set); `.stream` sends `"stream": true` and no
  `stream_options`; `bind_tools` adds `tools` in OpenAI's form and no `tool_choice`; a user's
  `max_tokens` goes as `max_completion_tokens`, `stream_usage=True` as
  `stream_options.include_usage`.
- OpenAI Agents SDK (`Agent` on `OpenAIChatCompletionsModel`): `{"model", "messages"}`, the
  agent's instructions as a system message first, no sampler field (`ModelSettings` all None) and
  no `store` (sent only to api.openai.com); `Runner.run_streamed` adds `"stream": true`; a
  `function_tool` goes as `tools` with `"strict": true` and `"additionalProperties": false`, no
  `tool_choice` or `parallel_tool_calls`; `ModelSettings(max_tokens=...)` goes as `max_tokens`,
  `include_usage=True` as `stream_options.include_usage` on streamed turns.
Both send a conversation's earlier replies back as `{"role": "assistant", "content": ...}`, which
the session takes as its own history (a multi-turn agent loop works unchanged).
"""

from __future__ import annotations

import asyncio
import json

import portpicker
import pytest

from tests import live_http

pytest.importorskip("openai")
pytest.importorskip("httpx")
pytestmark = pytest.mark.slow

SAMPLER = {"temperature", "top_p", "top_k", "seed", "presence_penalty", "frequency_penalty"}
FINISH = {"stop", "length", "tool_calls"}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The live server (override mode), stopped after the module: `(official client, its URL,
    process, folder)`."""
    import openai

    tmp_path = tmp_path_factory.mktemp("frameworks")
    port, http_port = portpicker.pick_unused_port(), portpicker.pick_unused_port()
    _, proc, log = live_http.serve(tmp_path, port, http_port, "server.http_sampling=override")
    url = f"http://127.0.0.1:{http_port}"
    try:
        server = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=300)
        first = live_http.take(server, proc, tmp_path)  # waits for the server to start
        _discard(server, first)
        yield server, url, proc, tmp_path
    finally:
        live_http.stop(proc, log)
    assert "Traceback" not in (tmp_path / "server.log").read_text()


def _discard(server, session) -> None:
    server.post(f"/sessions/{session['session_id']}/end", body={"discard": True}, cast_to=object)


class _Wire:
    """httpx event hooks that keep every request body sent and every non-streamed reply body."""

    def __init__(self):
        self.sent, self.got = [], []

    def request(self, req):
        self.sent.append(json.loads(req.content or b"{}"))

    def response(self, resp):
        if "event-stream" not in resp.headers.get("content-type", ""):
            self.got.append(json.loads(resp.read()))

    async def arequest(self, req):
        self.request(req)

    async def aresponse(self, resp):
        if "event-stream" not in resp.headers.get("content-type", ""):
            self.got.append(json.loads(await resp.aread()))

    def client(self):
        import httpx

        return httpx.Client(event_hooks={"request": [self.request], "response": [self.response]})

    def async_client(self):
        import httpx

        hooks = {"request": [self.arequest], "response": [self.aresponse]}
        return httpx.AsyncClient(event_hooks=hooks)


@pytest.fixture
def session(served):
    """A session taken for one test and discarded after it: `(base_url, prompt text)`."""
    server, url, proc, tmp_path = served
    s = live_http.take(server, proc, tmp_path)
    try:
        yield f"{url}/sessions/{s['session_id']}/v1", s["prompt"]["text"]
    finally:
        _discard(server, s)


ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Adds a and b.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}


# LangChain ------------------------------------------------------------------------------------


def _chat_openai(base_url, wire, **settings):
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(
        model="model", base_url=base_url, api_key="none", max_retries=0, timeout=300,
        http_client=wire.client(), **settings,
    )  # fmt: skip


def _check_ai_message(msg) -> None:
    assert isinstance(msg.content, str)  # may be empty: a random model may stop at once
    assert msg.response_metadata["finish_reason"] in FINISH
    assert msg.usage_metadata["output_tokens"] > 0


def test_langchain_chat_turn_with_defaults(session, monkeypatch):
    monkeypatch.delenv("LANGSMITH_TRACING", raising=False)
    monkeypatch.delenv("LANGCHAIN_TRACING_V2", raising=False)
    base_url, prompt = session
    wire = _Wire()
    msg = _chat_openai(base_url, wire).invoke([("user", prompt)])
    _check_ai_message(msg)
    (sent,) = wire.sent
    assert sent == {"model": "model", "messages": [{"role": "user", "content": prompt}],
                    "stream": False}  # fmt: skip
    assert wire.got[0]["sampling"]["overridden"] == []


def test_langchain_user_sampler_settings_are_overridden_and_reported(session):
    base_url, prompt = session
    wire = _Wire()
    llm = _chat_openai(base_url, wire, temperature=0.2, top_p=0.9, seed=7)
    _check_ai_message(llm.invoke([("user", prompt)]))
    assert {k for k in wire.sent[0] if k in SAMPLER} == {"temperature", "top_p", "seed"}
    sampling = wire.got[0]["sampling"]
    assert sorted(sampling["overridden"]) == ["seed", "temperature", "top_p"]
    assert sampling["temperature"] != 0.2  # the server's own sampler served it


def test_langchain_streams(session):
    base_url, prompt = session
    wire = _Wire()
    chunks = list(_chat_openai(base_url, wire, temperature=0.7).stream([("user", prompt)]))
    assert len(chunks) >= 2
    whole = chunks[0]
    for c in chunks[1:]:
        whole += c
    assert isinstance(whole.content, str)
    assert whole.response_metadata["finish_reason"] in FINISH
    (sent,) = wire.sent
    assert sent["stream"] is True and "stream_options" not in sent


def test_langchain_bind_tools(session):
    base_url, prompt = session
    wire = _Wire()
    msg = _chat_openai(base_url, wire).bind_tools([ADD]).invoke([("user", prompt)])
    assert msg.response_metadata["finish_reason"] in FINISH
    assert isinstance(msg.tool_calls, list) and isinstance(msg.invalid_tool_calls, list)
    for call in msg.tool_calls:
        assert call["name"] == "add" and isinstance(call["args"], dict)
    (sent,) = wire.sent
    assert sent["tools"] == [ADD] and "tool_choice" not in sent


def test_langchain_conversation_streams_its_second_turn(session):
    """An agent loop: the reply goes back in the history with a new message (the session's
    rule), the second turn streamed with usage (`stream_usage=True`: `stream_options`)."""
    from langchain_core.messages import HumanMessage

    base_url, prompt = session
    wire = _Wire()
    llm = _chat_openai(base_url, wire, max_tokens=4, stream_usage=True)
    history = [HumanMessage(prompt)]
    history += [llm.invoke(history), HumanMessage("Sure?")]
    whole = None
    for c in llm.stream(history):
        whole = c if whole is None else whole + c
    assert whole.response_metadata["finish_reason"] in FINISH
    assert whole.usage_metadata["output_tokens"] > 0
    first, second = wire.sent
    assert first["max_completion_tokens"] == 4 and "max_tokens" not in first
    assert second["stream_options"] == {"include_usage": True}
    assert [m["role"] for m in second["messages"]] == ["user", "assistant", "user"]


# OpenAI Agents SDK ----------------------------------------------------------------------------


def _agent(base_url, wire, tools=(), **settings):
    import openai
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, set_tracing_disabled

    set_tracing_disabled(True)  # nothing goes to the network
    client = openai.AsyncOpenAI(
        base_url=base_url, api_key="none", max_retries=0, timeout=300,
        http_client=wire.async_client(),
    )  # fmt: skip
    return Agent(
        name="solver",
        instructions="Solve the problem.",
        model=OpenAIChatCompletionsModel(model="model", openai_client=client),
        model_settings=ModelSettings(**settings),
        tools=list(tools),
    )


def test_agents_sdk_run_with_defaults(session):
    from agents import Runner

    base_url, prompt = session
    wire = _Wire()
    result = asyncio.run(Runner.run(_agent(base_url, wire), prompt))
    assert isinstance(result.final_output, str)
    assert result.raw_responses[-1].usage.output_tokens > 0
    sent = wire.sent[0]
    assert sent == {
        "model": "model",
        "messages": [
            {"role": "system", "content": "Solve the problem."},
            {"role": "user", "content": prompt},
        ],
    }
    assert wire.got[0]["sampling"]["overridden"] == []


def test_agents_sdk_user_sampler_settings_are_overridden_and_reported(session):
    from agents import Runner

    base_url, prompt = session
    wire = _Wire()
    agent = _agent(base_url, wire, temperature=0.3, top_p=0.8)
    result = asyncio.run(Runner.run(agent, prompt))
    assert isinstance(result.final_output, str)
    assert sorted(wire.got[0]["sampling"]["overridden"]) == ["temperature", "top_p"]


def test_agents_sdk_run_streamed(session):
    from agents import Runner

    base_url, prompt = session
    wire = _Wire()

    async def play():
        result = Runner.run_streamed(_agent(base_url, wire), prompt)
        events = [e.type async for e in result.stream_events()]
        return result, events

    result, events = asyncio.run(play())
    assert events.count("raw_response_event") >= 2
    assert isinstance(result.final_output, str)
    assert wire.sent[0]["stream"] is True


def test_agents_sdk_function_tool(session):
    from agents import Runner, function_tool

    calls = []

    @function_tool
    def add(a: int, b: int) -> int:
        """Adds a and b."""
        calls.append((a, b))
        return a + b

    base_url, prompt = session
    wire = _Wire()
    result = asyncio.run(Runner.run(_agent(base_url, wire, [add]), prompt))
    # A random model rarely writes a well-formed call; when it does, the tool ran and its result
    # went back in the same session (a longer history the server accepted).
    assert len(wire.sent) == len(result.raw_responses) >= 1 + len(calls)
    assert isinstance(result.final_output, str)
    (tool,) = wire.sent[0]["tools"]
    assert tool["function"]["name"] == "add" and tool["function"]["strict"] is True
    # Not enforced (arguments are sampled unconstrained), so reported as overridden.
    assert wire.got[0]["sampling"]["overridden"] == ["tools[].function.strict"]
    assert "tool_choice" not in wire.sent[0] and "parallel_tool_calls" not in wire.sent[0]


def test_agents_sdk_conversation_streams_its_second_turn(session):
    """Multi-turn as the SDK's users write it: `result.to_input_list()` plus a new message, the
    second turn streamed (`include_usage`: `stream_options`)."""
    from agents import Runner

    base_url, prompt = session
    wire = _Wire()
    agent = _agent(base_url, wire, max_tokens=4, include_usage=True)

    async def play():
        first = await Runner.run(agent, prompt)
        second = Runner.run_streamed(agent, [*first.to_input_list(), _user("Sure?")])
        async for _ in second.stream_events():
            pass
        return second

    second = asyncio.run(play())
    assert isinstance(second.final_output, str)
    first_sent, second_sent = wire.sent
    assert first_sent["max_tokens"] == 4
    assert second_sent["stream"] is True
    assert second_sent["stream_options"] == {"include_usage": True}
    roles = [m["role"] for m in second_sent["messages"]]
    assert roles == ["system", "user", "assistant", "user"]


def _user(text: str) -> dict:
    return {"role": "user", "content": text}
