"""When the trainer publishes its weights (`train.main.publish_if_due`, docs/DESIGN.md §6.3
liveness): every `weight_sync_interval` updates and after every skipped step, so a run of skipped
steps (nothing active, a non-finite loss) never leaves the servers' weights behind the trainer's
version, which would close their admission for good."""

from __future__ import annotations

import pathlib

import numpy as np
import pytest

from sat_jax.experiment import load_config
from sat_jax.step import TrainState
from train import checkpointing, main

CONFIG = str(pathlib.Path(__file__).resolve().parents[2] / "configs" / "arith_tiny.yaml")


class RecordingPusher:
    def __init__(self):
        self.submitted: list[int] = []
        self.waits = 0

    def submit(self, version, params):
        self.submitted.append(version)

    def wait(self):
        self.waits += 1


def _publish(cfg, pusher, step: int, version: int, skipped: bool) -> None:
    parts = main.LoopParts(
        pool=None, pusher=pusher, ckpt=None, writer=None, graphdef=None, step_fn=None,
        mesh=None, spec=None,
    )  # fmt: skip
    state = TrainState(params={"w": np.zeros(3, np.float32)}, opt_state=(), step=np.int32(step))
    progress = checkpointing.Progress(version=version, min_version=1, rng_key=(0, 0))
    main.publish_if_due(cfg, parts, state, progress, skipped)


@pytest.mark.parametrize("interval", [1, 2])
def test_async_skipped_steps_publish_the_unchanged_weights_under_the_new_version(interval):
    cfg = load_config(CONFIG, ["rollout.max_staleness=2", f"train.weight_sync_interval={interval}"])
    pusher = RecordingPusher()
    # step 1 (v2), then skipped steps (state.step stays 1: v3, v4), then step 2 (v5).
    for step, version, skipped in [(1, 2, False), (1, 3, True), (1, 4, True), (2, 5, False)]:
        _publish(cfg, pusher, step, version, skipped)
    due = [2, 3, 4, 5] if interval == 1 else [3, 4, 5]
    assert pusher.submitted == due and pusher.waits == 0  # async: nothing waits


def test_sync_publishes_after_every_step_and_waits():
    cfg = load_config(CONFIG, ["train.mode=sync", "rollout.max_staleness=0"])
    pusher = RecordingPusher()
    _publish(cfg, pusher, 1, 2, False)
    _publish(cfg, pusher, 1, 3, True)
    assert pusher.submitted == [2, 3] and pusher.waits == 2
