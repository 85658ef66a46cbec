"""Device idle time between the trainer loop's step programs, with a fast in-process group source.

    PYTHONPATH=. JAX_PLATFORMS=cpu python benchmarks/loop_idle.py [--preset small] [--steps 8]
        [--repeats 3] [--set key=value ...] [--json OUT]

``train/main.py``'s own ``train_loop`` runs ``--steps`` steps of the real jitted step at the
``--preset`` model (``configs/arith_main.yaml``'s batch: 16 groups × 8, routing replay, one length
bucket so it compiles once) against a ``FastPool``: every pull decodes synthetic ``Group`` protos
of the task's shapes (``benchmarks/step_data_path.make_groups``, as ``ServerPool.pull`` decodes a
reply), stamped with the version the trainer is at, so none is stale and the source never waits.
No pusher (the loop still takes the host copy of the params a push would take, every
``weight_sync_interval`` updates), no checkpoint, no evaluation.

Measured, after one untimed loop run that compiles, for each of ``--repeats`` loop runs of
``--steps`` steps, from the loop's own step calls (the step function is wrapped, not changed): the
time each step is handed to the device (just before its dispatch) and the time its outputs are
ready (a watcher thread per step blocks on them, so the loop itself never blocks more than it
does on its own). Then, for step k after the first:

- ``idle``: max(0, handed(k) − ready(k−1)), the time the device had no step program to run
  because the loop had not yet dispatched the next one;
- ``busy``: ready(k) − max(handed(k), ready(k−1)), the step program's own time;
- the idle fraction is the sum of ``idle`` over the sum of ``busy`` (target ≤ 5%);
- the period: from the first step's outputs ready to the last's, per step (on a CPU backend the
  host work competes with the step for the same cores, so the period need not fall with idle).

The median over the repeats is printed, with each repeat's. On a CPU backend the "device" is
the same cores the host work runs on, so the host thread that prefetches competes with the step
for them; on a machine shared with other jobs compare runs made back to back. Runs against any
checkout that has ``train.main.train_loop`` (an older tree's serial loop included):
``PYTHONPATH=OTHER_TREE python benchmarks/loop_idle.py``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import statistics
import sys
import threading
import time

import jax
import numpy as np

from rollout_api import records
from sat_jax import sharding
from sat_jax.experiment import load_config
from sat_jax.model import placement
from sat_jax.step import TrainState, create_train_state
from train import batching, checkpointing, main, setup

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import step_data_path

# The config of the tree under test (the one ``train`` is imported from).
CONFIG = pathlib.Path(main.__file__).resolve().parents[1] / "configs" / "arith_main.yaml"


class FastPool:
    """Serves synthetic groups at once: each pull decodes proto copies of the templates, with
    fresh group ids and, as a server just behind the trainer would, the version of the batch
    they will fill (group n is of version n // batch_groups + ``first_version``)."""

    def __init__(self, templates, spec: batching.BatchSpec, first_version: int):
        self.templates, self.spec = templates, spec
        self.first_version = first_version
        self.served = 0

    def pull(self, max_groups: int, timeout_s: float, *, limits=None, trainer_version=0) -> list:
        out = []
        for _ in range(max_groups):
            proto = type(self.templates[0])()
            proto.CopyFrom(self.templates[self.served % len(self.templates)])
            proto.group_id = self.served
            version = self.served // self.spec.batch_groups + self.first_version
            for t in proto.trajectories:  # the versions travel packed (records.to_proto)
                n = len(records.unpack_array(t.versions_packed, np.int64))
                t.versions_packed.CopyFrom(records.pack_array(np.full(n, version, np.int64)))
            out.append(records.decode_group(proto, limits or self.spec.limits))
            self.served += 1
        return out

    def ack(self, groups, *, rejected: bool = False) -> None:
        pass

    def flush_acks(self) -> None:
        pass

    def metrics(self) -> dict[str, float]:
        return {}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--steps", type=int, default=8, help="timed steps per repeat")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--json", default="")
    args = parser.parse_args(argv)
    if args.steps < 2 or args.repeats < 1:
        parser.error("--steps must be at least 2 and --repeats positive")
    return args


