"""Metrics rules both processes share, defined once: the latency histogram buckets, the
TTFT / TPOT / end-to-end arithmetic of one finished request, and the /metrics endpoint
(every series labelled with the model's name, plus the process_* metrics)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Histogram, ProcessCollector, start_http_server
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

# Seconds: 5 ms (a decode step on a GPU) to 2 minutes (a long generation under load).
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class RequestLatency:
    """TTFT, TPOT and end-to-end histograms named `{prefix}_...` in `registry`."""

    def __init__(self, prefix: str, registry: CollectorRegistry) -> None:
        self.ttft = latency_histogram(
            f"{prefix}_time_to_first_token_seconds", "Arrival to first token", registry
        )
        self.tpot = latency_histogram(
            f"{prefix}_time_per_output_token_seconds",
            "Mean gap between tokens after the first",
            registry,
        )
        self.e2e = latency_histogram(f"{prefix}_e2e_latency_seconds", "Arrival to last token", registry)

    def observe(self, arrival: float, first_token: float | None, end: float, tokens: int) -> None:
        """One request that got `tokens` tokens, the first at `first_token` (None: none came)
        and the last at `end` (monotonic seconds, like `arrival`)."""
        if first_token is None:
            return
        self.ttft.observe(first_token - arrival)
        self.e2e.observe(end - arrival)
        if tokens > 1:
            self.tpot.observe((end - first_token) / (tokens - 1))


def latency_histogram(name: str, documentation: str, registry: CollectorRegistry) -> Histogram:
    return Histogram(name, documentation, buckets=LATENCY_BUCKETS, registry=registry)


class _ModelLabel(Collector):
    """Every metric of `registry` with model_name="..." added to each series (as vLLM's
    metrics carry it), so one dashboard or autoscaler query can tell models apart."""

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        self._registry = registry
        self._model_name = model_name

    def collect(self) -> Iterator[Metric]:
        for family in self._registry.collect():
            labelled = Metric(family.name, family.documentation, family.type, family.unit)
            labelled.samples = [
                Sample(s.name, {"model_name": self._model_name, **s.labels}, s.value,
                       s.timestamp, s.exemplar)
                for s in family.samples
            ]
            yield labelled


def exposition(registry: CollectorRegistry, model_name: str) -> CollectorRegistry:
    """What /metrics shows: `registry`'s metrics labelled with the model, and process_*."""
    shown = CollectorRegistry(auto_describe=False)
    shown.register(_ModelLabel(registry, model_name))
    ProcessCollector(registry=shown)
    return shown


def serve_metrics(registry: CollectorRegistry, port: int, model_name: str) -> None:
    """Starts the /metrics HTTP endpoint on a background thread. Raises OSError naming the
    port when it cannot listen there."""
    try:
        start_http_server(port, registry=exposition(registry, model_name))
    except OSError as exc:
        raise OSError(f"--metrics-port {port}: cannot listen: {exc.strerror or exc}") from exc
