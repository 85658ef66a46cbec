"""A trainer's checkpoints killed mid-save (tests/train/test_checkpointing.py).

``python checkpoint_kill_worker.py DIR``: commits checkpoint 1 of a state of ~64 MB, starts
checkpoint 2 of a changed state in the background, prints ``saving 2`` and then sleeps until the
test kills it with SIGKILL while the write is (most likely) still going on.
"""

import sys
import time

import jax.numpy as jnp

from train import checkpointing

directory = sys.argv[1]
ckpt = checkpointing.Checkpointer(directory, keep=3)
progress = checkpointing.Progress(version=1, min_version=1, rng_key=(0, 1))


def state(value: float) -> checkpointing.TrainState:
    params = {f"w{i}": jnp.full((1024, 1024), value + i, jnp.float32) for i in range(16)}
    return checkpointing.TrainState(
        step=jnp.asarray(int(value)), params=params, opt_state=jnp.zeros((), jnp.float32)
    )


ckpt.save(1, state(1.0), progress)
ckpt.wait()
print("committed 1", flush=True)
ckpt.save(2, state(2.0), progress)
print("saving 2", flush=True)
time.sleep(600)
