"""A training loop whose every pulled group is stale (its servers never install the pushed
weights) ends with one line naming the cause, after ``stall_s`` of the loop's clock: it does not
pull forever (a fake pool and a fake clock)."""

from __future__ import annotations

import numpy as np
import pytest

from rollout_api import records
from tests.train.test_batching import spec
from train import checkpointing, pulling


def _group(group_id: int, version: int) -> records.Group:
    trajs = tuple(
        records.Trajectory(
            prompt_ids=np.array([1, 5], np.int32),
            completion_ids=np.array([7], np.int32),
            behavior_logprobs=np.array([-0.5], np.float32),
            versions=np.array([version], np.int64),
            routing=np.full((3, 2, 2), 1, np.uint8),
            reward=float(i),
        )
        for i in range(2)
    )
    return records.Group(
        server_id="srv", group_id=group_id, prompt_id=f"p{group_id}", trajectories=trajs
    )


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class StalePool:
    """Answers every pull with one group generated at `version`, each pull taking a second of
    the fake clock; fails the test past `limit` pulls (the loop pulled forever)."""

    def __init__(self, clock: FakeClock, version: int, limit: int = 1000):
        self.clock, self.version, self.limit = clock, version, limit
        self.pulls = 0
        self.rejected: list[int] = []

    def pull(self, max_groups, timeout_s, *, limits=None, trainer_version=None):
        self.pulls += 1
        if self.pulls > self.limit:
            raise AssertionError("the loop pulled forever")
        self.clock.now += 1.0
        return [_group(self.pulls, self.version)]

    def ack(self, groups, *, rejected=False):
        if rejected:
            self.rejected += [g.group_id for g in groups]


def test_a_loop_of_only_stale_groups_ends_naming_the_cause():
    clock = FakeClock()
    pool = StalePool(clock, version=0)
    progress = checkpointing.Progress(version=5, min_version=0, rng_key=(0, 0))
    with pytest.raises(RuntimeError, match="stale.*not installing the pushed weights"):
        pulling.pull_batch(pool, spec(), progress, timeout_s=0.1, stall_s=30, clock=clock)
    assert 30 <= pool.pulls <= 32  # stall_s of the fake clock, a pull a second
    assert pool.rejected == list(range(1, pool.pulls + 1))  # each stale one went back


def test_fresh_groups_after_stale_ones_make_the_batch():
    clock = FakeClock()
    pool = StalePool(clock, version=0)
    progress = checkpointing.Progress(version=5, min_version=0, rng_key=(0, 0))
    pulls = pool.pull

    def then_fresh(max_groups, timeout_s, **kw):
        out = pulls(max_groups, timeout_s, **kw)
        if pool.pulls > 20:  # the servers installed the weights: fresh groups from now on
            return [_group(pool.pulls, 5)]
        return out

    pool.pull = then_fresh
    selection = pulling.pull_batch(pool, spec(), progress, timeout_s=0.1, stall_s=30, clock=clock)
    assert len(selection.kept) == 3 and selection.stale_dropped == 20


def test_an_empty_stall_keeps_its_message():
    clock = FakeClock()

    class EmptyPool(StalePool):
        def pull(self, max_groups, timeout_s, **kw):
            super().pull(max_groups, timeout_s, **kw)
            return []

    pool = EmptyPool(clock, version=0)
    progress = checkpointing.Progress(version=5, min_version=0, rng_key=(0, 0))
    with pytest.raises(RuntimeError, match="no rollout group for 30s although the servers"):
        pulling.pull_batch(pool, spec(), progress, timeout_s=0.1, stall_s=30, clock=clock)
