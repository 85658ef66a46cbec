"""The HTTP sessions' lifecycle against a scripted fake driver (no engine, no JAX): what a real
network and a policy under RL do to a session (docs/DESIGN.md §6.6). Bad tool-call arguments,
retries, clients that leave mid-turn, double ends, discards, stuck turns, the idle clock, the
long-poll bound, hostile headers, an event loop kept free during a huge request, and TLS.

The server runs in this process on a loopback port (an aiohttp app on a background asyncio loop);
the fake driver answers each turn with the next scripted text from its own thread, held back by
a gate the test opens. Nothing waits on wall-clock time except to fail: counts of events decide.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import socket
import ssl
import threading
import time
import types

import numpy as np
import pytest
import requests

from rollout_server import sessions as sessions_module
from rollout_server.chat import ApiError, parse_chat, token_bytes
from rollout_server.driver import RolloutRequest, TurnEnd
from rollout_server.http_api import HttpApi, HttpLimits
from rollout_server.sessions import Generator, SessionLimits, SessionManager
from sat_jax import json_mask
from sat_jax.decoding import SamplingConfig
from sat_jax.json_mask import parse_response_format
from sat_jax.tasks import Prompt
from sat_jax.tasks.envs import CALCULATOR_TOOL

TOKEN = "tok"
STOP = 1
IDLE_S = 30.0
MAX_DECODE = 400
USER = [{"role": "user", "content": "What is 5 + 7?"}]
PROMPT = Prompt(id="p0", text="What is 5 + 7?", answer="12")


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class CharTokenizer:
    """One id per character (its code point); id 1 ends a turn. `block` holds a render of a
    message longer than 10 000 characters until it is set (a slow tokenization)."""

    stop_ids = frozenset({STOP})

    def __init__(self):
        self.block = threading.Event()
        self.renders = 0

    def _render(self, messages) -> str:
        return "".join(f"<{m['role']}>{m.get('content') or ''}|" for m in messages)

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def encode_messages(self, messages, tools=()) -> list[int]:
        self.renders += 1
        if any(len(m.get("content") or "") > 10_000 for m in messages):
            self.block.wait(20)  # bounded, so a failing test fails instead of hanging
        return self.encode(self._render(messages) + "<assistant>")

    def observation_ids(self, messages, tools=(), close_turn=False) -> list[int]:
        return self.encode(self._render(messages) + "<assistant>")

    def decode(self, ids) -> str:
        return "".join(chr(int(i)) for i in ids if int(i) != STOP)

    def __len__(self) -> int:  # the ids a constrained-decoding trie walks (Latin-1)
        return 256

    def closes_turn(self, token_id: int) -> bool:
        return True


class FakeEngine:
    max_decode_length = MAX_DECODE
    sampling = SamplingConfig()
    core = types.SimpleNamespace(max_prefill_length=4096)

    def check_prompt_length(self, n: int) -> None:
        if not 0 < n <= self.core.max_prefill_length:
            raise ValueError(f"the prompt has {n} tokens")


class FakeDriver:
    """Answers each turn (and each stateless request) with the next text of `replies` (then
    "12"), from a thread, once `gate` is open."""

    def __init__(self, encode=lambda text: [*map(ord, text)], stop=STOP):
        self.encode, self.stop = encode, stop
        self.replies: list[str] = []
        self.gate = threading.Event()
        self.gate.set()
        self.mid = threading.Event()  # held after `pause_at` ids of a turn, until set
        self.mid.set()
        self.pause_at = 3
        self.placed = 0
        self.turns = 0
        self.ended: list[RolloutRequest] = []
        self.inserted: list[list[int]] = []  # continue_episode's tokens
        self.prefills: list[list[int]] = []
        self.formats: list[str | None] = []  # each request's / turn's response_format

    def _emit(self, request: RolloutRequest) -> None:
        def run():
            self.gate.wait(60)
            text = self.replies.pop(0) if self.replies else "12"
            out = []
            for k, token in enumerate([*self.encode(text), self.stop]):  # as the driver does
                out.append(token)
                if token == self.stop:
                    break
                if k == self.pause_at:
                    self.mid.wait(60)
                if request.stop_when is not None and request.stop_when(np.array(out)):
                    break  # a stop string ended it
            ids = np.array(out, np.int32)
            if not request.episode:
                sample = types.SimpleNamespace(
                    completion_ids=ids,
                    logprobs=np.full(len(ids), -0.5, np.float32),
                    versions=np.zeros(len(ids), np.int64),
                    finish_reason="stop",
                )
                request.on_done(request, sample)
                return
            buf = request.buffer
            request.turn_start = buf.size
            buf.logprobs[buf.size : buf.size + len(ids)] = -0.25
            buf.size += len(ids)
            self.turns += 1
            room = request.max_tokens - buf.size
            request.on_turn(request, TurnEnd(ids=ids, finish_reason="stop", room=room))

        threading.Thread(target=run, daemon=True).start()

    def place_request_on_prefill_queue(self, request: RolloutRequest) -> None:
        self.placed += 1
        self.prefills.append(list(request.prefill_content))
        self.formats.append(request.response_format)
        n = request.max_tokens
        request.buffer = types.SimpleNamespace(
            logprobs=np.zeros(n, np.float32), versions=np.zeros(n, np.int64), size=0
        )
        self._emit(request)

    def continue_episode(self, request: RolloutRequest, tokens) -> None:
        self.inserted.append([int(t) for t in tokens])
        self.formats.append(request.response_format)
        request.buffer.size += len(tokens)
        self._emit(request)

    def end_episode(self, request: RolloutRequest) -> None:
        self.ended.append(request)
        request.on_done(request, "the sample")


class Live:
    def __init__(
        self, *, max_sessions=4, tokenizer=None, ssl_context=None, ca=None, driver=None, **limits
    ):
        self.clock = FakeClock()
        self.verify = ca or True
        self.driver = driver or FakeDriver()
        self.tok = tokenizer or CharTokenizer()
        engine = FakeEngine()
        engine.formats = types.SimpleNamespace(tokenizer=self.tok, vocab_size=256)
        self.gen = Generator(self.driver, engine, self.tok)
        self.sessions = SessionManager(
            self.gen,
            lambda text, answer: float(text.strip() == answer),
            SessionLimits(max_sessions=max_sessions, idle_s=IDLE_S),
            clock=self.clock,
        )
        self.done: list[tuple] = []
        self.api = HttpApi(
            generator=self.gen,
            sessions=self.sessions,
            limits=HttpLimits(
                max_body_bytes=4 * 1024 * 1024,
                max_messages=16,
                max_requests=8,
                reap_every_s=3600,
                **limits,
            ),
            token=TOKEN,
            model_name="m",
            default_tokens=50,
        )
        self.aio = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.aio.run_forever, daemon=True)
        self.thread.start()
        self.port = self.call(self.api.start("127.0.0.1", 0, ssl_context))
        self.url = f"{'https' if ssl_context else 'http'}://127.0.0.1:{self.port}"

    def call(self, coro, timeout=60):
        return asyncio.run_coroutine_threadsafe(coro, self.aio).result(timeout)

    def on_loop(self, fn, *args):
        async def run():
            return fn(*args)

        return self.call(run())

    def offer(self, n=1):
        for i in range(n):
            self.sessions.offer(PROMPT, (7, i), lambda tag, sample: self.done.append((tag, sample)))

    def take(self, n=1):
        self.offer(n)
        r = self.post("/sessions", {"max_sessions": n, "timeout_s": 10})
        assert r.status_code == 200, r.text
        return [s["session_id"] for s in r.json()["sessions"]]

    def post(self, path, body, **kw):
        return requests.post(
            self.url + path,
            json=body,
            headers={"Authorization": f"Bearer {TOKEN}"},
            timeout=60,
            verify=self.verify,
            **kw,
        )

    def chat(self, sid, messages, **extra):
        body = {"model": "m", "messages": messages, "tools": [CALCULATOR_TOOL], **extra}
        return self.post(f"/sessions/{sid}/v1/chat/completions", body)

    def stop(self):
        self.driver.gate.set()
        self.tok.block.set() if hasattr(self.tok, "block") else None
        self.call(self.api.stop())
        self.aio.call_soon_threadsafe(self.aio.stop)
        self.thread.join(10)


@pytest.fixture
def live():
    server = Live()
    yield server
    server.stop()


def wait(cond, what, timeout_s=30.0):
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def raw_request(port, path, body: bytes, headers=b"") -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=60)
    sock.sendall(
        b"POST " + path.encode() + b" HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + b"Authorization: Bearer " + TOKEN.encode() + b"\r\n" + headers
        + b"Content-Length: " + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n" + body
    )  # fmt: skip
    return sock


def raw_response(sock: socket.socket) -> tuple[int, dict]:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    sock.close()
    head, _, payload = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(payload)


BAD_ARGUMENTS = ["null", "3", "[1, 2]", '"1+1"', '"[1]"', '"not json"']


@pytest.mark.parametrize("arguments", BAD_ARGUMENTS)
def test_a_tool_call_whose_arguments_are_no_object_stays_content_and_the_session_goes_on(
    live, arguments
):
    text = f'<tool_call>{{"name": "calculator", "arguments": {arguments}}}</tool_call>'
    live.driver.replies = [text, "12"]
    (sid,) = live.take()
    r = live.chat(sid, USER)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["message"]["content"] == text and not choice["message"].get("tool_calls")
    assert choice["finish_reason"] == "stop"
    messages = [*USER, choice["message"], {"role": "user", "content": "Use the tool properly."}]
    r = live.chat(sid, messages)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == "12"
    r = live.post(f"/sessions/{sid}/end", {})
    assert r.status_code == 200 and r.json()["reward"] == 1.0
    wait(lambda: live.done, "the session's sample never reached the loop")
    assert live.done == [((7, 0), "the sample")]


def test_a_recording_that_fails_still_answers_and_frees_the_session(live, monkeypatch):
    """Whatever fails while building a reply, the turn is recorded as content: no wedge."""
    (sid,) = live.take()

    def broken(*a, **k):
        raise RuntimeError("a tokenizer's own failure")

    monkeypatch.setattr(live.gen, "reply", broken)
    r = live.chat(sid, USER)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "12"
    assert live.post(f"/sessions/{sid}/end", {"reward": 0.5}).status_code == 200
    wait(lambda: live.done, "no sample")


def test_well_formed_tool_calls_get_unique_ids(live):
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "5+7"}}</tool_call>'
    live.driver.replies = [call, call, call + call]
    ids = []
    for _ in range(3):
        body = {"model": "m", "messages": USER, "tools": [CALCULATOR_TOOL]}
        r = live.post("/v1/chat/completions", body)
        calls = r.json()["choices"][0]["message"]["tool_calls"]
        assert json.loads(calls[0]["function"]["arguments"]) == {"expression": "5+7"}
        ids += [c["id"] for c in calls]
    assert len(ids) == 4 and len(set(ids)) == 4


def test_a_retry_of_the_last_request_gets_its_reply_while_and_after_the_turn(live):
    (sid,) = live.take()
    body = json.dumps({"model": "m", "messages": USER}).encode()
    path = f"/sessions/{sid}/v1/chat/completions"
    live.driver.gate.clear()
    first = raw_request(live.port, path, body)
    wait(lambda: live.driver.placed == 1, "the first request was not accepted")
    second = raw_request(live.port, path, body)  # the client's retry, during the turn
    wait(lambda: live.sessions.retries == 1, "the retry was not joined to the turn")
    live.driver.gate.set()
    (s1, b1), (s2, b2) = raw_response(first), raw_response(second)
    assert s1 == s2 == 200 and b1["choices"] == b2["choices"]
    third = raw_response(raw_request(live.port, path, body))  # and after it
    assert third[0] == 200 and third[1]["choices"] == b1["choices"]
    assert live.driver.turns == 1 and live.sessions.retries == 2
    # A different request is the next turn.
    messages = [*USER, b1["choices"][0]["message"], {"role": "user", "content": "Again."}]
    assert live.chat(sid, messages, tools=None).status_code == 200
    assert live.driver.turns == 2


def test_a_client_that_leaves_mid_turn_is_noticed_and_its_reply_kept(live):
    (sid,) = live.take()
    body = json.dumps({"model": "m", "messages": USER}).encode()
    path = f"/sessions/{sid}/v1/chat/completions"
    live.driver.gate.clear()
    sock = raw_request(live.port, path, body)
    wait(lambda: live.driver.placed == 1, "the request was not accepted")
    sock.close()
    wait(lambda: live.sessions.disconnects == 1, "the departure was not noticed")
    live.driver.gate.set()
    wait(lambda: live.sessions.get(sid).state == "waiting", "the turn did not end")
    status, out = raw_response(raw_request(live.port, path, body))
    assert status == 200 and out["choices"][0]["message"]["content"] == "12"
    assert live.driver.turns == 1 and live.sessions.abandoned == 0


def test_only_accepted_requests_refresh_the_idle_clock(live):
    (sid,) = live.take()
    assert live.chat(sid, USER).status_code == 200
    for _ in range(3):  # refused requests (a history edit) just before the idle time
        live.clock.now += IDLE_S - 1
        edited = [{"role": "user", "content": "Something else"}, {"role": "user", "content": "x"}]
        assert live.chat(sid, edited).status_code == 400
        if live.on_loop(live.sessions.reap):
            break
    assert live.sessions.abandoned == 1
    wait(lambda: live.done, "the dropped session's sample was not re-offered")
    assert live.done == [((7, 0), None)]


def test_end_is_idempotent_refuses_another_reward_and_chat_after_it_is_409(live):
    (sid,) = live.take()
    r = live.chat(sid, USER)
    # The budget left: the episode's completion tokens minus the turn's "12" and its stop.
    assert r.json()["session"]["remaining_tokens"] == MAX_DECODE - 3
    for _ in range(2):
        r = live.post(f"/sessions/{sid}/end", {"reward": 1.0})
        assert r.status_code == 200 and r.json()["reward"] == 1.0
    r = live.post(f"/sessions/{sid}/end", {"reward": 0.0})
    assert r.status_code == 409 and r.json()["error"]["code"] == "session_ended"
    assert live.post(f"/sessions/{sid}/end", {"discard": True}).status_code == 409
    r = live.chat(sid, USER)
    assert r.status_code == 409 and r.json()["error"]["code"] == "session_ended"
    wait(lambda: live.done, "no sample")
    assert live.sessions.finished == 1 and len(live.driver.ended) == 1
    assert live.done == [((7, 0), "the sample")]
    assert live.post("/sessions/nope/end", {}).status_code == 404


def test_discard_reoffers_the_sample_and_nothing_trains(live):
    (sid,) = live.take()
    assert live.chat(sid, USER).status_code == 200
    for _ in range(2):
        r = live.post(f"/sessions/{sid}/end", {"discard": True})
        assert r.status_code == 200 and r.json()["discarded"] is True
    assert live.post(f"/sessions/{sid}/end", {"reward": 1.0}).status_code == 409
    wait(lambda: live.done, "no report")
    assert live.done == [((7, 0), None)]  # None: the loop samples it again
    assert live.sessions.discarded == 1 and live.sessions.finished == 0


def test_the_reaper_ends_a_session_stuck_generating(live):
    (sid,) = live.take()
    live.driver.gate.clear()
    holder = {}
    t = threading.Thread(target=lambda: holder.update(r=live.chat(sid, USER)))
    t.start()
    wait(lambda: live.driver.placed == 1, "not accepted")
    live.clock.now += 3 * IDLE_S + 1
    live.on_loop(live.sessions.reap)
    t.join(30)
    assert holder["r"].status_code == 504
    assert live.sessions.stuck == 1 and live.done == [((7, 0), None)]
    live.driver.gate.set()  # its turn ends late: the slot is freed, nothing reported twice
    wait(lambda: live.driver.ended, "the late turn did not free its slot")
    assert live.done == [((7, 0), None)] and live.sessions.open_sessions == 0


def test_concurrent_long_polls_never_open_more_than_max_sessions(live):
    out = []

    def poll():
        r = live.post("/sessions", {"max_sessions": 4, "timeout_s": 10})
        out.append(len(r.json().get("sessions", [])))

    threads = [threading.Thread(target=poll) for _ in range(3)]
    for th in threads:
        th.start()
    # The polls wait (nothing is offered yet), then many more sessions than the bound arrive.
    wait(lambda: live.sessions.polling == 3, "the polls did not wait")
    live.offer(12)
    for th in threads:
        th.join(30)
    assert sum(out) <= 4 and live.sessions.open_sessions <= 4


def test_a_non_utf8_authorization_header_is_a_json_401(live):
    body = json.dumps({"model": "m", "messages": USER}).encode()
    sock = socket.create_connection(("127.0.0.1", live.port), timeout=30)
    sock.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer \xff\xfe\xc3\r\n"
        b"Content-Type: application/json\r\nContent-Length: " + str(len(body)).encode()
        + b"\r\nConnection: close\r\n\r\n" + body
    )  # fmt: skip
    status, out = raw_response(sock)
    assert status in (400, 401) and out["error"]["message"]
    # The open health probe needs no token; the rest does.
    assert requests.get(live.url + "/health", timeout=10).status_code == 200
    assert requests.get(live.url + "/v1/models", timeout=10).status_code == 401


def test_an_unexpected_failure_is_an_openai_500_and_one_log_line(live, monkeypatch, caplog):
    def broken(*a, **k):
        raise KeyError("boom")

    monkeypatch.setattr(HttpApi, "_limits", broken)
    r = live.post("/v1/chat/completions", {"model": "m", "messages": USER})
    assert r.status_code == 500 and r.headers["Content-Type"].startswith("application/json")
    assert r.json()["error"]["type"] == "server_error"
    lines = [rec for rec in caplog.records if "failed" in rec.getMessage()]
    assert len(lines) == 1 and lines[0].exc_info is None


def test_the_loop_serves_others_while_a_huge_request_renders(live):
    """A ~1 MB request renders off the event loop: requests sent meanwhile are all answered
    (a count, not a time). On the loop they would wait for the render."""
    (sid,) = live.take()
    huge = [{"role": "user", "content": "x" * 1_000_000}]
    holder = {}
    t = threading.Thread(target=lambda: holder.update(r=live.chat(sid, huge)))
    t.start()
    wait(lambda: live.tok.renders == 1, "the huge request did not reach the tokenizer")
    served = 0
    for _ in range(10):
        r = requests.get(
            live.url + "/v1/models", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10
        )
        served += r.status_code == 200
    live.tok.block.set()
    t.join(30)
    assert served == 10
    assert holder["r"].status_code == 400  # longer than max_prefill_length


def test_a_prompt_too_long_for_any_tokenization_is_refused_before_tokenizing():
    class Vocab(CharTokenizer):
        _tok = types.SimpleNamespace(get_vocab=lambda: {"a": 0, "bb": 1, "ccc": 2})

    server = Live(tokenizer=Vocab())
    try:
        body = {"model": "m", "messages": [{"role": "user", "content": "x" * 20_000}]}
        r = server.post("/v1/chat/completions", body)
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        assert server.tok.renders == 0
    finally:
        server.stop()


def test_max_completion_tokens_null_falls_back_and_the_url_session_wins():
    body = {"model": "m", "messages": USER, "max_completion_tokens": None, "max_tokens": 7}
    req = parse_chat(
        dict(body, session_id="body"),
        SamplingConfig(),
        max_tokens=100,
        default_tokens=50,
        max_messages=8,
        session_id="url",
    )
    assert req.generation.max_tokens == 7 and req.session_id == "url"
    with pytest.raises(ApiError):
        parse_chat(
            dict(body, max_tokens=1000),
            SamplingConfig(),
            max_tokens=100,
            default_tokens=50,
            max_messages=8,
        )


def test_logprob_bytes_are_the_tokens_own(tmp_path):
    from sat_jax.tasks.hf_tokenizer import HFTokenizer
    from tests.hf_fixtures import make_tokenizer

    make_tokenizer(tmp_path / "tok")
    tok = HFTokenizer(str(tmp_path / "tok"))
    text = "é 😀 ok"
    ids = tok.encode(text)
    assert any("\ufffd" in tok.decode([i]) for i in ids)  # some token is part of a character
    assert b"".join(bytes(token_bytes(tok, i, tok.decode([i]))) for i in ids) == text.encode()


def _self_signed(tmp_path):
    """A CA, and a server certificate for 127.0.0.1 that it signed: (ca, cert, key) paths."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)

    def name(cn):
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca = (
        x509.CertificateBuilder()
        .subject_name(name("test CA"))
        .issuer_name(name("test CA"))
        .public_key(ca_key.public_key())
        .serial_number(1)
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    cert = (
        x509.CertificateBuilder()
        .subject_name(name("127.0.0.1"))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(2)
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    paths = tmp_path / "ca.pem", tmp_path / "cert.pem", tmp_path / "key.pem"
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return tuple(map(str, paths))


def test_tls_on_the_http_port_with_the_official_client(tmp_path):
    openai = pytest.importorskip("openai")

    from rollout_server.http_api import server_ssl_context

    ca, cert, key = _self_signed(tmp_path)
    server = Live(ssl_context=server_ssl_context(cert, key), ca=ca)
    try:
        (sid,) = server.take()
        client = openai.OpenAI(
            base_url=f"{server.url}/sessions/{sid}/v1",
            api_key=TOKEN,
            max_retries=0,
            http_client=openai.DefaultHttpxClient(verify=ssl.create_default_context(cafile=ca)),
        )
        out = client.chat.completions.create(model="m", messages=USER)
        assert out.choices[0].message.content == "12"
        with pytest.raises(openai.APIConnectionError):  # a client that does not trust the CA
            openai.OpenAI(base_url=server.url + "/v1", api_key=TOKEN, max_retries=0).models.list()
        with pytest.raises(requests.exceptions.ConnectionError):  # plain HTTP gets nothing
            requests.get(f"http://127.0.0.1:{server.port}/health", timeout=10)
    finally:
        server.stop()


def test_a_non_loopback_http_port_without_tls_is_refused_at_start():
    from sat_jax.experiment import ConfigError, load_config

    base = ["server.host=0.0.0.0", "server.token=s3cret", "server.http_port=9100"]
    with pytest.raises(ConfigError, match="needs tls_cert and tls_key") as e:
        load_config(None, base)
    assert "\n" not in str(e.value)
    cfg = load_config(None, [*base, "server.tls_cert=c.pem", "server.tls_key=k.pem"])
    assert cfg.server.tls_cert == "c.pem"


def test_the_example_agent_ends_discards_or_leaves_sessions_and_never_dies(live):
    openai = pytest.importorskip("openai")
    from examples.http_agent import calculator_agent

    server = openai.OpenAI(base_url=live.url, api_key=TOKEN, max_retries=0)
    call = '<tool_call>{"name": "calculator", "arguments": null}</tool_call>'
    live.driver.replies = [call, "#### 12"]
    played, ended_under_it, failing = live.take(3)
    calculator_agent.play_session(server, live.url, {"session_id": played, "prompt": {"text": "q"}})
    # A session the server ended meanwhile (409 session_ended): left as it is.
    assert live.post(f"/sessions/{ended_under_it}/end", {"discard": True}).status_code == 200
    calculator_agent.play_session(
        server, live.url, {"session_id": ended_under_it, "prompt": {"text": "q"}}
    )
    # A server failure that is not the policy's (500): discarded.
    broken = live.sessions.chat

    async def fails(req):
        if req.session_id == failing:
            raise RuntimeError("the server's own defect")
        return await broken(req)

    live.sessions.chat = fails
    calculator_agent.play_session(
        server, live.url, {"session_id": failing, "prompt": {"text": "q"}}
    )
    wait(lambda: len(live.done) == 3, "not every session was ended")
    assert live.sessions.finished == 1 and live.sessions.discarded == 2
    assert sorted(live.done, key=lambda d: d[0]) == [
        ((7, 0), "the sample"),
        ((7, 1), None),
        ((7, 2), None),
    ]


def sse(response):
    """The stream's events: ("data", parsed JSON or "[DONE]") and ("comment", text)."""
    for line in response.iter_lines():
        if line.startswith(b"data: "):
            body = line[6:].decode()
            yield "data", body if body == "[DONE]" else json.loads(body)
        elif line.startswith(b":"):
            yield "comment", line.decode()


def test_a_stream_sends_content_before_the_turn_ends(live, monkeypatch):
    import rollout_server.http_api as http_api

    monkeypatch.setattr(http_api, "KEEPALIVE_S", 0.05)
    (sid,) = live.take()
    live.driver.replies = ["7 + 5 = 12"]
    live.driver.mid.clear()  # the turn pauses after its fourth id
    r = requests.post(
        f"{live.url}/sessions/{sid}/v1/chat/completions",
        json={
            "model": "m",
            "messages": USER,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
        headers={"Authorization": f"Bearer {TOKEN}"},
        stream=True,
        timeout=60,
    )
    assert r.status_code == 200 and r.headers["Content-Type"].startswith("text/event-stream")
    events = sse(r)
    content, comments = "", 0
    for kind, event in events:
        comments += kind == "comment"
        if kind == "data" and event["choices"] and event["choices"][0]["delta"].get("content"):
            content += event["choices"][0]["delta"]["content"]
        if content and comments:
            break
    # Content arrived, and keep-alives while the turn was paused, before its last token.
    assert content and "7 + 5 = 12".startswith(content) and live.driver.turns == 0
    live.driver.mid.set()
    finish, usage, session = None, None, None
    for kind, event in events:
        if kind != "data" or event == "[DONE]":
            continue
        for c in event["choices"]:
            content += c["delta"].get("content") or ""
            finish = c["finish_reason"] or finish
        usage, session = event.get("usage") or usage, event.get("session") or session
    assert content == "7 + 5 = 12" and finish == "stop"
    assert usage["completion_tokens"] == 11 and session["remaining_tokens"] == MAX_DECODE - 11


def test_a_stream_holds_back_stop_strings_and_tool_calls(live):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=live.url + "/v1", api_key=TOKEN, max_retries=0)
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "5+7"}}</tool_call>'
    live.driver.replies = ["7 + 5 = 12", "Let me add.<tool_call>", "Let me add." + call]
    chunks = list(
        client.chat.completions.create(model="m", messages=USER, stop=["= 1"], stream=True)
    )
    pieces = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert "".join(pieces) == "7 + 5 " and not any("=" in p for p in pieces)
    for want_calls in (False, True):  # an unfinished call block is content; a call is a call
        chunks = list(
            client.chat.completions.create(
                model="m", messages=USER, tools=[CALCULATOR_TOOL], stream=True
            )
        )
        pieces = [c.choices[0].delta.content or "" for c in chunks if c.choices]
        calls = [t for c in chunks if c.choices for t in c.choices[0].delta.tool_calls or ()]
        if want_calls:
            assert "".join(pieces) == "Let me add." and not any("<" in p for p in pieces)
            assert json.loads(calls[0].function.arguments) == {"expression": "5+7"}
            assert chunks[-1].choices[0].finish_reason == "tool_calls"
        else:
            assert "".join(pieces) == "Let me add.<tool_call>" and not calls


