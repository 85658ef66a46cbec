"""sat_jax.decoding through sat_jax.completions.complete: continuous batching over fewer slots than
prompts gives, per prompt, the tokens and behavior log-probs of a full forward pass, and ends at a
stop id or the limit."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sat_jax import completions, decoding, sharding
from sat_jax.model import ModelConfig, Transformer, placement
from tests.random_models import random_params

CFG = ModelConfig.preset("tiny", dispatch="dense")
MAX_NEW = 6
# The first ids are never sampled (like a tokenizer's pad/bos), nor the rows past 40.
SAMPLEABLE = (np.arange(CFG.vocab_size) >= 2) & (np.arange(CFG.vocab_size) < 40)
PROMPTS = [[1, 5, 9], [1, 7], [1, 3, 3, 8, 2], [1, 30], [1, 12, 13, 14]]


@functools.cache
def _model():
    return random_params(CFG, seed=1)


def _core(sampling: decoding.SamplingConfig, slots: int = 2) -> decoding.DecodeCore:
    graphdef, _ = _model()
    return decoding.DecodeCore(
        graphdef,
        CFG,
        slots=slots,
        max_prefill_length=8,
        max_decode_length=MAX_NEW,
        sampling=sampling,
        sampleable_v=SAMPLEABLE,
    )


def _reference_logp(prompt: list[int], ids: tuple[int, ...], temperature: float) -> np.ndarray:
    """[len(ids), V] log-softmax over the sampleable ids of the full forward's next-token logits."""
    graphdef, params = _model()
    seq = np.asarray([[*prompt, *ids]], np.int32)
    logits = np.asarray(nnx.merge(graphdef, params)(jnp.asarray(seq)))[0]
    logits = logits[len(prompt) - 1 : len(prompt) - 1 + len(ids)] / temperature
    return np.asarray(jax.nn.log_softmax(np.where(SAMPLEABLE, logits, -np.inf), axis=-1))


def test_greedy_completions_follow_the_full_forward_and_stop_at_a_stop_id() -> None:
    _, params = _model()
    core = _core(decoding.SamplingConfig(top_k=1))
    free = completions.complete(core, params, PROMPTS)
    assert [c.finish for c in free] == ["length"] * len(PROMPTS)
    for prompt, c in zip(PROMPTS, free, strict=True):
        ref = _reference_logp(prompt, c.ids, 1.0)
        assert list(c.ids) == list(np.argmax(ref, axis=-1))
        assert all(SAMPLEABLE[i] for i in c.ids)
        np.testing.assert_allclose(c.logp, 0.0)  # top-k = 1 is a point mass
    # Make the third greedy token of every prompt a stop id: each completion ends right there.
    stops = {c.ids[2] for c in free}
    stopped = completions.complete(core, params, PROMPTS, stop_ids=sorted(stops))
    for c, s in zip(free, stopped, strict=True):
        cut = next(i for i, t in enumerate(c.ids) if t in stops)
        assert s.ids == c.ids[: cut + 1] and s.finish == "stop"


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_logprobs_are_the_behavior_policy(temperature: float) -> None:
    """Also: a group's samples share one prefill, each still the behavior policy's."""
    _, params = _model()
    core = _core(decoding.SamplingConfig(temperature=temperature))
    prompts = [p for p in PROMPTS for _ in range(3)]  # groups of 3 samples per prompt
    done = completions.complete(core, params, prompts)
    assert core.prefill_calls == len(PROMPTS)  # one prefill per group
    assert len({c.ids for c in done}) > len(PROMPTS)  # the samples of a group differ
    for prompt, c in zip(prompts, done, strict=True):
        assert len(c.ids) == MAX_NEW
        ref = _reference_logp(prompt, c.ids, temperature)
        want = ref[np.arange(len(c.ids)), list(c.ids)]
        np.testing.assert_allclose(c.logp, want, atol=1e-4)


