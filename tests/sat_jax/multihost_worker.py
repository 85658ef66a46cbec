"""One process of the two-process train-step test, and the case both sides of that test share.

Run as ``python tests/sat_jax/multihost_worker.py PORT PROCESS_ID OUT.npz`` with
``XLA_FLAGS=--xla_force_host_platform_device_count=4``: joins a 2-process ``jax.distributed`` job on
127.0.0.1:PORT (CPU, gloo collectives), runs one sharded train step over the 8 global devices and,
on process 0, writes the loss and the updated params (gathered) to OUT.npz.

With PORT = 0 it runs the same step alone in one process (the reference; give it 8 devices).
"""

from __future__ import annotations

import sys

import numpy as np

MESH = {"data": 2, "fsdp": 2, "expert": 2, "tensor": 1}


def build_case():
    """(model_cfg, optimizer, loss_cfg, host TrainBatch) used by both processes and the test."""
    import optax

    from sat_jax import objectives
    from sat_jax.model import ModelConfig
    from sat_jax.step import TrainBatch

    model_cfg = ModelConfig.preset("tiny", num_layers=1, dispatch="dense")
    optimizer = optax.sgd(0.1, momentum=0.9)
    loss_cfg = objectives.PolicyLossConfig(sat=objectives.SATConfig(enabled=True))
    rng = np.random.default_rng(1)
    b, t = 8, 12
    mask = (np.arange(t)[None, :] >= 5) & (np.arange(t)[None, :] < rng.integers(7, t + 1, (b, 1)))
    batch = TrainBatch(
        tokens=rng.integers(0, model_cfg.vocab_size, (b, t)).astype(np.int32),
        loss_mask=mask.astype(np.float32),
        behavior_logp=(-4.0 + 0.3 * rng.normal(size=(b, t))).astype(np.float32),
        advantages=rng.normal(size=(b, t)).astype(np.float32),
    )
    return model_cfg, optimizer, loss_cfg, batch


def flatten(tree) -> dict[str, np.ndarray]:
    """{"a/b/c": array} of a nested dict of arrays."""
    import jax

    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {jax.tree_util.keystr(p, simple=True, separator="/"): np.asarray(v) for p, v in leaves}


def main(port: int, process_id: int, out: str) -> None:
    import jax

    if port:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            coordinator_address=f"127.0.0.1:{port}",
            num_processes=2,
            process_id=process_id,
            initialization_timeout=60,
        )
    from jax.experimental import multihost_utils

    from sat_jax import sharding
    from sat_jax.step import StepConfig, init_train_state, make_train_step, shard_batch

    assert jax.device_count() == 8, jax.devices()
    assert jax.process_count() == (2 if port else 1), jax.process_count()
    model_cfg, optimizer, loss_cfg, batch = build_case()
    mesh = sharding.make_mesh(sharding.MeshConfig(**MESH))
    state = init_train_state(model_cfg, optimizer, mesh, rng=0)
    step = make_train_step(model_cfg, optimizer, StepConfig(loss=loss_cfg), mesh)
    state, metrics = step(state, shard_batch(batch, mesh))
    params = multihost_utils.process_allgather(state.params, tiled=True)
    loss = np.asarray(metrics["loss"].addressable_data(0))
    if process_id == 0:
        np.savez(out, loss=loss, **{"param/" + k: v for k, v in flatten(params).items()})
    if port:
        jax.distributed.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
