"""The trainer replays constrained decoding's masks (`response_format`, docs/DESIGN.md §6.6).

Replies sampled by the real engine and driver under json_object and a json_schema (a single
request each, and an episode whose two turns are constrained, each its own automaton run) go
through the wire (`records.to_proto` / `decode_group`) and the trainer's batch path
(`select_groups`, `assemble_batch`, padded and packed) into the train step's log-prob function:
at lag 0 the trainer's log-prob of every generated token equals its recorded behavior log-prob
(ratio 1 to float32 tolerance), with the full distribution and with top-k / top-p truncation.
Scored without the masks they differ: the bias the replay removes. A trajectory whose tokens the
trainer's replay does not allow (another tokenizer, a token changed) is rejected with the reason.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import queue

import jax
import numpy as np
import pytest
from flax import nnx

from rollout_server import jetstream_compat  # noqa: F401  (must precede jetstream imports)

# isort: split
from rollout_api import records
from rollout_server.driver import RolloutDriver, RolloutRequest
from rollout_server.engine import MoEEngine
from sat_jax.decoding import SamplingConfig
from sat_jax.json_mask import parse_response_format
from sat_jax.model import ModelConfig, Transformer
from sat_jax.step.step import _logprobs
from sat_jax.tasks.hf_tokenizer import HFTokenizer
from tests.hf_fixtures import make_tokenizer
from train import batching

MAX_TOKENS, TURN_TOKENS = 96, 40
SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "pick": {"enum": ["a", "b", 7, None]},
        "list": {"type": "array", "items": {"type": "boolean"}},
    },
    "required": ["ok", "pick"],
}
JSON_SCHEMA = parse_response_format(
    {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}}
)
JSON_OBJECT = parse_response_format({"type": "json_object"})
SAMPLINGS = {
    "full": SamplingConfig(),
    "truncated": SamplingConfig(temperature=0.8, top_k=24, top_p=0.9),
}
ATOL = 2e-4  # the server-side test's tolerance (the engine's forward vs the trainer's)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    make_tokenizer(path)
    return HFTokenizer(str(path), chat_template=True)


def _requests(tokenizer, driver, done):
    """A json_schema request, a json_object one, a free one, and an episode: a json_object turn,
    an observation, then a json_schema turn."""
    prompt = list(tokenizer.encode_messages([{"role": "user", "content": "Answer in JSON: 5+7?"}]))
    obs = tokenizer.observation_ids([{"role": "user", "content": "JSON now"}], close_turn=True)

    def on_turn(request, turn):
        if request.segment == 0:
            request.response_format = JSON_SCHEMA
            driver.continue_episode(request, obs)
        else:
            driver.end_episode(request)

    common = dict(return_channel=None, prefill_content=prompt, is_client_side_tokenization=True)
    on_done = lambda r, s: done.put((r.tag, s))
    for i, fmt in enumerate((JSON_SCHEMA, JSON_OBJECT, None)):
        yield RolloutRequest(
            max_tokens=MAX_TOKENS, tag=i, on_done=on_done, response_format=fmt, **common
        )
    yield RolloutRequest(
        max_tokens=MAX_TOKENS,
        tag=3,
        on_done=on_done,
        response_format=JSON_OBJECT,
        episode=True,
        turn_tokens=TURN_TOKENS,
        on_turn=on_turn,
        **common,
    )


@pytest.fixture(scope="module", params=sorted(SAMPLINGS))
def served(request, tokenizer):
    """(sampling name, the engine, its params, the finished samples in request order)."""
    cfg = ModelConfig.preset("tiny").replace(vocab_size=len(tokenizer), max_seq_len=512)
    model = Transformer(cfg, rngs=nnx.Rngs(jax.random.key(3, impl="rbg")))
    engine = MoEEngine(
        model,
        tokenizer=tokenizer,
        slots=2,
        max_prefill_length=64,
        max_decode_length=MAX_TOKENS,
        sampling=SAMPLINGS[request.param],
    )
    params = engine.load_params()
    driver = RolloutDriver.interleaved(engine)
    done: queue.Queue = queue.Queue()
    try:
        for r in list(_requests(tokenizer, driver, done)):
            driver.place_request_on_prefill_queue(r)
        samples = dict(done.get(timeout=900) for _ in range(4))
    finally:
        driver.stop()
    return request.param, engine, params, [samples[i] for i in range(4)]


def _group(samples, truncated: bool, changes: dict | None = None) -> records.Group:
    """The samples as one group, through the wire as the trainer pulls it."""
    trajectories = []
    for i, s in enumerate(samples):
        fields = dict(
            prompt_ids=s.prompt_ids,
            completion_ids=s.completion_ids,
            behavior_logprobs=s.logprobs,
            versions=s.versions,
            kept_counts=s.kept_counts if truncated else None,
            loss_mask=s.loss_mask,
            reward=float(i),
            finish_reason=s.finish_reason,
            response_formats=s.response_formats,
            format_index=s.format_index,
        )
        trajectories.append(records.Trajectory(**{**fields, **(changes or {}).get(i, {})}))
    group = records.Group(
        group_id=1, prompt_id="p", server_id="srv", trajectories=tuple(trajectories)
    )
    return records.decode_group(records.to_proto(group))


def _spec(engine, tokenizer, *, truncated: bool, packing: bool) -> batching.BatchSpec:
    cfg = engine.config
    return batching.BatchSpec(
        batch_groups=1,
        group_size=4,
        seq_len=64 + MAX_TOKENS,
        length_bucket=16,
        routing_lk=None,
        routing_dtype="uint8",
        max_staleness=0,
        stale_policy="drop",
        vocab_size=cfg.vocab_size,
        num_experts=cfg.num_experts,
        kept_counts=truncated,
        packing=packing,
        row_multiple=2,
        tokenizer=tokenizer,
    )


def _trainer_logprobs(engine, params, batch, sampling, *, masks: bool = True) -> np.ndarray:
    """The train step's log-prob function (`sat_jax.step.step._logprobs`) on the batch."""
    fn = functools.partial(
        _logprobs,
        replay=False,
        graphdef=engine.core.graphdef,
        temperature=sampling.temperature,
        vocab_mask=engine.sampleable_ids,
        format_masks=batch.format_masks if masks else None,
    )
    if not masks:
        batch = batch.replace(format_ids=None)
    step_batch = jax.tree.map(np.asarray, batch.replace(format_masks=None))
    return np.asarray(jax.jit(fn)(params, step_batch)[0])


