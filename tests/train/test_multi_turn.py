"""Multi-turn trajectories on the trainer side (issue 24, docs/DESIGN.md §7.1): observation tokens
(``Trajectory.loss_mask`` 0, inserted by the environment) are context only. Out of the loss, SAT's
quantile and every metric; their behavior log-probs, versions and kept counts (unspecified on the
wire) reach neither the batch nor the staleness checks; R3 replays their recorded routing (the
server's cache extension records it), like every other position's.

"Only the observation tokens' values change" cannot include their token ids or routing in the
middle of a trajectory: those are the context of the later generated tokens, and the loss must
see them. What an observation token carries besides (its behavior log-prob, version and kept
count) may change freely; and the loss terms of an observation position's own log-prob are
shown out of the loss separately, by changing the ids of observation tokens that END a trajectory
(a turn cut at the token limit, closed by end-of-turn tokens, then the episode ended): they are in
no generated token's context, so only their own log-prob terms see them.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import optax
import pytest

from rollout_api import records
from sat_jax import objectives, sharding
from sat_jax.model import ModelConfig, placement
from sat_jax.step import (
    StepConfig,
    TrainBatch,
    create_train_state,
    make_train_step,
    shard_batch,
)
from tests.train.test_batching import assemble, make_group, spec
from train import batching

MODEL = ModelConfig.preset("tiny", dispatch="dense", router_aux_loss_coef=0.05)
LK = (MODEL.num_moe_layers, MODEL.num_experts_per_tok)
P = 3
# Completion of 10: turn 1 (3 generated), an observation (3), turn 2 (2 generated), 2 end-of-turn
# tokens inserted after a cut turn, at the end.
GENERATED = np.array([1, 1, 1, 0, 0, 0, 1, 1, 0, 0], bool)
OBS = np.flatnonzero(~GENERATED)
MID_OBS = OBS[OBS < 6]  # in the context of turn 2
END_OBS = OBS[OBS >= 8]  # after the last generated token


def episode(
    seed: int, reward: float, version: int, *, garbage: int | None = None
) -> records.Trajectory:
    """A multi-turn trajectory; its tokens' values and routing come from ``seed``, its
    observation tokens' log-probs, versions and kept counts from ``garbage`` (None: the values
    a careful server would send: 0.0, the version, 1 kept)."""
    rng = np.random.default_rng(seed)
    c = GENERATED.size
    routing = np.stack(
        [
            rng.permutation(MODEL.num_experts)[: LK[1]].astype(np.uint8)
            for _ in range((P + c) * LK[0])
        ]
    ).reshape(P + c, *LK)
    t = records.Trajectory(
        prompt_ids=np.array([1, 5, 6], np.int32),
        completion_ids=rng.integers(2, MODEL.vocab_size, c).astype(np.int32),
        behavior_logprobs=-rng.uniform(0.5, 4.0, c).astype(np.float32),
        versions=np.full(c, version, np.int64),
        routing=routing,
        kept_counts=rng.integers(1, MODEL.vocab_size, c).astype(np.int32),
        loss_mask=GENERATED,
        reward=reward,
    )
    n = OBS.size
    if garbage is None:
        values = np.zeros(n, np.float32), np.full(n, version), np.ones(n, np.int32)
    else:
        g = np.random.default_rng(1000 + garbage)
        values = (
            -g.uniform(0.0, 30.0, n).astype(np.float32),
            g.integers(-(2**40), 2**40, n),
            g.integers(-5, 10**6, n).astype(np.int32),
        )
    behavior, versions, kept = t.behavior_logprobs.copy(), t.versions.copy(), t.kept_counts.copy()
    behavior[OBS], versions[OBS], kept[OBS] = values
    return dataclasses.replace(t, behavior_logprobs=behavior, versions=versions, kept_counts=kept)


def groups(garbage: int | None = None) -> list[records.Group]:
    """Two groups of two episodes at trainer version 5, one with a lag-1 episode."""
    g = lambda i: None if garbage is None else garbage + i
    rows = [
        (episode(1, 1.0, 5, garbage=g(0)), episode(2, 0.0, 4, garbage=g(1))),
        (episode(3, 0.5, 5, garbage=g(2)), episode(4, 0.0, 5, garbage=g(3))),
    ]
    return [
        records.Group(group_id=i, prompt_id=f"p{i}", trajectories=trajs)
        for i, trajs in enumerate(rows)
    ]


def batch_spec(**kw) -> batching.BatchSpec:
    base = dict(
        batch_groups=2,
        seq_len=16,
        routing_lk=LK,
        vocab_size=MODEL.vocab_size,
        num_experts=MODEL.num_experts,
        kept_counts=True,
    )
    return spec(**(base | kw))


def assert_same_batch(a: TrainBatch, b: TrainBatch) -> None:
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert x.dtype == y.dtype
        np.testing.assert_array_equal(x, y)


def test_observation_values_do_not_reach_the_batch_or_its_stats():
    s = batch_spec()
    clean, clean_stats = assemble(groups(), s, trainer_version=5)
    for garbage in (0, 10):
        batch, stats = assemble(groups(garbage), s, trainer_version=5)
        assert_same_batch(batch, clean)
        assert stats == dataclasses.replace(clean_stats, lags=stats.lags)
        np.testing.assert_array_equal(stats.lags, clean_stats.lags)
    # What the batch holds at the observation positions: the padding's values, and the
    # recorded routing (R3 replays it).
    row = slice(P, P + GENERATED.size)
    np.testing.assert_array_equal(clean.loss_mask[:4, row], np.tile(GENERATED, (4, 1)))
    assert not clean.behavior_logp[:, P + OBS].any() and not clean.kept_counts[:, P + OBS].any()
    assert not clean.fresh_mask[:, P + OBS].any()
    for r, t in enumerate(g for group in groups(7) for g in group.trajectories):
        np.testing.assert_array_equal(clean.routing[r, : P + GENERATED.size], t.routing)
    # Generated tokens keep theirs.
    t = groups(7)[0].trajectories[0]
    np.testing.assert_array_equal(
        clean.behavior_logp[0, row][GENERATED], t.behavior_logprobs[GENERATED]
    )
    np.testing.assert_array_equal(clean.kept_counts[0, row][GENERATED], t.kept_counts[GENERATED])
    np.testing.assert_array_equal(clean.routing[0, row][GENERATED], t.routing[P:][GENERATED])
    np.testing.assert_array_equal(
        clean.fresh_mask[:4, row], [GENERATED, 0 * GENERATED, GENERATED, GENERATED]
    )
    # Counts: 5 generated tokens a row; lags only of those (row 1 has lag 1).
    assert clean_stats.tokens == 20 and clean_stats.response_len_mean == 5.0
    np.testing.assert_array_equal(clean_stats.lags, [0] * 5 + [1] * 5 + [0] * 10)
    assert clean_stats.pad_frac == pytest.approx(1 - 4 * 13 / (4 * 16))  # observations are real


@pytest.mark.parametrize("policy", ["drop", "keep"])
def test_staleness_and_min_version_read_generated_tokens_only(policy):
    """Ancient or pre-sync versions at observation positions neither drop a group nor count it
    stale; the same version at a generated position does."""
    s = batch_spec(stale_policy=policy, max_staleness=1)
    old_obs = groups(garbage=0)  # observation versions down to -2**40
    selection = batching.select_groups(old_obs, s, trainer_version=5, min_version=4)
    assert len(selection.kept) == 2 and selection.stale_dropped == selection.stale_kept == 0
    # A generated token of version 3: stale (lag 2 > 1), and below min_version 4.
    t = old_obs[0].trajectories[0]
    versions = t.versions.copy()
    versions[1] = 3
    stale = dataclasses.replace(
        old_obs[0],
        trajectories=(dataclasses.replace(t, versions=versions), *old_obs[0].trajectories[1:]),
    )
    selection = batching.select_groups([stale], s, trainer_version=5, min_version=0)
    assert (selection.stale_dropped, selection.stale_kept) == (
        (1, 0) if policy == "drop" else (0, 1)
    )
    selection = batching.select_groups([stale], s, trainer_version=5, min_version=4)
    assert selection.stale_dropped == 1 and not selection.kept


def test_the_soft_overlong_punishment_reads_the_longest_turn():
    t = episode(1, 1.0, 5)
    assert batching.longest_turn(t) == 3
    assert batching.longest_turn(dataclasses.replace(t, loss_mask=None)) == 10
    s = batch_spec(overlong="soft", overlong_cache=2, max_new_tokens=4, overlong_penalty=1.0)
    batch, _ = assemble(groups(), s, trainer_version=5)
    # Turns of 3 and 2 tokens: 3 = L_max - L_cache + 1, punished by 1/2 (not the 10 tokens).
    np.testing.assert_allclose(batch.rewards[:4], np.array([1.0, 0.0, 0.5, 0.0]) - 0.5)


def _turns(turns: list[tuple[int, int]], finish: str) -> records.Trajectory:
    """An episode of [(generated, inserted)] token runs with the server's finish reason."""
    mask = np.concatenate([[True] * g + [False] * i for g, i in turns]).astype(bool)
    c, lk = mask.size, (MODEL.num_moe_layers, MODEL.num_experts_per_tok)
    return records.Trajectory(
        prompt_ids=np.array([1, 5, 6], np.int32),
        completion_ids=np.full(c, 7, np.int32),
        behavior_logprobs=np.full(c, -1.0, np.float32),
        versions=np.zeros(c, np.int64),
        routing=np.broadcast_to(np.arange(lk[1], dtype=np.uint8), (P + c, *lk)).copy(),
        loss_mask=mask,
        reward=1.0,
        finish_reason=finish,
    )


