"""DAPO's recipe options on the trainer side: dynamic sampling (``train.filter_groups``: groups
whose rewards are all equal are rejected to the server and replaced, within a budget per batch)
and overlong shaping (``train.overlong``: "mask" or "soft"), their metrics (``groups_filtered``,
``overlong_frac``) and their config keys. The live test runs the loop against a real rollout
server whose dataset has prompts the model can never answer."""

from __future__ import annotations

import dataclasses
import functools
import io
import json
import logging

import jax
import numpy as np
import pytest

from rollout_api import records
from sat_jax import sharding
from sat_jax.experiment import ConfigError, load_config
from sat_jax.model import placement
from tests.train.test_batching import spec as batching_spec
from train import batching, checkpointing, main, metrics, pulling, setup

L, K = 2, 2


def traj(
    reward: float, length: int, *, finish: str = "stop", version: int = 9, prompt=(1, 5, 6)
) -> records.Trajectory:
    p = len(prompt)
    return records.Trajectory(
        prompt_ids=np.array(prompt, np.int32),
        completion_ids=np.arange(10, 10 + length, dtype=np.int32),
        behavior_logprobs=-0.5 - np.arange(length, dtype=np.float32),
        versions=np.full(length, version, np.int64),
        routing=np.full((p + length, L, K), 3, np.uint8),
        reward=reward,
        finish_reason=finish,
    )


def group(group_id: int, rewards, *, lengths=None, finish=None, version: int = 9) -> records.Group:
    lengths = lengths or [2] * len(rewards)
    finish = finish or ["stop"] * len(rewards)
    return records.Group(
        group_id=group_id,
        prompt_id=f"p{group_id}",
        trajectories=tuple(
            traj(r, n, finish=f, version=version)
            for r, n, f in zip(rewards, lengths, finish, strict=True)
        ),
    )


def spec(**kw) -> batching.BatchSpec:
    """test_batching's spec with two groups a batch and completions of at most 8 tokens."""
    return batching_spec(**({"batch_groups": 2, "seq_len": 3 + 8, "max_new_tokens": 8} | kw))


def assemble(groups, batch_spec, *, trainer_version=9):
    selection = batching.select_groups(
        groups, batch_spec, trainer_version=trainer_version, min_version=0
    )
    return batching.assemble_batch(selection, batch_spec, trainer_version=trainer_version)


class QueuePool:
    """Serves its queue of groups, at most ``per_pull`` per Pull; records every acknowledgement
    as (group id, rejected)."""

    def __init__(self, queue, per_pull: int = 2):
        self.queue = list(queue)
        self.per_pull = per_pull
        self.pulls = 0
        self.acks: list[tuple[int, bool]] = []

    def pull(self, max_groups: int, timeout_s: float, *, limits=None, trainer_version=0):
        self.pulls += 1
        n = min(max_groups, self.per_pull)
        out, self.queue = self.queue[:n], self.queue[n:]
        return out

    def ack(self, groups, *, rejected: bool = False) -> None:
        self.acks.extend((g.group_id, rejected) for g in groups)


def _progress(version: int = 9) -> checkpointing.Progress:
    return checkpointing.Progress(version=version, min_version=1, rng_key=(0, 0))


# Dynamic sampling.


def test_all_equal_groups_are_filtered_and_counted_in_pull_order():
    groups = [
        group(1, [1, 1]),  # all equal: filtered
        group(2, [1, 0]),
        group(3, [0.0, 0.0]),  # all equal: filtered
        group(4, [0.25, 0.5]),
    ]
    s = spec(filter_groups="all_equal")
    selection = batching.select_groups(groups, s, trainer_version=9, min_version=0)
    assert [g.group_id for g in selection.kept] == [2, 4]
    assert (selection.filtered, selection.stale_dropped, selection.duplicates) == (2, 0, 0)
    # Off (the default): every group is kept, none filtered.
    off = batching.select_groups(groups[:2], spec(), trainer_version=9, min_version=0)
    assert [g.group_id for g in off.kept] == [1, 2] and off.filtered == 0


