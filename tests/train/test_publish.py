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


class KeepingPusher(RecordingPusher):
    def submit(self, version, params):
        super().submit(version, params)
        self.params = params


@pytest.mark.parametrize(
    ("overrides", "pushed"),
    [
        (["server.weight_dtype=int8", "server.dtype=bfloat16"], "int8"),
        (["server.weight_dtype=fp8"], "fp8"),
        ([], "bfloat16"),
        (["server.weight_dtype=int8", "model.lora.rank=4"], "bfloat16"),
    ],
)
def test_the_push_carries_the_servers_8bit_weights_unless_lora(overrides, pushed):
    """For 8-bit servers the host copy the loop hands the pusher is already quantized (values
    and scales); LoRA's adapters and pushes to unquantized servers stay full precision."""
    from sat_jax import quant

    cfg = load_config(CONFIG, overrides)
    assert main.pushed_weight_dtype(cfg) == pushed
    pusher = KeepingPusher()
    parts = main.LoopParts(
        pool=None, pusher=pusher, ckpt=None, writer=None, graphdef=None, step_fn=None,
        mesh=None, spec=None,
    )  # fmt: skip
    w = np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4)
    state = TrainState(params={"lm_head_dv": w}, opt_state=(), step=np.int32(1))
    progress = checkpointing.Progress(version=2, min_version=1, rng_key=(0, 0))
    main.publish_if_due(cfg, parts, state, progress, False)
    assert quant.tree_format(pusher.params) == pushed
    if pushed != "bfloat16":
        cast = w.astype(main.serving_dtype(cfg.server) or w.dtype)  # then quantized
        want = quant.quantize_params({"lm_head_dv": cast}, pushed)["lm_head_dv"]
        np.testing.assert_array_equal(np.asarray(pusher.params["lm_head_dv"].q), want.q)
        np.testing.assert_array_equal(np.asarray(pusher.params["lm_head_dv"].scale), want.scale)
