"""The requests an engine serves, through a router's Session or a Generate call, from
admission to their one end: what the drain waits for and the metrics count."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc

from omnibus.engine.core.sequence import RequestOutput
from omnibus.engine.serving.metrics import EngineMetrics

if TYPE_CHECKING:
    from omnibus.engine.serving.session import SessionStream

# Outcomes of requests that never had their adapter in use: not counted for it.
_NOT_ADAPTER_USE = ("invalid_argument", "not_found")


@dataclass(eq=False)
class Live:
    """One request being served: the state its metrics and the drain need."""

    request_id: str
    adapter: str
    arrival: float  # time.monotonic()
    session: SessionStream  # a router's Session stream, or a Generate call's own
    handle: int = 0  # the session's number for it
    first: float | None = None  # when its first token went out
    tokens: int = 0
    prompt: int = 0
    cached: int = 0
    timer: asyncio.TimerHandle | None = None  # its deadline

    def saw(self, out: RequestOutput) -> None:
        """Notes what `out`, one of its outputs, says of its progress."""
        if out.new_token_ids and self.first is None:
            self.first = time.monotonic()
        self.tokens = out.num_output_tokens
        self.prompt, self.cached = out.num_prompt_tokens, out.num_cached_tokens


def outcome_of(code: grpc.StatusCode) -> str:
    """The metrics' outcome of a request that ended with (or was refused with) `code`."""
    return code.name.lower()


class Registry:
    """Every request being served, by id. `get(request_id)` is the hot path (every
    output of every step): the dict's own lookup."""

    def __init__(self, metrics: EngineMetrics) -> None:
        self._metrics = metrics
        self._live: dict[str, Live] = {}
        self.get = self._live.get
        self.num_requests = 0  # admitted since start

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._live

    def ids(self) -> list[str]:
        return list(self._live)

    def of(self, session: SessionStream) -> list[Live]:
        """The requests `session` still serves."""
        return [live for live in self._live.values() if live.session is session]

    def open(self, request_id: str, adapter: str, session: SessionStream, handle: int = 0) -> Live:
        """Registers an admitted request, served by `session`."""
        live = self._live[request_id] = Live(request_id, adapter, time.monotonic(), session, handle)
        self.num_requests += 1
        return live

    def refused(self, code: grpc.StatusCode) -> None:
        """Counts a request refused before admission."""
        self._metrics.requests.labels(outcome_of(code)).inc()

    def end(self, live: Live, outcome: str | grpc.StatusCode) -> None:
        """`live` has ended (`outcome`: a finish reason, cancelled, or the status it failed
        with): out of the registry, into the metrics. Once: a later call does nothing."""
        if self._live.get(live.request_id) is not live:
            return
        del self._live[live.request_id]
        if live.timer is not None:
            live.timer.cancel()
        label = outcome_of(outcome) if isinstance(outcome, grpc.StatusCode) else outcome
        self._metrics.observe(live.arrival, live.first, live.tokens, label)
        self._metrics.count_tokens(live.prompt, live.cached, live.tokens)
        if live.adapter and label not in _NOT_ADAPTER_USE:
            self._metrics.adapter_requests.labels(live.adapter).inc()