def test_staleness_and_duplicates_come_before_the_filter_and_the_budget_caps_it():
    stale = group(1, [1, 1], version=5)  # lag 4: dropped as stale, not counted as filtered
    kept_stale = group(2, [1, 1], version=5)  # stale_policy keep: filtered
    groups = [stale, group(3, [0, 0]), group(4, [0, 0]), group(5, [1, 0])]
    s = spec(filter_groups="all_equal")
    sel = batching.select_groups(
        groups, s, trainer_version=9, min_version=0, seen_groups={"x"}, filter_budget=1
    )
    # Budget 1: group 3 is filtered, group 4 (all equal too) is kept.
    assert [g.group_id for g in sel.kept] == [4, 5]
    assert (sel.stale_dropped, sel.filtered) == (1, 1)
    keep = batching.select_groups(
        [kept_stale],
        spec(filter_groups="all_equal", stale_policy="keep"),
        trainer_version=9,
        min_version=0,
    )
    assert (len(keep.kept), keep.filtered, keep.stale_kept) == (0, 1, 0)


def test_pull_batch_rejects_filtered_groups_at_once_and_pulls_on():
    queue = [
        group(1, [1, 1]),
        group(2, [1, 0]),
        group(3, [0, 0]),
        group(4, [0, 0]),
        group(5, [0.5, 0]),
        group(6, [1, 0]),  # not needed: never pulled
    ]
    pool = QueuePool(queue)
    s = spec(filter_groups="all_equal")
    selection = pulling.pull_batch(pool, s, _progress(), timeout_s=0.1, stall_s=5)
    assert [g.group_id for g in selection.kept] == [2, 5]
    assert selection.filtered == 3 and [g.group_id for g in pool.queue] == [6]
    # The filtered ones were rejected (the server replaces them), the kept ones not yet acked.
    assert pool.acks == [(1, True), (3, True), (4, True)]
    batch, stats = batching.assemble_batch(selection, s, trainer_version=9)
    assert stats.filtered == 3 and stats.groups == 2 and stats.prompt_ids == ("p2", "p5")
    np.testing.assert_array_equal(batch.group_ids, [0, 0, 1, 1])
    assert main.loop_scalars(stats, _progress())["groups_filtered"] == 3


def test_pull_batch_gives_up_filtering_after_the_budget_and_warns(caplog):
    """Every group all equal: the filter stops after filter_max_rounds · batch_groups groups and
    the batch is filled without it; the run never spins."""
    pool = QueuePool([group(i, [0, 0]) for i in range(100)], per_pull=3)
    s = spec(filter_groups="all_equal", filter_max_rounds=2)  # budget 2 · 2 = 4
    with caplog.at_level(logging.WARNING, logger="train"):
        selection = pulling.pull_batch(pool, s, _progress(7), timeout_s=0.1, stall_s=5)
    # Pulls of 2, 2 (4 filtered: budget spent), then 2 kept without the filter.
    assert selection.filtered == 4 and [g.group_id for g in selection.kept] == [4, 5]
    assert pool.acks == [(i, True) for i in range(4)] and pool.pulls == 3
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert "version 7: 4 pulled groups had all-equal rewards" in warnings[0]
    assert "filled without the filter" in warnings[0] and "too easy or too hard" in warnings[0]
    _, stats = batching.assemble_batch(selection, s, trainer_version=7)
    assert (stats.groups, stats.filtered) == (2, 4)
    # The next batch has its own budget.
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="train"):
        again = pulling.pull_batch(pool, s, _progress(8), timeout_s=0.1, stall_s=5)
    assert again.filtered == 4 and len(again.kept) == 2 and "version 8" in caplog.text


