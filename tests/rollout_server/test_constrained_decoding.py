"""Constrained decoding (`response_format`) through the real engine and driver, in process: a
random tiny model's replies under a json_schema / json_object mask are JSON satisfying the
format, each constrained token's recorded behavior log-prob is the masked distribution's of a
fresh forward over the same sequence, and a free request decoding beside it is untouched."""

from __future__ import annotations

import json
import queue

import jax
import jax.numpy as jnp
import jsonschema
import numpy as np
import pytest
from flax import nnx

from rollout_server import jetstream_compat  # noqa: F401  (must precede jetstream imports)

# isort: split
from rollout_server.driver import RolloutDriver, RolloutRequest
from rollout_server.engine import MoEEngine
from sat_jax.decoding import SamplingConfig
from sat_jax.json_mask import mask_for, parse_response_format
from sat_jax.model import ModelConfig, Transformer
from sat_jax.tasks.hf_tokenizer import HFTokenizer
from tests.hf_fixtures import make_tokenizer

MAX_TOKENS = 160
SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "pick": {"enum": ["a", "b", 7, None]},
        "n": {"type": "null"},
        "list": {"type": "array", "items": {"type": "boolean"}},
    },
    "required": ["ok", "pick"],
}
SCHEMA_FMT = {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    make_tokenizer(path)
    return HFTokenizer(str(path), chat_template=True)


@pytest.fixture(scope="module")
def served(tokenizer):
    """Two slots, four requests: three constrained to the schema and one free, interleaved;
    returns (the engine, its params, the formats, the finished samples by request)."""
    cfg = ModelConfig.preset("tiny").replace(vocab_size=len(tokenizer), max_seq_len=512)
    model = Transformer(cfg, rngs=nnx.Rngs(jax.random.key(3, impl="rbg")))
    engine = MoEEngine(
        model,
        tokenizer=tokenizer,
        slots=2,
        max_prefill_length=64,
        max_decode_length=MAX_TOKENS,
        sampling=SamplingConfig(),
    )
    params = engine.load_params()
    driver = RolloutDriver.interleaved(engine)
    schema = parse_response_format(SCHEMA_FMT)
    formats = [schema, None, schema, parse_response_format({"type": "json_object"})]
    done: queue.Queue = queue.Queue()
    prompt = tokenizer.encode_messages([{"role": "user", "content": "Answer in JSON: 5 + 7?"}])
    try:
        for i, fmt in enumerate(formats):
            driver.place_request_on_prefill_queue(
                RolloutRequest(
                    max_tokens=MAX_TOKENS,
                    return_channel=None,
                    prefill_content=list(prompt),
                    is_client_side_tokenization=True,
                    tag=i,
                    on_done=lambda r, s: done.put((r.tag, s)),
                    response_format=fmt,
                )
            )
        samples = dict(done.get(timeout=600) for _ in formats)
    finally:
        driver.stop()
    return engine, params, formats, samples


def _reply(tokenizer, sample):
    ids = sample.completion_ids
    assert sample.finish_reason == "stop" and ids[-1] in tokenizer.stop_ids
    return tokenizer.decode(ids[:-1].tolist())


def test_constrained_replies_are_json_of_the_format(tokenizer, served):
    _, _, formats, samples = served
    for i in (0, 2):
        jsonschema.validate(json.loads(_reply(tokenizer, samples[i])), SCHEMA)
    # json_object leaves a random model free to write one long object: it may end at the limit
    # (every token of it allowed, `test_behavior_logprobs...`), or whole, then an object.
    if samples[3].finish_reason == "length":
        assert len(samples[3].completion_ids) == MAX_TOKENS
    else:
        assert isinstance(json.loads(_reply(tokenizer, samples[3])), dict)
    # The free request's reply is no JSON (the random model writes anything).
    free = tokenizer.decode(samples[1].completion_ids.tolist())
    with pytest.raises(ValueError):
        json.loads(free)


def test_behavior_logprobs_are_the_masked_distributions_of_a_fresh_forward(tokenizer, served):
    """Per token: log softmax of the fresh forward's logits over the sampleable ids that the
    format's mask allows after the reply so far (every id for the free request)."""
    engine, params, formats, samples = served
    model = nnx.merge(engine.core.graphdef, params)
    for fmt, sample in zip(formats, samples.values(), strict=True):
        seq = np.concatenate([sample.prompt_ids, sample.completion_ids])
        logits = np.asarray(model(jnp.asarray(seq[None], jnp.int32)))[0]
        p, ids = len(sample.prompt_ids), sample.completion_ids.tolist()
        mask = None if fmt is None else mask_for(fmt, tokenizer, engine.config.vocab_size)
        state = None if mask is None else mask.start()
        want = []
        for t, token in enumerate(ids):
            allowed = engine.sampleable_ids.copy()
            if mask is not None:
                allowed &= mask.allowed(state)
                assert allowed[token]
                if token not in tokenizer.stop_ids:
                    state = mask.advance(state, token)
            logp = jax.nn.log_softmax(np.where(allowed, logits[p - 1 + t], -np.inf))
            want.append(float(logp[token]))
        np.testing.assert_allclose(sample.logprobs, want, rtol=0, atol=2e-4)
    # The masks did take mass away: the free forward's log-probs differ from the recorded ones.
    sample = samples[0]
    seq = np.concatenate([sample.prompt_ids, sample.completion_ids])
    logits = np.asarray(model(jnp.asarray(seq[None], jnp.int32)))[0]
    p = len(sample.prompt_ids)
    free = jax.nn.log_softmax(np.where(engine.sampleable_ids, logits[p - 1 : -1], -np.inf))
    free = np.take_along_axis(np.asarray(free), sample.completion_ids[:, None], -1)[:, 0]
    assert np.all(sample.logprobs >= free - 1e-5) and np.any(sample.logprobs > free + 0.1)


def test_a_continued_turn_is_constrained_from_its_extension_on(tokenizer, served):
    """An episode: a free first turn ended after 4 tokens, then the observation and a turn under the
    schema (`response_format` set before `continue_episode`): only the second turn's tokens are
    masked, from the extension's segment on (each one allowed where it stands), and every
    generated token's log-prob is its own turn's distribution: free, then masked."""
    engine, params, _, _ = served
    driver = RolloutDriver.interleaved(engine)
    fmt = parse_response_format(SCHEMA_FMT)
    obs = tokenizer.observation_ids([{"role": "user", "content": "JSON now"}], close_turn=True)
    prompt = tokenizer.encode_messages([{"role": "user", "content": "5 + 7?"}])
    done: queue.Queue = queue.Queue()
    first_turn = [True]  # the first turn ends after 4 tokens (like a stop string)

    def on_turn(request, turn):
        if request.segment == 0:
            first_turn[0] = False
            request.response_format = fmt
            driver.continue_episode(request, obs)
        else:
            done.put(turn)
            driver.end_episode(request)

    try:
        driver.place_request_on_prefill_queue(
            RolloutRequest(
                max_tokens=MAX_TOKENS,
                return_channel=None,
                prefill_content=list(prompt),
                is_client_side_tokenization=True,
                on_done=lambda r, s: done.put(s),
                episode=True,
                turn_tokens=MAX_TOKENS,
                on_turn=on_turn,
                stop_when=lambda ids: first_turn[0] and len(ids) >= 4,
            )
        )
        turn, sample = done.get(timeout=600), done.get(timeout=600)
    finally:
        driver.stop()
    first = 4  # the free turn's tokens, then the observation's
    second = sample.completion_ids[first + len(obs) :]
    assert second.tolist() == turn.ids.tolist()
    # The random model pads this reply with whitespace (which JSON allows between tokens), so it
    # may reach the episode's budget before its value is whole; whole, it satisfies the schema.
    if turn.finish_reason == "stop":
        jsonschema.validate(json.loads(tokenizer.decode(second[:-1].tolist())), SCHEMA)
    else:
        assert len(sample.completion_ids) == MAX_TOKENS
    model = nnx.merge(engine.core.graphdef, params)
    seq = np.concatenate([sample.prompt_ids, sample.completion_ids])
    logits = np.asarray(model(jnp.asarray(seq[None], jnp.int32)))[0]
    mask = mask_for(fmt, tokenizer, engine.config.vocab_size)
    state, p = mask.start(), len(sample.prompt_ids)
    for t, token in enumerate(sample.completion_ids.tolist()):
        allowed = engine.sampleable_ids.copy()
        if t >= first + len(obs):
            allowed &= mask.allowed(state)
            assert allowed[token]
            if token not in tokenizer.stop_ids:
                state = mask.advance(state, token)
        if t < first or t >= first + len(obs):  # generated tokens only
            want = jax.nn.log_softmax(np.where(allowed, logits[p - 1 + t], -np.inf))[token]
            np.testing.assert_allclose(sample.logprobs[t], want, rtol=0, atol=2e-4)
    np.testing.assert_array_equal(sample.loss_mask[first : first + len(obs)], 0)
