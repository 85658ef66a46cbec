"""The OpenAI-compatible endpoint, live: the official `openai` client against the real engine,
driver, rollout loop and sessions in this process, on a free loopback port.

A scripted policy (`ForcedCore`, as in test_episodes.py: the sampler returns given tokens at given
cache positions, with their log-probs under the model) makes the replies known: a session's
first turn is a calculator tool call, its second the answer; a stateless prompt of another length
gets "7 + 5 = 12". The session's trajectory on the wire must be its turns and the template's
delta between them, loss mask 0 on the delta, and the log-probs the client got must be the
behavior log-probs on the wire and one full forward's.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time

import grain
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import requests
from flax import nnx

from rollout_server import engine as engine_module
from rollout_server import jetstream_compat  # noqa: F401  (must precede jetstream imports)

# isort: split
from rollout_api import records
from rollout_server.driver import RolloutDriver
from rollout_server.engine import MoEEngine
from rollout_server.http_api import HttpApi, HttpLimits
from rollout_server.persistence import StateStore
from rollout_server.rollout import RolloutLoop
from rollout_server.sessions import Generator, SessionLimits, SessionManager
from sat_jax.config import RolloutConfig, ServerConfig
from sat_jax.decoding import SamplingConfig
from sat_jax.model import ModelConfig, Transformer, token_logprobs
from sat_jax.tasks import Prompt, exact_match_reward
from sat_jax.tasks.envs import CALCULATOR_TOOL
from sat_jax.tasks.hf_tokenizer import HFTokenizer
from tests.hf_fixtures import make_tokenizer
from tests.rollout_server.test_episodes import ForcedCore

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.slow

PROMPT = Prompt(id="p0", text="What is 5 + 7?", answer="12")
SESSION_MESSAGES = [{"role": "user", "content": PROMPT.text}]
STATELESS_MESSAGES = [
    {"role": "system", "content": "You add numbers. " * 8},
    {"role": "user", "content": "What is 7 + 5?"},
]
# Qwen3's rule, cut down: an assistant message before the last user message loses its reasoning
# when the conversation is rendered again. A session never re-renders, so its ids keep it.
REASONING_TEMPLATE = (
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for m in messages %}{% if m['role'] == 'user' %}{% set ns.last_user = loop.index0 %}"
    "{% endif %}{% endfor -%}"
    "{%- for m in messages -%}"
    "{%- set content = m['content'] -%}"
    "{%- if m['role'] == 'assistant' and loop.index0 < ns.last_user and '</think>' in content -%}"
    "{%- set content = content.split('</think>')[-1] -%}"
    "{%- endif -%}"
    "{{ '<|im_start|>' + m['role'] + '\\n' + content + '<|im_end|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif -%}"
)
REASONING_MESSAGES = [{"role": "user", "content": "Think, then add 5 and 7. " * 12}]
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "5 + 7"}}</tool_call>'
TOKEN = "secret-token"
MODEL = "sat-jax-tiny"
# Fields accepted only at the values the server honours (rollout_server/chat.py).
HONOURED_ONLY = (
    "seed", "store", "metadata", "parallel_tool_calls", "service_tier", "presence_penalty",
)  # fmt: skip
IDLE_S = 30.0


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _ids(tokenizer, text):
    return tokenizer._tok(text, add_special_tokens=False)["input_ids"]


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("http")
    fast = make_tokenizer(tmp / "tok", chat_template=False)
    fast.chat_template = REASONING_TEMPLATE
    fast.save_pretrained(str(tmp / "tok"))
    tok = HFTokenizer(str(tmp / "tok"), chat_template=True)
    end = int(tok._tok.convert_tokens_to_ids("<|im_end|>"))
    # The script: a tool call then the answer for the session, "7 + 5 = 12" for the stateless.
    p0 = len(tok.encode_messages(SESSION_MESSAGES, tools=[CALCULATOR_TOOL]))
    turn1 = [*_ids(tok, CALL), end]
    delta = tok.observation_ids([{"role": "tool", "content": "12", "tool_call_id": "call_0_0"}])
    turn2 = [*_ids(tok, "12"), end]
    p1 = len(tok.encode_messages(STATELESS_MESSAGES))
    plain = [*_ids(tok, "7 + 5 = 12"), end]
    script = np.full(512, -1, np.int32)
    script[p0 : p0 + len(turn1)] = turn1
    q = p0 + len(turn1) + len(delta)
    script[q : q + len(turn2)] = turn2
    assert p1 > q + len(turn2)
    script[p1 : p1 + len(plain)] = plain
    # The reasoning session: "<think>...</think>7", a user's "Again.", then "12".
    p2 = len(tok.encode_messages(REASONING_MESSAGES))
    assert p2 > p1 + len(plain)
    r1 = [*_ids(tok, "<think>5 + 7</think>7"), end]
    r_delta = tok.observation_ids([{"role": "user", "content": "Again."}])
    r2 = [*_ids(tok, "12"), end]
    script[p2 : p2 + len(r1)] = r1
    script[p2 + len(r1) + len(r_delta) : p2 + len(r1) + len(r_delta) + len(r2)] = r2
    mp = pytest.MonkeyPatch()
    mp.setattr(ForcedCore, "SCRIPT", script)
    mp.setattr(engine_module, "DecodeCore", ForcedCore)
    cfg = ModelConfig.preset("tiny").replace(vocab_size=len(tok), max_seq_len=512)
    model = Transformer(cfg, rngs=nnx.Rngs(jax.random.key(0, impl="rbg")))
    engine = MoEEngine(
        model,
        tokenizer=tok,
        slots=4,
        max_prefill_length=256,
        max_decode_length=256,
        sampling=SamplingConfig(),
    )
    params = engine.load_params()
    driver = RolloutDriver.interleaved(engine)
    clock = FakeClock()
    generator = Generator(driver, engine, tok)
    sessions = SessionManager(
        generator, exact_match_reward, SessionLimits(max_sessions=2, idle_s=IDLE_S), clock=clock
    )
    loop = RolloutLoop(
        driver=driver,
        engine=engine,
        prompts=grain.MapDataset.source([PROMPT]).repeat().to_iter_dataset(),
        reward_fn=exact_match_reward,
        tokenizer=tok,
        cfg=RolloutConfig(group_size=2, max_new_tokens=100, batch_groups=1, max_staleness=3),
        store=StateStore(str(tmp / "state")),
        wait_for_weights=False,
        max_response_bytes=ServerConfig().max_message_bytes,
        lease_s=600.0,
        sessions=sessions,
    )
    api = HttpApi(
        generator=generator,
        sessions=sessions,
        limits=HttpLimits(
            max_body_bytes=64 * 1024, max_messages=16, max_requests=8, reap_every_s=0.05
        ),
        token=TOKEN,
        model_name=MODEL,
        default_tokens=100,
    )
    aio = asyncio.new_event_loop()
    thread = threading.Thread(target=aio.run_forever, daemon=True)
    thread.start()
    try:
        port = asyncio.run_coroutine_threadsafe(api.start("127.0.0.1", 0), aio).result(60)
        loop.start()
        yield dict(
            url=f"http://127.0.0.1:{port}",
            tok=tok,
            loop=loop,
            engine=engine,
            params=params,
            sessions=sessions,
            clock=clock,
            turns=(turn1, delta, turn2),
            plain=plain,
            reasoning=(r1, r_delta, r2),
            p0=p0,
        )
    finally:
        loop.stop()
        asyncio.run_coroutine_threadsafe(api.stop(), aio).result(30)
        aio.call_soon_threadsafe(aio.stop)
        thread.join(10)
        driver.stop()
        mp.undo()


def _client(live, base="/v1", token=TOKEN):
    return openai.OpenAI(base_url=live["url"] + base, api_key=token, max_retries=0, timeout=300)


def _full_forward(live, ids, p):
    model = nnx.merge(live["engine"].core.graphdef, live["params"])
    seq = jnp.asarray([ids], jnp.int32)
    logits = model(seq)
    mask = jnp.asarray(live["engine"].sampleable_ids)
    return np.asarray(token_logprobs(logits[:, p - 1 : -1], seq[:, p:], vocab_mask=mask)[0])


def test_models_plain_chat_n_logprobs_and_usage(live):
    client = _client(live)
    assert [m.id for m in client.models.list().data] == [MODEL]
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="gpt-4o", messages=STATELESS_MESSAGES)
    out = client.chat.completions.create(
        model="sat-jax-tiny", messages=STATELESS_MESSAGES, n=2, logprobs=True, max_tokens=20
    )
    plain = live["plain"]
    assert len(out.choices) == 2
    prompt = live["tok"].encode_messages(STATELESS_MESSAGES)
    want = _full_forward(live, prompt + plain, len(prompt))
    for choice in out.choices:
        assert choice.message.content == "7 + 5 = 12"
        assert choice.finish_reason == "stop"
        assert [t.token_id for t in choice.logprobs.content] == plain
        got = [t.logprob for t in choice.logprobs.content]
        np.testing.assert_allclose(got, want, atol=2e-4)
    assert out.usage.prompt_tokens == len(prompt)
    assert out.usage.completion_tokens == 2 * len(plain)


def test_stop_strings_and_max_tokens(live):
    client = _client(live)
    out = client.chat.completions.create(
        model=MODEL, messages=STATELESS_MESSAGES, stop=["= 1"], max_completion_tokens=20
    )
    assert out.choices[0].message.content == "7 + 5 "
    assert out.choices[0].finish_reason == "stop"
    out = client.chat.completions.create(model=MODEL, messages=STATELESS_MESSAGES, max_tokens=2)
    assert out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 2


def test_stream_and_completions(live):
    client = _client(live)
    stream = client.chat.completions.create(
        model=MODEL,
        messages=STATELESS_MESSAGES,
        stream=True,
        stream_options={"include_usage": True},
        logprobs=True,
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "7 + 5 = 12"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage.completion_tokens == len(live["plain"])
    prompt = live["tok"]._tok.apply_chat_template(
        STATELESS_MESSAGES, tokenize=False, add_generation_prompt=True
    )
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, logprobs=1)
    assert out.choices[0].text == "7 + 5 = 12"
    assert len(out.choices[0].logprobs.token_logprobs) == len(live["plain"])


def _take(live, n=1):
    r = requests.post(
        live["url"] + "/sessions",
        json={"max_sessions": n, "timeout_s": 30},
        headers={"Authorization": f"Bearer {TOKEN}"},
        timeout=60,
    )
    return r


def _take_all(live, n):
    """`n` sessions, taken over as many requests as it takes (a take returns what is offered)."""
    taken = []
    while len(taken) < n:
        r = _take(live, n - len(taken))
        assert r.status_code == 200, r.text
        taken += r.json()["sessions"]
    return taken


def _wait(cond, what, timeout_s=120):
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def _play(live, session_id):
    """The calculator agent's two turns (a tool call, then the answer) through the client;
    returns the two completions."""
    client = _client(live, f"/sessions/{session_id}/v1")
    messages = list(SESSION_MESSAGES)
    first = client.chat.completions.create(
        model=MODEL, messages=messages, tools=[CALCULATOR_TOOL], logprobs=True
    )
    call = first.choices[0].message.tool_calls[0]
    assert first.choices[0].finish_reason == "tool_calls"
    assert call.function.name == "calculator"
    assert json.loads(call.function.arguments) == {"expression": "5 + 7"}
    messages.append(first.choices[0].message.model_dump(exclude_none=True))
    messages.append({"role": "tool", "content": "12", "tool_call_id": call.id})
    second = client.chat.completions.create(
        model=MODEL, messages=messages, tools=[CALCULATOR_TOOL], logprobs=True
    )
    assert second.choices[0].message.content == "12"
    # A history edit is refused; the session goes on.
    edited = [{"role": "user", "content": "What is 6 + 7?"}, *messages[1:]]
    with pytest.raises(openai.BadRequestError, match="do not extend"):
        client.chat.completions.create(model=MODEL, messages=edited, tools=[CALCULATOR_TOOL])
    return first, second


def test_sessions_make_a_group_with_the_wire_logprobs(live):
    loop, tok = live["loop"], live["tok"]
    taken = _take_all(live, 2)
    assert (
        taken[0]["group_id"] == taken[1]["group_id"] and taken[0]["prompt"]["text"] == PROMPT.text
    )
    # Two sessions are open: a third is refused.
    assert _take(live).status_code == 429
    replies = {}
    for s in taken:
        replies[s["session_id"]] = _play(live, s["session_id"])
        r = requests.post(
            live["url"] + f"/sessions/{s['session_id']}/end",
            json={},  # the task's reward scores the last reply
            headers={"Authorization": f"Bearer {TOKEN}"},
            timeout=60,
        )
        assert r.status_code == 200 and r.json()["reward"] == 1.0
    _wait(lambda: len(loop.queue) >= 1, "no group from the sessions")
    (group,) = [records.decode_group(m) for m in loop.queue.snapshot()[:1]]
    turn1, delta, turn2 = live["turns"]
    prompt = tok.encode_messages(SESSION_MESSAGES, tools=[CALCULATOR_TOOL])
    completion = turn1 + delta + turn2
    mask = [True] * len(turn1) + [False] * len(delta) + [True] * len(turn2)
    want = _full_forward(live, prompt + completion, len(prompt))[np.asarray(mask)]
    for first, second in replies.values():
        got = [t.logprob for c in (first, second) for t in c.choices[0].logprobs.content]
        np.testing.assert_allclose(got, want, atol=2e-4)
    for t in group.trajectories:
        assert t.prompt_ids.tolist() == prompt
        # Prefix-stable template: the session's ids are the full render of the conversation.
        assert t.completion_ids.tolist() == completion
        np.testing.assert_array_equal(t.loss_mask, mask)
        np.testing.assert_allclose(t.behavior_logprobs[t.loss_mask], want, atol=2e-4)
        assert t.reward == 1.0
    # The template is prefix-stable here (no user message after a reasoning turn): the ids are
    # the full render of the conversation, up to the newline the template puts after the last
    # end-of-turn.
    conversation = [
        *SESSION_MESSAGES,
        {"role": "assistant", "content": CALL},
        {"role": "tool", "content": "12"},
        {"role": "assistant", "content": "12"},
    ]
    render = tok._tok.apply_chat_template(conversation, tokenize=False)
    render_ids = tok._tok(render, add_special_tokens=False)["input_ids"]
    assert render_ids[: len(prompt + completion)] == prompt + completion
    assert tok._tok.decode(render_ids[len(prompt + completion) :]) == "\n"
    # The returned log-probs are the wire's, bit for bit.
    wire = group.trajectories[0].behavior_logprobs[np.asarray(mask)]
    first, second = next(iter(replies.values()))
    got = [t.logprob for c in (first, second) for t in c.choices[0].logprobs.content]
    np.testing.assert_array_equal(np.float32(got), wire)
    loop.ack([group.group_id])


def test_a_session_extends_by_the_delta_where_a_rerender_drops_reasoning(live):
    """Qwen3-style templates drop earlier reasoning when the conversation is rendered again: the
    session's ids are the incremental ones the model saw, not the re-render."""
    loop, tok = live["loop"], live["tok"]
    _wait(lambda: live["sessions"].open_sessions == 0, "sessions of the last test still open")
    taken = _take_all(live, 2)
    assert taken[0]["group_id"] == taken[1]["group_id"]
    for s in taken:
        client = _client(live, f"/sessions/{s['session_id']}/v1")
        messages = list(REASONING_MESSAGES)
        first = client.chat.completions.create(model=MODEL, messages=messages)
        assert first.choices[0].message.content == "<think>5 + 7</think>7"
        messages += [first.choices[0].message.model_dump(), {"role": "user", "content": "Again."}]
        second = client.chat.completions.create(model=MODEL, messages=messages)
        assert second.choices[0].message.content == "12"
        messages.append(second.choices[0].message.model_dump())
        r = requests.post(
            live["url"] + f"/sessions/{s['session_id']}/end",
            json={"reward": 0.25},
            headers={"Authorization": f"Bearer {TOKEN}"},
            timeout=60,
        )
        assert r.json()["reward"] == 0.25
    group_id = taken[0]["group_id"]
    _wait(lambda: any(m.group_id == group_id for m in loop.queue.snapshot()), "no reasoning group")
    (group,) = [records.decode_group(m) for m in loop.queue.snapshot() if m.group_id == group_id]
    r1, r_delta, r2 = live["reasoning"]
    prompt = tok.encode_messages(REASONING_MESSAGES)
    rerender = tok._tok.apply_chat_template(
        [m if m["role"] != "assistant" else {"role": "assistant", "content": m["content"]}
         for m in messages],
        tokenize=False,
    )  # fmt: skip
    rerender_ids = tok._tok(rerender, add_special_tokens=False)["input_ids"]
    for t in group.trajectories:
        ids = t.prompt_ids.tolist() + t.completion_ids.tolist()
        assert ids == prompt + r1 + r_delta + r2
        assert "<think>" not in rerender and ids[: len(rerender_ids)] != rerender_ids
        assert t.reward == 0.25
    loop.ack([group_id])