def test_bad_prompts_and_masks_are_errors() -> None:
    _, params = _model()
    core = _core(decoding.SamplingConfig())
    with pytest.raises(ValueError, match="prompt 1 has 9 tokens; it must have 1 to 8"):
        completions.complete(core, params, [[1], [1] * 9])
    with pytest.raises(ValueError, match="prompt 0 has 0 tokens"):
        completions.complete(core, params, [[]])
    with pytest.raises(ValueError, match=r"sampleable_v has shape \(3,\)"):
        decoding.DecodeCore(
            _model()[0],
            CFG,
            slots=1,
            max_prefill_length=8,
            max_decode_length=2,
            sampling=decoding.SamplingConfig(),
            sampleable_v=np.ones(3, bool),
        )


def _steps(core: decoding.DecodeCore, params, steps: int) -> tuple[list[dict], Any]:
    """Three prompts into slots 0..2, then ``steps`` generate steps; host view of every step."""
    state = core.init_state()
    for slot, ids in enumerate(PROMPTS[:3]):
        state = core.insert(core.prefill_prompt(params, ids), state, jnp.int32(slot))
    rows = []
    for _ in range(steps):
        state, data = core.generate(params, state, jnp.int32(0))
        rows.append(decoding.unpack_step(data, CFG.num_moe_layers, CFG.num_experts_per_tok))
    return rows, state


@pytest.mark.parametrize("sampling", [decoding.SamplingConfig(top_k=1), decoding.SamplingConfig()])
def test_sharded_core_equals_one_device(sampling: decoding.SamplingConfig) -> None:
    """8 simulated devices (expert=4, tensor=2): same tokens, routing ids, log-probs (1e-5)."""
    graphdef, params = _model()
    one = jax.device_put(params, jax.devices()[0])
    mesh = sharding.make_mesh(sharding.MeshConfig(fsdp=1, expert=4, tensor=2))
    shardings = sharding.param_shardings(placement.abstract_model(CFG)[1], mesh)
    sharded = jax.device_put(params, shardings)
    want, _ = _steps(_core(sampling, slots=4), one, MAX_NEW)
    core = decoding.DecodeCore(
        graphdef,
        CFG,
        slots=4,
        max_prefill_length=8,
        max_decode_length=MAX_NEW,
        sampling=sampling,
        sampleable_v=SAMPLEABLE,
        mesh=mesh,
    )
    got, state = _steps(core, sharded, MAX_NEW)
    for w, g in zip(want, got, strict=True):
        for key in ("token", "valid", "length", "version", "routing"):
            np.testing.assert_array_equal(g[key], w[key], err_msg=key)
        np.testing.assert_allclose(g["logp"], w["logp"], atol=1e-5)
    cache_spec = state.cache.k_lbsgh.sharding.spec
    assert cache_spec[3] == "tensor", cache_spec  # KV heads over tensor
    assert len(state.cache.k_lbsgh.sharding.device_set) == 8


def test_generate_and_extend_write_the_donated_cache_in_place() -> None:
    """The compiled decode step (and an extension) write their new keys and values into the
    donated cache: the outputs alias the donated buffers and the temporaries stay well under the
    cache, so no second cache is built (before, the step stacked per-layer copies: temporaries
    1.29x the cache here). Structural, from XLA's memory analysis; nothing is timed."""
    cfg = ModelConfig.preset("tiny", dispatch="dense", num_layers=8)
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))
    params = nnx.to_pure_dict(abstract)
    core = decoding.DecodeCore(
        graphdef,
        cfg,
        slots=8,
        max_prefill_length=16,
        max_decode_length=239,
        sampling=decoding.SamplingConfig(),
        sampleable_v=np.ones((cfg.vocab_size,), bool),
    )
    state = jax.eval_shape(core.init_state)
    cache_bytes = 2 * state.cache.k_lbsgh.size * state.cache.k_lbsgh.dtype.itemsize
    scalar = jnp.int32(0)
    generate = core.generate_step.lower(params, state, scalar, core.cache_length).compile()
    tokens = jax.ShapeDtypeStruct((16,), jnp.int32)
    extend = core._extend_step.lower(params, state, scalar, tokens, *(scalar,) * 5)
    for name, compiled in (("generate", generate), ("extend", extend.compile())):
        stats = compiled.memory_analysis()
        assert stats.alias_size_in_bytes >= cache_bytes, name
        assert stats.temp_size_in_bytes < cache_bytes / 2, (name, stats.temp_size_in_bytes)


