"""What a request used and how it ended: its usage and timing (the last message's),
its refusal or outcome counted and logged once, and what it owes of the tenant's
budget."""

from __future__ import annotations

import time
from typing import Any

import grpc
import structlog
from omnibus.v1 import inference_pb2

from omnibus.router.service.errors import RequestError
from omnibus.router.service.job import Job
from omnibus.router.service.metrics import RouterMetrics

log = structlog.get_logger("router")

# How an engine refuses a request before working on it (FAILED_PRECONDITION: e.g. the
# adapter's weights failed to load); the stream (stream.py) names them engine_<code>.
ENGINE_REFUSAL_CODES = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
                        grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.RESOURCE_EXHAUSTED)
_ENGINE_REFUSALS = frozenset(f"engine_{code.name.lower()}" for code in ENGINE_REFUSAL_CODES)


class Accounts:
    """The router's books: refusals and outcomes, counted in its metrics and logged."""

    def __init__(self, metrics: RouterMetrics) -> None:
        self._metrics = metrics
        # The labelled counters each request ends in, looked up once: labels() takes a lock
        # and builds a key per call. Outcomes are fixed reasons and tenants those of the
        # keys file, never user text, so these stay small.
        self._ended: dict[str, Any] = {}  # outcome -> requests{outcome}
        self._deadlines: dict[str, tuple[Any, Any]] = {}  # tenant -> (deadline requests, misses)

    def refused(self, err: RequestError, request_id: str) -> RequestError:
        """Counts and logs a refusal (also one a transport makes while parsing a request),
        once however many layers pass it on, and returns it, to raise."""
        if err.counted:
            return err
        err.counted = True
        self._metrics.rejected.labels(err.reason).inc()
        log.info(
            "request_refused",
            request_id=request_id,
            code=err.code.name,
            reason=err.reason,
            message=err.message,
        )
        return err

    def record(self, job: Job, outcome: str) -> None:
        """A served request's end: its outcome, tokens, latency and deadline counted."""
        m, now = self._metrics, time.monotonic()
        prompt_tokens = len(job.request.prompt_ids)
        ended = self._ended.get(outcome) or self._ended.setdefault(outcome, m.requests.labels(outcome))
        ended.inc()
        m.prompt_tokens.inc(prompt_tokens)
        m.completion_tokens.inc(job.completion_tokens)
        if job.dispatched is not None:
            m.queue_time.observe(job.dispatched - job.arrival)
        m.latency.observe(job.arrival, job.first_token, now, job.completion_tokens)
        if job.caller.deadline is not None:
            # A miss: it did not complete (stop or length) before its deadline. One its
            # deadline ended is a miss even when that timer fired a moment early.
            missed = outcome not in ("stop", "length") and (
                outcome == "deadline" or now >= job.caller.deadline)
            requests, misses = self._deadline_counters(job.caller.tenant.name)
            requests.inc()
            misses.inc(int(missed))
        log.info(
            "request_done",
            request_id=job.request.request_id,
            tenant=job.caller.tenant.name,
            adapter=job.adapter,
            engine=job.engine,
            outcome=outcome,
            prompt_tokens=prompt_tokens,
            completion_tokens=job.completion_tokens,
            cached_tokens=job.cached_tokens,
            seconds=round(now - job.arrival, 4),
        )


    def _deadline_counters(self, tenant: str) -> tuple[Any, Any]:
        """The tenant's (deadline requests, deadline misses) counters."""
        counters = self._deadlines.get(tenant)
        if counters is None:
            m = self._metrics
            counters = self._deadlines[tenant] = (m.deadline_requests.labels(tenant),
                                                  m.deadline_misses.labels(tenant))
        return counters


def usage(job: Job) -> inference_pb2.Usage:
    return inference_pb2.Usage(
        prompt_tokens=len(job.request.prompt_ids),
        completion_tokens=job.completion_tokens,
        cached_prompt_tokens=job.cached_tokens,
    )


def timing(job: Job) -> inference_pb2.Timing:
    now = time.monotonic()
    return inference_pb2.Timing(
        queue_seconds=(job.dispatched or now) - job.arrival,
        time_to_first_token_seconds=(job.first_token or now) - job.arrival,
        total_seconds=now - job.arrival,
    )


def unserved(job: Job, outcome: str) -> bool:
    """No engine worked on the request: it never left the queue (cancelled, timed out),
    or the engine refused it before its first token. Such an ending is a refusal
    (rejected_requests) and costs nothing of the budget."""
    return job.dispatched is None or (job.first_token is None and outcome in _ENGINE_REFUSALS)


def used_tokens(job: Job, outcome: str) -> int:
    """What a request used of its budget: its prompt and output once an engine may have
    worked on it, nothing when none did. A request cancelled after dispatch pays its
    prompt even without a token (the engine may have prefilled it)."""
    if unserved(job, outcome):
        return 0
    return len(job.request.prompt_ids) + job.completion_tokens
