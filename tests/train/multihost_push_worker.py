"""One process of the two-process push-during-checkpoint run: the loop keeps pushing while a
background checkpoint's commit is held open.

Run as ``python tests/train/multihost_push_worker.py PORT PROCESS_ID OUT_DIR HOLD [PACE_S STEPS
EVERY]`` (one CPU device each): joins a 2-process ``jax.distributed`` job on 127.0.0.1:PORT
(gloo), syncs weights version 1 (``main.sync_weights``), then runs ``main.train_loop`` for
``STEPS`` steps with a real ``WeightPusher`` (a push after every step), a fake server pool on
process 0 that serves fresh groups and records every ``UpdateWeights``, and a real background
``Checkpointer`` saving once, at step ``EVERY``, whose commit (orbax's lock held) is held open:

- ``HOLD`` = ``event``: until the pool has been told version v + 3, v being the checkpoint's
  version (process 0 then posts a key that releases process 1's commit);
- ``HOLD`` = a number of seconds: that long (``benchmarks/multihost_push.py``).

The step adds 1 to a parameter sharded over both processes and sums it (a cross-process
all-reduce); ``PACE_S`` (default 0) sleeps in it, standing in for a step's compute in the benchmark.
Writes OUT_DIR/push{PROCESS_ID}.json: the steps dispatched while the commit was held, the hold's
length, the checkpoint's version, and (process 0) the versions announced while held and in all.
"""

from __future__ import annotations

import itertools
import json
import pathlib
import sys
import threading
import time

import numpy as np

from tests.train import multihost_worker

W_SIZE = 4096
RELEASE_KEY = "test/push_worker/release"


class FreshPool(multihost_worker.FakePool):
    """Serves fresh groups of the trainer's version; records each ``UpdateWeights`` and sets
    ``reached`` once a version ≥ ``target`` is announced."""

    def __init__(self):
        super().__init__(rounds=0)
        self.ids = itertools.count()
        self.announced: list[int] = []
        self.target: int | None = None
        self.reached = threading.Event()
        self.lock = threading.Lock()

    def pull(self, max_groups: int, timeout_s: float, *, limits=None, trainer_version=0) -> list:
        from rollout_api import records

        out = []
        for _ in range(max_groups):
            n = next(self.ids)
            trajectories = tuple(
                multihost_worker._trajectory(1000 + 2 * n + j, trainer_version) for j in range(2)
            )
            out.append(records.Group(group_id=n, prompt_id=f"p{n}", trajectories=trajectories))
        return out

    def versions(self) -> list[int]:
        return [0]

    def update_weights(self, version, path, *, new_admission_epoch=False, base_path="", wait_s=0.0):
        with self.lock:
            self.pushes.append((version, path, new_admission_epoch))
            self.announced.append(version)
            if self.target is not None and version >= self.target:
                self.reached.set()


def make_pusher(pool, weights_dir: str):
    """The trainer's pusher as ``train.main.run`` makes it; on a tree from before issue 42
    (``WeightPusher(push, supersede=False)`` with several processes) as that tree made it, for
    the benchmark's before figure."""
    import jax

    from train import weight_sync

    if hasattr(weight_sync, "PushGroup"):
        group = weight_sync.PushGroup.of_job()
        push = lambda v, p: weight_sync.push_weights(pool, p, v, weights_dir, group=group)
        return weight_sync.WeightPusher(push, group=group)
    push = lambda v, p: weight_sync.push_weights(pool, p, v, weights_dir)
    return weight_sync.WeightPusher(push, supersede=jax.process_count() == 1)


