"""Multi-turn episodes through the real engine, driver and rollout loop (in process).

A scripted policy (`ForcedCore`: the engine's sampler returns given tokens at given cache
positions, with their log-probs under the model) plays the `feedback` environment: a wrong answer,
a turn cut at `max_new_tokens`, then the right answer. The trajectory must be exactly the turns
and the chat template's deltas between them, with loss mask 0 on every inserted token, and every
generated token's behavior log-prob must equal one full forward over the whole multi-turn
sequence (the KV-cache extension is exact).
"""

from __future__ import annotations

import time

import grain
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rollout_server import engine as engine_module
from rollout_server import jetstream_compat  # noqa: F401  (must precede jetstream imports)

# isort: split
from rollout_api import records
from rollout_server.driver import RolloutDriver
from rollout_server.engine import MoEEngine
from rollout_server.persistence import StateStore
from rollout_server.rollout import RolloutLoop
from sat_jax.config import RolloutConfig, ServerConfig
from sat_jax.decoding import DecodeCore, SamplingConfig, sample, sampling_logprobs
from sat_jax.model import ModelConfig, Transformer, token_logprobs
from sat_jax.tasks import Prompt, exact_match_reward
from sat_jax.tasks.envs import (
    CALCULATOR_TOOL,
    RETRY_MESSAGE,
    Calculator,
    EnvConfig,
    EpisodeRunner,
    Feedback,
)
from sat_jax.tasks.envs.calculator import find_tool_calls, run_tool_call
from sat_jax.tasks.hf_tokenizer import HFTokenizer
from tests.hf_fixtures import make_tokenizer

TURN_TOKENS = 6  # rollout.max_new_tokens: each turn's bound
EPISODE_TOKENS = 400  # the engine's per-slot completion budget
PROMPT = Prompt(id="p0", text="What is 5 + 7?", answer="12")


class ForcedCore(DecodeCore):
    """`DecodeCore` whose sampler returns `SCRIPT[position]` where it is >= 0 (the token's
    log-prob is still the model's), and samples elsewhere."""

    SCRIPT = np.full((1,), -1, np.int32)

    def _sample(self, logits_bv, key, positions_b):
        tokens_b, _, kept_b = sample(logits_bv, key, self.sampling)
        script = jnp.asarray(self.SCRIPT)
        forced_b = script[jnp.minimum(positions_b, script.shape[0] - 1)]
        tokens_b = jnp.where(forced_b >= 0, forced_b, tokens_b)
        logp_bv = sampling_logprobs(logits_bv, self.sampling)
        return tokens_b, jnp.take_along_axis(logp_bv, tokens_b[:, None], axis=-1)[:, 0], kept_b


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    make_tokenizer(path)
    return HFTokenizer(str(path), chat_template=True)


def _ids(tokenizer, text):
    return tokenizer._tok(text, add_special_tokens=False)["input_ids"]


def _env_config(turn_discount=1.0):
    return EnvConfig(
        reward="exact_match",
        system_prompt="",
        max_turns=4,
        max_episode_tokens=EPISODE_TOKENS,
        turn_discount=turn_discount,
    )


def _scripted(turns, prompt_ids):
    """(completion, loss mask, the forced-token script) of [(generated ids, inserted ids)]."""
    completion, mask = [], []
    for generated, inserted in turns:
        completion += generated + inserted
        mask += [True] * len(generated) + [False] * len(inserted)
    script = np.full(len(prompt_ids) + EPISODE_TOKENS + 1, -1, np.int32)
    p = len(prompt_ids)
    for i, (tok, gen) in enumerate(zip(completion, mask, strict=True)):
        if gen:
            script[p + i] = tok
    return completion, mask, script


def _run_episodes(
    tokenizer,
    monkeypatch,
    tmp_path,
    *,
    script,
    turn_discount=0.5,
    groups=1,
    env=Feedback,
    turn_tokens=TURN_TOKENS,
):
    """Runs `groups` groups of 2 episodes of `env` with the engine forced by `script`; returns
    (the decoded groups, the engine, the model's params)."""
    end = int(tokenizer._tok.convert_tokens_to_ids("<|im_end|>"))
    cfg = ModelConfig.preset("tiny").replace(vocab_size=len(tokenizer), max_seq_len=512)
    model = Transformer(cfg, rngs=nnx.Rngs(jax.random.key(0, impl="rbg")))
    monkeypatch.setattr(ForcedCore, "SCRIPT", np.asarray(script, np.int32))
    monkeypatch.setattr(engine_module, "DecodeCore", ForcedCore)
    engine = MoEEngine(
        model,
        tokenizer=tokenizer,
        slots=2,
        max_prefill_length=64,
        max_decode_length=EPISODE_TOKENS,
        sampling=SamplingConfig(),
    )
    params = engine.load_params()
    driver = RolloutDriver.interleaved(engine)
    loop = RolloutLoop(
        driver=driver,
        engine=engine,
        prompts=grain.MapDataset.source([PROMPT]).repeat().to_iter_dataset(),
        reward_fn=exact_match_reward,
        tokenizer=tokenizer,
        cfg=RolloutConfig(
            group_size=2, max_new_tokens=turn_tokens, batch_groups=groups, max_staleness=0
        ),
        store=StateStore(str(tmp_path / "state")),
        wait_for_weights=False,
        max_response_bytes=ServerConfig().max_message_bytes,
        lease_s=600.0,
        episodes=EpisodeRunner(env, _env_config(turn_discount), tokenizer),
    )
    loop.start()
    try:
        deadline = time.monotonic() + 300
        while len(loop.queue) < groups:
            assert time.monotonic() < deadline, "no group within 300 s"
            assert loop.alive()
            time.sleep(0.05)
    finally:
        loop.stop()
        driver.stop()
    got = [records.decode_group(m) for m in loop.queue.snapshot()[:groups]]
    assert end in tokenizer.stop_ids
    return got, engine, params


