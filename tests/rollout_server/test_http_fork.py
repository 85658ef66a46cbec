"""Forks instead of refusals (`server.http_session_fork`, docs/DESIGN.md §6.6): a session request
whose history diverges from the session's starts a new segment, re-prefilled from the new
history; each segment is a trajectory of its own and the session's reward is all of theirs.

The lifecycle against the scripted fake driver of test_sessions_lifecycle.py; then, live on the
real engine and driver, an agent on the official `openai` client that forks and ends its
session: each segment's log-probs equal a fresh prefill (one full forward) of its history.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading

import numpy as np
import pytest

from rollout_server.driver import FinishedSample, RolloutRequest
from rollout_server.segments import ForkedSample, Segments, segments_of
from tests.rollout_server.test_sessions_lifecycle import PROMPT, USER, FakeDriver, Live, wait


class SampleDriver(FakeDriver):
    """The fake driver whose ended episodes give a `FinishedSample`: the prefill's ids as the
    prompt, each turn's tokens and inserted tokens as the completion (`fail` marks requests
    whose sample is None)."""

    def __init__(self):
        super().__init__()
        self.fail: set[int] = set()
        self.tokens: dict[int, list[int]] = {}

    def place_request_on_prefill_queue(self, request: RolloutRequest) -> None:
        self.tokens[id(request)] = []
        super().place_request_on_prefill_queue(request)

    def continue_episode(self, request: RolloutRequest, tokens) -> None:
        self.tokens[id(request)] += [int(t) for t in tokens]
        super().continue_episode(request, tokens)

    def end_episode(self, request: RolloutRequest) -> None:
        self.ended.append(request)
        n = request.buffer.size
        sample = FinishedSample(
            prompt_ids=np.asarray(request.prefill_content, np.int32),
            completion_ids=np.zeros(n, np.int32),
            logprobs=request.buffer.logprobs[:n].copy(),
            versions=np.zeros(n, np.int64),
            routing=np.zeros((0, 1, 1), np.uint8),
            finish_reason="stop",
        )
        request.on_done(request, None if id(request) in self.fail else sample)


@pytest.fixture
def refusing():
    server = Live()
    yield server
    server.stop()


@pytest.fixture
def forking():
    server = Live(driver=SampleDriver())
    server.sessions.limits = dataclasses.replace(server.sessions.limits, fork=True, max_segments=3)
    yield server
    server.stop()


def _turn(live, sid, messages, status=200):
    r = live.chat(sid, messages)
    assert r.status_code == status, r.text
    return r.json()


def test_without_forks_a_diverging_history_is_still_refused(refusing):
    live = refusing
    (sid,) = live.take()
    first = _turn(live, sid, USER)["choices"][0]["message"]
    trimmed = [{"role": "user", "content": "Summary: 5 + 7 was asked."}]
    r = live.chat(sid, trimmed)
    assert r.status_code == 400 and r.json()["error"]["code"] == "history_mismatch"
    assert live.sessions.forks == 0
    assert _turn(live, sid, [*USER, first, {"role": "user", "content": "Sure?"}])["choices"]


def test_a_diverging_history_starts_a_segment_prefilled_from_it(forking):
    live, driver = forking, forking.driver
    (sid,) = live.take()
    driver.replies = ["12", "13", "14"]
    first = _turn(live, sid, USER)["choices"][0]["message"]
    # The agent summarises its context: the history no longer extends the session's.
    summary = [{"role": "system", "content": "Earlier: 5 + 7."}, {"role": "user", "content": "Go"}]
    out = _turn(live, sid, summary)
    assert out["choices"][0]["message"]["content"] == "13"
    assert live.sessions.forks == 1 and len(driver.ended) == 1
    assert driver.prefills[-1] == live.tok.encode_messages(summary)
    assert out["usage"]["prompt_tokens"] == len(driver.prefills[-1])
    # The client's retry of the forking request gets its reply: nothing forks again.
    again = _turn(live, sid, summary)
    assert again["choices"] == out["choices"] and again["usage"] == out["usage"]
    assert live.sessions.forks == 1 and live.sessions.retries == 1
    # The new segment extends by the delta, as any session does.
    more = [*summary, out["choices"][0]["message"], {"role": "user", "content": "Sure?"}]
    assert _turn(live, sid, more)["choices"][0]["message"]["content"] == "14"
    assert driver.placed == 2 and len(driver.inserted) == 1
    # An assistant message the model did not write is a divergence too.
    edited = [*USER, {**first, "content": "11"}, {"role": "user", "content": "Sure?"}]
    _turn(live, sid, edited)
    assert live.sessions.forks == 2
    r = live.post(f"/sessions/{sid}/end", {"reward": 0.5})
    assert r.status_code == 200, r.text
    wait(lambda: live.done, "no sample")
    ((tag, sample),) = live.done
    assert tag == (7, 0) and isinstance(sample, ForkedSample)
    segments = segments_of(sample)
    prompts = [s.prompt_ids.tolist() for s in segments]
    assert prompts == driver.prefills
    assert live.sessions.find(sid).reward == 0.5  # the group record's reward of every segment


def test_segments_are_bounded_and_a_failed_one_fails_the_sample(forking):
    live, driver = forking, forking.driver
    (sid,) = live.take()
    _turn(live, sid, USER)
    for k in range(2):
        _turn(live, sid, [{"role": "user", "content": f"Fork {k}"}])
    r = live.chat(sid, [{"role": "user", "content": "Fork 3"}])
    assert r.status_code == 400 and "at most 3 segments" in r.json()["error"]["message"]
    assert live.sessions.forks == 2
    driver.fail.add(id(driver.ended[0]))  # too late for it: recorded already
    live.post(f"/sessions/{sid}/end", {"reward": 1.0})
    wait(lambda: live.done, "no sample")
    assert len(segments_of(live.done[0][1])) == 3
    # A segment whose sample is lost: the session's sample is generated again.
    (sid,) = live.take()
    _turn(live, sid, USER)
    driver.fail.add(id(live.sessions.get(sid).request))
    _turn(live, sid, [{"role": "user", "content": "Fork"}])
    live.post(f"/sessions/{sid}/end", {"reward": 1.0})
    wait(lambda: len(live.done) == 2, "no second sample")
    assert live.done[1][1] is None


def test_forks_need_sessions_and_reach_the_servers_sessions():
    from rollout_server.process import session_limits
    from sat_jax.config import ServerConfig

    with pytest.raises(ValueError, match="http_session_fork needs http_sessions"):
        ServerConfig(http_port=8800, http_session_fork=True)
    on = ServerConfig(http_port=8800, http_sessions=True, http_session_fork=True)
    assert session_limits(on).fork and not session_limits(ServerConfig(http_port=8800)).fork
    assert session_limits(on).max_sessions == on.http_max_sessions


def test_a_sample_waits_for_every_segment_in_any_order():
    segments = Segments()
    old = object()
    segments.fork(old)
    assert len(segments) == 2 and not segments.complete
    assert not segments.arrived(object(), None)  # the current request's, not a segment's
    arrays = dict(
        completion_ids=np.zeros(1, np.int32),
        logprobs=np.zeros(1, np.float32),
        versions=np.zeros(1, np.int64),
        routing=np.zeros((3, 1, 1), np.uint8),
        finish_reason="stop",
    )
    one = FinishedSample(prompt_ids=np.ones(2, np.int32), **arrays)
    two = FinishedSample(prompt_ids=np.full(2, 2, np.int32), **arrays)
    assert segments.arrived(old, one) and segments.complete
    both = segments.sample(two)
    assert [s.prompt_ids.tolist() for s in segments_of(both)] == [[1, 1], [2, 2]]
    assert segments_of(one) == (one,)


# Live: the real engine and driver, the official client.

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def engine_live(tmp_path_factory):
    import jax
    from flax import nnx

    from rollout_server import jetstream_compat  # noqa: F401  (must precede jetstream imports)
    from rollout_server.driver import RolloutDriver
    from rollout_server.engine import MoEEngine
    from rollout_server.http_api import HttpApi, HttpLimits
    from rollout_server.sessions import Generator, SessionLimits, SessionManager
    from sat_jax.decoding import SamplingConfig
    from sat_jax.model import ModelConfig, Transformer
    from sat_jax.tasks.hf_tokenizer import HFTokenizer
    from tests.hf_fixtures import make_tokenizer

    path = tmp_path_factory.mktemp("fork") / "tok"
    make_tokenizer(path)
    tok = HFTokenizer(str(path), chat_template=True)
    cfg = ModelConfig.preset("tiny").replace(vocab_size=len(tok), max_seq_len=512)
    model = Transformer(cfg, rngs=nnx.Rngs(jax.random.key(0, impl="rbg")))
    engine = MoEEngine(
        model,
        tokenizer=tok,
        slots=2,
        max_prefill_length=256,
        max_decode_length=128,
        sampling=SamplingConfig(),
    )
    params = engine.load_params()
    driver = RolloutDriver.interleaved(engine)
    generator = Generator(driver, engine, tok)
    sessions = SessionManager(
        generator,
        lambda text, answer: 0.0,
        SessionLimits(max_sessions=2, idle_s=600.0, fork=True),
    )
    api = HttpApi(
        generator=generator,
        sessions=sessions,
        limits=HttpLimits(max_body_bytes=64 * 1024, max_messages=16, max_requests=4),
        token="t",
        model_name="tiny",
        default_tokens=6,
    )
    aio = asyncio.new_event_loop()
    thread = threading.Thread(target=aio.run_forever, daemon=True)
    thread.start()
    try:
        port = asyncio.run_coroutine_threadsafe(api.start("127.0.0.1", 0), aio).result(60)
        yield dict(
            url=f"http://127.0.0.1:{port}",
            tok=tok,
            engine=engine,
            params=params,
            sessions=sessions,
            driver=driver,
            model=model,
            cfg=cfg,
        )
    finally:
        asyncio.run_coroutine_threadsafe(api.stop(), aio).result(30)
        aio.call_soon_threadsafe(aio.stop)
        thread.join(10)
        driver.stop()


def _full_forward(live, ids, p):
    """The log-probs of `ids[p:]` under one full forward of `ids` (a fresh prefill)."""
    import jax.numpy as jnp
    from flax import nnx

    from sat_jax.model import token_logprobs

    model = nnx.merge(live["engine"].core.graphdef, live["params"])
    seq = jnp.asarray([ids], jnp.int32)
    mask = jnp.asarray(live["engine"].sampleable_ids)
    return np.asarray(token_logprobs(model(seq)[:, p - 1 : -1], seq[:, p:], vocab_mask=mask)[0])


def _fork_agent(url: str, session: dict) -> list[list]:
    """An agent on the official client: two turns, then it trims its context to a summary (a
    fork) and goes on for a turn; returns its requests' histories, each with the log-probs the
    client got."""
    server = openai.OpenAI(base_url=url, api_key="t", max_retries=2, timeout=300)
    client = server.with_options(base_url=f"{url}/sessions/{session['session_id']}/v1")
    histories = []

    def turn(messages):
        out = client.chat.completions.create(model="tiny", messages=messages, logprobs=True)
        histories.append([list(messages), [t.logprob for t in out.choices[0].logprobs.content]])
        return out.choices[0].message.model_dump(exclude_none=True)

    messages = [{"role": "user", "content": session["prompt"]["text"]}]
    messages += [turn(messages), {"role": "user", "content": "And 2 + 2?"}]
    messages += [turn(messages)]
    summary = [{"role": "system", "content": "Asked: 5 + 7, 2 + 2."}, {"role": "user", "content": "3 + 3?"}]  # fmt: skip
    summary += [turn(summary), {"role": "user", "content": "Sure?"}]
    turn(summary)
    server.post(f"/sessions/{session['session_id']}/end", body={"reward": 0.75}, cast_to=object)
    return histories


@pytest.mark.slow
def test_an_agent_that_forks_makes_two_trajectories_each_a_fresh_prefill(engine_live):
    live, done = engine_live, []
    live["sessions"].offer(PROMPT, (3, 0), lambda tag, sample: done.append(sample))
    server = openai.OpenAI(base_url=live["url"], api_key="t", max_retries=0, timeout=300)
    (session,) = server.post(
        "/sessions", body={"max_sessions": 1, "timeout_s": 30}, cast_to=object
    )["sessions"]
    histories = _fork_agent(live["url"], session)
    wait(lambda: done, "no sample", timeout_s=120)
    segments = segments_of(done[0])
    assert len(segments) == 2 and live["sessions"].forks == 1
    assert live["sessions"].find(session["session_id"]).reward == 0.75
    tok = live["tok"]
    for segment, (first, second) in zip(segments, (histories[:2], histories[2:]), strict=True):
        # The segment's prompt is a fresh render of the history it started from.
        assert segment.prompt_ids.tolist() == tok.encode_messages(first[0])
        ids = [*segment.prompt_ids.tolist(), *segment.completion_ids.tolist()]
        p = len(segment.prompt_ids)
        want = _full_forward(live, ids, p)[segment.loss_mask]
        np.testing.assert_allclose(segment.logprobs[segment.loss_mask], want, atol=2e-4)
        np.testing.assert_allclose(first[1] + second[1], want, atol=2e-4)
        assert len(segment.routing) == len(ids)


def _take(url: str) -> dict:
    server = openai.OpenAI(base_url=url, api_key="t", max_retries=0, timeout=300)
    body = {"max_sessions": 1, "timeout_s": 30}
    (session,) = server.post("/sessions", body=body, cast_to=object)["sessions"]
    return session


def _plain_agent(url: str, session: dict, reward: float) -> None:
    """One turn, then the end with `reward` (no fork)."""
    server = openai.OpenAI(base_url=url, api_key="t", max_retries=2, timeout=300)
    client = server.with_options(base_url=f"{url}/sessions/{session['session_id']}/v1")
    messages = [{"role": "user", "content": session["prompt"]["text"]}]
    client.chat.completions.create(model="tiny", messages=messages)
    server.post(f"/sessions/{session['session_id']}/end", body={"reward": reward}, cast_to=object)


def _train_step(live, batch):
    """One train step on `batch` from the engine's own params: its metrics."""
    import jax
    import optax
    from flax import nnx

    from sat_jax import objectives, sharding
    from sat_jax.step import StepConfig, create_train_state, make_train_step, shard_batch

    cfg = live["cfg"]
    mesh = sharding.make_mesh(sharding.MeshConfig(fsdp=1), jax.devices()[:1])
    params = jax.device_get(nnx.to_pure_dict(nnx.state(live["model"])))
    step_cfg = StepConfig(loss=objectives.PolicyLossConfig(), routing_replay=True)
    mask = np.asarray(live["engine"].sampleable_ids)
    step = make_train_step(cfg, optax.sgd(0.1), step_cfg, mesh, vocab_mask=mask)
    state = create_train_state(cfg, optax.sgd(0.1), mesh, params)
    _, metrics = step(state, shard_batch(batch, mesh))
    return jax.device_get(metrics)


