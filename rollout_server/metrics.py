"""Prometheus metrics of the rollout server (served on `server.metrics_port` when non-zero)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import prometheus_client as prom

# The busy-time gauges (`loop_stats.LoopAccounting`, docs/DESIGN.md §4), all since the start.
ACCOUNTING = (
    ("decode_seconds", "seconds the engine spent on generate steps"),
    ("decode_steps", "generate steps"),
    ("admission_idle_slot_seconds", "free slots x seconds while admission was closed"),
    ("cpu_seconds", "CPU seconds (user + system) of the server process"),
    ("steal_seconds", "the machine's steal seconds (NaN where the kernel does not report it)"),
)


class ServerMetrics:
    """Gauges read live from the rollout loop and driver, the Pulls waiting for groups, and
    weight-swap observations.

    Args:
      stats: returns the rollout loop's `stats()` dict.
      prefill_backlog: returns the driver's prefill backlog size.
      registry: where the metrics register (a fresh one per server; tests build several).
      accounting: returns the busy-time accounting (`loop_stats.LoopAccounting.stats`), exported
        as the gauges of `ACCOUNTING`; None = not exported.
    """

    def __init__(
        self,
        stats: Callable[[], dict[str, Any]],
        prefill_backlog: Callable[[], int],
        registry: prom.CollectorRegistry,
        accounting: Callable[[], dict[str, Any]] | None = None,
    ):
        self.registry = registry
        for key, doc in ACCOUNTING if accounting is not None else ():
            gauge = prom.Gauge(f"satjax_rollout_{key}", doc, registry=registry)
            # NaN where a figure is not reported (steal on a kernel without the column), never 0.
            gauge.set_function(lambda key=key: float(accounting().get(key, math.nan)))
        for key, doc in [
            ("version", "weights version in use"),
            ("groups_produced", "finished groups produced"),
            ("groups_consumed", "groups pulled by the trainer"),
            ("groups_queued", "finished groups waiting to be pulled"),
            ("groups_running", "groups being generated"),
            ("tokens_generated", "completion tokens generated"),
            ("prompts_drawn", "prompts drawn from the pipeline"),
        ]:
            gauge = prom.Gauge(f"satjax_rollout_{key}", doc, registry=registry)
            gauge.set_function(lambda key=key: float(stats()[key]))
        backlog = prom.Gauge("satjax_rollout_prefill_backlog", "queued prefills", registry=registry)
        backlog.set_function(lambda: float(prefill_backlog()))
        self._pulls_waiting = prom.Gauge(
            "satjax_rollout_pulls_waiting",
            "Pulls received and not answered yet (waiting for groups or for a pull thread)",
            registry=registry,
        )
        self._swap_seconds = prom.Histogram(
            "satjax_rollout_weight_swap_seconds",
            "UpdateWeights load + swap time",
            registry=registry,
        )

    def pull_started(self) -> None:
        """Counts one more Pull waiting for its reply."""
        self._pulls_waiting.inc()

    def pull_finished(self) -> None:
        """Counts one Pull less (answered, failed or abandoned)."""
        self._pulls_waiting.dec()

    def observe_swap(self, version: int, seconds: float) -> None:
        """Records one UpdateWeights' load + swap time."""
        self._swap_seconds.observe(seconds)

    def serve(self, port: int, host: str) -> None:
        """Starts the HTTP exporter thread."""
        prom.start_http_server(port, addr=host, registry=self.registry)