def test_a_client_that_leaves_its_stream_stops_nothing_but_its_stream(live):
    (sid,) = live.take()
    live.driver.replies = ["7 + 5 = 12"]
    live.driver.mid.clear()
    body = {"model": "m", "messages": USER, "stream": True}
    sock = raw_request(live.port, f"/sessions/{sid}/v1/chat/completions", json.dumps(body).encode())
    seen = b""
    while b'"content": "7' not in seen:  # the first content delta, then the client leaves
        seen += sock.recv(4096)
    sock.close()
    wait(lambda: live.sessions.disconnects == 1, "the departure was not noticed")
    live.driver.mid.set()
    wait(lambda: live.sessions.get(sid).state == "waiting", "the turn did not end")
    again = requests.post(
        f"{live.url}/sessions/{sid}/v1/chat/completions",
        json=body,
        headers={"Authorization": f"Bearer {TOKEN}"},
        timeout=60,
    )
    text = "".join(
        c["delta"].get("content") or ""
        for kind, e in sse(again)
        if kind == "data" and e != "[DONE]"
        for c in e["choices"]
    )
    assert text == "7 + 5 = 12" and live.driver.turns == 1 and live.sessions.retries == 1


def test_return_token_ids_tokenize_and_health(live):
    (sid,) = live.take()
    live.driver.replies = ["7", "12"]
    r = live.chat(sid, USER, return_token_ids=True, tools=None).json()
    prompt = live.tok.encode_messages(USER)
    assert r["prompt_token_ids"] == prompt
    assert r["choices"][0]["token_ids"] == [ord("7"), STOP]
    messages = [*USER, r["choices"][0]["message"], {"role": "user", "content": "Again."}]
    r2 = live.chat(sid, messages, return_token_ids=True, tools=None).json()
    delta = live.tok.observation_ids([{"role": "user", "content": "Again."}])
    assert r2["prompt_token_ids"] == [*prompt, ord("7"), STOP, *delta]  # the whole context
    assert r2["choices"][0]["token_ids"] == [ord("1"), ord("2"), STOP]
    out = live.post("/tokenize", {"model": "m", "prompt": "ab"}).json()
    assert out["tokens"] == [97, 98] and out["count"] == 2 and out["max_model_len"] == 4096
    out = live.post("/tokenize", {"model": "m", "messages": USER}).json()
    assert out["tokens"] == prompt
    assert live.post("/tokenize", {"prompt": "a", "messages": USER}).status_code == 400
    r = live.post("/v1/chat/completions", {"model": "gpt-4o", "messages": USER})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    body = {"model": "m", "prompt": "ab", "return_token_ids": True}
    out = live.post("/v1/completions", body).json()
    assert out["prompt_token_ids"] == [97, 98] and out["choices"][0]["token_ids"][-1] == STOP