def test_decode_window_follows_the_live_length_and_equals_the_full_cache() -> None:
    """Steps over the power-of-two window (16, 32, then the 57-position cache) give the tokens,
    log-probs and cache of steps that attend over the whole cache."""
    _, params = _model()
    graphdef, _ = _model()
    core = decoding.DecodeCore(
        graphdef,
        CFG,
        slots=2,
        max_prefill_length=16,
        max_decode_length=40,
        sampling=decoding.SamplingConfig(),
        sampleable_v=SAMPLEABLE,
    )
    assert core.cache_length == 57

    def filled():
        state = core.init_state()
        for slot, ids in enumerate([PROMPTS[2], list(range(1, 15))]):
            state = core.insert(core.prefill_prompt(params, ids), state, jnp.int32(slot))
        return state

    full, windowed = filled(), filled()
    windows = []
    for step in range(40):
        if step == 30:
            windowed = core.evict(windowed, jnp.int32(1))  # the longer slot leaves
            full = core.evict(full, jnp.int32(1))
        windows.append(core.decode_window())
        full, full_data = core.generate_step(params, full, jnp.int32(0), core.cache_length)
        windowed, data = core.generate(params, windowed, jnp.int32(0))
        got = decoding.unpack_step(data, CFG.num_moe_layers, CFG.num_experts_per_tok)
        want = decoding.unpack_step(full_data, CFG.num_moe_layers, CFG.num_experts_per_tok)
        np.testing.assert_array_equal(got["token"], want["token"])
        np.testing.assert_array_equal(got["routing"], want["routing"])
        np.testing.assert_allclose(got["logp"], want["logp"], rtol=0, atol=1e-6)
    # Slot 1 (14 prompt tokens) needs 16 at the first step, 32 from its 3rd token and the whole
    # cache from its 19th; once it leaves, slot 0 (5 + 30 positions) needs 64 > 57.
    assert windows[:2] == [16, 16] and windows[2] == 32 and windows[18] == 57
    assert sorted(set(windows)) == [16, 32, 57]
    np.testing.assert_allclose(windowed.cache.k_lbsgh, full.cache.k_lbsgh, rtol=0, atol=1e-6)
    np.testing.assert_array_equal(windowed.cache.lengths_b, full.cache.lengths_b)


@pytest.mark.parametrize(("temperature", "top_k", "top_p"), [(1.0, 20, 0.9), (0.7, 0, 0.8)])
def test_truncated_sampling_is_replayed_by_the_trainers_logprobs(temperature, top_k, top_p):
    """Lag 0, float32: the trainer's log-probs under the sampler's recorded kept-set sizes equal
    the behavior log-probs (1e-5); over the whole vocabulary they do not."""
    graphdef, params = _model()
    sampling = decoding.SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p)
    done = completions.complete(_core(sampling), params, PROMPTS)
    model = nnx.merge(graphdef, params)
    for prompt, c in zip(PROMPTS, done, strict=True):
        assert all(1 <= n <= (top_k or CFG.vocab_size) for n in c.kept)
        p = len(prompt)
        tokens = jnp.asarray([[*prompt, *c.ids]], jnp.int32)
        kept = jnp.asarray([[0] * p + list(c.kept)], jnp.int32)
        kw = dict(temperature=temperature, vocab_mask=jnp.asarray(SAMPLEABLE))
        replayed = np.asarray(model.logprobs(tokens, kept_bt=kept, **kw)[0])[0, p:]
        full = np.asarray(model.logprobs(tokens, **kw)[0])[0, p:]
        np.testing.assert_allclose(replayed, c.logp, atol=1e-5, rtol=0)
        assert np.max(np.abs(full - np.asarray(c.logp))) > 1e-2