def test_a_scripted_policy_gives_the_exact_turns_deltas_and_mask(tokenizer, monkeypatch, tmp_path):
    end = int(tokenizer._tok.convert_tokens_to_ids("<|im_end|>"))
    prompt_ids = tokenizer.encode_messages([{"role": "user", "content": PROMPT.text}])
    retry = [{"role": "user", "content": RETRY_MESSAGE}]
    wrong = [*_ids(tokenizer, "7"), end]
    cut = _ids(tokenizer, "1 + 1 + 1 + 1 + 1 + 1")[:TURN_TOKENS]  # no stop: cut at the bound
    right = [*_ids(tokenizer, "12"), end]
    obs1 = tokenizer.observation_ids(retry)
    obs2 = tokenizer.observation_ids(retry, close_turn=True)
    assert obs2[0] == end and obs2[1:] == obs1  # the template closes the cut turn first
    completion, mask, script = _scripted([(wrong, obs1), (cut, obs2), (right, [])], prompt_ids)
    p = len(prompt_ids)

    groups, engine, params = _run_episodes(tokenizer, monkeypatch, tmp_path, script=script)

    (group,) = groups
    for t in group.trajectories:
        assert t.prompt_ids.tolist() == prompt_ids
        assert t.completion_ids.tolist() == completion
        np.testing.assert_array_equal(t.loss_mask, mask)
        # The last turn ended with its stop token, but the middle one was cut: overlong.
        assert t.finish_reason == "length"
        assert t.reward == pytest.approx(0.5**2)  # right at turn 3, discounted twice
        assert t.num_generated == len(wrong) + len(cut) + len(right)
        # The inserted tokens decode to the environment's message, in the template's frame.
        inserted = tokenizer._tok.decode(np.asarray(completion)[~np.asarray(mask)])
        assert inserted.count(RETRY_MESSAGE) == 2
        assert inserted.endswith("<|im_start|>assistant\n")
    # One prefill per group of the prompt; each extension computed only its observation tokens.
    assert engine.prefill_tokens == len(prompt_ids)
    assert engine.extend_tokens == 2 * (len(obs1) + len(obs2))

    # Every generated token's behavior log-prob equals one full forward over the whole sequence.
    model = nnx.merge(engine.core.graphdef, params)
    seq = jnp.asarray([prompt_ids + completion], jnp.int32)
    logits = model(seq)
    want = token_logprobs(
        logits[:, p - 1 : -1], seq[:, p:], vocab_mask=jnp.asarray(engine.sampleable_ids)
    )[0]
    for t in group.trajectories:
        np.testing.assert_allclose(
            t.behavior_logprobs[t.loss_mask], np.asarray(want)[np.asarray(mask)], atol=2e-4
        )

    # Every position's recorded routing, the inserted tokens' included (the extension's), is
    # the trainer's own routing of it at lag 0; replaying it, the trainer's log-probs are the
    # behavior log-probs at every generated token.
    live = np.sort(np.asarray(model.forward(seq).routing_btlk[0]), -1)
    inserted = p + np.flatnonzero(~np.asarray(mask))
    for t in group.trajectories:
        np.testing.assert_array_equal(np.sort(t.routing, -1)[inserted], live[inserted])
        np.testing.assert_array_equal(np.sort(t.routing, -1), live)
        replayed = model.logprobs(
            seq,
            vocab_mask=jnp.asarray(engine.sampleable_ids),
            replay_routing=jnp.asarray(t.routing.astype(np.int32))[None],
        )[0]
        np.testing.assert_allclose(
            t.behavior_logprobs[t.loss_mask],
            np.asarray(replayed)[0, p:][np.asarray(mask)],
            atol=2e-4,
        )