# max_new_tokens 4, overlong_cache 2, penalty 1: a turn of 3 tokens is punished by 1/2.
OVERLONG_CASES = {
    # The middle turn was cut at max_new_tokens, the last ended on its stop id: the server
    # records "length" (any cut turn), so mask masks it and soft gives the full punishment.
    "middle_turn_cut": (_turns([(4, 2), (1, 0)], "length"), True, -1.0),
    # The episode's token budget cut the last turn after 2 tokens: overlong too, although no
    # turn reached max_new_tokens.
    "budget_cut": (_turns([(1, 2), (2, 0)], "length"), True, -1.0),
    # Every turn ended on its stop id: not overlong; soft grades its longest turn (3 tokens).
    "stopped": (_turns([(3, 2), (1, 0)], "stop"), False, -0.5),
    # Ended because the next observation would not fit: no turn was cut, not overlong.
    "observation_did_not_fit": (_turns([(2, 2), (1, 0)], "stop"), False, 0.0),
}


@pytest.mark.parametrize("case", list(OVERLONG_CASES))
def test_mask_and_soft_agree_on_which_episodes_are_overlong(case):
    """One definition (finish reason "length": a turn was cut, by max_new_tokens or the
    episode's budget) for both modes: a masked episode is exactly one soft punishes fully."""
    traj, overlong, shaping = OVERLONG_CASES[case]
    group = records.Group(group_id=0, prompt_id="p", trajectories=(traj, traj))
    kw = dict(batch_groups=1, max_new_tokens=4, overlong_cache=2, overlong_penalty=1.0)
    masked, stats = assemble([group], batch_spec(overlong="mask", **kw), trainer_version=0)
    assert (not masked.loss_mask[:2].any()) == overlong
    assert stats.overlong_frac == float(overlong)
    soft, _ = assemble([group], batch_spec(overlong="soft", **kw), trainer_version=0)
    np.testing.assert_allclose(soft.rewards[:2], 1.0 + shaping)
    assert soft.loss_mask[:2].any()


