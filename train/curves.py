"""``curves.png``: reward, held-out accuracy, mismatch, lag and SAT gate rate against the step."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from matplotlib.figure import Figure  # no pyplot: no global backend switch for an importer

PANELS = (
    ("reward_mean", "reward (train batch)"),
    ("accuracy", "held-out greedy accuracy"),
    ("mismatch_abs_mean", "mismatch |logp − behavior_logp|"),
    ("lag_mean", "lag (mean, max dashed)"),
    ("sat_gate_rate", "SAT gate rate"),
)


def plot_curves(records: Sequence[dict[str, Any]], path: str, *, title: str = "") -> None:
    """Writes one panel per metric of ``PANELS`` (records without a metric are skipped)."""
    fig = Figure(figsize=(3.6 * len(PANELS), 3.0))
    axes = fig.subplots(1, len(PANELS))
    for ax, (key, label) in zip(axes, PANELS, strict=True):
        points = sorted((r["step"], r[key]) for r in records if r.get(key) is not None)
        if points:
            xs, ys = (np.asarray(v, float) for v in zip(*points, strict=True))
            if len(xs) < 30:
                ax.plot(xs, ys, marker="o", markersize=3)
            else:  # per-step series are noisy: faint raw values under a moving average
                ax.plot(xs, ys, alpha=0.25, linewidth=0.8)
                ax.plot(xs, _moving_average(ys, max(len(ys) // 25, 2)), color="C0")
        if key == "lag_mean":
            peaks = [(r["step"], r["lag_max"]) for r in records if r.get("lag_max") is not None]
            if peaks:
                xs, ys = zip(*peaks, strict=True)
                ax.plot(xs, ys, linestyle="--", alpha=0.6)
        ax.set_title(label, fontsize=9)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def _moving_average(ys: np.ndarray, window: int) -> np.ndarray:
    """Trailing mean over up to ``window`` points (shorter at the start), same length as ``ys``."""
    sums = np.cumsum(np.concatenate([[0.0], ys]))
    lo = np.maximum(np.arange(1, len(ys) + 1) - window, 0)
    return (sums[1:] - sums[lo]) / (np.arange(1, len(ys) + 1) - lo)
