"""The checkpoint side of the GCS round trip (tests/train/test_gcs.py), in its own process.

Run as ``python tests/train/gcs_worker.py gs://BUCKET/PATH OUT_JSON`` with the environment the test
sets (every storage client pointed at the local emulator). Through ``train.checkpointing`` alone
it saves steps 1, 2 and 3 with ``keep=2``, closes the manager, opens a new one on the same URL,
lists the steps, restores the latest into the shardings ``abstract_train_state`` gives, and
writes what it saw to OUT_JSON.

A separate process because the storage layers read their environment once: etils caches whether
TensorFlow's gfile is used, gcsfs caches its filesystem, tensorstore its endpoint.
"""

from __future__ import annotations

import json
import sys

import jax
import numpy as np
import optax

from sat_jax import sharding
from sat_jax.model import ModelConfig
from sat_jax.step import init_train_state
from train import checkpointing

MODEL_CFG = ModelConfig.preset("tiny")
OPTIMIZER = optax.adamw(1e-3, b2=0.98)


def progress_at(step: int) -> checkpointing.Progress:
    """The ``Progress`` saved with checkpoint ``step``."""
    return checkpointing.Progress(
        version=step + 1,
        min_version=1,
        rng_key=(step, 7),
        groups_trained=8 * step,
        recent_prompt_ids=tuple(f"p{i}" for i in range(step)),
    )


def main(url: str, out: str) -> None:
    """Saves, lists and restores through ``url``; writes the facts to ``out``."""
    mesh = sharding.make_mesh(sharding.MeshConfig(fsdp=1), jax.devices()[:1])
    state = init_train_state(MODEL_CFG, OPTIMIZER, mesh, 3)
    with checkpointing.Checkpointer(url, keep=2) as ckpt:
        for step in (1, 2, 3):
            state = state.replace(step=state.step + 1)
            ckpt.save(step, state, progress_at(step))
        steps_after_save = ckpt.all_steps()
    with checkpointing.Checkpointer(url, keep=2) as again:
        latest = again.latest_step()
        all_steps = again.all_steps()
        abstract = checkpointing.abstract_train_state(MODEL_CFG, OPTIMIZER, mesh)
        restored, progress = again.restore(latest, abstract)
    equal = jax.tree.map(lambda a, b: np.array_equal(np.asarray(a), np.asarray(b)), restored, state)
    on_target = jax.tree.map(lambda a, s: a.sharding == s.sharding, restored, abstract)
    facts = {
        "steps_after_save": steps_after_save,
        "latest_step": latest,
        "all_steps": all_steps,
        "restored_step": int(restored.step),
        "progress_equal": progress == progress_at(3),
        "leaves": len(jax.tree.leaves(state)),
        "leaves_equal": sum(bool(x) for x in jax.tree.leaves(equal)),
        "leaves_on_target_sharding": sum(bool(x) for x in jax.tree.leaves(on_target)),
    }
    with open(out, "w") as f:
        json.dump(facts, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