def test_single_turn_batches_are_unchanged_by_an_all_generated_mask():
    plain = [make_group(1, [1, 0], [[1, 1], [1, 1, 1]]), make_group(2, [0.5, 0], [[1], [1] * 4])]
    ones = [
        dataclasses.replace(
            g,
            trajectories=tuple(
                dataclasses.replace(t, loss_mask=np.ones(t.completion_ids.size, bool))
                for t in g.trajectories
            ),
        )
        for g in plain
    ]
    a, a_stats = assemble(plain, spec(), trainer_version=1)
    b, b_stats = assemble(ones, spec(), trainer_version=1)
    assert_same_batch(a, b)
    assert dataclasses.replace(a_stats, lags=b_stats.lags) == b_stats


def test_observation_positions_are_out_of_sats_quantile():
    """q over the loss-mask tokens only: huge log-ratios at mask-0 positions would move it."""
    rng = np.random.default_rng(0)
    logp = -rng.uniform(0.5, 3.0, (2, 12)).astype(np.float32)
    behavior = logp + rng.normal(0, 0.1, logp.shape).astype(np.float32)
    mask = np.zeros((2, 12), np.float32)
    mask[:, 2:12] = GENERATED
    behavior[:, 2 + OBS] = logp[:, 2 + OBS] + 25.0  # |d| = 25 at every observation
    cfg = objectives.PolicyLossConfig(sat=objectives.SATConfig(enabled=True, quantile=0.9))
    q = float(objectives.sat_threshold(logp, behavior, mask, cfg))
    d = np.abs(logp - behavior)[mask > 0]
    assert q == np.quantile(d, 0.9, method="inverted_cdf")
    counted = mask.copy()
    counted[:, 2 + OBS] = 1.0
    moved = float(objectives.sat_threshold(logp, behavior, counted, cfg))
    assert moved == pytest.approx(25.0, abs=1e-4) and q < 1.0  # counted, they would move q