def test_an_abandoned_session_is_dropped_counted_and_replaced(live):
    sessions, clock = live["sessions"], live["clock"]
    _wait(lambda: sessions.open_sessions == 0, "sessions of the last test still open")
    (s,) = _take(live).json()["sessions"]
    client = _client(live, f"/sessions/{s['session_id']}/v1")
    client.chat.completions.create(model=MODEL, messages=SESSION_MESSAGES, max_tokens=2)
    clock.now += IDLE_S + 1
    _wait(lambda: sessions.abandoned == 1, "the idle session was not dropped")
    # The drop is counted when it starts; the session has ended once its slot is free (before
    # that a request gets 409 "ending", which raced this test's request under load).
    _wait(lambda: sessions.open_sessions == 0, "the dropped session still holds its slot")
    with pytest.raises(openai.ConflictError, match="ended"):  # known, and ended: 409
        client.chat.completions.create(model=MODEL, messages=SESSION_MESSAGES)
    # Its sample is offered again as a new session.
    again = _take_all(live, 2)
    assert s["session_id"] not in {x["session_id"] for x in again}
    for x in again:  # played and ended, so the groups can finish
        c = _client(live, f"/sessions/{x['session_id']}/v1")
        c.chat.completions.create(model=MODEL, messages=SESSION_MESSAGES, max_tokens=2)
        _client(live, "").post(
            f"/sessions/{x['session_id']}/end", body={"reward": 0.0}, cast_to=object
        )