def test_http_sampling_override_serves_the_servers_sampler_and_says_so():
    openai = pytest.importorskip("openai")
    server = Live()
    try:
        body = {"model": "m", "messages": USER, "temperature": 0.2, "seed": 3, "top_p": 0.9}
        r = server.post("/v1/chat/completions", body)
        assert r.status_code == 400 and r.json()["error"]["param"] in ("temperature", "seed")
        server.api.limits = dataclasses.replace(server.api.limits, sampling_override=True)
        client = openai.OpenAI(base_url=server.url + "/v1", api_key=TOKEN, max_retries=0)
        out = client.chat.completions.create(
            model="m", messages=USER, temperature=0.2, seed=3, top_p=0.9, frequency_penalty=0.5
        )
        assert out.choices[0].message.content == "12"
        sampling = out.model_extra["sampling"]
        assert sampling["temperature"] == SamplingConfig().temperature
        assert sampling["overridden"] == ["temperature", "top_p", "seed", "frequency_penalty"]
    finally:
        server.stop()


def test_a_strict_function_tool_is_refused_or_reported_as_overridden():
    """`strict: true` (the Agents SDK's default) asks for schema-constrained arguments, which the
    server does not enforce: strict mode refuses it naming `tools`, override serves it and says
    so."""
    openai = pytest.importorskip("openai")
    tool = {
        "type": "function",
        "function": {"name": "add", "strict": True, "parameters": {"type": "object"}},
    }
    server = Live()
    try:
        r = server.post("/v1/chat/completions", {"model": "m", "messages": USER, "tools": [tool]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tools"
        assert "strict" in r.json()["error"]["message"]
        loose = {**tool, "function": {**tool["function"], "strict": False}}
        r = server.post("/v1/chat/completions", {"model": "m", "messages": USER, "tools": [loose]})
        assert r.status_code == 200, r.text
        server.api.limits = dataclasses.replace(server.api.limits, sampling_override=True)
        client = openai.OpenAI(base_url=server.url + "/v1", api_key=TOKEN, max_retries=0)
        out = client.chat.completions.create(model="m", messages=USER, tools=[tool])
        assert out.model_extra["sampling"]["overridden"] == ["tools[].function.strict"]
    finally:
        server.stop()


# Qwen3's chat format, cut down: reasoning in <think>, `enable_thinking`, and Qwen3-Coder's XML
# tool calls (rendered back from the arguments mapping).
QWEN3_TEMPLATE = (
    "{%- if tools %}{{ '<|im_start|>system\\n# Tools:' }}{% for t in tools %}"
    "{{ ' ' + t.function.name }}{% endfor %}{{ '<|im_end|>\\n' }}{% endif -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' -%}"
    "{{ '<|im_start|>assistant\\n' }}"
    "{%- if m.reasoning_content %}{{ '<think>\\n' + m.reasoning_content + '\\n</think>\\n\\n' }}"
    "{%- endif %}{{ m.content or '' }}"
    "{%- for c in m.tool_calls or [] %}{{ '<tool_call>\\n<function=' + c.function.name + '>\\n' }}"
    "{%- for k, v in c.function.arguments.items() %}"
    "{{ '<parameter=' + k + '>\\n' + (v | string) + '\\n</parameter>\\n' }}{% endfor %}"
    "{{ '</function>\\n</tool_call>' }}{% endfor %}{{ '<|im_end|>\\n' }}"
    "{%- elif m.role == 'tool' -%}"
    "{{ '<|im_start|>user\\n<tool_response>\\n' + m.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else -%}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}{% endif -%}"
)
ADD_TOOL = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "note": {"type": "string"}},
        },
    },
}


