"""The trainer with its step replaced by a sleep, for `benchmarks/async_vs_sync.py --stand-in`.

    python benchmarks/stand_in_train.py --step-s 0.08 --config FILE [k=v ...]

Runs `python -m train` (`train.main.cli`) with every train step a sleep of ``--step-s`` seconds
that returns the state with its step count advanced and the params unchanged (never skipped); the
rest is the real trainer's: pulling, batching, acknowledgements, the weight pushes and the
metrics. Only this benchmark selects it.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import numpy as np

from train import main as train_main


def sleep_step(step_s: float, sleep=time.sleep):
    """A train step that sleeps `step_s` and advances the state's step count; its metrics are
    ``step_skipped`` 0 and the batch's ``active_tokens`` (the loss mask's sum)."""

    def step(state, batch):
        sleep(step_s)
        metrics = {
            "step_skipped": np.float32(0),
            "active_tokens": np.float32(np.asarray(batch.loss_mask).sum()),
        }
        return dataclasses.replace(state, step=state.step + 1), metrics

    return step


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--step-s", type=float, required=True, help="seconds each step sleeps")
    args, rest = parser.parse_known_args(argv)
    if not (math.isfinite(args.step_s) and args.step_s >= 0):
        parser.error(f"--step-s must be a finite number >= 0, got {args.step_s}")
    train_main.make_step_fn = lambda *a, **k: sleep_step(args.step_s)
    train_main.cli(rest)


if __name__ == "__main__":
    main()
