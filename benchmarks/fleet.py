"""The elastic rollout fleet (docs/DESIGN.md §6.3, §6.5): stale drops per trained group with 1, 2
(and 4) servers under the fleet's one staleness budget and under per-server budgets (what servers
did before `admission_share`), and trained tokens/s with two servers, after losing one and after it
rejoins.

    PYTHONPATH=$PWD python benchmarks/fleet.py [--servers 1 2 4] [--steps 30] [--step-s 0.5]

The trainer's loop runs in this process against `--servers` rollout server processes
(configs/arith_tiny.yaml, max_staleness 1, 2 groups of 2 per batch) with a stand-in step that only
takes `--step-s` seconds, so generation outpaces training and admission is what bounds staleness.
"per-server" sends every server a share of 1, which is how each server counted before the fleet
had one budget. The kill/rejoin phase SIGKILLs the second of two servers after a quarter of the
steps and restarts it (same port and state_dir) at half of them (the loop waits at the next step
for it to rejoin), and reports trained completion tokens/s per phase, the after-rejoin one over
the second half from the third step after that server's first group (its first compilations
left out), and the seconds from the restart to the first group of that server pulled.
Prints Markdown tables.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import tempfile
import time

import jax
import numpy as np
from flax import nnx

from sat_jax import sharding
from sat_jax.experiment import load_config
from sat_jax.model import placement
from sat_jax.step import TrainState
from train import checkpointing, main, metrics, remote, setup, weight_sync
from train.local_server import LocalServer

REPO = pathlib.Path(__file__).resolve().parents[1]
CONFIG = str(REPO / "configs" / "arith_tiny.yaml")
B = 2


def _overrides(tmp: pathlib.Path) -> list[str]:
    return [
        "rollout.max_staleness=1",
        f"rollout.batch_groups={B}",
        "rollout.group_size=2",
        "rollout.max_new_tokens=6",
        "server.slots=4",
        f"server.checkpoint_root={tmp}",
        "train.checkpoint.every=1000",
        "train.eval.problems=0",
        "train.client.grace_s=2",
        "train.client.wait_s=300",
        f"train.run_dir={tmp / 'run'}",
    ]


def _params(cfg) -> dict:
    abstract = nnx.to_pure_dict(placement.abstract_model(cfg.model)[1])
    rng = np.random.default_rng(0)
    return jax.tree.map(
        lambda x: jax.device_put((0.1 * rng.standard_normal(x.shape)).astype(x.dtype)), abstract
    )


def _step(seconds: float, hooks: dict, trained: list):
    calls = [0]

    def step(state: TrainState, batch):
        calls[0] += 1
        if calls[0] in hooks:
            hooks[calls[0]]()
        time.sleep(seconds)
        trained.append((time.monotonic(), int(np.asarray(batch.loss_mask).sum())))
        return state.replace(step=state.step + 1), {"step_skipped": np.bool_(False)}

    return step


class _PerServerPool(remote.ServerPool):
    """Sends every server a share of 1: each counts only its own groups (the old behaviour)."""

    def _update_request(self, version, path, new_epoch, share, base_path=""):
        return super()._update_request(version, path, new_epoch, 1.0, base_path)


def run(k: int, steps: int, step_s: float, *, fleet_budget: bool, kill: bool = False) -> dict:
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="fleet-"))
    overrides = _overrides(tmp)
    servers = [
        LocalServer(
            CONFIG, [*overrides, f"server.state_dir={tmp / f'state-{i}'}"], str(tmp / f"s{i}.log")
        )
        for i in range(k)
    ]
    marks: dict[str, float] = {}
    trained: list[tuple[float, int]] = []
    pool_ref = []

    def kill_second():
        servers[1].proc.kill()
        servers[1].proc.wait()
        marks["killed"] = time.monotonic()

    def restart_second():
        servers[1].restart_if_exited()
        marks["restarted"] = time.monotonic()
        marks["pulled_before"] = pool_ref[0].metrics()["pulled_1"]

    def wait_for_second():  # its start-up takes longer than the steps left on a loaded machine
        while pool_ref[0].metrics()["servers_up"] < 2:
            time.sleep(0.1)

    hooks = {}
    if kill:
        hooks = {steps // 4: kill_second, steps // 2: restart_second}
        hooks[steps // 2 + 1] = wait_for_second
    try:
        for s in servers:
            s.wait_ready(timeout_s=300)
        cfg = load_config(
            CONFIG,
            [*overrides, f"train.client.servers=[{','.join(s.address for s in servers)}]",
             f"train.steps={steps}"],
        )  # fmt: skip
        t = cfg.train
        pool_cls = remote.ServerPool if fleet_budget else _PerServerPool
        pool = pool_cls(
            t.servers, token="", max_message_bytes=cfg.server.max_message_bytes,
            retry_max_s=t.retry_max_s, server_wait_s=t.server_wait_s, grace_s=t.server_grace_s,
            background=True,
        )  # fmt: skip
        pool_ref.append(pool)
        _, _, weights_dir = setup.run_paths(cfg)
        push = lambda v, p: weight_sync.push_weights(pool, p, v, weights_dir)
        state = TrainState(params=_params(cfg), opt_state=(), step=np.int32(0))
        progress = checkpointing.Progress(version=1, min_version=1, rng_key=(0, 0))
        writer = metrics.MetricsWriter(str(tmp / "logs"), total_steps=steps, console=None)
        first_b = []
        with pool, writer, weight_sync.WeightPusher(push) as pusher:
            progress = main.sync_weights(pool, state, progress, weights_dir)
            parts = main.LoopParts(
                pool=pool, pusher=pusher, ckpt=None, writer=writer, graphdef=None,
                step_fn=_step(step_s, hooks, trained),
                mesh=sharding.make_mesh(t.mesh, jax.devices()[:1]), spec=setup.batch_spec(cfg),
            )  # fmt: skip
            if kill:
                real_pull = pool.pull

                def pull(*a, **kw):
                    got = real_pull(*a, **kw)
                    if (
                        "restarted" in marks
                        and not first_b
                        and pool.metrics()["pulled_1"] > (marks["pulled_before"])
                    ):
                        first_b.append(time.monotonic())
                    return got

                pool.pull = pull
            _, progress = main.train_loop(cfg, parts, state, progress)
    finally:
        for s in servers:
            s.stop()
    out = {"k": k, "drops_per_group": progress.stale_dropped / max(progress.groups_trained, 1)}
    if kill:

        def rate(lo, hi):
            sel = [(t, n) for t, n in trained if lo <= t < hi]
            if len(sel) < 2:
                return float("nan")
            return sum(n for _, n in sel[1:]) / (sel[-1][0] - sel[0][0])

        start = trained[2][0] if len(trained) > 2 else 0  # skip the first, compiling steps
        out["two_up"] = rate(start, marks["killed"])
        # From the third step after the kill: the grace before it left is over by then.
        after_kill = [t for t, _ in trained if t >= marks["killed"]][3:4]
        out["one_up"] = rate(after_kill[0], marks["restarted"]) if after_kill else float("nan")
        rejoined = first_b[0] if first_b else float("nan")
        settled = [t for t, _ in trained if t >= rejoined][3:4]  # 3 steps after its first group
        out["rejoined"] = rate(settled[0], float("inf")) if settled else float("nan")
        out["restart_to_first_group_s"] = rejoined - marks["restarted"]
    return out


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--servers", type=int, nargs="*", default=[1, 2])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--step-s", type=float, default=0.5)
    parser.add_argument("--no-kill", action="store_true", help="skip the kill/rejoin phase")
    args = parser.parse_args()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    if args.servers:
        print("| servers | stale drops / trained group, per-server budgets | one fleet budget |")
        print("| --- | --- | --- |")
    for k in args.servers:
        before = run(k, args.steps, args.step_s, fleet_budget=False)
        after = run(k, args.steps, args.step_s, fleet_budget=True)
        print(f"| {k} | {before['drops_per_group']:.2f} | {after['drops_per_group']:.2f} |")
        sys.stdout.flush()
    if not args.no_kill:
        r = run(2, max(args.steps, 40), args.step_s, fleet_budget=True, kill=True)
        print()
        print(
            "| trained tokens/s: two servers | one killed | after it rejoined | restart → first group pulled (s) |"
        )
        print("| --- | --- | --- | --- |")
        print(f"| {r['two_up']:.1f} | {r['one_up']:.1f} | {r['rejoined']:.1f} | "
              f"{r['restart_to_first_group_s']:.1f} |")  # fmt: skip


if __name__ == "__main__":
    cli()