@pytest.fixture(scope="module")
def qwen3_tokenizer(tmp_path_factory):
    from sat_jax.tasks.hf_tokenizer import HFTokenizer
    from tests.hf_fixtures import make_tokenizer

    path = tmp_path_factory.mktemp("qwen3") / "tok"
    fast = make_tokenizer(path, chat_template=False)
    fast.chat_template = QWEN3_TEMPLATE
    fast.save_pretrained(str(path))
    return HFTokenizer(str(path), chat_template=True)


def test_qwen3_reasoning_and_coder_tool_calls_round_trip_in_a_session(qwen3_tokenizer):
    openai = pytest.importorskip("openai")
    tok = qwen3_tokenizer
    end = int(tok._tok.convert_tokens_to_ids("<|im_end|>"))
    driver = FakeDriver(
        encode=lambda text: tok._tok(text, add_special_tokens=False)["input_ids"], stop=end
    )
    call = (
        "<tool_call>\n<function=add>\n<parameter=a>\n5\n</parameter>\n"
        "<parameter=note>\n7\n</parameter>\n</function>\n</tool_call>"
    )
    driver.replies = ["<think>\nadd them\n</think>\n\n" + call, "<think>\ndone\n</think>\n\n12"]
    server = Live(tokenizer=tok, driver=driver, reasoning_parser="qwen3")
    try:
        (sid,) = server.take()
        client = openai.OpenAI(
            base_url=f"{server.url}/sessions/{sid}/v1", api_key=TOKEN, max_retries=0
        )
        first = client.chat.completions.create(
            model="m",
            messages=USER,
            tools=[ADD_TOOL],
            extra_body={"return_token_ids": True},
        )
        message = first.choices[0].message
        assert message.model_extra["reasoning_content"] == "add them" and not message.content
        (tc,) = message.tool_calls
        assert tc.function.name == "add"
        assert json.loads(tc.function.arguments) == {"a": 5, "note": "7"}  # by the schema's types
        assert first.choices[0].finish_reason == "tool_calls"
        opening = tok.encode_messages(USER, tools=[ADD_TOOL])
        assert first.model_extra["prompt_token_ids"] == opening
        # Sent back with its reasoning (as model_dump keeps it) or without: both extend.
        tool = {"role": "tool", "tool_call_id": tc.id, "content": "12"}
        with_reasoning = [*USER, message.model_dump(exclude_none=True), tool]
        without = [
            *USER,
            {k: v for k, v in with_reasoning[1].items() if k != "reasoning_content"},
            tool,
        ]
        second = client.chat.completions.create(
            model="m", messages=without, tools=[ADD_TOOL], extra_body={"return_token_ids": True}
        )
        assert second.choices[0].message.content == "12"
        assert second.choices[0].message.model_extra["reasoning_content"] == "done"
        turn1 = first.choices[0].model_extra["token_ids"]
        delta = tok.observation_ids([tool], tools=[ADD_TOOL])
        assert second.model_extra["prompt_token_ids"] == [*opening, *turn1, *delta]
        assert "<|im_start|>user\n<tool_response>" in tok._tok.decode(delta)
        # The reasoning-kept form is also the session's conversation (a retry of it is equal).
        more = [*with_reasoning, second.choices[0].message.model_dump(exclude_none=True)]
        more.append({"role": "user", "content": "Thanks."})
        assert client.chat.completions.create(model="m", messages=more, tools=[ADD_TOOL]).choices
    finally:
        server.stop()


