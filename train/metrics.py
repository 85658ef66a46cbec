"""Where the trainer's per-step metrics go: TensorBoard event files, a JSON-lines log (read back for
``curves.png``), a console progress line, and optionally Weights & Biases.

Scalars are logged under their docs/DESIGN.md §4 names; a batch's lags (``BatchStats``, the one
place they are counted) go to TensorBoard as a histogram (``lag``) and to the JSON log as
``BatchStats.lag_hist`` counts (lags 0 … 7, then one bin for everything older).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Mapping
from typing import Any, TextIO

import numpy as np
from tensorboardX import SummaryWriter

from train.batching import BatchStats

# The console line shows these, in this order, when present.
CONSOLE_KEYS = (
    "reward_mean",
    "accuracy",
    "mismatch_abs_mean",
    "lag_mean",
    "lag_max",
    "sat_gate_rate",
    "router_shift_ratio",
    "stale_dropped",
    "groups_filtered",
    "steps_skipped",
    "tokens_per_s",
)


class MetricsWriter:
    """Writes one record per step to every sink.

    Args:
      log_dir: TensorBoard event files and ``metrics.jsonl`` go here.
      total_steps: for the progress line.
      wandb_project: a W&B project name to log to as well; "" = off.
      console: the stream for the progress line (None = silent).
    """

    def __init__(
        self,
        log_dir: str,
        *,
        total_steps: int,
        wandb_project: str = "",
        console: TextIO | None = sys.stdout,
    ):
        os.makedirs(log_dir, exist_ok=True)
        self.jsonl_path = os.path.join(log_dir, "metrics.jsonl")
        self._tb = SummaryWriter(log_dir)
        self._jsonl = open(self.jsonl_path, "a")
        self._total = total_steps
        self._console = console
        self._start = time.monotonic()
        self._wandb = None
        if wandb_project:
            import wandb  # optional dependency, imported only when asked for

            self._wandb = wandb.init(project=wandb_project, dir=log_dir, resume="allow")

    def write(
        self,
        step: int,
        scalars: Mapping[str, float | None],
        stats: BatchStats | None = None,
        *,
        console: bool = True,
    ) -> None:
        """Logs ``scalars`` (None values are left out) and the lags of the step's batch ``stats``
        at ``step``; ``console=False`` keeps it off the progress line."""
        clean = {k: float(v) for k, v in scalars.items() if v is not None}
        if not clean and stats is None:
            return
        for key, value in clean.items():
            self._tb.add_scalar(key, value, step)
        record: dict[str, Any] = {"step": step, "time": time.time(), **clean}
        if stats is not None and stats.lags.size:
            lags = stats.lags
            self._tb.add_histogram("lag", lags, step, bins=np.arange(-0.5, lags.max() + 1.5))
            record["lag_hist"] = stats.lag_hist.tolist()
        self._jsonl.write(json.dumps(_finite(record)) + "\n")
        self._jsonl.flush()
        if self._wandb is not None:
            self._wandb.log(clean, step=step)
        if console and self._console is not None:
            self._console.write(progress_line(step, self._total, clean, self._start) + "\n")
            self._console.flush()

    def flush(self) -> None:
        self._tb.flush()
        self._jsonl.flush()

    def close(self) -> None:
        self._tb.close()
        self._jsonl.close()
        if self._wandb is not None:
            self._wandb.finish()

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def progress_line(step: int, total: int, scalars: Mapping[str, float], start: float) -> str:
    """``[#####.....] 12/100 reward_mean=0.41 ...`` with elapsed time."""
    width = 20
    done = min(width, int(width * step / max(total, 1)))
    parts = [f"[{'#' * done}{'.' * (width - done)}] {step}/{total}"]
    for key in CONSOLE_KEYS:
        if key in scalars:
            value = scalars[key]
            parts.append(
                f"{key}={value:.0f}" if float(value).is_integer() else f"{key}={value:.4g}"
            )
    parts.append(f"{time.monotonic() - start:.0f}s")
    return " ".join(parts)


def read_jsonl(path: str) -> list[dict[str, Any]]:
    """The records of a ``metrics.jsonl``; a torn last line (killed writer) is skipped."""
    records = []
    with open(path) as f:
        for line in f:
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return records


def _finite(record: dict[str, Any]) -> dict[str, Any]:
    return {
        k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()
    }
