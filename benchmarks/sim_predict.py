"""The fleet simulator (`tests/fleet_sim.py`) as a predictor of one measured run's period.

`predict_period(Components(...))` builds a one-server `FleetSim` in seconds from the component
times an async run measured (`benchmarks/async_vs_sync.py` fills them): the step, the push (save +
UpdateWeights, its install included: from the step's end to the server holding the weights), the
server's seconds per generate step (every busy slot decodes one token in it) with the installs in
series slowing it down, the tokens per sample, the Pull latency, and the run's shape (slots, group
size, batch groups, queue capacity, max_staleness, weight_sync_interval), and returns the period
it simulates (the mean over its steps after the warm-up). The simulator's servers always install
every version; `IntervalSim` pushes every `weight_sync_interval`-th only, as the trainer does.
"""

from __future__ import annotations

import dataclasses
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from tests.fleet_sim import FleetSim


@dataclasses.dataclass(frozen=True, kw_only=True)
class Components:
    """One async run's component times (seconds) and shape; see the module docstring.

    Attributes:
      step_s: the trainer's step (`step_s`, mean over the run).
      push_s: a push from the step's end to the server holding the weights (median `push_s`).
      install_s: one install on the server (load + swap), in series with generation.
      installs_per_step: installs per trained step (1 at n = 1, about 1/8 at n = 8).
      token_s: seconds per generate step (the server's decode seconds ÷ its generate steps).
      tokens: completion tokens per sample (the stop id included).
      pull_s: one Pull's latency (what the trainer waits for a reply beyond the groups' wait).
      decode_per_batch_s: the server's decode seconds per batch (to weigh the installs).
    """

    step_s: float
    push_s: float
    install_s: float
    installs_per_step: float
    token_s: float
    tokens: float
    pull_s: float
    decode_per_batch_s: float
    slots: int
    group_size: int
    batch_groups: int
    queue_groups: int
    max_staleness: int
    interval: int


class IntervalSim(FleetSim):
    """`FleetSim` whose trainer pushes every `interval`-th version only (its first always)."""

    def __init__(self, *args, interval: int = 1, **kwargs):
        self.interval = interval
        super().__init__(*args, **kwargs)

    def _push_all(self, new_epoch: bool, delay: float | None = None) -> None:
        if new_epoch or self.version % self.interval == 0:
            super()._push_all(new_epoch, delay)


def build(c: Components) -> IntervalSim:
    """The simulator of `c` (one server, seconds as its time unit)."""
    busy = c.decode_per_batch_s + c.installs_per_step * c.install_s
    slowdown = busy / c.decode_per_batch_s if c.decode_per_batch_s > 0 else 1.0
    speed = 1.0 / (c.token_s * slowdown)  # tokens per second per slot, installs included
    return IntervalSim(
        [(speed, c.slots, (c.tokens, c.tokens))],
        interval=c.interval,
        max_staleness=c.max_staleness,
        batch_groups=c.batch_groups,
        group_size=c.group_size,
        capacity=c.queue_groups,
        step_time=c.step_s,
        push_delay=c.push_s,
        pull_delay=c.pull_s,
        dt=min(c.step_s, c.token_s) / 4,
        stall_after=1e6,
    )


def predict_period(c: Components, steps: int = 200, warmup: int = 20) -> float:
    """The simulated trainer period of `c`, seconds per step (steps after `warmup`)."""
    return build(c).run(steps, warmup=warmup)["period"]
