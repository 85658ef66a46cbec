"""Metrics sinks: TensorBoard event files, the JSON-lines log, the console line, curves.png."""

from __future__ import annotations

import io
import json
import subprocess
import sys

import numpy as np
import pytest

from train import curves, metrics
from train.batching import LAG_BINS, BatchStats


def _stats(lags: np.ndarray) -> BatchStats:
    return BatchStats(
        groups=1,
        stale_dropped=0,
        stale_kept=0,
        duplicates=0,
        invalid=0,
        reward_mean=0.5,
        response_len_mean=float(lags.size),
        tokens=lags.size,
        prompt_ids=("p",),
        group_keys=("s/0",),
        pad_frac=0.25,
        lags=lags,
    )


def test_writer_sinks_and_curves(tmp_path):
    console = io.StringIO()
    with metrics.MetricsWriter(str(tmp_path), total_steps=4, console=console) as writer:
        for step in (1, 2):
            writer.write(
                step,
                {"reward_mean": 0.25 * step, "lag_mean": 0.5, "lag_max": 1, "sat_gate_rate": 0.1},
                _stats(np.array([0, 1, 1, 0, 12])),
            )
        writer.write(2, {"accuracy": 0.5, "skip_me": None}, console=False)
    events = [p for p in tmp_path.iterdir() if p.name.startswith("events.out.tfevents")]
    assert events and events[0].stat().st_size > 0
    # A line torn by a killed writer is skipped on reading.
    with open(writer.jsonl_path, "a") as f:
        f.write('{"step": 3, "rew')
    records = metrics.read_jsonl(writer.jsonl_path)
    assert [r["step"] for r in records] == [1, 2, 2]
    # The batch's own histogram: lags past the last bin are counted in it.
    assert records[0]["lag_hist"] == [2, 2] + [0] * (LAG_BINS - 3) + [1] and records[2] == {
        **records[2],
        "accuracy": 0.5,
    }
    assert "skip_me" not in records[2]
    lines = console.getvalue().splitlines()
    assert len(lines) == 2 and lines[1].startswith("[##########..........] 2/4 reward_mean=0.5")
    png = tmp_path / "curves.png"
    curves.plot_curves(records, str(png), title="t")
    assert png.read_bytes()[:4] == b"\x89PNG"
    json.dumps(records)  # the log stays plain JSON


@pytest.mark.slow  # imports the trainer in a process
def test_importing_the_trainer_leaves_matplotlib_alone():
    # curves.py draws on a bare Figure: importing the trainer (train.setup in a notebook) must not
    # load pyplot or switch its backend (which silently stops inline figures).
    code = "import sys, train.main, train.setup; print('matplotlib.pyplot' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "False"