def test_the_budget_mid_pull_keeps_the_rest_of_that_pull():
    pool = QueuePool([group(i, [1, 1]) for i in range(10)], per_pull=5)
    s = spec(batch_groups=4, filter_groups="all_equal", filter_max_rounds=1)  # budget 4
    selection = pulling.pull_batch(pool, s, _progress(), timeout_s=0.1, stall_s=5)
    # The first pull asks for 4: all filtered. The next: 4 kept.
    assert selection.filtered == 4 and [g.group_id for g in selection.kept] == [4, 5, 6, 7]


def test_stats_json_carries_the_new_fields():
    s = spec(filter_groups="all_equal")
    groups = [group(1, [1, 1]), group(2, [1, 0], finish=["length", "stop"], lengths=[8, 2])]
    batch, stats = assemble(groups, s)
    assert (stats.filtered, stats.overlong_frac) == (1, 0.5)
    back = batching.BatchStats.from_json(stats.to_json(), lags=stats.lags)
    assert dataclasses.replace(back, lags=None) == dataclasses.replace(stats, lags=None)


# Overlong shaping.


def test_mask_zeroes_exactly_the_truncated_rows_and_keeps_their_rewards_in_the_baseline():
    groups = [
        group(1, [1, 0], lengths=[8, 3], finish=["length", "stop"]),
        group(2, [0.5, 0], lengths=[2, 8], finish=["stop", "length"]),
    ]
    plain, plain_stats = assemble(groups, spec())
    masked, stats = assemble(groups, spec(overlong="mask"))
    truncated = np.array([True, False, False, True])
    np.testing.assert_array_equal(masked.loss_mask[truncated], 0)
    np.testing.assert_array_equal(masked.loss_mask[~truncated], plain.loss_mask[~truncated])
    assert plain.loss_mask[truncated].sum() == 16
    # Rewards and group ids are untouched: the truncated rows still count in the baseline.
    np.testing.assert_array_equal(masked.rewards, plain.rewards)
    np.testing.assert_array_equal(masked.group_ids, plain.group_ids)
    np.testing.assert_array_equal(masked.tokens, plain.tokens)
    # The lags are still the trained tokens in row-major order.
    assert stats.tokens == 3 + 2 == stats.lags.size
    assert stats.overlong_frac == plain_stats.overlong_frac == 0.5
    assert stats.reward_mean == plain_stats.reward_mean == pytest.approx(0.375)
    assert stats.response_len_mean == plain_stats.response_len_mean


def _soft(length: int, l_max: int, cache: int, penalty: float) -> float:
    """DAPO's soft overlong punishment, written out."""
    if length <= l_max - cache:
        return 0.0
    if length <= l_max:
        return ((l_max - cache) - length) / cache * penalty
    return -penalty


@pytest.mark.parametrize("penalty", [1.0, 0.5])
def test_soft_punishment_below_at_inside_and_at_the_end_of_the_cache_window(penalty):
    # L_max 8, L_cache 4: window (4, 8].
    lengths = [3, 4, 5, 6, 7, 8]
    finish = ["stop"] * 5 + ["length"]
    shape = dict(group_size=6, batch_groups=1)
    s = spec(**shape, overlong="soft", overlong_cache=4, overlong_penalty=penalty)
    rewards = [1.0, 0.0, 1.0, 0.0, 1.0, 0.0]
    batch, stats = assemble([group(1, rewards, lengths=lengths, finish=finish)], s)
    want = [r + _soft(n, 8, 4, penalty) for r, n in zip(rewards, lengths, strict=True)]
    assert [_soft(n, 8, 4, 1.0) for n in lengths] == [0, 0, -0.25, -0.5, -0.75, -1.0]
    np.testing.assert_allclose(batch.rewards, want, rtol=0, atol=1e-7)
    assert batch.rewards.dtype == np.float32
    for n in [*lengths, 9]:
        assert batching.overlong_shaping(n, s) == pytest.approx(_soft(n, 8, 4, penalty))
    # The stats keep the raw task reward; the mask is untouched.
    assert stats.reward_mean == pytest.approx(0.5) and stats.overlong_frac == pytest.approx(1 / 6)
    plain, _ = assemble([group(1, rewards, lengths=lengths, finish=finish)], spec(**shape))
    np.testing.assert_array_equal(batch.loss_mask, plain.loss_mask)