def test_server_records_which_tokens_each_format_constrained(served):
    _, _, _, samples = served
    schema, obj, free, episode = samples
    assert schema.response_formats == (JSON_SCHEMA,)
    assert (schema.format_index == 1).all() and obj.response_formats == (JSON_OBJECT,)
    assert free.response_formats == () and free.format_index is None
    # The episode: a json_object turn, the observation (free), a json_schema turn.
    assert episode.response_formats == (JSON_OBJECT, JSON_SCHEMA)
    idx, mask = episode.format_index, episode.loss_mask
    runs = np.flatnonzero(np.diff(np.concatenate([[0], idx, [0]])))
    assert idx[0] == 1 and idx[-1] == 2 and len(runs) == 4
    np.testing.assert_array_equal(idx == 0, ~mask)


@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
def test_trainer_logprobs_equal_the_behavior_ones_at_lag_0(tokenizer, served, packing):
    name, engine, params, samples = served
    truncated, sampling = name == "truncated", SAMPLINGS[name]
    spec = _spec(engine, tokenizer, truncated=truncated, packing=packing)
    selection = batching.select_groups(
        [_group(samples, truncated)], spec, trainer_version=0, min_version=0
    )
    assert len(selection.kept) == 1 and selection.invalid == 0
    batch, stats = batching.assemble_batch(selection, spec, trainer_version=0)
    assert batch.packed == packing and batch.format_masks.shape[0] % spec.row_multiple == 0
    assert stats.lags.max() == 0
    trained = np.asarray(batch.loss_mask) > 0
    constrained = trained & (np.asarray(batch.format_ids) > 0)
    assert constrained.sum() > 20 and (trained & ~constrained).any()
    behavior = np.asarray(batch.behavior_logp)
    logp = _trainer_logprobs(engine, params, batch, sampling)
    np.testing.assert_allclose(logp[trained], behavior[trained], rtol=0, atol=ATOL)
    # Without the masks the constrained tokens are scored under another distribution.
    unmasked = _trainer_logprobs(engine, params, batch, sampling, masks=False)
    np.testing.assert_allclose(
        unmasked[trained & ~constrained], behavior[trained & ~constrained], atol=ATOL
    )
    assert np.abs(unmasked[constrained] - behavior[constrained]).max() > 0.1


def test_a_token_the_replay_does_not_allow_rejects_the_group(tokenizer, served, caplog, tmp_path):
    name, engine, _, samples = served
    truncated = name == "truncated"
    spec = _spec(engine, tokenizer, truncated=truncated, packing=False)
    # A json_object reply must open with "{": its first token made a digit's is refused.
    ids = samples[1].completion_ids.copy()
    ids[0] = tokenizer.encode("7")[-1]
    bad = _group(samples, truncated, {1: {"completion_ids": ids}})
    with caplog.at_level(logging.WARNING, logger="train"):
        chosen = batching.select_groups([bad], spec, trainer_version=0, min_version=0)
    assert chosen.kept == () and chosen.invalid == 1
    assert "trajectory 1: completion token 0" in caplog.text and "not allowed" in caplog.text
    # The trainer's tokenizer is another one than the server's: its replay refuses the replies.
    make_tokenizer(tmp_path / "other", vocab_size=300)
    other = HFTokenizer(str(tmp_path / "other"), chat_template=True)
    mismatched = dataclasses.replace(spec, tokenizer=other)
    chosen = batching.select_groups(
        [_group(samples, truncated)], mismatched, trainer_version=0, min_version=0
    )
    assert chosen.kept == () and chosen.invalid == 1
    # No tokenizer at all: a group with formats is rejected, one without is trained.
    blind = dataclasses.replace(spec, tokenizer=None)
    chosen = batching.select_groups(
        [_group(samples, truncated)], blind, trainer_version=0, min_version=0
    )
    assert chosen.invalid == 1 and "no tokenizer" in caplog.text
    free = records.Group(
        group_id=2,
        prompt_id="q",
        server_id="srv",
        trajectories=(
            records.Trajectory(
                prompt_ids=samples[2].prompt_ids,
                completion_ids=samples[2].completion_ids,
                behavior_logprobs=samples[2].logprobs,
                versions=samples[2].versions,
            ),
        )
        * 4,
    )
    chosen = batching.select_groups([free], blind, trainer_version=0, min_version=0)
    assert len(chosen.kept) == 1
