"""The train step with the recipe options, at lag 0 on the tiny model in float32: the truncation
replay makes ``sampler_kl`` ≈ 0 where scoring over the whole vocabulary does not; recomputed
proximal log-probs equal the behavior log-probs; and the config refuses the combinations that
would silently do nothing."""

from __future__ import annotations

import functools

import jax
import numpy as np
import optax
import pytest

from sat_jax import completions, decoding, objectives, sharding
from sat_jax.experiment import ConfigError, load_config
from sat_jax.step import StepConfig, TrainBatch, create_train_state, make_train_step, shard_batch
from tests.sat_jax import test_decoding

CFG, SAMPLEABLE = test_decoding.CFG, test_decoding.SAMPLEABLE
PROMPTS = test_decoding.PROMPTS[:4]
G, MAX_NEW, T = 2, 6, 12
SAMPLING = decoding.SamplingConfig(temperature=0.8, top_k=20, top_p=0.9)


def _params():
    """The tiny model of tests/sat_jax/test_decoding.py: (graphdef, random float32 params)."""
    return test_decoding._model()


@functools.cache
def _batch() -> TrainBatch:
    """G samples of each prompt, sampled with top-k / top-p by the params being trained (lag 0)."""
    graphdef, params = _params()
    core = decoding.DecodeCore(
        graphdef, CFG, slots=4, max_prefill_length=8, max_decode_length=MAX_NEW,
        sampling=SAMPLING, sampleable_v=SAMPLEABLE,
    )  # fmt: skip
    prompts = [p for p in PROMPTS for _ in range(G)]
    done = completions.complete(core, params, prompts)
    rows = len(prompts)
    tokens, mask = np.zeros((rows, T), np.int32), np.zeros((rows, T), np.float32)
    behavior, kept = np.zeros((rows, T), np.float32), np.zeros((rows, T), np.int32)
    for r, (prompt, c) in enumerate(zip(prompts, done, strict=True)):
        p, n = len(prompt), len(c.ids)
        tokens[r, :p], tokens[r, p : p + n] = prompt, c.ids
        mask[r, p : p + n], behavior[r, p : p + n], kept[r, p : p + n] = 1.0, c.logp, c.kept
    return TrainBatch(
        tokens=tokens,
        loss_mask=mask,
        behavior_logp=behavior,
        rewards=np.random.default_rng(0).integers(0, 2, rows).astype(np.float32),
        group_ids=np.repeat(np.arange(len(PROMPTS)), G).astype(np.int32),
        kept_counts=kept,
        fresh_mask=mask.copy(),
    )


def _metrics(batch, loss_cfg, **options) -> dict:
    mesh = sharding.make_mesh(sharding.MeshConfig(fsdp=1), jax.devices()[:1])
    optimizer = optax.sgd(0.0)
    cfg = StepConfig(
        loss=loss_cfg,
        temperature=SAMPLING.temperature,
        kept_counts=batch.kept_counts is not None,
        **options,
    )
    step = make_train_step(CFG, optimizer, cfg, mesh, vocab_mask=SAMPLEABLE)
    state = create_train_state(CFG, optimizer, mesh, jax.device_get(_params()[1]))
    _, metrics = step(state, shard_batch(batch, mesh))
    return jax.device_get(metrics)


def test_sampler_kl_is_zero_with_the_replay_and_not_over_the_whole_vocabulary():
    batch = _batch()
    sat = objectives.PolicyLossConfig(sat=objectives.SATConfig(enabled=True))
    replayed = _metrics(batch, sat)
    full = _metrics(batch.replace(kept_counts=None), sat)
    assert replayed["fresh_tokens"] == full["fresh_tokens"] == batch.loss_mask.sum()
    assert replayed["sampler_kl"] < 1e-9 and replayed["mismatch_abs_mean"] < 1e-5
    assert full["sampler_kl"] > 1e-3 and full["mismatch_abs_mean"] > 0.05
    # The truncation read as staleness: SAT's threshold is the truncation's bias, not ~0.
    assert full["sat_q"] > 100 * replayed["sat_q"]
    # sampler_kl counts only lag-0 tokens: none here means 0 whatever the mismatch.
    stale = _metrics(
        batch.replace(kept_counts=None, fresh_mask=np.zeros_like(batch.loss_mask)), sat
    )
    assert stale["fresh_tokens"] == 0 and stale["sampler_kl"] == 0.0 and stale["kl_k3"] > 1e-3


@pytest.mark.parametrize("microbatches", [1, 2])
def test_recomputed_proximal_logprobs_equal_the_behavior_logprobs_at_lag_0(microbatches):
    """With TIS on recomputed proximal log-probs, the weights exp(old − behavior) are 1."""
    loss = objectives.PolicyLossConfig(tis_cap=100.0, seq_tis_cap=1e6)
    m = _metrics(_batch(), loss, microbatches=microbatches, recompute_old_logp=True)
    assert abs(m["tis_weight_mean"] - 1.0) < 1e-5, m["tis_weight_mean"]
    assert abs(m["seq_tis_weight_mean"] - 1.0) < 1e-4, m["seq_tis_weight_mean"]
    assert m["ratio_mean"] == 1.0  # r = exp(logp − stop_gradient(logp))
    # Behavior as the proximal policy: TIS needs old_logp, which nothing gives.
    with pytest.raises(ValueError, match="tis_cap is set but old_logp is None"):
        _metrics(_batch(), loss, microbatches=microbatches)


def test_recompute_refuses_a_batch_that_carries_old_logp():
    batch = _batch()
    with pytest.raises(ValueError, match="must not carry it"):
        _metrics(batch.replace(old_logp=batch.behavior_logp), objectives.PolicyLossConfig(),
                 recompute_old_logp=True)  # fmt: skip


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["train.loss.tis_cap=2.0"], "loss.tis_cap weighs behavior → proximal"),
        (["train.loss.seq_mask_range=[0.5,2.0]"], "loss.seq_mask_range weighs"),
        (["train.old_logp=recompute"], "old_logp 'recompute' with loss.sat.enabled"),
        (
            [
                "train.old_logp=recompute",
                "train.loss.sat.enabled=false",
                "train.loss.dppo_tv_delta=0.1",
            ],
            "with loss.dppo_tv_delta",
        ),
        (["train.old_logp=proximal"], "old_logp must be one of"),
        (["rollout.logprob_replay=none"], "logprob_replay must be 'truncated' or 'full'"),
    ],
)
def test_config_refuses_inert_or_incomplete_combinations(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_config_accepts_the_decoupled_recipe_and_knows_when_to_replay():
    cfg = load_config(
        None,
        ["train.old_logp=recompute", "train.loss.sat.enabled=false", "train.loss.tis_cap=2.0",
         "train.loss.seq_mask_range=[0.5,2.0]"],
    )  # fmt: skip
    assert cfg.train.old_logp == "recompute" and cfg.train.loss.seq_mask_range == (0.5, 2.0)
    assert not load_config(None, []).rollout.replays_truncation  # no truncation
    assert load_config(None, ["rollout.top_p=0.9"]).rollout.replays_truncation
    assert load_config(None, ["rollout.top_k=5"]).rollout.replays_truncation
    assert not load_config(
        None, ["rollout.top_k=5", "rollout.logprob_replay=full"]
    ).rollout.replays_truncation