def test_episodes_insert_between_turns_and_stay_the_behavior_policy() -> None:
    """complete_episodes: turns of MAX_NEW tokens, 3 ids inserted after each of the first two
    (over 3 slots for 5 episodes, so slots are refilled); every generated token's log-prob is the
    full forward's over the whole sequence, inserted ids are marked, and after_turn sees each
    turn's ids and the room left."""
    _, params = _model()
    graphdef, _ = _model()
    core = decoding.DecodeCore(
        graphdef,
        CFG,
        slots=3,
        max_prefill_length=8,
        max_decode_length=40,
        sampling=decoding.SamplingConfig(temperature=0.8),
        sampleable_v=SAMPLEABLE,
    )
    seen: dict[int, list[tuple[int, str, int]]] = {}

    def after_turn(i, ids, finish, room):
        seen.setdefault(i, []).append((len(ids), finish, room))
        return [41, 42, 43 + i] if len(seen[i]) < 3 else None

    done = completions.complete_episodes(
        core, params, PROMPTS, stop_ids=(), turn_tokens=MAX_NEW, after_turn=after_turn
    )
    turn = [True] * MAX_NEW
    for i, (prompt, c) in enumerate(zip(PROMPTS, done, strict=True)):
        assert c.generated == (*turn, False, False, False, *turn, False, False, False, *turn)
        assert [c.ids[j] for j, g in enumerate(c.generated) if not g] == [41, 42, 43 + i] * 2
        # Room after each turn: 40 - 6, then 3 inserted and 6 generated less each time.
        assert seen[i] == [(MAX_NEW, "length", 34), (MAX_NEW, "length", 25),
                           (MAX_NEW, "length", 16)]  # fmt: skip
        ref = _reference_logp(prompt, c.ids, 0.8)
        gen = np.asarray(c.generated)
        want = ref[np.arange(len(c.ids)), list(c.ids)][gen]
        np.testing.assert_allclose(np.asarray(c.logp)[gen], want, atol=1e-4)
        assert c.finish == "length"


def _replayed_error(model, prompt: list[int], c: completions.Completion, temperature: float):
    """(max |trainer log-prob − behavior log-prob| over the generated ids under R3, replaying
    the completion's recorded routing of every id and the prompt's live routing, and the
    trainer's live routing [C, L, K] of the completion)."""
    p = len(prompt)
    tokens = jnp.asarray([[*prompt, *c.ids]], jnp.int32)
    live = np.asarray(model.forward(tokens).routing_btlk[0])
    routing = np.concatenate([live[:p], c.routing]).astype(live.dtype)[None]
    kw = dict(temperature=temperature, vocab_mask=jnp.asarray(SAMPLEABLE))
    logp = np.asarray(model.logprobs(tokens, replay_routing=jnp.asarray(routing), **kw)[0])[0, p:]
    gen = np.asarray(c.generated, bool) if c.generated else np.ones(len(c.ids), bool)
    return float(np.max(np.abs(logp - np.asarray(c.logp))[gen])), live[p:]


