"""One process of the two-process trainer kill test (tests/train/test_process_kill.py).

``python tests/train/process_kill_worker.py PORT PROCESS_ID OUT_DIR STEPS [HOLD_AT]``: joins a
2-process ``jax.distributed`` job on 127.0.0.1:PORT (gloo, one CPU device each; JAX's own
heartbeat timeout set to 600 s, so that only ``train.peers`` can end a survivor sooner), then runs
``main.train_loop`` inside ``peers.watch()`` to STEPS with a checkpoint every 2 steps under
OUT_DIR/ckpt, resuming from the latest one. Process 0 pulls from ``FileServer``, a stand-in
rollout server whose acknowledgements persist in OUT_DIR/acked.json (groups pulled and not
acknowledged are handed out again, as a real server's leases are). With HOLD_AT, process 0's
step HOLD_AT writes OUT_DIR/holding and then waits forever (for the test to kill the other
process). At the end each process writes OUT_DIR/done-PROCESS_ID.json (its resumed step and the
final progress).
"""

from __future__ import annotations

import json
import pathlib
import sys
import threading

import numpy as np

B = 2  # groups per batch
CONFIG_OVERRIDES = [
    "rollout.batch_groups=2",
    "rollout.group_size=2",
    "rollout.max_staleness=1000",  # the stand-in server's versions do not follow the trainer's
    "train.routing_replay=false",
    "train.checkpoint.every=2",
    "train.eval.problems=0",
]


class FileServer:
    """Groups 0, 1, 2, ... in order, skipping the acknowledged ones (OUT_DIR/acked.json) and the
    ones pulled since this process started."""

    def __init__(self, out: pathlib.Path):
        self.path = out / "acked.json"
        self.acked: list[int] = json.loads(self.path.read_text()) if self.path.exists() else []
        self.pulled: set[int] = set()
        # The loop acknowledges trained groups on its thread while the prefetch thread pulls and
        # rejects; and a kill may land mid-write: one writer at a time, each write atomic.
        self._lock = threading.Lock()

    def pull(self, max_groups: int, timeout_s: float, *, limits=None, trainer_version=0) -> list:
        from rollout_api.records import Group, Trajectory

        groups, i = [], 0
        with self._lock:
            while len(groups) < max_groups:
                if i not in self.pulled and i not in self.acked:
                    self.pulled.add(i)
                    trajectories = tuple(
                        Trajectory(
                            prompt_ids=np.array([1, 5, 6], np.int32),
                            completion_ids=np.array([7, 2], np.int32),
                            behavior_logprobs=np.array([-1.0, -0.5], np.float32),
                            versions=np.full(2, 1, np.int64),
                            reward=float(j),
                        )
                        for j in range(2)
                    )
                    groups.append(Group(group_id=i, prompt_id=f"p{i}", trajectories=trajectories))
                i += 1
        return groups

    def ack(self, groups, *, rejected: bool = False) -> None:
        with self._lock:
            self.acked.extend(g.group_id for g in groups)
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps(self.acked))
            tmp.replace(self.path)

    def flush_acks(self) -> None:
        pass

    def metrics(self) -> dict[str, float]:
        return {}


def _step_fn(out: pathlib.Path, process_id: int, hold_at: int | None):
    import jax

    from sat_jax.step import TrainState

    add = jax.jit(lambda w: w + 1.0)
    calls = [0]

    def step(state: TrainState, batch):
        calls[0] += 1
        if hold_at is not None and process_id == 0 and int(state.step) + 1 == hold_at:
            (out / "holding").write_text(str(calls[0]))
            threading.Event().wait()  # until the test kills the other process
        params = {"w": add(state.params["w"])}
        return state.replace(params=params, step=state.step + 1), {"step_skipped": np.bool_(False)}

    return step


def main(port: int, process_id: int, out: pathlib.Path, steps: int, hold_at: int | None) -> None:
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}",
        num_processes=2,
        process_id=process_id,
        initialization_timeout=120,
        heartbeat_timeout_seconds=600,
    )
    from jax.experimental import multihost_utils
    from jax.sharding import NamedSharding, PartitionSpec

    from sat_jax import sharding
    from sat_jax.experiment import load_config
    from sat_jax.step import TrainState
    from tests.train.test_main import CONFIG
    from train import checkpointing, main, peers, setup

    cfg = load_config(CONFIG, [*CONFIG_OVERRIDES, f"train.steps={steps}"])
    mesh = sharding.make_mesh(sharding.MeshConfig(fsdp=2), jax.devices())
    w = jax.make_array_from_callback(
        (8,), NamedSharding(mesh, PartitionSpec("fsdp")), lambda idx: np.zeros(8, np.float32)[idx]
    )
    state = TrainState(params={"w": w}, opt_state=(), step=np.int32(0))
    progress = checkpointing.Progress(version=1, min_version=1, rng_key=(0, 0))
    with (
        peers.watch(),
        checkpointing.Checkpointer(str(out / "ckpt"), keep=5) as ckpt,
    ):
        resumed = ckpt.latest_step()
        if resumed is not None:
            abstract = jax.tree.map(
                lambda x: (
                    jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
                    if isinstance(x, jax.Array)
                    else jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype)
                ),
                state,
            )
            state, progress = ckpt.restore(resumed, abstract)
        print(f"process {process_id} starts at step {int(state.step)}", flush=True)
        parts = main.LoopParts(
            pool=FileServer(out) if process_id == 0 else None,
            pusher=None,
            ckpt=ckpt,
            writer=None,
            graphdef=None,
            step_fn=_step_fn(out, process_id, hold_at),
            mesh=mesh,
            spec=setup.batch_spec(cfg),
        )
        state, progress = main.train_loop(cfg, parts, state, progress)
        ckpt.save(int(state.step), state, progress)
        w_all = multihost_utils.process_allgather(state.params["w"], tiled=True)
    done = {
        "resumed": resumed,
        "step": int(state.step),
        "w": np.asarray(w_all).tolist(),
        "keys": list(progress.recent_group_keys),
    }
    (out / f"done-{process_id}.json").write_text(json.dumps(done))
    jax.distributed.shutdown()


if __name__ == "__main__":
    args = sys.argv[1:]
    main(
        int(args[0]),
        int(args[1]),
        pathlib.Path(args[2]),
        int(args[3]),
        int(args[4]) if len(args) > 4 else None,
    )