def main(
    port: int, process_id: int, out_dir: str, hold: str, pace_s: float, steps: int, every: int
):
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}",
        num_processes=2,
        process_id=process_id,
        initialization_timeout=60,
    )
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from sat_jax import params_io, sharding
    from sat_jax.experiment import load_config
    from sat_jax.step import TrainState
    from train import batching, checkpointing, main, pulling

    out = pathlib.Path(out_dir)
    cfg = load_config(
        str(pathlib.Path(__file__).resolve().parents[2] / "configs" / "arith_tiny.yaml"),
        [
            f"train.steps={steps}",
            f"train.checkpoint.every={every}",
            "train.weight_sync_interval=1",
            "train.eval.every=0",
            "train.client.wait_s=60",
        ],
    )
    mesh = Mesh(np.array(jax.devices()), ("data",))
    w = jax.make_array_from_callback(
        (W_SIZE,), NamedSharding(mesh, PartitionSpec("data")), lambda i: np.zeros(W_SIZE)[i]
    )
    state = TrainState(params={"w": w}, opt_state=(), step=np.int32(0))
    pool = FreshPool() if process_id == 0 else None
    weights_dir = str(out / "weights")
    progress = checkpointing.Progress(version=1, min_version=1, rng_key=(0, 0))
    progress = main.sync_weights(pool, state, progress, weights_dir, main.serving_dtype(cfg.server))

    dispatched = itertools.count(1)
    steps_dispatched = [0]
    update = jax.jit(lambda w: (w + 1, jnp.sum(w)))

    def step(state, batch):
        if pace_s:
            time.sleep(pace_s)  # the step's compute, simulated (benchmark only)
        w, total = update(state.params["w"])
        steps_dispatched[0] = next(dispatched)
        new = state.replace(params={"w": w}, step=state.step + 1)
        return new, {"step_skipped": np.float32(0), "total": total}

    client = pulling._client()
    facts: dict = {}
    ckpt = checkpointing.Checkpointer(str(out / "checkpoints"), keep=2)
    save, commit = ckpt.save, ckpt._commit

    def saving(step_, state_, progress_):
        facts["ckpt_step"], facts["ckpt_version"] = step_, progress_.version
        if pool is not None:
            pool.target = progress_.version + 3
        return save(step_, state_, progress_)

    def held_commit(step_: int) -> None:  # on the checkpoint's thread, orbax's lock held
        start, at = time.monotonic(), steps_dispatched[0]
        announced_before = len(pool.announced) if pool is not None else 0
        if hold != "event":
            threading.Event().wait(float(hold))
        elif pool is not None:
            assert pool.reached.wait(120), "v + 3 never reached the server"
            client.key_value_set(RELEASE_KEY, "1")
        else:
            client.blocking_key_value_get(RELEASE_KEY, 120_000)
        facts["hold_s"] = time.monotonic() - start
        facts["steps_during_hold"] = steps_dispatched[0] - at
        facts["orbax_lock_held_at_release"] = params_io.ORBAX_LOCK.locked()
        if pool is not None:
            with pool.lock:
                facts["announced_during_hold"] = pool.announced[announced_before:]
        commit(step_)

    ckpt.save, ckpt._commit = saving, held_commit
    parts = main.LoopParts(
        pool=pool,
        pusher=make_pusher(pool, weights_dir),
        ckpt=ckpt,
        writer=None,
        graphdef=None,
        step_fn=step,
        mesh=sharding.make_mesh(sharding.MeshConfig()),
        spec=batching.BatchSpec(**multihost_worker.SPEC_KWARGS),
    )
    start = time.monotonic()
    with parts.pusher:
        state, progress = main.train_loop(cfg, parts, state, progress)
    facts["loop_s"] = time.monotonic() - start
    ckpt.close()
    facts["committed"] = ckpt.all_steps() if hasattr(ckpt, "all_steps") else None
    facts["final_version"] = progress.version
    if pool is not None:
        facts["announced"] = pool.announced
        last = pool.pushes[-1][1]
    if pool is not None and hasattr(params_io, "is_sharded"):  # (an orbax version: both would)
        like = {"w": jax.ShapeDtypeStruct((W_SIZE,), jnp.float32)}
        facts["last_announced_values"] = sorted(
            set(np.asarray(params_io.load_params(last, like)["w"]).tolist())
        )
    (out / f"push{process_id}.json").write_text(json.dumps(facts))
    jax.distributed.shutdown()


if __name__ == "__main__":
    args = sys.argv[1:]
    main(
        int(args[0]),
        int(args[1]),
        args[2],
        args[3],
        float(args[4]) if len(args) > 4 else 0.0,
        int(args[5]) if len(args) > 5 else 7,
        int(args[6]) if len(args) > 6 else 4,
    )
