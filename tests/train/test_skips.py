"""A run that cannot progress stops (``train.max_skipped_steps``, docs/DESIGN.md §7): the streak
and cause of ``train.skips``, the config key, and the loop against a fake pool whose every step
is skipped: it checkpoints, then raises ``NoProgress`` with one line naming the count and cause;
the command line turns that into exit status 1 and that one line."""

from __future__ import annotations

import dataclasses
import logging

import jax
import numpy as np
import pytest

from sat_jax.experiment import ConfigError, load_config
from sat_jax.step import TrainBatch, TrainState
from tests.train.test_main import CONFIG, FakePool, _loop_parts
from train import batching, checkpointing, main, metrics, skips, weight_sync


def _batch(rewards, group_ids) -> TrainBatch:
    rows = len(rewards)
    return TrainBatch(
        tokens=np.zeros((rows, 4), np.int32),
        loss_mask=np.zeros((rows, 4), np.float32),
        behavior_logp=np.zeros((rows, 4), np.float32),
        rewards=np.asarray(rewards, np.float32),
        group_ids=np.asarray(group_ids, np.int32),
    )


def _stats(overlong_frac: float, groups: int = 2) -> batching.BatchStats:
    return batching.BatchStats(
        groups=groups,
        stale_dropped=0,
        stale_kept=0,
        duplicates=0,
        invalid=0,
        reward_mean=0.0,
        response_len_mean=0.0,
        tokens=0,
        prompt_ids=(),
        group_keys=(),
        pad_frac=0.0,
        lags=np.zeros(0, np.int64),
        overlong_frac=overlong_frac,
    )


def test_the_streak_counts_consecutive_skips_and_an_update_resets_it():
    streak = skips.SkipStreak()
    for _ in range(2):
        streak = streak.after(True, "cut")
    assert streak.count == 2 and not streak.exhausted(3)
    assert streak.after(False) == skips.SkipStreak()  # an update starts over
    streak = streak.after(True, "nonfinite")
    assert streak.exhausted(3) and not streak.exhausted(0)  # 0 = never
    line = streak.message()
    assert "3 consecutive steps" in line and "train.max_skipped_steps" in line
    assert skips.CAUSES["cut"] in line and "\n" not in line  # the most frequent cause


def test_the_cause_names_cut_completions_non_finite_steps_and_all_equal_groups():
    varied, equal = _batch([0, 1, 2, 2], [0, 0, 1, 1]), _batch([1, 1, 0, 0, 0], [0, 0, 1, 1, -1])
    ok = {"total_loss": np.float32(0.0), "grad_norm": np.float32(0.0)}
    assert skips.skip_cause(ok, varied, _stats(1.0), "mask") == "cut"
    assert skips.skip_cause(ok, varied, _stats(1.0), "none") == "empty"  # cut, but trained
    nan = {**ok, "grad_norm": np.float32(np.nan)}
    assert skips.skip_cause(nan, varied, _stats(0.5), "mask") == "nonfinite"
    assert skips.skip_cause(ok, equal, _stats(0.0), "none") == "all_equal"
    assert "rollout.max_new_tokens" in skips.CAUSES["cut"]
    assert "train.overlong=soft" in skips.CAUSES["cut"]
    assert "train.filter_groups" in skips.CAUSES["all_equal"]


def test_max_skipped_steps_defaults_to_100_and_refuses_a_negative_count():
    assert load_config(CONFIG, []).train.max_skipped_steps == 100
    assert load_config(CONFIG, ["train.max_skipped_steps=0"]).train.max_skipped_steps == 0
    with pytest.raises(ConfigError, match="max_skipped_steps"):
        load_config(CONFIG, ["train.max_skipped_steps=-1"])


class _CutPool(FakePool):
    """``FakePool`` whose every completion was cut at ``rollout.max_new_tokens``."""

    def pull(self, max_groups, timeout_s, **kwargs):
        cut = lambda t: dataclasses.replace(t, finish_reason="length")
        return [
            dataclasses.replace(g, trajectories=tuple(map(cut, g.trajectories)))
            for g in super().pull(max_groups, timeout_s, **kwargs)
        ]


def _skipping(calls: int):
    """A train step skipped on its first ``calls`` calls (an update after: without the stop the
    loop would finish ``train.steps`` and return)."""
    made = []

    def step(state, batch):
        made.append(len(made))
        skipped = len(made) <= calls
        return state.replace(step=state.step + int(not skipped)), {
            "step_skipped": np.bool_(skipped)
        }

    return step


def _stuck_run(limit: int):
    """The loop over a fake pool, every step skipped, every completion cut and masked."""
    cfg = load_config(
        CONFIG,
        [
            "train.mode=sync",  # each push lands before the next pull: nothing goes stale
            "rollout.max_staleness=0",
            "rollout.batch_groups=2",
            "rollout.group_size=2",
            "train.routing_replay=false",
            "train.steps=3",
            "train.checkpoint.every=100",
            "train.overlong=mask",
            f"train.max_skipped_steps={limit}",
        ],
    )
    pool = _CutPool()
    state = TrainState(params={"w": jax.numpy.zeros(3)}, opt_state=(), step=np.int32(0))
    progress = checkpointing.Progress(version=1, min_version=1, rng_key=(0, 0))
    return cfg, pool, state, progress


def test_a_stuck_loop_checkpoints_then_stops_naming_the_count_and_the_cause(tmp_path):
    limit = 4
    cfg, pool, state, progress = _stuck_run(limit)
    with (
        weight_sync.WeightPusher(lambda v, p: pool.update_weights(v, "unused")) as pusher,
        checkpointing.Checkpointer(str(tmp_path / "ckpt"), keep=1) as ckpt,
        metrics.MetricsWriter(str(tmp_path / "logs"), total_steps=3, console=None) as writer,
    ):
        parts = _loop_parts(cfg, pool, pusher, writer, _skipping(2 * limit), ckpt=ckpt)
        stopped_state, stopped, line = main.loop_or_stuck(cfg, parts, state, progress)
        assert ckpt.all_steps() == [0]  # written before the stop
        _, saved = ckpt.restore(0, jax.tree.map(jax.numpy.asarray, state))
    assert "\n" not in line and f"{limit} consecutive steps" in line, line
    assert skips.CAUSES["cut"] in line and "checkpoint 0 in" in line, line
    # It stopped at the limit: that many batches consumed, each a version, all acknowledged.
    assert saved.steps_skipped == limit and saved.version == limit + 1
    assert stopped == saved and int(stopped_state.step) == 0  # the run's result: the latest
    records = metrics.read_jsonl(writer.jsonl_path)
    assert [r["steps_skipped"] for r in records] == list(range(1, limit + 1))
    assert pool.acked[: limit * 2] == list(range(limit * 2))


def test_the_command_line_ends_a_stuck_run_with_exit_1_and_one_line(monkeypatch, caplog):
    line = "stopped: 4 consecutive steps were skipped (train.max_skipped_steps); likely cause: x"
    result = main.RunResult(
        steps=0, version=5, accuracy_before=None, accuracy_after=None, run_dir="r", no_progress=line
    )
    monkeypatch.setattr(main, "run", lambda cfg, path, overrides: result)
    monkeypatch.setattr(main.setup, "check_run", lambda cfg: None)
    monkeypatch.setattr(main.sat_cli, "log_to_stderr", lambda *names: None)
    with caplog.at_level(logging.INFO, logger="train"), pytest.raises(SystemExit) as exit_:
        main.cli(["--config", CONFIG])
    assert exit_.value.code == 1
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert [r.getMessage() for r in errors] == [line] and errors[0].exc_info is None