def test_episode_routing_is_recorded_and_replayed_like_single_turn() -> None:
    """Lag 0, float32: the cache extension records the inserted ids' routing, which is the
    trainer's own (live) routing of them; replaying every recorded routing, the trainer's
    log-probs of the generated ids after an observation equal the behavior log-probs as
    tightly as a single-turn completion's do."""
    graphdef, params = _model()
    model = nnx.merge(graphdef, params)
    core = decoding.DecodeCore(
        graphdef,
        CFG,
        slots=2,
        max_prefill_length=8,
        max_decode_length=40,
        sampling=decoding.SamplingConfig(temperature=0.8),
        sampleable_v=SAMPLEABLE,
    )
    turns: dict[int, int] = {}

    def after_turn(i, ids, finish, room):
        turns[i] = turns.get(i, 0) + 1
        return [41, 42, 43 + i, 5, 9] if turns[i] < 3 else None

    prompts = PROMPTS[:3]  # more than the slots: a slot is refilled; each is checked eagerly
    episodes = completions.complete_episodes(
        core, params, prompts, stop_ids=(), turn_tokens=MAX_NEW, after_turn=after_turn
    )
    singles = completions.complete(core, params, prompts)
    multi_err, single_err = [], []
    for prompt, c, s in zip(prompts, episodes, singles, strict=True):
        inserted = ~np.asarray(c.generated)
        assert c.routing.shape == (len(c.ids), CFG.num_moe_layers, CFG.num_experts_per_tok)
        err, live = _replayed_error(model, prompt, c, 0.8)
        np.testing.assert_array_equal(np.sort(c.routing[inserted], -1), np.sort(live[inserted], -1))
        np.testing.assert_array_equal(np.sort(c.routing, -1), np.sort(live, -1))
        multi_err.append(err)
        single_err.append(_replayed_error(model, prompt, s, 0.8)[0])
    print(f"max |logp - behavior| under R3: multi-turn {max(multi_err):.2e}, "
          f"single-turn {max(single_err):.2e}")  # fmt: skip
    assert max(multi_err) <= 1e-5 and max(single_err) <= 1e-5


@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.7, 0.9)])
def test_allowed_rows_constrain_one_slot_and_leave_the_others_bit_identical(temperature, top_p):
    """`generate(allowed_bv=...)`: the masked slot draws only allowed ids, with the log-prob of
    the model's distribution renormalized over them (after temperature, then top-p); a slot whose
    row is all True gets the tokens, log-probs and routing of the unmasked program, bit for
    bit."""
    _, params = _model()
    sampling = decoding.SamplingConfig(temperature=temperature, top_p=top_p)
    allowed = np.ones((2, CFG.vocab_size), bool)
    allowed[1] = False
    allowed[1, [3, 8, 21, 33]] = True  # with SAMPLEABLE: four ids
    plain, masked = _core(sampling), _core(sampling)
    states = []
    for core in (plain, masked):
        state = core.init_state()
        for slot, ids in enumerate([PROMPTS[0], PROMPTS[2]]):
            state = core.insert(core.prefill_prompt(params, ids), state, jnp.int32(slot))
        states.append(state)
    seq = [list(PROMPTS[2])]
    for _ in range(MAX_NEW):
        states[0], want = plain.generate(params, states[0], 0)
        states[1], got = masked.generate(params, states[1], 0, allowed)
        want = decoding.unpack_step(want, CFG.num_moe_layers, CFG.num_experts_per_tok)
        got = decoding.unpack_step(got, CFG.num_moe_layers, CFG.num_experts_per_tok)
        for key in ("token", "logp", "routing", "kept", "valid"):
            np.testing.assert_array_equal(got[key][0], want[key][0])
        token = int(got["token"][1])
        assert token in (3, 8, 21, 33)
        # The behavior log-prob: the full forward's logits of the slot's sequence, masked.
        graphdef, _ = _model()
        logits = nnx.merge(graphdef, params)(jnp.asarray([seq[0]], jnp.int32))[0, -1]
        logits = jnp.where(SAMPLEABLE & allowed[1], logits, -jnp.inf)[None]
        ref = decoding.sampling_logprobs(logits, sampling)[0]
        np.testing.assert_allclose(got["logp"][1], ref[token], rtol=0, atol=1e-5)
        assert got["kept"][1] == int(np.sum(np.isfinite(np.asarray(ref))))
        seq[0].append(token)
