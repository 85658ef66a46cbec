"""Weight pushes of a two-process trainer while a background checkpoint's commit is held open.

    PYTHONPATH=. python benchmarks/multihost_push.py [--hold-s 2] [--pace-s 0.05] [--steps 89]
        [--every 45] [--tree DIR] [--json OUT]

Runs ``tests/train/multihost_push_worker.py`` as two ``jax.distributed`` CPU processes (gloo, one
device each): the trainer's loop with a push after every step, a fake server pool on process 0,
and one real background checkpoint (at step ``--every``) whose commit is held open for
``--hold-s`` seconds; each step sleeps ``--pace-s`` (its compute, simulated). ``--tree`` runs the
trainer code of another checkout (e.g. ``git archive`` of main before issue 42 unpacked in a
directory) with this checkout's worker. Printed: the steps each process dispatched while the
commit was held, the versions announced meanwhile (the checkpoint's version v, and which of
v + 1, v + 2, ... reached the server), and the loop's wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile

import portpicker

REPO = pathlib.Path(__file__).resolve().parents[1]
WORKER = REPO / "tests" / "train" / "multihost_push_worker.py"


def run(args: argparse.Namespace) -> dict:
    out = tempfile.mkdtemp(prefix="multihost_push-")
    port = portpicker.pick_unused_port()
    path = [str(pathlib.Path(args.tree).resolve())] if args.tree else []
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": "--xla_force_host_platform_device_count=1",
        "PYTHONPATH": os.pathsep.join([*path, str(REPO)]),
    }
    argv = [str(args.hold_s), str(args.pace_s), str(args.steps), str(args.every)]
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(port), str(pid), out, *argv],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for pid in range(2)
    ]
    for p in procs:
        log = p.communicate(timeout=600)[0]
        if p.returncode:
            raise SystemExit(f"worker failed (rc={p.returncode}):\n{log[-3000:]}")
    facts = [json.loads(pathlib.Path(out, f"push{pid}.json").read_text()) for pid in range(2)]
    v = facts[0]["ckpt_version"]
    return {
        "tree": args.tree or str(REPO),
        "hold_s": [round(f["hold_s"], 2) for f in facts],
        "ckpt_version": v,
        "steps_during_hold": [f["steps_during_hold"] for f in facts],
        "announced_during_hold": facts[0]["announced_during_hold"],
        "announced_total": len(facts[0]["announced"]),
        "final_version": facts[0]["final_version"],
        "loop_s": [round(f["loop_s"], 2) for f in facts],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hold-s", type=float, default=2.0)
    parser.add_argument("--pace-s", type=float, default=0.05)
    parser.add_argument("--steps", type=int, default=89)
    parser.add_argument("--every", type=int, default=45)
    parser.add_argument("--tree", default="")
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    result = run(args)
    print(json.dumps(result, indent=1))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