def test_an_episode_out_of_tokens_ends_with_its_last_turn(tokenizer, monkeypatch, tmp_path):
    """Wrong answers that never stop: every turn is cut, and the episode ends when the next
    observation would not fit its token budget (never by overflowing the slot)."""
    prompt_ids = tokenizer.encode_messages([{"role": "user", "content": PROMPT.text}])
    filler = _ids(tokenizer, "1 + 1 + 1 + 1 + 1 + 1 + 1 + 1 + 1 + 1 + 1 + 1 + 1 + 1")
    script = np.full(len(prompt_ids) + EPISODE_TOKENS + 1, filler[0], np.int32)
    groups, _, _ = _run_episodes(tokenizer, monkeypatch, tmp_path, script=script)
    for t in groups[0].trajectories:
        assert t.completion_ids.size <= EPISODE_TOKENS
        assert t.finish_reason == "length" and t.reward == 0.0
        runs = np.flatnonzero(np.diff(t.loss_mask.astype(int)) != 0)
        assert len(runs) >= 2  # at least one observation was inserted
        assert t.loss_mask[-1]  # it ended on a generated turn


def test_hostile_and_good_tool_calls_of_a_scripted_policy(tokenizer, monkeypatch, tmp_path):
    """`calculator` with its tools in the prompt: a hostile call (a tower of powers) is answered
    with an error message and the episode goes on, a good call with its result, and the answer
    after it earns the reward."""
    end = int(tokenizer._tok.convert_tokens_to_ids("<|im_end|>"))
    opening = Calculator(_env_config()).reset(PROMPT)
    prompt_ids = tokenizer.encode_messages(opening, tools=[CALCULATOR_TOOL])
    call = '<tool_call>{{"name": "calculator", "arguments": {{"expression": "{}"}}}}</tool_call>'
    hostile, good = call.format("9**9**9**9"), call.format("5 + 7")
    error = run_tool_call(find_tool_calls(hostile)[0])
    result = run_tool_call(find_tool_calls(good)[0])
    assert error.startswith("error:") and result == "12"
    tool = lambda content: tokenizer.observation_ids([{"role": "tool", "content": content}])
    turns = [
        ([*_ids(tokenizer, hostile), end], tool(error)),
        ([*_ids(tokenizer, good), end], tool(result)),
        ([*_ids(tokenizer, "12"), end], []),
    ]
    completion, mask, script = _scripted(turns, prompt_ids)
    groups, _, _ = _run_episodes(
        tokenizer,
        monkeypatch,
        tmp_path,
        script=script,
        env=Calculator,
        turn_discount=1.0,
        turn_tokens=120,
    )
    for t in groups[0].trajectories:
        assert t.prompt_ids.tolist() == prompt_ids
        assert t.completion_ids.tolist() == completion
        np.testing.assert_array_equal(t.loss_mask, mask)
        assert t.reward == 1.0
        inserted = tokenizer._tok.decode(np.asarray(completion)[~np.asarray(mask)])
        assert error in inserted and "\n12<|im_end|>" in inserted


def test_a_weight_swap_between_turns_versions_the_next_turn(tokenizer, monkeypatch, tmp_path):
    """New weights installed while the environment answers turn 1: the extension and every token
    of turn 2 on carry the new version, turn 1's the old one."""
    swap = {}

    class SwappingFeedback(Feedback):
        def step(self, text):
            if self.turn == 1 and "engine" in swap:  # on the loop's thread, before the extension
                engine = swap.pop("engine")
                version, params = engine.current_params()
                engine.swap_params(version + 1, jax.tree.map(lambda x: x * 1.01, params))
            return super().step(text)

    end = int(tokenizer._tok.convert_tokens_to_ids("<|im_end|>"))
    prompt_ids = tokenizer.encode_messages([{"role": "user", "content": PROMPT.text}])
    retry = tokenizer.observation_ids([{"role": "user", "content": RETRY_MESSAGE}])
    wrong, right = [*_ids(tokenizer, "7"), end], [*_ids(tokenizer, "12"), end]
    completion, mask, script = _scripted([(wrong, retry), (right, [])], prompt_ids)
    real_init = MoEEngine.__init__

    def init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        swap["engine"] = self

    monkeypatch.setattr(MoEEngine, "__init__", init)
    groups, _, _ = _run_episodes(
        tokenizer, monkeypatch, tmp_path, script=script, env=SwappingFeedback, groups=1
    )
    # The environment runs turns one at a time on the loop's thread, so the swap (at the first
    # turn it steps) precedes every extension: turn 2 is the new version in both samples, and
    # the sample whose turn ended first sampled all of turn 1 with the old weights.
    gen = np.asarray(mask)
    turn2 = slice(len(wrong) + len(retry), None)
    firsts = []
    for t in groups[0].trajectories:
        assert t.completion_ids.tolist() == completion
        v = np.asarray(t.versions)
        assert set(v[turn2][gen[turn2]].tolist()) == {1}, v
        assert np.all(np.diff(v[gen]) >= 0), v  # versions never go back
        firsts.append(set(v[: len(wrong)].tolist()))
    assert {0} in firsts, firsts