def test_the_example_agent_plays_sessions_into_groups(live):
    """examples/http_agent: its workers, on the official client only, finish the open groups."""
    from examples.http_agent import calculator_agent

    sessions = live["sessions"]

    def agents_group() -> bool:
        # The module's server is shared: the queue may also hold other tests' groups, finished
        # before or while this one runs (so a count of groups produced is not the agent's). One
        # of them is the agent's once its system prompt is in a queued group.
        return any(
            calculator_agent.SYSTEM
            in live["tok"].decode(records.decode_group(g).trajectories[0].prompt_ids)
            for g in live["loop"].queue.snapshot()
        )

    assert not agents_group()
    stop, done = threading.Event(), []
    workers = [
        threading.Thread(
            target=calculator_agent.worker, args=(live["url"], TOKEN, stop, done), daemon=True
        )
        for _ in range(2)
    ]
    for w in workers:
        w.start()
    try:
        _wait(agents_group, "no group from the example agent")
    finally:
        stop.set()
        for w in workers:
            w.join(300)
    assert done and sessions.finished >= len(done)


def _post(live, path, data, headers=None):
    h = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
    return requests.post(
        live["url"] + path, data=data, headers={**h, **(headers or {})}, timeout=60
    )


@pytest.mark.parametrize(
    "data,headers,status,code",
    [
        (b"{not json", None, 400, "invalid_request_error"),
        (b"x" * (65 * 1024), None, 413, "invalid_request_error"),
        (json.dumps({"model": MODEL, "messages": SESSION_MESSAGES, "bogus": 1}), None, 400, None),
        (json.dumps({"model": MODEL, "messages": SESSION_MESSAGES}), {"Authorization": ""}, 401, None),
        (json.dumps({"model": MODEL, "messages": SESSION_MESSAGES, "temperature": 0.5}), None, 400, None),
        (json.dumps({"model": MODEL, "messages": SESSION_MESSAGES, "max_tokens": 10**6}), None, 400, None),
        (json.dumps({"model": MODEL, "messages": [{"role": "x"}]}), None, 400, None),
        (json.dumps({"model": MODEL, "messages": SESSION_MESSAGES * 17}), None, 400, None),
        (json.dumps({"model": MODEL, "messages": SESSION_MESSAGES, "session_id": "nope"}), None, 404, None),
        # Accepted only where honoured: a seed cannot be (one PRNG stream for every slot).
        (json.dumps({"model": MODEL, "messages": SESSION_MESSAGES, "seed": 3}), None, 400, "seed"),
        (json.dumps({"model": MODEL, "messages": SESSION_MESSAGES, "store": True}), None, 400, "store"),
        (json.dumps({"model": MODEL, "messages": SESSION_MESSAGES, "metadata": {"a": "b"}}), None, 400, "metadata"),
        (json.dumps({"model": MODEL, "messages": SESSION_MESSAGES, "parallel_tool_calls": False}), None, 400, "parallel_tool_calls"),
        (json.dumps({"model": MODEL, "messages": SESSION_MESSAGES, "service_tier": "flex"}), None, 400, "service_tier"),
        (json.dumps({"model": MODEL, "messages": SESSION_MESSAGES, "presence_penalty": True}), None, 400, "presence_penalty"),
    ],
)  # fmt: skip
def test_hostile_requests_get_4xx_and_the_server_serves_on(live, data, headers, status, code):
    r = _post(live, "/v1/chat/completions", data, headers)
    assert r.status_code == status
    error = r.json()["error"]
    assert error["message"]
    if code in HONOURED_ONLY:  # a field accepted only where honoured: named, with the reason
        assert error["param"] == code and error["type"] == "invalid_request_error"
        assert error["message"].startswith(f"{code}=") and len(error["message"]) > 30
    elif code:
        assert error["code"] == code or error["type"] == code
    out = _client(live).chat.completions.create(model=MODEL, messages=STATELESS_MESSAGES)
    assert out.choices[0].message.content == "7 + 5 = 12"