def test_overlong_frac_counts_truncated_trajectories_of_the_batch():
    groups = [
        group(1, [1, 0], lengths=[8, 8], finish=["length", "length"]),
        group(2, [1, 0], lengths=[8, 2], finish=["length", ""]),
    ]
    for mode in ("none", "mask"):
        _, stats = assemble(groups, spec(overlong=mode))
        assert stats.overlong_frac == 0.75
    _, empty = assemble([], spec())
    assert empty.overlong_frac == 0.0


@pytest.mark.parametrize("defaults", [{}, {"filter_max_rounds": 9, "overlong_cache": 0}])
def test_every_option_off_gives_todays_batch_bit_for_bit(defaults):
    groups = [
        group(1, [1, 0], lengths=[8, 3], finish=["length", "stop"]),
        group(2, [0.5, 0.5], lengths=[2, 7]),
    ]
    base = spec(**defaults)
    explicit = spec(filter_groups="none", overlong="none", overlong_penalty=1.0, **defaults)
    (a, sa), (b, sb) = assemble(groups, base), assemble(groups, explicit)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes()
    assert dataclasses.replace(sa, lags=None) == dataclasses.replace(sb, lags=None)
    assert sa.groups == 2 and sa.filtered == 0


def test_bad_spec_values_are_refused():
    for kw, match in [
        (dict(filter_groups="some"), "filter_groups"),
        (dict(filter_max_rounds=0), "filter_max_rounds"),
        (dict(overlong="cut"), "overlong"),
        (dict(overlong="soft", overlong_cache=0), "overlong_cache"),
        (dict(overlong="soft", overlong_cache=9), "overlong_cache"),
    ]:
        with pytest.raises(ValueError, match=match):
            spec(**kw)


# Config keys.


def test_keys_parse_from_yaml_and_overrides_and_reach_the_batch_spec(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(
        "rollout:\n  max_new_tokens: 12\n"
        "train:\n  filter_groups: all_equal\n  overlong: soft\n  overlong_cache: 4\n"
    )
    cfg = load_config(str(path), ["train.filter_max_rounds=2", "train.overlong_penalty=0.5"])
    t = cfg.train
    assert (t.filter_groups, t.filter_max_rounds) == ("all_equal", 2)
    assert (t.overlong, t.overlong_cache, t.overlong_penalty) == ("soft", 4, 0.5)
    s = setup.batch_spec(cfg)
    assert (s.filter_groups, s.filter_max_rounds, s.filter_budget) == ("all_equal", 2, 16)
    assert (s.overlong, s.overlong_cache, s.overlong_penalty, s.max_new_tokens) == (
        "soft",
        4,
        0.5,
        12,
    )
    d = load_config(None).train
    assert (d.filter_groups, d.filter_rounds, d.overlong, d.overlong_cache) == (
        "none",
        4,
        "none",
        0,
    )
    assert d.soft_penalty == 1.0
    assert load_config(None, ["train.overlong=mask"]).train.overlong == "mask"


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["train.filter_groups=zero_std"], "filter_groups"),
        (["train.filter_groups=true"], "train.filter_groups"),
        (["train.filter_max_rounds=0"], "filter_max_rounds"),
        (["train.filter_max_rounds=1.5"], "train.filter_max_rounds"),
        (["train.overlong=truncate"], "overlong"),
        (["train.overlong_cache=-1"], "overlong_cache"),
        (["train.overlong_penalty=-0.1"], "overlong_penalty"),
        (["train.overlong_penalty=.inf"], "overlong_penalty"),
        (["train.overlong=soft"], "overlong_cache"),
        (["train.overlong=soft", "train.overlong_cache=9"], "train.overlong_cache"),
    ],
)
def test_bad_values_name_the_key(overrides, key):
    # arith defaults: rollout.max_new_tokens 16; the last case sets it to 8 (arith_tiny's).
    with pytest.raises(ConfigError, match=key):
        load_config(None, [*overrides, "rollout.max_new_tokens=8"])


