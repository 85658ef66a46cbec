"""rollout_server.stand_in: the stand-in engine sleeps per step and makes valid completions of
the length asked for, alone and through the real server (admission, Pull, Ack, Stats)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from rollout_api import records
from rollout_server.engine import unpack_step
from rollout_server.stand_in import StandInEngine, split_args
from sat_jax.decoding import SamplingConfig
from sat_jax.experiment import load_config
from tests.rollout_server.conftest import CONFIG, SHAPES, pull_all, stats
from tests.rollout_server.test_engine import CFG, TOK, _model


def _engine(sleeps: list[float], tokens: float = 3, slots: int = 4) -> StandInEngine:
    return StandInEngine(
        _model(),
        step_s=0.004,
        tokens=tokens,
        sleep=sleeps.append,
        tokenizer=TOK,
        slots=slots,
        max_prefill_length=16,
        max_decode_length=8,
        sampling=SamplingConfig(),
    )


def _insert(engine, state, slot, text="12+7="):
    ids = np.array([TOK.bos_id, *TOK.encode(text)], np.int32)
    padded = np.zeros(16, np.int32)
    padded[: len(ids)] = ids
    prefix = engine.prefill(padded_tokens=padded, true_length=len(ids))
    return engine.insert(prefix, state, slot), ids


def test_each_step_sleeps_and_a_request_ends_with_a_stop_at_its_length():
    sleeps: list[float] = []
    engine = _engine(sleeps, tokens=3)
    state, ids = _insert(engine, engine.init_decode_state(), slot=1)
    steps = []
    for _ in range(4):
        state, result = engine.generate(None, state)
        engine.decode_clock.ready()
        steps.append(unpack_step(result.data, CFG.num_moe_layers, CFG.num_experts_per_tok))
    assert sleeps == [0.004] * 4 and engine.decode_clock.steps == 4
    valid = [bool(s["valid"][1]) for s in steps]
    assert valid == [True, True, True, False]  # free after its stop id
    assert not any(s["valid"][0] for s in steps)  # never inserted
    tokens = [int(s["token"][1]) for s in steps[:3]]
    stops = TOK.stop_ids
    assert tokens[2] in stops and not set(tokens[:2]) & stops
    assert all(engine.sampleable_ids[t] for t in tokens[:2])
    assert [int(s["length"][1]) for s in steps[:3]] == [1, 2, 3]
    s = steps[0]
    assert s["version"][1] == engine.version and math.isfinite(float(s["logp"][1]))
    assert s["routing"].shape == (4, CFG.num_moe_layers, CFG.num_experts_per_tok)
    assert (s["routing"][1] < CFG.num_experts).all()
    prompt_ids, routing = engine.slot_prompt(1)
    assert (prompt_ids == ids).all() and routing.shape[0] == len(ids)
    assert engine.prefill_calls == 1 and engine.prefill_tokens == len(ids)


def test_fractional_tokens_mix_the_two_lengths_to_that_mean():
    engine = _engine([], tokens=2.25, slots=1)
    state = engine.init_decode_state()
    lengths = []
    for _ in range(400):
        state, _ = _insert(engine, state, slot=0)
        lengths.append(int(state.target_b[0]))
        state.generated_b[0] = -1
    assert set(lengths) == {2, 3}
    assert np.mean(lengths) == pytest.approx(2.25, abs=0.06)


def test_bad_arguments_are_one_clear_error():
    with pytest.raises(ValueError, match="step_s"):
        StandInEngine(_model(), step_s=-1, tokens=3, tokenizer=TOK, slots=1,
                      max_prefill_length=16, max_decode_length=8, sampling=SamplingConfig())  # fmt: skip
    with pytest.raises(ValueError, match="unknown stand-in argument"):
        split_args(["stand_in.speed=3"])
    with pytest.raises(ValueError, match="missing stand_in.tokens"):
        split_args(["stand_in.step_s=0.1"])
    assert split_args(["a=1", "stand_in.step_s=0.1", "stand_in.tokens=3"]) == (
        {"step_s": "0.1", "tokens": "3"},
        ["a=1"],
    )


def test_stand_in_server_serves_groups_through_pull_and_ack(server_factory):
    server = server_factory(
        ["server.wait_for_weights=false", "stand_in.step_s=0.001", "stand_in.tokens=4"],
        module="rollout_server.stand_in",
    )
    stub = server.rollout_stub()
    groups = pull_all(stub, 2)
    model = load_config(str(CONFIG), SHAPES).model
    limits = records.GroupLimits(
        vocab_size=model.vocab_size,
        num_experts=model.num_experts,
        routing_lk=(model.num_moe_layers, model.num_experts_per_tok),
    )
    for g in groups:
        group = records.decode_group(g, limits)  # the trainer's checks
        assert [len(t.completion_ids) for t in group.trajectories] == [4, 4]
        assert all(t.finish_reason == "stop" for t in group.trajectories)
    got = stats(stub)
    assert got.decode_steps >= 4 and got.decode_seconds > 0 and got.cpu_seconds > 0
    assert got.groups_consumed >= 2
    assert "stand-in engine" in server.log()
