"""Admission control: per-tenant concurrency caps and token-rate budgets, and the
global caps on what may wait in the queue. Every refusal is RESOURCE_EXHAUSTED with a
message that names the limit.

Tenant limits are counted in this router's memory, or, with a shared store
(router/admission/store.py, --limits-store), once for every router."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import grpc

from omnibus.router.admission.auth import Tenant
from omnibus.router.service.errors import RequestError

Clock = Callable[[], float]


class TokenBucket:
    """`per_minute` tokens per minute, in bursts of up to one minute's worth."""

    def __init__(self, per_minute: int, clock: Clock = time.monotonic) -> None:
        if per_minute <= 0:
            raise ValueError(f"per_minute must be > 0, got {per_minute}")
        self.capacity = float(per_minute)
        self._rate = per_minute / 60.0  # tokens per second
        self._clock = clock
        self._level = self.capacity
        self._last = clock()

    @property
    def level(self) -> float:
        self._refill()
        return self._level

    def take(self, n: int) -> float:
        """Takes n tokens and returns 0, or takes nothing and returns the seconds until n
        would be available (inf when n exceeds the capacity)."""
        self._refill()
        if n <= self._level:
            self._level -= n
            return 0.0
        if n > self.capacity:
            return math.inf
        return (n - self._level) / self._rate

    def give_back(self, n: int) -> None:
        self._refill()
        self._level = min(self.capacity, self._level + n)

    def _refill(self) -> None:
        now = self._clock()
        self._level = min(self.capacity, self._level + (now - self._last) * self._rate)
        self._last = now


@dataclass
class _TenantUsage:
    active: int = 0  # requests admitted and not yet released
    bucket: TokenBucket | None = None


class Permit(Protocol):
    """An admitted request's hold on its tenant's limits."""

    def release(self, used_tokens: int) -> None:
        """Frees the concurrency slot and refunds the charged tokens beyond `used_tokens`;
        calls after the first do nothing."""


class SharedLimits(Protocol):
    """Tenant limits counted for every router (router/admission/store.py)."""

    async def acquire(self, tenant: Tenant, cost: int) -> Permit | None:
        """A permit, or RequestError(RESOURCE_EXHAUSTED) over a limit; None when the
        store is unreachable and the router should fall back to its own limits."""


class LocalPermit:
    """A hold on this router's in-memory counts."""

    def __init__(self, usage: _TenantUsage, charged: int) -> None:
        self._usage = usage
        self._charged = charged
        self._released = False

    def release(self, used_tokens: int) -> None:
        """Frees the concurrency slot and refunds the charged tokens beyond `used_tokens`."""
        if self._released:
            return
        self._released = True
        self._usage.active -= 1
        if self._usage.bucket is not None and used_tokens < self._charged:
            self._usage.bucket.give_back(self._charged - used_tokens)


