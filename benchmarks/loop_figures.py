"""Loop efficiency, contention and admission idle of one run (`benchmarks/async_vs_sync.py`).

`StatsPoller` asks the rollout server for its Stats every `period_s` while a run trains, keeping
the busy-time accounting fields (docs/DESIGN.md §4) with their wall time and the RPC's round trip;
`server_window` reads the fields' change over the trainer's timed steps (linear between polls),
and `loop_figures` puts them beside the trainer's metrics:

- server busy per batch: the engine's decode seconds plus its installs (load + swap), which run in
  series with generation; trainer busy: its mean ``step_s`` (the step; the push runs beside it);
- loop efficiency = max(server busy, trainer busy) ÷ the run's period (1 when the slower side never
  waits; below 1, the share of the period both sides wait on each other);
- CPU seconds per batch of each process (the trainer's ``cpu_s``, the server's ``cpu_seconds``),
  whose async ÷ sync ratio is the contention;
- admission idle: slot-seconds idle while admission was closed, per batch;
- steal: the machine's steal seconds per batch (None where the kernel does not report it);
- CPU loop efficiency = max(server CPU, trainer CPU) per batch ÷ the period: with each process on
  a core of its own, its CPU seconds are its time on that core, host work included (the server's
  prefill, inserts, sampling, loop and Pull replies are not in its decode seconds);
- batch host: the trainer's ``batch_host_s`` per batch (its host work on a batch after the groups
  are in: assembly, broadcast, host→device transfer).
"""

from __future__ import annotations

import statistics
import threading
import time

from rollout_api.client import connect
from rollout_api.proto import rollout_pb2

FIELDS = ("decode_seconds", "decode_steps", "admission_idle_slot_seconds", "cpu_seconds")
STEAL = "steal_seconds"
TOKENS = "tokens_generated"


class StatsPoller:
    """Polls `address`'s Stats on a thread (`start` / `stop`); `samples`: (wall time, fields)."""

    def __init__(self, address: str, period_s: float = 0.2):
        self.address, self.period_s = address, period_s
        self.samples: list[tuple[float, dict[str, float | None]]] = []
        self.rpc_s: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stats-poller", daemon=True)

    def _run(self) -> None:
        channel, stub = connect(self.address, 64 * 1024 * 1024)
        try:
            while not self._stop.is_set():
                t0 = time.perf_counter()
                try:
                    reply = stub.Stats(rollout_pb2.StatsRequest(), timeout=5.0)
                except Exception:  # the server starting or stopping: try again
                    self._stop.wait(self.period_s)
                    continue
                self.rpc_s.append(time.perf_counter() - t0)
                fields: dict[str, float | None] = {k: float(getattr(reply, k)) for k in FIELDS}
                fields[TOKENS] = float(reply.tokens_generated)
                fields[STEAL] = reply.steal_seconds if reply.HasField(STEAL) else None
                self.samples.append((time.time(), fields))
                self._stop.wait(self.period_s)
        finally:
            channel.close()

    def start(self) -> StatsPoller:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


def at(samples: list[tuple[float, dict]], key: str, t: float) -> float | None:
    """`key`'s value at wall time `t`, linear between the polls around it (the nearest poll
    outside them); None when a poll it needs has no value."""
    if not samples:
        return None
    before = [s for s in samples if s[0] <= t]
    after = [s for s in samples if s[0] >= t]
    lo = before[-1] if before else samples[0]
    hi = after[0] if after else samples[-1]
    a, b = lo[1][key], hi[1][key]
    if a is None or b is None:
        return None
    if hi[0] <= lo[0]:
        return a
    return a + (b - a) * (t - lo[0]) / (hi[0] - lo[0])


def server_window(
    samples: list[tuple[float, dict]], t0: float, t1: float
) -> dict[str, float | None]:
    """Each field's change between wall times `t0` and `t1`."""
    out: dict[str, float | None] = {}
    for key in (*FIELDS, TOKENS, STEAL):
        a, b = at(samples, key, t0), at(samples, key, t1)
        out[key] = None if a is None or b is None else b - a
    return out


def loop_figures(
    records: list[dict],
    samples: list[tuple[float, dict]],
    *,
    skip: int,
    install_s: float,
    installs_per_step: float,
) -> dict[str, float | None]:
    """One run's per-batch figures (module docstring) over its steps from `skip` on."""
    timed = records[skip:]
    batches = len(timed) - 1
    period = (timed[-1]["time"] - timed[0]["time"]) / batches
    server = server_window(samples, timed[0]["time"], timed[-1]["time"])
    per = {k: (None if v is None else v / batches) for k, v in server.items()}
    decode = per["decode_seconds"] or 0.0
    server_busy = decode + installs_per_step * install_s
    trainer_busy = statistics.fmean(r["step_s"] for r in timed[1:])
    steps = server["decode_steps"] or 0.0
    trainer_cpu = _mean(timed[1:], "cpu_s")
    cpus = [c for c in (per["cpu_seconds"], trainer_cpu) if c is not None]
    return {
        "period": period,
        "server_busy": server_busy,
        "trainer_busy": trainer_busy,
        "efficiency": max(server_busy, trainer_busy) / period,
        "decode": decode,
        "token_s": (server["decode_seconds"] or 0.0) / steps if steps else None,
        "tokens": per[TOKENS],
        "admission_idle": per["admission_idle_slot_seconds"],
        "server_cpu": per["cpu_seconds"],
        "trainer_cpu": trainer_cpu,
        "cpu_efficiency": max(cpus) / period if cpus else None,
        "batch_host": _mean(timed[1:], "batch_host_s"),
        "steal": per[STEAL],
    }


def _mean(records: list[dict], key: str) -> float | None:
    """`key`'s mean over the records that have it (None if none has)."""
    values = [r[key] for r in records if r.get(key) is not None]
    return statistics.fmean(values) if values else None
