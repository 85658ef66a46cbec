"""The fleet simulator (`tests/fleet_sim.py`) as a predictor of one measured run's period.

`predict_period(Components(...))` builds a one-server `FleetSim` in seconds from the component
times an async run measured (`benchmarks/async_vs_sync.py` fills them): the step, the push (save +
UpdateWeights, its install included: from the step's end to the server holding the weights), the
server's seconds per generate step (every busy slot decodes one token in it) with the installs in
series slowing it down, the tokens per sample, the Pull latency, and the run's shape (slots, group
size, batch groups, queue capacity, max_staleness, weight_sync_interval), and returns the period
it simulates (the mean over its steps after the warm-up). The simulator's servers always install
every version; `IntervalSim` pushes every `weight_sync_interval`-th only, as the trainer does.

Two host costs beside the components above, both measured in the same run:

- the server's CPU seconds per batch (`server_cpu_s`, its Stats ``cpu_seconds``): on a core of its
  own, everything the server process does for a batch (prefill and inserts, sampling, the loop,
  admission, delivery, Pull replies, installs) runs in series with its generate steps. Where it
  exceeds decode + installs the simulated server is slowed so that a batch on all its slots takes
  that long (`server_speed`), not only the decode seconds;
- the trainer's host work on a batch after its groups are in (`batch_host_s`, the trainer's
  ``batch_host_s``: assembly, broadcast, the host→device transfer): a batch is ready that long
  after its last group is in (`FleetSim`'s ``batch_host``), so the trainer waits for it only when
  the batch fills up late, not when it was prefetched during the step before. The rest of the
  trainer's host work runs beside the step and is in its measured ``step_s``.
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
      server_cpu_s: the server process's CPU seconds per batch (0 = not measured).
      batch_host_s: the trainer's host seconds on a batch after its groups are in (0 = not
        measured).
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
    server_cpu_s: float = 0.0
    batch_host_s: float = 0.0


class IntervalSim(FleetSim):
    """`FleetSim` whose trainer pushes every `interval`-th version only (its first always)."""

    def __init__(self, *args, interval: int = 1, **kwargs):
        self.interval = interval
        super().__init__(*args, **kwargs)

    def _push_all(self, new_epoch: bool, delay: float | None = None) -> None:
        if new_epoch or self.version % self.interval == 0:
            super()._push_all(new_epoch, delay)


def server_speed(c: Components) -> float:
    """Tokens per second per slot of the simulated server: the decode rate slowed by the installs
    in series with it, and, where the server's CPU seconds per batch exceed decode + installs,
    no faster than a batch of ``batch_groups`` × ``group_size`` samples of ``tokens`` on all
    ``slots`` in ``server_cpu_s``."""
    busy = c.decode_per_batch_s + c.installs_per_step * c.install_s
    slowdown = busy / c.decode_per_batch_s if c.decode_per_batch_s > 0 else 1.0
    speed = 1.0 / (c.token_s * slowdown)  # installs included
    if c.server_cpu_s > busy:
        samples = c.batch_groups * c.group_size
        speed = min(speed, samples * c.tokens / (c.slots * c.server_cpu_s))
    return speed


def build(c: Components) -> IntervalSim:
    """The simulator of `c` (one server, seconds as its time unit)."""
    speed = server_speed(c)
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
        batch_host=c.batch_host_s,
        dt=min(c.step_s, c.token_s) / 4,
        stall_after=1e6,
    )


def predict_period(c: Components, steps: int = 200, warmup: int = 20) -> float:
    """The simulated trainer period of `c`, seconds per step (steps after `warmup`)."""
    return build(c).run(steps, warmup=warmup)["period"]
