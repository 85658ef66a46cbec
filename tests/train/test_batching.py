"""Batch assembly: alignment, fixed shapes, lag tagging, the staleness policy, the rewards and group
ids the step turns into advantages, and the counts that reach ``BatchStats`` on the live path
(``pulling.next_batch``)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from rollout_api import records
from sat_jax.model import placement
from sat_jax.step import (
    StepConfig,
    create_train_state,
    make_train_step,
    shard_batch,
    with_advantages,
)
from train import batching, pulling

L, K = 2, 2


def make_group(
    group_id: int,
    rewards: list[float],
    versions: list[list[int]],
    *,
    prompt: tuple[int, ...] = (1, 5, 6),
) -> records.Group:
    trajs = []
    for i, (reward, vs) in enumerate(zip(rewards, versions, strict=True)):
        c = len(vs)
        trajs.append(
            records.Trajectory(
                prompt_ids=np.array(prompt, np.int32),
                completion_ids=np.arange(10, 10 + c, dtype=np.int32),
                behavior_logprobs=-0.5 - np.arange(c, dtype=np.float32),
                versions=np.array(vs, np.int64),
                routing=np.full((len(prompt) + c, L, K), 3 + i, np.uint8),
                reward=reward,
            )
        )
    return records.Group(group_id=group_id, prompt_id=f"p{group_id}", trajectories=tuple(trajs))


def spec(**kw) -> batching.BatchSpec:
    base = dict(
        batch_groups=3,
        group_size=2,
        seq_len=10,
        length_bucket=0,
        routing_lk=(L, K),
        routing_dtype="uint8",
        max_staleness=1,
        stale_policy="drop",
        vocab_size=64,
        num_experts=8,
    )
    return batching.BatchSpec(**(base | kw))


def assemble(groups, batch_spec, *, trainer_version, min_version=0, seen=()):
    """select_groups then assemble_batch, as the live path does (`seen`: trained group keys)."""
    selection = batching.select_groups(
        groups,
        batch_spec,
        trainer_version=trainer_version,
        min_version=min_version,
        seen_groups=seen,
    )
    return batching.assemble_batch(selection, batch_spec, trainer_version=trainer_version)


def advantages(batch) -> np.ndarray:
    """[R, T] the advantages the train step computes from the batch's rewards and group ids
    (GRPO with the std division, the step's defaults)."""
    with_adv = with_advantages(batch)
    return np.asarray(with_adv.advantages)


def test_alignment_shapes_and_advantages():
    groups = [make_group(7, [1.0, 0.0], [[5, 5], [5, 5, 5]])]
    batch, stats = assemble(groups, spec(), trainer_version=5)
    # Per-row rewards and group ids (-1: padding rows); the step derives the advantages.
    assert batch.advantages is None
    np.testing.assert_array_equal(batch.rewards, [1, 0, 0, 0, 0, 0])
    np.testing.assert_array_equal(batch.group_ids, [0, 0, -1, -1, -1, -1])
    assert batch.rewards.dtype == np.float32 and batch.group_ids.dtype == np.int32
    assert batch.tokens.shape == (6, 10) and batch.routing.shape == (6, 10, L, K)
    np.testing.assert_array_equal(batch.tokens[0, :5], [1, 5, 6, 10, 11])
    np.testing.assert_array_equal(batch.loss_mask[0], [0, 0, 0, 1, 1, 0, 0, 0, 0, 0])
    np.testing.assert_array_equal(batch.loss_mask[1, :7], [0, 0, 0, 1, 1, 1, 0])
    np.testing.assert_allclose(batch.behavior_logp[1, 3:6], [-0.5, -1.5, -2.5])
    # GRPO with std normalization: rewards (1, 0) → ±0.5/(std + eps), std = 1/√2 (ddof = 1).
    a = 0.5 / (np.std([1.0, 0.0], ddof=1) + 1e-6)
    adv = advantages(batch)
    np.testing.assert_allclose(adv[0, 3:5], [a, a], rtol=1e-5)
    np.testing.assert_allclose(adv[1, 3:6], [-a] * 3, rtol=1e-5)
    assert np.all(adv[batch.loss_mask == 0] == 0)
    assert np.all(batch.loss_mask[2:] == 0)  # padding rows
    assert batch.routing[1, 0, 0, 0] == 4 and batch.routing.dtype == np.uint8
    np.testing.assert_array_equal(batch.routing[4, 0, 0], [0, 1])  # padding: a valid set
    assert stats.tokens == 5 and stats.lag_max == 0 and stats.reward_mean == 0.5
    assert stats.response_len_mean == 2.5 and stats.prompt_ids == ("p7",)


@pytest.mark.parametrize(
    "policy, kept, dropped, stale_kept", [("drop", 2, 1, 0), ("keep", 3, 0, 1)]
)
def test_staleness_policy(policy, kept, dropped, stale_kept):
    groups = [
        make_group(1, [1, 0], [[9, 9], [9]]),  # lag 0
        make_group(2, [1, 0], [[8, 9], [8]]),  # lag 1: within max_staleness
        make_group(3, [1, 0], [[7, 8], [8]]),  # lag 2: stale
    ]
    batch, stats = assemble(groups, spec(stale_policy=policy), trainer_version=9)
    assert (stats.groups, stats.stale_dropped, stats.stale_kept) == (kept, dropped, stale_kept)
    expected_lags = [0, 0, 0, 1, 0, 1] + ([2, 1, 1] if policy == "keep" else [])
    np.testing.assert_array_equal(np.sort(stats.lags), np.sort(expected_lags))
    assert stats.lag_max == max(expected_lags)
    assert stats.lag_mean == pytest.approx(np.mean(expected_lags))
    assert stats.lag_hist.sum() == len(expected_lags) and stats.lag_hist[0] == 4
    assert batch.loss_mask.sum() == len(expected_lags)


def test_pre_sync_versions_are_dropped():
    groups = [make_group(1, [1, 0], [[0, 1], [1]]), make_group(2, [1, 0], [[1], [1]])]
    _, stats = assemble(groups, spec(), trainer_version=1, min_version=1)
    assert stats.groups == 1 and stats.stale_dropped == 1 and stats.prompt_ids == ("p2",)


def test_lag_histogram_last_bin_collects_old_tokens():
    groups = [make_group(1, [1, 0], [[0], [100]])]
    _, stats = assemble(groups, spec(stale_policy="keep"), trainer_version=100)
    assert stats.lag_hist[-1] == 1 and stats.lag_hist[0] == 1


def test_equal_rewards_give_zero_advantage_and_empty_batch_is_all_padding():
    batch, _ = assemble([make_group(1, [1, 1], [[2], [2]])], spec(), trainer_version=2)
    assert np.all(advantages(batch) == 0)
    batch, stats = assemble([], spec(routing_lk=None), trainer_version=0)
    assert batch.routing is None and batch.loss_mask.sum() == 0 and stats.lag_max == 0


@pytest.mark.parametrize(
    "group, message",
    [
        (make_group(1, [1], [[1]]), "expected 2"),
        (make_group(1, [1, 0], [[1] * 8, [1]]), "exceeds seq_len"),
    ],
)
def test_malformed_groups_are_rejected(group, message):
    with pytest.raises(ValueError, match=message):
        assemble([group], spec(), trainer_version=1)


def test_same_shapes_for_every_batch():
    a, _ = assemble([make_group(1, [1, 0], [[1], [1]])], spec(), trainer_version=1)
    b, _ = assemble(
        [make_group(i, [1, 0], [[1] * 5, [1]]) for i in range(3)], spec(), trainer_version=1
    )
    for x, y in zip(
        (a.tokens, a.loss_mask, a.routing), (b.tokens, b.loss_mask, b.routing), strict=True
    ):
        assert x.shape == y.shape and x.dtype == y.dtype


def test_duplicates_and_counts_reach_the_stats():
    groups = [
        make_group(1, [1, 0], [[9], [9]]),
        make_group(2, [1, 0], [[9], [9]]),  # trained recently: a duplicate
        make_group(3, [1, 0], [[5], [9]]),  # lag 4: stale
    ]
    _, stats = assemble(groups, spec(), trainer_version=9, seen={groups[1].key})
    assert (stats.groups, stats.stale_dropped, stats.duplicates) == (1, 1, 1)
    assert stats.prompt_ids == ("p1",)


def test_a_prompt_trained_recently_may_come_again_as_a_new_group():
    """A dataset smaller than the run repeats its prompts: only the group's name is a duplicate."""
    first = make_group(1, [1, 0], [[9], [9]])
    again = dataclasses.replace(first, group_id=77)  # the same prompt "p1", a new group
    _, stats = assemble([again], spec(), trainer_version=9, seen={first.key})
    assert (stats.groups, stats.duplicates) == (1, 0)


def test_selections_add_up_in_pull_order():
    a = batching.select_groups(
        [make_group(1, [1, 0], [[9], [9]]), make_group(2, [1, 0], [[1], [1]])],
        spec(),
        trainer_version=9,
        min_version=0,
    )
    g3 = make_group(3, [1, 0], [[9], [9]])
    b = batching.select_groups([g3], spec(), trainer_version=9, min_version=0, seen_groups={g3.key})
    both = batching.Selection.empty() + a + b
    assert [g.prompt_id for g in both.kept] == ["p1"]
    assert (both.stale_dropped, both.stale_kept, both.duplicates) == (1, 0, 1)


def test_too_many_groups_are_rejected():
    selection = dataclasses.replace(
        batching.Selection.empty(), kept=tuple(make_group(i, [1, 0], [[1], [1]]) for i in range(4))
    )
    with pytest.raises(ValueError, match="4 groups for a batch of 3"):
        batching.assemble_batch(selection, spec(), trainer_version=1)


def test_stats_json_round_trip():
    """What the multi-host broadcast does: the JSON of the stats, and the flat lags padded to
    R · T as int32, cut back to the batch's trained tokens."""
    groups = [make_group(1, [1, 0], [[7, 9], [8]]), make_group(2, [0.25, 0], [[9], [9]])]
    batch, stats = assemble(groups, spec(stale_policy="keep"), trainer_version=9, seen={"x"})
    padded = np.zeros(batch.tokens.size, np.int32)
    padded[: stats.lags.size] = stats.lags
    tokens = int(np.count_nonzero(batch.loss_mask))
    back = batching.BatchStats.from_json(stats.to_json(), lags=padded[:tokens].astype(np.int64))
    assert dataclasses.replace(back, lags=None) == dataclasses.replace(stats, lags=None)
    np.testing.assert_array_equal(back.lags, stats.lags)
    assert back.lags.dtype == np.int64 and (back.lag_max, back.stale_kept) == (2, 1)


def test_live_path_counts_each_pulled_group_once():
    """The policy runs once, in pull_batch: its counts are the batch's stats."""
    from tests.train import multihost_worker

    pool, progress = multihost_worker.FakePool(), multihost_worker.progress()
    pulled = pulling.next_batch(
        pool, batching.BatchSpec(**multihost_worker.SPEC_KWARGS), progress, timeout_s=0.1, stall_s=5
    )
    s = pulled.stats
    assert (s.groups, s.stale_dropped, s.stale_kept, s.duplicates) == (3, 1, 0, 1)
    # The stale and the duplicate group are acknowledged while the batch is still being pulled.
    assert len(pool.acked) == 2 and not {id(g) for g in pool.acked} & {
        id(g) for g in pulled.pulled if g.prompt_id in s.prompt_ids
    }
    assert s.prompt_ids == ("a0", "b0", "c0")


@pytest.mark.parametrize(
    "bucket, longest, length",
    [(4, 0, 4), (4, 3, 4), (4, 4, 4), (4, 5, 8), (4, 8, 8), (4, 9, 10), (4, 10, 10), (0, 3, 10)],
)
def test_bucket_is_the_smallest_power_of_two_multiple_that_holds_the_longest_row(
    bucket, longest, length
):
    assert batching.bucket_length(longest, spec(length_bucket=bucket)) == length


def test_a_batch_of_short_rows_gets_a_short_shape_and_its_pad_frac():
    # Rows of 3 + 2 and 3 + 3 tokens: bucket 8 of capacity 10; R = 6 rows (4 of them padding).
    groups = [make_group(1, [1, 0], [[1, 1], [1, 1, 1]])]
    batch, stats = assemble(groups, spec(length_bucket=4), trainer_version=1)
    assert batch.tokens.shape == (6, 8) and batch.routing.shape == (6, 8, L, K)
    adv = advantages(batch)
    assert batch.loss_mask.shape == adv.shape == batch.behavior_logp.shape == (6, 8)
    assert stats.pad_frac == pytest.approx(1 - 11 / 48)
    full, full_stats = assemble(groups, spec(), trainer_version=1)
    assert full.tokens.shape == (6, 10) and full_stats.pad_frac == pytest.approx(1 - 11 / 60)
    for short, long in zip(
        (batch.tokens, batch.loss_mask, batch.behavior_logp, adv, batch.routing),
        (full.tokens, full.loss_mask, full.behavior_logp, advantages(full), full.routing),
        strict=True,
    ):
        np.testing.assert_array_equal(short, long[:, :8])
    np.testing.assert_array_equal(stats.lags, full_stats.lags)
    empty, empty_stats = assemble([], spec(length_bucket=4), trainer_version=1)
    assert empty.tokens.shape == (6, 4) and empty_stats.pad_frac == 1.0


def test_bucketed_batch_trains_like_the_capacity_padded_one():
    """The step on a bucketed batch = the step on the same rows padded to the capacity, router
    aux loss included (padding is out of the router's statistics)."""
    import jax
    import optax

    from sat_jax import objectives, sharding
    from sat_jax.model import ModelConfig

    model_cfg = ModelConfig.preset("tiny", dispatch="dense", router_aux_loss_coef=0.05)
    mesh = sharding.make_mesh(sharding.MeshConfig(fsdp=1), jax.devices()[:1])
    _, params0 = placement.init_sharded(model_cfg, mesh, 0)
    params0 = jax.device_get(params0)
    loss_cfg = objectives.PolicyLossConfig(sat=objectives.SATConfig(enabled=True))
    step_fn = make_train_step(model_cfg, optax.sgd(0.1), StepConfig(loss=loss_cfg), mesh)
    groups = [
        make_group(1, [1, 0], [[1, 1], [1, 1, 1]]),
        make_group(2, [0.5, 0], [[1], [1, 1, 1, 1]]),
    ]
    results = []
    for bucket in (4, 0):
        batch, _ = assemble(groups, spec(length_bucket=bucket, routing_lk=None), trainer_version=1)
        state = create_train_state(model_cfg, optax.sgd(0.1), mesh, params0)
        state, metrics = step_fn(state, shard_batch(batch, mesh))
        results.append((batch.tokens.shape, jax.device_get(state.params), jax.device_get(metrics)))
    (short_shape, short_params, short_m), (long_shape, long_params, long_m) = results
    assert short_shape == (6, 8) and long_shape == (6, 10)
    assert short_m.keys() == long_m.keys() and long_m["active_tokens"] == 10
    assert short_m["aux_loss"] > 0
    for key in long_m:
        np.testing.assert_allclose(short_m[key], long_m[key], rtol=1e-5, atol=1e-6, err_msg=key)
    for got, want in zip(jax.tree.leaves(short_params), jax.tree.leaves(long_params), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_lags_are_the_trained_tokens_in_row_major_order():
    """``BatchStats.lags`` (built once, flat) lines up with ``batch.loss_mask > 0``."""
    groups = [make_group(1, [1, 0], [[7, 9], [8]]), make_group(2, [0.25, 0], [[9, 6], [9]])]
    batch, stats = assemble(groups, spec(stale_policy="keep"), trainer_version=9)
    lag_bt = np.zeros(batch.tokens.shape, np.int64)  # by hand: row r, completion position t
    for r, traj in enumerate(t for g in groups for t in g.trajectories):
        p = len(traj.prompt_ids)
        lag_bt[r, p : p + len(traj.versions)] = 9 - traj.versions
    np.testing.assert_array_equal(stats.lags, lag_bt[batch.loss_mask > 0])
    assert stats.lags.dtype == np.int64 and stats.lags.size == stats.tokens


@pytest.mark.parametrize("routing_lk", [(L, K), None])
@pytest.mark.parametrize("bucket", [4, 0])
def test_empty_batch_has_the_shapes_of_its_bucket(routing_lk, bucket):
    """What a process receiving a broadcast batch fills: derived from the spec and the length."""
    import jax

    s = spec(routing_lk=routing_lk, length_bucket=bucket, routing_dtype="uint16")
    batch, _ = assemble([make_group(1, [1, 0], [[1] * 4, [1]])], s, trainer_version=1)
    empty = batching.empty_batch(s, batch.tokens.shape[1])
    got, want = jax.tree.flatten(empty), jax.tree.flatten(batch)
    assert got[1] == want[1]  # the same fields set (routing or not)
    for x, y in zip(got[0], want[0], strict=True):
        assert (x.shape, x.dtype) == (y.shape, y.dtype)
    assert empty.loss_mask.sum() == 0 and not empty.tokens.any()
    if routing_lk is not None:
        np.testing.assert_array_equal(empty.routing[3, 2, 1], np.arange(K))  # a valid set


def test_invalid_and_repeated_groups_are_counted_in_pull_order():
    """An ``InvalidGroup`` (refused where it was pulled) is counted and never kept; a key that
    comes twice in one pull is a duplicate the second time."""
    g1, g2 = make_group(1, [1, 0], [[9], [9]]), make_group(2, [1, 0], [[9], [9]])
    bad = records.InvalidGroup(group_id=3, prompt_id="p3", server_id="", problem="token id 99")
    selection = batching.select_groups([g1, bad, g2, g1], spec(), trainer_version=9, min_version=0)
    assert [g.key for g in selection.kept] == ["/1", "/2"]
    assert (selection.invalid, selection.duplicates, selection.stale_dropped) == (1, 1, 0)
    assert [g.key for g in selection.pulled] == ["/1", "/3", "/2", "/1"]


def test_kept_counts_and_the_lag0_mask_line_up_with_the_completion_tokens():
    with_kept = make_group(0, [1.0, 0.0], [[4, 5], [5, 5, 5]])
    t0 = dataclasses.replace(with_kept.trajectories[0], kept_counts=np.array([3, 7], np.int32))
    with_kept = dataclasses.replace(with_kept, trajectories=(t0, with_kept.trajectories[1]))
    plain = make_group(1, [0.0, 1.0], [[5], [4, 5]])
    batch, _ = assemble([with_kept, plain], spec(kept_counts=True), trainer_version=5)
    kept, fresh = np.asarray(batch.kept_counts), np.asarray(batch.fresh_mask)
    assert kept.dtype == np.int32 and kept.shape == batch.tokens.shape
    # Row 0: prompt of 3, then counts 3 and 7 at the completion positions; the trajectory
    # without counts (no truncation) and every other position are 0.
    np.testing.assert_array_equal(kept[0, :6], [0, 0, 0, 3, 7, 0])
    assert kept[1:].sum() == 0
    # Lag 0 = version 5 of trainer version 5.
    np.testing.assert_array_equal(fresh[0, 3:5], [0, 1])
    np.testing.assert_array_equal(fresh[1, 3:6], [1, 1, 1])
    np.testing.assert_array_equal(fresh[3, 3:5], [0, 1])
    assert np.all(fresh <= np.asarray(batch.loss_mask))
    # Without replay the batch carries no counts; the mask is always there; empty_batch agrees.
    batch, _ = assemble([with_kept, plain], spec(), trainer_version=5)
    assert batch.kept_counts is None and batch.fresh_mask is not None
    for s in (spec(), spec(kept_counts=True)):
        empty = batching.empty_batch(s, 10)
        full, _ = assemble([with_kept], s, trainer_version=5)
        assert jax_structure(empty) == jax_structure(full)


def jax_structure(batch):
    import jax

    return jax.tree.structure(batch), [(x.shape, x.dtype) for x in jax.tree.leaves(batch)]


def forked_group(group_id: int, rewards: list[float], segments: list[int]) -> records.Group:
    """A group of sessions of `rewards`, session i in `segments[i]` segments (trajectories)."""
    flat = [r for r, k in zip(rewards, segments, strict=True) for _ in range(k)]
    sessions = tuple(i for i, k in enumerate(segments) for _ in range(k))
    base = make_group(group_id, flat, [[5, 5]] * len(flat))
    return dataclasses.replace(base, sessions=sessions if len(flat) > len(rewards) else ())


def test_forked_sessions_count_once_in_their_groups_statistics():
    """Forks (docs/DESIGN.md §6.6): a session's segments are trajectories of their own, each
    taking its session's advantage, with the group's mean and std over its sessions: the
    advantages are those of the same group without forks. The rows grow to the next multiple of
    the batch's; a batch without forks carries no session weights."""
    s = spec(batch_groups=2, group_size=3)
    forked = [
        forked_group(0, [1.0, 0.0, 0.5], [3, 1, 2]),
        forked_group(1, [2.0, 0.0, 0.0], [1, 1, 1]),
    ]
    plain = [forked_group(0, [1.0, 0.0, 0.5], [1, 1, 1]), forked[1]]
    batch, stats = assemble(forked, s, trainer_version=5)
    base, base_stats = assemble(plain, s, trainer_version=5)
    assert base.session_weights is None and base.tokens.shape[0] == 6
    assert batch.tokens.shape[0] == 12  # 9 trajectories in rows of 6
    assert batch.group_ids.tolist() == [0] * 6 + [1] * 3 + [-1] * 3
    third, half = 1 / 3, 1 / 2
    np.testing.assert_allclose(batch.session_weights[:9], [third] * 3 + [1, half, half, 1, 1, 1])
    got = advantages(batch)[:, 3]  # each row's advantage at its first completion token
    want = advantages(base)[:, 3]
    np.testing.assert_allclose(
        got[:9], [want[0]] * 3 + [want[1]] + [want[2]] * 2 + list(want[3:]), rtol=1e-5
    )
    assert want[0] != 0 and stats.reward_mean == pytest.approx(base_stats.reward_mean)
    assert stats.tokens == 9 * 2 and not advantages(batch)[9:].any()
    # Without the weights (every segment a sample) the baseline would be another one.
    unweighted = advantages(batch.replace(session_weights=None))[:, 3]
    assert not np.allclose(unweighted[:6], got[:6])


def test_a_forked_group_must_hold_group_size_sessions():
    two = forked_group(0, [1.0, 0.0], [2, 1])
    with pytest.raises(ValueError, match="group 0 has 2 sessions, expected 3"):
        batching.assemble_batch(
            batching.Selection(kept=(two,), stale_dropped=0, stale_kept=0, duplicates=0),
            spec(group_size=3),
            trainer_version=0,
        )


def test_a_forked_batch_trains_padded_and_packed():
    """A step runs on a forked batch, padded and packed (its session weights carried along)."""
    import jax
    import optax

    from sat_jax import objectives, sharding
    from sat_jax.model import ModelConfig

    model = ModelConfig.preset("tiny", dispatch="dense")
    groups = [forked_group(0, [1.0, 0.0], [2, 1]), forked_group(1, [0.5, 0.0], [1, 1])]
    mesh = sharding.make_mesh(sharding.MeshConfig(fsdp=1), jax.devices()[:1])
    _, params = placement.init_sharded(model, mesh, 0)
    params = jax.device_get(params)
    step_cfg = StepConfig(loss=objectives.PolicyLossConfig())
    step = make_train_step(model, optax.sgd(0.1), step_cfg, mesh)
    weights = None
    for packing in (False, True):
        s = spec(batch_groups=2, group_size=2, routing_lk=None, packing=packing)
        batch, stats = assemble(groups, s, trainer_version=5)
        if weights is None:
            weights = batch.session_weights
        np.testing.assert_array_equal(batch.session_weights, weights)
        state = create_train_state(model, optax.sgd(0.1), mesh, params)
        _, metrics = step(state, shard_batch(batch, mesh))
        metrics = jax.device_get(metrics)
        assert metrics["step_skipped"] == 0 and metrics["active_tokens"] == stats.tokens == 10