def _step_runs(configs):
    """[(metrics, params)] of one train step per (batch, step options) on fresh equal states."""
    mesh = sharding.make_mesh(sharding.MeshConfig(fsdp=1), jax.devices()[:1])
    _, params0 = placement.init_sharded(MODEL, mesh, 0)
    params0 = jax.device_get(params0)
    compiled, out = {}, []
    for batch, options in configs:
        key = tuple(sorted(options.items()))
        if key not in compiled:
            loss_cfg = objectives.PolicyLossConfig(
                sat=objectives.SATConfig(enabled=True, quantile=0.5),
                tis_cap=2.0 if options.get("recompute_old_logp") else None,
            )
            cfg = StepConfig(
                loss=loss_cfg,
                routing_replay=True,
                kept_counts=batch.kept_counts is not None,
                **options,
            )
            compiled[key] = make_train_step(MODEL, optax.sgd(0.1), cfg, mesh)
        state = create_train_state(MODEL, optax.sgd(0.1), mesh, params0)
        state, metrics = compiled[key](state, shard_batch(batch, mesh))
        out.append((jax.device_get(metrics), jax.device_get(state.params)))
    return out


def _perturb_observations(batch: TrainBatch, seed: int) -> TrainBatch:
    """Other behavior log-probs, kept counts and fresh flags at the observation positions in the
    middle of every row (not their token ids or routing: they are context)."""
    rng = np.random.default_rng(seed)
    at = (slice(0, 4), P + MID_OBS)
    behavior, kept = np.array(batch.behavior_logp), np.array(batch.kept_counts)
    fresh = np.array(batch.fresh_mask)
    n = 4 * MID_OBS.size
    behavior[at] = -rng.uniform(0, 30, n).reshape(4, -1)
    kept[at] = rng.integers(0, MODEL.vocab_size + 5, n).reshape(4, -1)
    fresh[at] = 1
    return batch.replace(behavior_logp=behavior, kept_counts=kept, fresh_mask=fresh)


def _reroute_observations(batch: TrainBatch, seed: int) -> TrainBatch:
    """Other routing at the observation positions in the middle of every row."""
    rng = np.random.default_rng(seed)
    routing = np.array(batch.routing)
    n = 4 * MID_OBS.size
    ids = np.stack([rng.permutation(MODEL.num_experts)[: LK[1]] for _ in range(n * LK[0])])
    routing[:4, P + MID_OBS] = ids.reshape(4, MID_OBS.size, *LK).astype(routing.dtype)
    return batch.replace(routing=routing)


def _with_end_tokens(batch: TrainBatch, seed: int) -> TrainBatch:
    """Other token ids (and values) of the observation tokens that end every row."""
    rng = np.random.default_rng(seed)
    tokens = np.array(batch.tokens)
    tokens[:4, P + END_OBS] = rng.integers(0, MODEL.vocab_size, (4, END_OBS.size))
    kept = np.array(batch.kept_counts)
    kept[:4, P + END_OBS] = 1  # a truncated set: the own log-prob term changes a lot
    return batch.replace(tokens=tokens, kept_counts=kept)


@pytest.mark.parametrize(
    "options", [dict(), dict(microbatches=2, recompute_old_logp=True)], ids=["plain", "micro_tis"]
)
def test_observation_values_change_neither_loss_metrics_nor_gradients(options):
    """The "done when" test: R3 on, SAT on, truncation replay, fresh mask; bit-identical."""
    base, _ = assemble(groups(), batch_spec(), trainer_version=5)
    variants = [base, _perturb_observations(base, 1), _with_end_tokens(base, 2)]
    # The controls: the same perturbation at a GENERATED position changes the step, and so
    # does other routing at the observation positions (R3 replays it: they are context).
    control = np.array(base.behavior_logp)
    control[0, P + 1] -= 3.0
    variants.append(base.replace(behavior_logp=control))
    variants.append(_reroute_observations(base, 3))
    runs = _step_runs([(b, options) for b in variants])
    (m0, p0), *same, (mc, pc), (mr, pr) = runs
    assert m0["step_skipped"] == 0 and m0["active_tokens"] == 20
    for m, p in same:
        assert m.keys() == m0.keys()
        for k in m0:
            np.testing.assert_array_equal(m[k], m0[k], err_msg=k)
        for x, y in zip(jax.tree.leaves(p), jax.tree.leaves(p0), strict=True):
            np.testing.assert_array_equal(x, y)
    assert mc["mismatch_abs_mean"] != m0["mismatch_abs_mean"]
    assert mr["mismatch_abs_mean"] != m0["mismatch_abs_mean"]