def test_cache_may_be_the_whole_completion():
    cfg = load_config(
        None, ["train.overlong=soft", "train.overlong_cache=8", "rollout.max_new_tokens=8"]
    )
    assert setup.batch_spec(cfg).overlong_cache == 8


# The loop: groups_filtered and overlong_frac in metrics.jsonl and on the console.


def test_loop_writes_groups_filtered_and_overlong_frac_per_step(tmp_path):
    from sat_jax.step import TrainState

    cfg = load_config(
        None,
        [
            "rollout.batch_groups=2",
            "rollout.group_size=2",
            "rollout.max_new_tokens=8",
            "server.max_prefill_length=16",
            "train.routing_replay=false",
            "train.steps=2",
            "train.checkpoint.every=100",
            "train.eval.problems=0",
            "train.filter_groups=all_equal",
        ],
    )
    # Step 1's batch: 1 filtered; step 2's: 2 filtered, one truncated trajectory.
    queue = [
        group(1, [1, 1], version=1),
        group(2, [1, 0], version=1),
        group(3, [1, 0], version=1),
        group(4, [0, 0], version=2),
        group(5, [0, 0], version=2),
        group(6, [1, 0], lengths=[8, 2], finish=["length", "stop"], version=2),
        group(7, [0.5, 0], version=2),
    ]

    class Pool(QueuePool):
        def flush_acks(self):
            pass

        def metrics(self):
            return {}

    pool = Pool(queue)

    def step_fn(state, batch):
        return state.replace(step=state.step + 1), {"step_skipped": np.bool_(False)}

    console = io.StringIO()
    state = TrainState(params={"w": jax.numpy.zeros(3)}, opt_state=(), step=np.int32(0))
    with metrics.MetricsWriter(str(tmp_path), total_steps=2, console=console) as writer:
        parts = main.LoopParts(
            pool=pool,
            pusher=None,
            ckpt=None,
            writer=writer,
            graphdef=None,
            step_fn=step_fn,
            mesh=sharding.make_mesh(cfg.train.mesh, jax.devices()[:1]),
            spec=setup.batch_spec(cfg),
        )
        main.train_loop(cfg, parts, state, _progress(1))
    rows = [json.loads(line) for line in open(writer.jsonl_path)]
    assert [r["groups_filtered"] for r in rows] == [1, 2]
    assert [r["overlong_frac"] for r in rows] == [0, 0.25]
    assert "groups_filtered=2" in console.getvalue().splitlines()[-1]
    assert sorted(i for i, rejected in pool.acks if rejected) == [1, 4, 5]


# Live: a real rollout server.


