"""Prometheus metrics of one router process (served on --metrics-port)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import (
    CollectorRegistry,
    Counter,
    disable_created_metrics,
)
from prometheus_client.core import GaugeMetricFamily

from omnibus.common.metrics import RequestLatency, latency_histogram, serve_metrics
from prometheus_client.registry import Collector

from omnibus.router.dispatch.dispatcher import Ticket
from omnibus.router.dispatch.fleet import Fleet
from omnibus.router.dispatch.queue import RequestQueue

# Seconds, from a fast CPU decode step to a long generation.


class RouterMetrics:
    def __init__(
        self, queue: RequestQueue[Ticket], fleet: Fleet, model_name: str = ""
    ) -> None:
        self.model_name = model_name  # the model_name label of every series
        disable_created_metrics()  # the *_created series only add noise to every counter
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "omnibus_router_requests",
            "Requests that ended, by outcome (finish reason or status)",
            ["outcome"],
            registry=r,
        )
        self.rejected = Counter(
            "omnibus_router_rejected_requests",
            "Requests refused before an engine worked on them (at admission, in the queue, or "
            "by the engine before a token), by reason; later endings count only by outcome",
            ["reason"],
            registry=r,
        )
        self.continued = Counter(
            "omnibus_router_continued_streams",
            "Streams moved to another engine mid-way (prompt + tokens sent), by why",
            ["reason"],
            registry=r,
        )
        self.handoffs = Counter(
            "omnibus_router_prefill_handoffs",
            "Streams a prefill engine handed to a decode engine (--role), by where the decode "
            "engine gets the prompt's KV: transfer (a handle to read) or recompute (none held)",
            ["kv_from"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "omnibus_router_prompt_tokens", "Prompt tokens served", registry=r
        )
        self.completion_tokens = Counter(
            "omnibus_router_completion_tokens", "Tokens generated", registry=r
        )
        self.embed_requests = Counter(
            "omnibus_router_embed_requests", "Embed requests served (refusals count in "
            "omnibus_router_rejected_requests)", registry=r,
        )
        self.embed_tokens = Counter(
            "omnibus_router_embed_tokens", "Input tokens of the Embed requests served", registry=r
        )
        self.queue_time = latency_histogram(
            "omnibus_router_queue_time_seconds", "Arrival to dispatch", r
        )
        self.latency = RequestLatency("omnibus_router", r)
        self.adapter_requests = Counter(
            "omnibus_router_adapter_requests",
            "Requests admitted for a LoRA adapter, by adapter",
            ["adapter"],
            registry=r,
        )
        self.adapter_dispatches = Counter(
            "omnibus_router_adapter_dispatches",
            "Adapter requests sent to an engine, by how ready the engine was: resident "
            "(device slot), cached (host memory) or cold (a disk load)",
            ["affinity"],
            registry=r,
        )
        self.deadline_requests = Counter(
            "omnibus_router_deadline_requests",
            "Requests that ended and carried a deadline, by tenant",
            ["tenant"],
            registry=r,
        )
        self.deadline_misses = Counter(
            "omnibus_router_deadline_misses",
            "Requests with a deadline that did not complete (stop or length) by it, by tenant; "
            "the miss rate is this over omnibus_router_deadline_requests",
            ["tenant"],
            registry=r,
        )
        r.register(_StateCollector(queue, fleet))

    def serve(self, port: int) -> None:
        """Starts the /metrics HTTP endpoint on a background thread."""
        serve_metrics(self.registry, port, self.model_name)



class _StateCollector(Collector):
    """Queue and engine gauges, read at scrape time so they are never stale."""

    def __init__(self, queue: RequestQueue[Ticket], fleet: Fleet) -> None:
        self._queue = queue
        self._engines = fleet
        # Priorities seen so far, the default one (0) from the start: each keeps its
        # series at 0 once empty, so an autoscaler reads 0 rather than "no data".
        self._priorities: set[int] = {0}

    def collect(self) -> Iterator[GaugeMetricFamily]:
        queued = GaugeMetricFamily(
            "omnibus_router_queue_length",
            "Requests waiting for an engine, by priority (0 when none wait)",
            labels=["priority"],
        )
        counts = self._queue.count_by_priority()
        self._priorities |= counts.keys()
        for priority in sorted(self._priorities):
            queued.add_metric([str(priority)], counts.get(priority, 0))
        yield queued
        yield GaugeMetricFamily(
            "omnibus_router_queued_tokens",
            "Prompt + max_tokens of the queued requests",
            value=self._queue.tokens,
        )
        yield from self._engine_gauges()

    def _engine_gauges(self) -> Iterator[GaugeMetricFamily]:
        def family(name: str, doc: str) -> GaugeMetricFamily:
            return GaugeMetricFamily(f"omnibus_router_engine_{name}", doc, labels=["engine"])

        healthy = family("healthy", "1 when the engine is reporting load and not draining")
        inflight = family("inflight", "Requests this router has on the engine")
        # The report gauges below are absent for an engine not reporting now (down, stalled):
        # its last values would count forever in a sum over engines.
        running = family("running_sequences", "Sequences running, as the engine last reported")
        waiting = family(
            "waiting_sequences", "Sequences waiting inside the engine, as last reported"
        )
        free = family("kv_blocks_free", "Free KV blocks, as last reported")
        total = family("kv_blocks_total", "Usable KV blocks, as last reported")
        resident = family("adapters_resident", "Adapters in device slots, as last reported")
        cached = family("adapters_cached", "Adapters in host memory, as last reported")
        available = family("adapters_available", "Adapters on the engine's disk, as last reported")
        where = GaugeMetricFamily(
            "omnibus_router_engine_adapter_resident",
            "1 for each adapter in an engine's device slots, as last reported",
            labels=["engine", "adapter"],
        )
        for e in self._engines:  # a snapshot: discovery replaces it on the event loop
            labels = [e.address]
            healthy.add_metric(labels, float(e.seats.accepting))
            inflight.add_metric(labels, e.seats.inflight)
            if e.load.reported and e.link.healthy:  # a silent engine's last report is stale: absent
                running.add_metric(labels, e.load.running)
                waiting.add_metric(labels, e.load.waiting)
                free.add_metric(labels, e.load.free_blocks)
                total.add_metric(labels, e.load.total_blocks)
                resident.add_metric(labels, len(e.load.adapters_resident))
                cached.add_metric(labels, len(e.load.adapters_cached))
                available.add_metric(labels, len(e.load.adapters_available))
                for adapter in sorted(e.load.adapters_resident):
                    where.add_metric([e.address, adapter], 1)
        yield from (healthy, inflight, running, waiting, free, total)
        yield from (resident, cached, available, where)
