"""Latency metrics both processes export, defined once: the histogram buckets and the
TTFT / TPOT / end-to-end arithmetic of one finished request."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram

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