def test_the_fields_at_the_values_honoured_are_accepted(live):
    """The official client's fields at the values this server honours (or null) pass; a seed
    only as null."""
    out = _client(live).chat.completions.create(
        model=MODEL,
        messages=STATELESS_MESSAGES,
        seed=None,
        store=False,
        metadata={},
        parallel_tool_calls=True,
        service_tier="auto",
        presence_penalty=0.0,
        user="agent-7",
    )
    assert out.choices[0].message.content == "7 + 5 = 12"
    with pytest.raises(openai.BadRequestError, match="one PRNG key stream") as e:
        _client(live).chat.completions.create(model=MODEL, messages=STATELESS_MESSAGES, seed=0)
    assert e.value.param == "seed"


def test_no_token_is_refused_by_the_client(live):
    with pytest.raises(openai.AuthenticationError):
        _client(live, token="wrong").models.list()


def test_sat_serve_serves_http_beside_grpc(server_factory):
    """`sat-serve ... server.http_port=N`: the endpoint starts and stops with the process."""
    import portpicker

    port = portpicker.pick_unused_port()
    server = server_factory(
        [f"server.http_port={port}", f"server.token={TOKEN}", "server.wait_for_weights=false"]
    )
    client = openai.OpenAI(
        base_url=f"http://127.0.0.1:{port}/v1", api_key=TOKEN, max_retries=0, timeout=120
    )
    (model,) = [m.id for m in client.models.list().data]
    out = client.completions.create(model=model, prompt="1+2=", max_tokens=3, logprobs=1)
    assert out.usage.completion_tokens == len(out.choices[0].logprobs.token_logprobs) >= 1
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0
        ).models.list()
    # A chat request to a tokenizer without a chat template is a 400, and the server serves on.
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "1+2"}])
    assert client.completions.create(model=model, prompt="3+4=", max_tokens=2).choices
    assert server.stop() == 0, server.log()