def test_enable_thinking_is_fixed_per_session(qwen3_tokenizer):
    tok = qwen3_tokenizer
    end = int(tok._tok.convert_tokens_to_ids("<|im_end|>"))
    driver = FakeDriver(
        encode=lambda text: tok._tok(text, add_special_tokens=False)["input_ids"], stop=end
    )
    server = Live(tokenizer=tok, driver=driver, reasoning_parser="qwen3")
    try:
        (sid,) = server.take()
        off = {"enable_thinking": False}
        r = server.post(
            f"/sessions/{sid}/v1/chat/completions",
            {"model": "m", "messages": USER, "chat_template_kwargs": off, "return_token_ids": True},
        ).json()
        assert tok._tok.decode(r["prompt_token_ids"]).endswith("<think>\n\n</think>\n\n")
        assert r["choices"][0]["message"]["content"] == "12"
        messages = [*USER, r["choices"][0]["message"], {"role": "user", "content": "Again."}]
        body = {
            "model": "m",
            "messages": messages,
            "chat_template_kwargs": {"enable_thinking": True},
        }
        bad = server.post(f"/sessions/{sid}/v1/chat/completions", body)
        assert bad.status_code == 400 and bad.json()["error"]["code"] == "history_mismatch"
        body = {"model": "m", "messages": messages, "return_token_ids": True}  # omitted: kept
        r2 = server.post(f"/sessions/{sid}/v1/chat/completions", body).json()
        assert tok._tok.decode(r2["prompt_token_ids"]).endswith("<think>\n\n</think>\n\n")
        out = server.post("/tokenize", {"messages": USER, "chat_template_kwargs": off}).json()
        assert out["tokens"] == r["prompt_token_ids"]
    finally:
        server.stop()