def run(args: argparse.Namespace) -> dict:
    cfg = load_config(
        str(CONFIG),
        [
            f"model.preset={args.preset}",
            "train.length_bucket=0",  # one shape: the step compiles once
            "train.eval.every=0",
            "train.checkpoint.every=1000000",
            *args.set,
        ],
    )
    mesh = sharding.make_mesh(cfg.train.mesh)
    _, params = placement.init_sharded(cfg.model, mesh, cfg.train.seed)
    optimizer = cfg.train.optimizer.make(1000)
    step_fn = main.make_step_fn(cfg, optimizer, mesh)
    spec = setup.batch_spec(cfg)
    templates = step_data_path.make_groups(cfg, 0)
    state = create_train_state(cfg.model, optimizer, mesh, params)
    handed: list[float] = []
    ready: list[float] = []
    watchers: list[threading.Thread] = []

    def watch(outputs, slot: int) -> None:
        jax.block_until_ready(outputs)
        ready[slot] = time.perf_counter()

    def timed_step(state: TrainState, batch):
        handed.append(time.perf_counter())
        ready.append(0.0)
        out = step_fn(state, batch)
        watcher = threading.Thread(target=watch, args=(out[1], len(ready) - 1))
        watcher.start()
        watchers.append(watcher)
        return out

    def loop(state: TrainState, version: int, steps: int) -> tuple[TrainState, dict]:
        pool = FastPool(templates, spec, version)
        loop_cfg = dataclasses.replace(
            cfg, train=dataclasses.replace(cfg.train, steps=int(state.step) + steps)
        )
        parts = main.LoopParts(
            pool=pool,
            pusher=None,
            ckpt=None,
            writer=None,
            graphdef=None,
            step_fn=timed_step,
            mesh=mesh,
            spec=spec,
        )
        progress = checkpointing.Progress(version=version, min_version=1, rng_key=(0, 1))
        handed.clear(), ready.clear(), watchers.clear()
        state, _ = main.train_loop(loop_cfg, parts, state, progress)
        for w in watchers:
            w.join()
        idle = [max(0.0, handed[k] - ready[k - 1]) for k in range(1, len(handed))]
        busy = [ready[k] - max(handed[k], ready[k - 1]) for k in range(1, len(handed))]
        period = (ready[-1] - ready[0]) / len(idle)
        return state, {
            "idle_s": sum(idle),
            "busy_s": sum(busy),
            "gaps": len(idle),
            "period": period,
        }

    state, _ = loop(state, 1, 2)  # compiles
    version, runs = 3, []
    for _ in range(args.repeats):
        state, run = loop(state, version, args.steps)
        version += args.steps
        runs.append(run)
    fracs = [r["idle_s"] / r["busy_s"] for r in runs]
    return {
        "preset": args.preset,
        "batch": f"{spec.batch_groups} groups x {spec.group_size}, T {spec.seq_len}",
        "devices": f"{jax.device_count()} {jax.default_backend()}",
        "steps": args.steps,
        "repeats": args.repeats,
        "step_s": statistics.median(r["busy_s"] / r["gaps"] for r in runs),
        "idle_s_per_step": statistics.median(r["idle_s"] / r["gaps"] for r in runs),
        "period_s": statistics.median(r["period"] for r in runs),
        "idle_frac": statistics.median(fracs),
        "idle_frac_each": fracs,
        "prefetch": "prefetch" in {f.name for f in dataclasses.fields(main.LoopParts)},
        "load_average": os.getloadavg(),
        "cpus": os.cpu_count(),
    }


def main_cli(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    out = run(args)
    print(
        f"{out['preset']} ({out['batch']}), {out['devices']}, prefetch {out['prefetch']}: step "
        f"program {out['step_s']:.3f} s, device idle between step programs "
        f"{out['idle_s_per_step']:.4f} s per step = {100 * out['idle_frac']:.1f}% of the step, "
        f"one step every {out['period_s']:.3f} s "
        "(each repeat: "
        + ", ".join(f"{100 * f:.1f}%" for f in out["idle_frac_each"])
        + f"); load average {out['load_average'][0]:.1f} on {out['cpus']} CPUs",
        flush=True,
    )
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main_cli()