class Admission:
    """Decides whether a request may enter the queue."""

    def __init__(
        self,
        max_queued_requests: int,
        max_queued_tokens: int,
        clock: Clock = time.monotonic,
        shared: SharedLimits | None = None,
    ) -> None:
        self._max_requests = max_queued_requests
        self._max_tokens = max_queued_tokens
        self._clock = clock
        self._tenants: dict[str, _TenantUsage] = {}
        self._shared = shared

    def active(self, tenant: str) -> int:
        """Requests the tenant has admitted and not released."""
        usage = self._tenants.get(tenant)
        return usage.active if usage else 0

    async def admit(
        self, tenant: Tenant, cost: int, queued_requests: int, queued_tokens: int, choices: int = 1
    ) -> Permit:
        """Admits a request costing `cost` tokens (prompt + max_tokens) given what is
        queued now, or raises RequestError: INVALID_ARGUMENT when the tenant's limits could
        never admit it (with the `choices` - 1 others of its HTTP request, which run beside
        it), RESOURCE_EXHAUSTED over a limit now, UNAVAILABLE when the shared store is down
        and the router fails closed."""
        never = never_admitted(tenant, cost, choices)
        if never is not None:
            raise never
        if self._shared is not None:
            self._check_queue(cost, queued_requests, queued_tokens)
            permit = await self._shared.acquire(tenant, cost)
            if permit is not None:
                return permit
        return self.admit_local(tenant, cost, queued_requests, queued_tokens)

    def admit_local(
        self, tenant: Tenant, cost: int, queued_requests: int, queued_tokens: int
    ) -> LocalPermit:
        """`admit` counting in this router's memory only."""
        usage = self._usage(tenant)
        limit = tenant.limits.max_concurrent
        if limit and usage.active >= limit:
            raise concurrency_refusal(tenant)
        self._check_queue(cost, queued_requests, queued_tokens)
        if usage.bucket is not None:
            wait = usage.bucket.take(cost)
            if wait:
                raise budget_refusal(tenant, cost, wait, usage.bucket.level)
        usage.active += 1
        return LocalPermit(usage, cost)

    def _check_queue(self, cost: int, queued_requests: int, queued_tokens: int) -> None:
        if queued_requests >= self._max_requests:
            raise _exhausted(
                f"server overloaded, retry later ({queued_requests} requests are queued, "
                f"the limit is {self._max_requests})",
                "overloaded",
            )
        # An empty queue takes any request, or one larger than the cap could never run.
        if queued_requests and queued_tokens + cost > self._max_tokens:
            raise _exhausted(
                f"server overloaded, retry later ({queued_tokens} tokens are queued, this "
                f"request adds {cost}, the limit is {self._max_tokens})",
                "overloaded",
            )

    def _usage(self, tenant: Tenant) -> _TenantUsage:
        usage = self._tenants.get(tenant.name)
        if usage is None:
            per_minute = tenant.limits.tokens_per_minute
            bucket = TokenBucket(per_minute, self._clock) if per_minute else None
            usage = self._tenants[tenant.name] = _TenantUsage(bucket=bucket)
        return usage


def concurrency_refusal(tenant: Tenant) -> RequestError:
    return _exhausted(
        f"tenant {tenant.name!r} has reached its limit of {tenant.limits.max_concurrent} "
        "concurrent requests; retry when one of them has finished",
        "tenant_concurrency",
    )


def never_admitted(tenant: Tenant, cost: int, choices: int = 1) -> RequestError | None:
    """INVALID_ARGUMENT when `choices` requests of `cost` tokens each, side by side, are
    over the tenant's limits even when it runs nothing else: waiting cannot help, so this
    is not a RESOURCE_EXHAUSTED to retry."""
    limits = tenant.limits
    if limits.max_concurrent and choices > limits.max_concurrent:
        return RequestError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"n={choices} choices run side by side but tenant {tenant.name!r} may run "
            f"{limits.max_concurrent} requests at once; lower n",
            "tenant_concurrency",
            param="n",
        )
    budget = limits.tokens_per_minute
    if budget and cost * choices > budget:
        need = f"{choices} choices of {cost} tokens" if choices > 1 else f"{cost} tokens"
        return RequestError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"this request needs {need} (prompt + max_tokens) but tenant {tenant.name!r} has a "
            f"budget of {budget} tokens per minute, so it can never be admitted; lower "
            + ("max_tokens or n" if choices > 1 else "max_tokens"),
            "tenant_budget",
            param="max_tokens",
        )
    return None


def budget_refusal(tenant: Tenant, cost: int, wait: float, level: float) -> RequestError:
    """The tenant's budget has `level` tokens and `cost` fits in `wait` seconds (inf: never)."""
    budget = tenant.limits.tokens_per_minute
    if math.isinf(wait):  # a budget that changed under a request (checked before admission)
        return never_admitted(tenant, cost) or _exhausted(
            f"tenant {tenant.name!r} is over its budget of {budget} tokens per minute",
            "tenant_budget",
        )
    return _exhausted(
        f"tenant {tenant.name!r} is over its budget of {budget} tokens per minute "
        f"(this request needs {cost}, {int(level)} are left); "
        f"retry in {math.ceil(wait)} s",
        "tenant_budget",
        retry_after_s=wait,
    )


def _exhausted(message: str, reason: str, retry_after_s: float | None = None) -> RequestError:
    return RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED, message, reason, retry_after_s)