def test_a_reasoning_stream_sends_reasoning_then_content(qwen3_tokenizer):
    from rollout_server.chat import StreamText

    tok = qwen3_tokenizer
    text = "<think>\nfirst 5, then 7\n</think>\n\nLet me add.<tool_call>\n<function=add>"
    ids = tok._tok(text, add_special_tokens=False)["input_ids"]
    stream = StreamText(tok, (), tools=True, reasoning=True)
    deltas = [stream.feed([i]) for i in ids]
    reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
    content = "".join(d.get("content", "") for d in deltas)
    assert reasoning.strip() == "first 5, then 7" and content == "Let me add."
    first_content = next(k for k, d in enumerate(deltas) if "content" in d)
    assert all("content" not in d for d in deltas[:first_content])
    assert max(k for k, d in enumerate(deltas) if "reasoning_content" in d) < first_content
    assert not any(
        "<" in d.get("content", "") or "</" in d.get("reasoning_content", "") for d in deltas
    )


def test_tool_choice_named_and_required_force_the_call_as_inserted_tokens(live):
    (sid,) = live.take()
    live.driver.replies = [
        '{"expression": "5+7"}}\n</tool_call>',
        '{"name": "calculator", "arguments": {}}</tool_call>',
    ]
    named = {"type": "function", "function": {"name": "calculator"}}
    r = live.chat(sid, USER, tool_choice=named).json()
    (call,) = r["choices"][0]["message"]["tool_calls"]
    assert (
        call["function"]["name"] == "calculator"
        and r["choices"][0]["finish_reason"] == "tool_calls"
    )
    assert json.loads(call["function"]["arguments"]) == {"expression": "5+7"}
    prefix = '<tool_call>\n{"name": "calculator", "arguments": '
    opening = live.tok.encode_messages(USER)
    assert live.driver.prefills == [[*opening, *map(ord, prefix)]]  # the prefix: prompt tokens
    messages = [
        *USER,
        r["choices"][0]["message"],
        {"role": "tool", "tool_call_id": call["id"], "content": "12"},
    ]
    # "required" on a later turn: the call's opening goes in with the delta (loss mask 0).
    r2 = live.chat(sid, messages, tool_choice="required").json()
    assert live.driver.inserted[-1][-len("<tool_call>\n") :] == [*map(ord, "<tool_call>\n")]
    assert r2["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "calculator"
    bad = live.chat(sid, USER, tool_choice={"type": "function", "function": {"name": "nope"}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tool_choice"
    body = {"model": "m", "messages": USER, "tool_choice": "required"}
    assert live.post("/v1/chat/completions", body).status_code == 400  # no tools


def test_tool_choice_named_in_qwen3_coder_xml(qwen3_tokenizer):
    tok = qwen3_tokenizer
    end = int(tok._tok.convert_tokens_to_ids("<|im_end|>"))
    driver = FakeDriver(
        encode=lambda text: tok._tok(text, add_special_tokens=False)["input_ids"], stop=end
    )
    driver.replies = ["<parameter=a>\n5\n</parameter>\n</function>\n</tool_call>"]
    server = Live(tokenizer=tok, driver=driver)
    try:
        body = {
            "model": "m",
            "messages": USER,
            "tools": [ADD_TOOL],
            "tool_choice": {"type": "function", "function": {"name": "add"}},
        }
        r = server.post("/v1/chat/completions", body).json()
        (call,) = r["choices"][0]["message"]["tool_calls"]
        assert call["function"]["name"] == "add" and json.loads(call["function"]["arguments"]) == {
            "a": 5
        }
        assert tok._tok.decode(driver.prefills[0]).endswith("<tool_call>\n<function=add>\n")
    finally:
        server.stop()


@pytest.mark.parametrize(
    "fmt",
    [
        {"type": "json_object"},
        {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "object"}}},
    ],
)
def test_response_format_json_is_served_turn_by_turn(live, fmt):
    """json_object / json_schema reach the engine request of each turn that asks for them, as
    the canonical format (the trainer replays its mask); text and no field are free; a forced
    tool call and the legacy completions endpoint refuse them naming the field."""
    canonical = parse_response_format(fmt)
    live.driver.replies = ['{"a": 1}', '{"b": 2}', "12", '{"c": 3}']
    body = {"model": "m", "messages": USER, "response_format": fmt}
    r = live.post("/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == '{"a": 1}'
    (sid,) = live.take()
    history = [*USER]
    for i, f in enumerate((fmt, {"type": "text"}, fmt)):
        r = live.chat(sid, history, response_format=f)
        assert r.status_code == 200, r.text
        history += [r.json()["choices"][0]["message"], {"role": "user", "content": f"go {i}"}]
    assert live.driver.formats == [canonical, canonical, None, canonical]
    forced = {
        **body,
        "tools": [ADD_TOOL],
        "tool_choice": {"type": "function", "function": {"name": "add"}},
    }
    legacy = {"model": "m", "prompt": "x", "response_format": fmt}
    for path, b in (("/v1/chat/completions", forced), ("/v1/completions", legacy)):
        r = live.post(path, b)
        assert r.status_code == 400 and r.json()["error"]["param"] == "response_format", r.text


def test_a_format_is_built_on_the_pool_before_the_engine_sees_it(live, monkeypatch):
    """The tokenizer's trie and a format's automaton (seconds on a real vocabulary) are built on
    the HTTP pool before the request or turn reaches the engine, not on its generate thread
    while every slot waits; a free request builds nothing."""
    built = []

    def recording_mask_for(fmt, tokenizer, vocab_size):
        built.append((fmt, threading.current_thread().name))
        return json_mask.mask_for(fmt, tokenizer, vocab_size)

    monkeypatch.setattr(sessions_module, "mask_for", recording_mask_for)
    seen_at_placement = []
    place, cont = live.driver.place_request_on_prefill_queue, live.driver.continue_episode

    def place_(request):
        seen_at_placement.append(list(built))
        place(request)

    def continue_(request, tokens):
        seen_at_placement.append(list(built))
        cont(request, tokens)

    live.driver.place_request_on_prefill_queue, live.driver.continue_episode = place_, continue_
    fmt = {"type": "json_object"}
    canonical = parse_response_format(fmt)
    live.driver.replies = ['{"a": 1}', "12", '{"b": 2}']
    r = live.post("/v1/chat/completions", {"model": "m", "messages": USER, "response_format": fmt})
    assert r.status_code == 200, r.text
    (sid,) = live.take()
    history = [*USER]
    for i, f in enumerate(({"type": "text"}, fmt)):
        r = live.chat(sid, history, response_format=f)
        assert r.status_code == 200, r.text
        history += [r.json()["choices"][0]["message"], {"role": "user", "content": f"go {i}"}]
    assert [len(b) for b in seen_at_placement] == [1, 1, 2]
    assert [fmt for fmt, _ in built] == [canonical, canonical]
    assert all(name.startswith("http-cpu") for _, name in built), built
    mask = json_mask.mask_for(canonical, live.tok, 256)
    assert mask.allowed(mask.start())[ord("{")] and not mask.allowed(mask.start())[ord("a")]


@pytest.mark.parametrize(
    ("schema", "keyword"),
    [
        ({"type": "object", "properties": {"a": {"type": "string", "pattern": "^x"}}}, "pattern"),
        ({"type": "object", "properties": {"a": {"oneOf": [{"type": "string"}]}}}, "oneOf"),
        ({"type": "array"}, "type"),
    ],
)
def test_a_schema_outside_the_enforced_subset_is_refused_naming_the_keyword(live, schema, keyword):
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}
    r = live.post("/v1/chat/completions", {"model": "m", "messages": USER, "response_format": fmt})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "response_format"
    assert f"json_schema keyword {keyword!r}" in error["message"]
    bad = {"model": "m", "messages": USER, "response_format": {"type": "yaml"}}
    r = live.post("/v1/chat/completions", bad)
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"