@pytest.mark.slow
def test_a_forked_session_reaches_the_trainer_as_two_trajectories_and_trains(engine_live):
    """End to end: a group of two sessions (one forks) through `Generation`, its record over the
    wire (`to_proto` -> bytes -> `decode_group`), `select_groups`, `assemble_batch` and a train
    step: three trajectories, each segment's log-probs a fresh prefill of its history, the
    group's statistics over its two sessions, and the step trains every generated token."""
    from rollout_api import records
    from rollout_api.proto import rollout_pb2
    from rollout_server.generation import Generation
    from sat_jax.config import RolloutConfig
    from sat_jax.step.batch import with_advantages
    from train import batching

    live, tok = engine_live, engine_live["tok"]
    forks = live["sessions"].forks
    generation = Generation(
        driver=live["driver"],
        engine=live["engine"],
        cfg=RolloutConfig(group_size=2, max_new_tokens=6),
        tokenizer=tok,
        reward_fn=lambda text, answer: 0.0,
        episodes=None,
        sessions=live["sessions"],
    )
    record = {"group_id": 11, "id": PROMPT.id, "text": PROMPT.text, "answer": PROMPT.answer}
    generation.submit(generation.start(record))
    histories = _fork_agent(live["url"], _take(live["url"]))  # reward 0.75, one fork
    _plain_agent(live["url"], _take(live["url"]), 0.25)
    finished = []
    for _ in range(240):
        finished += generation.collect(0.5).finished
        if finished:
            break
    assert finished and live["sessions"].forks == forks + 1
    message = records.to_proto(generation.group_record(finished[0], "srv"))
    cfg = live["cfg"]
    spec = batching.BatchSpec(
        batch_groups=1,
        group_size=2,
        seq_len=384,
        length_bucket=0,
        routing_lk=(cfg.num_moe_layers, cfg.num_experts_per_tok),
        routing_dtype="uint8",
        max_staleness=4,
        stale_policy="drop",
        vocab_size=cfg.vocab_size,
        num_experts=cfg.num_experts,
    )
    wire = rollout_pb2.Group.FromString(message.SerializeToString())
    group = records.decode_group(wire, spec.limits)
    assert group.sessions == (0, 0, 1) and len(group.trajectories) == 3
    assert [t.reward for t in group.trajectories] == [0.75, 0.75, 0.25]
    starts = [histories[0][0], histories[2][0]]
    for traj, history in zip(group.trajectories, starts, strict=False):
        assert traj.prompt_ids.tolist() == tok.encode_messages(history)
        ids = [*traj.prompt_ids.tolist(), *traj.completion_ids.tolist()]
        want = _full_forward(live, ids, len(traj.prompt_ids))[traj.generated]
        np.testing.assert_allclose(traj.behavior_logprobs[traj.generated], want, atol=2e-4)
    selection = batching.select_groups([group], spec, trainer_version=0, min_version=0)
    batch, stats = batching.assemble_batch(selection, spec, trainer_version=0)
    # Three trajectories in a batch of two rows: the rows double; the forked session's two
    # segments weigh 1/2 each, so the group's mean and spread are its two sessions'.
    assert batch.tokens.shape[0] == 4 and batch.group_ids.tolist() == [0, 0, 0, -1]
    np.testing.assert_allclose(batch.session_weights, [0.5, 0.5, 1.0, 0.0])
    assert stats.reward_mean == pytest.approx(0.5) and stats.tokens == batch.loss_mask.sum()
    advantages = np.asarray(with_advantages(batch).advantages)
    per_row = [advantages[r][batch.loss_mask[r] > 0] for r in range(3)]
    for row, sign in zip(per_row, (1, 1, -1), strict=True):  # (0.75 - 0.5) / std(0.75, 0.25)
        np.testing.assert_allclose(row, sign / np.sqrt(2), rtol=1e-4)
    metrics = _train_step(live, batch)
    assert metrics["step_skipped"] == 0 and metrics["active_tokens"] == stats.tokens
    assert metrics["mismatch_abs_mean"] < 1e-3  # the trainer scores what the engine sampled