def _write_dataset(path, n_easy: int, n_impossible: int) -> None:
    """Prompts over the alphabet " 0". "Easy" ones: the answer "" (a completion of spaces, or
    none); sampled uniformly over {eos, " ", "0"}, about half the completions score 1, so a group
    of 4 is informative with probability ~7/8. "Impossible" ones: an answer of 9 zeros, longer
    than any completion (max_new_tokens 8): every sample scores 0, the group is all equal."""
    rows = [{"id": f"easy{i}", "prompt": "0" * (i + 1), "answer": ""} for i in range(n_easy)]
    rows += [
        {"id": f"never{i}", "prompt": " " + "0" * (i + 1), "answer": "0" * 9}
        for i in range(n_impossible)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _zero_params(cfg) -> dict:
    """All-zero params of the model's structure: every logit 0, so the server samples uniformly
    over the sampleable ids."""
    from flax import nnx

    abstract = nnx.to_pure_dict(placement.abstract_model(cfg.model)[1])
    return jax.tree.map(lambda x: jax.device_put(np.zeros(x.shape, x.dtype)), abstract)


@pytest.mark.slow  # a rollout server process
def test_live_filtering_trains_informative_groups_and_the_server_replaces_the_rest(
    tmp_path, monkeypatch
):
    from rollout_api.client import connect
    from rollout_api.proto import rollout_pb2
    from sat_jax.step import TrainState
    from tests.train.conftest import JAX_CACHE
    from tests.train.test_main import CONFIG, _push_to
    from train import weight_sync
    from train.local_server import LocalServer

    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(JAX_CACHE))
    monkeypatch.setenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")
    data = tmp_path / "data.jsonl"
    # 1 in 4 prompts easy: most pulled groups are filtered (any 6 in a row unfiltered: ~1e-4).
    _write_dataset(data, n_easy=4, n_impossible=12)
    steps = 3
    overrides = [
        "task.source=file",
        f"task.path={data}",
        "task.alphabet=' 0'",
        "rollout.batch_groups=2",
        "rollout.group_size=4",
        "rollout.max_new_tokens=8",
        "rollout.max_staleness=1",
        "server.slots=8",
        f"server.checkpoint_root={tmp_path}",
        f"server.state_dir={tmp_path / 'server'}",
        "train.filter_groups=all_equal",
        "train.filter_max_rounds=20",  # budget 40 a batch: never reached here
        f"train.steps={steps}",
        "train.checkpoint.every=100",
        "train.eval.problems=0",
        "train.client.wait_s=120",
        f"train.run_dir={tmp_path / 'run'}",
    ]
    cfg = load_config(CONFIG, overrides)
    _, _, weights_dir = setup.run_paths(cfg)
    state = TrainState(params=_zero_params(cfg), opt_state=(), step=np.int32(0))
    progress = _progress(1)
    trained: list[tuple[np.ndarray, np.ndarray]] = []

    def step_fn(state, batch):  # records what it trains
        trained.append((np.asarray(batch.rewards), np.asarray(batch.group_ids)))
        return state.replace(step=state.step + 1), {"step_skipped": np.bool_(False)}

    with (
        LocalServer(CONFIG, overrides, str(tmp_path / "server.log")) as server,
        metrics.MetricsWriter(str(tmp_path / "logs"), total_steps=steps, console=None) as writer,
    ):
        server.wait_ready(timeout_s=150)
        push = functools.partial(_push_to, weights_dir=weights_dir)
        with (
            setup.connect(cfg, server) as pool,
            weight_sync.WeightPusher(functools.partial(push, pool)) as pusher,
        ):
            progress = main.sync_weights(pool, state, progress, weights_dir)
            parts = main.LoopParts(
                pool=pool,
                pusher=pusher,
                ckpt=None,
                writer=writer,
                graphdef=None,
                step_fn=step_fn,
                mesh=sharding.make_mesh(cfg.train.mesh, jax.devices()[:1]),
                spec=setup.batch_spec(cfg),
            )
            state, progress = main.train_loop(cfg, parts, state, progress)
        channel, stub = connect(server.address, cfg.server.max_message_bytes)
        with channel:
            stats = stub.Stats(rollout_pb2.StatsRequest(), timeout=10)
        path = writer.jsonl_path
    rows = metrics.read_jsonl(path)
    assert len(trained) == len(rows) == steps
    for rewards, group_ids in trained:  # every trained group is informative
        assert sorted(set(group_ids.tolist())) == [0, 1]
        for g in (0, 1):
            assert np.ptp(rewards[group_ids == g]) > 0, (rewards, group_ids)
    filtered = sum(r["groups_filtered"] for r in rows)
    other = sum(r["duplicates_skipped"] + r["groups_invalid"] for r in rows)
    assert filtered > 0, rows
    # The server replaced every group the trainer rejected: the filtered ones (and any other).
    assert stats.groups_rejected == filtered + other + progress.stale_dropped, (stats, rows)
    assert stats.groups_consumed == filtered + other + progress.stale_dropped + 2 * steps
