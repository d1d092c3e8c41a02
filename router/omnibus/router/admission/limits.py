"""Admission control: per-tenant concurrency caps and token-rate budgets, and the
global caps on what may wait in the queue. Every refusal is RESOURCE_EXHAUSTED with a
message that names the limit.

Tenant limits are counted in this router's memory, or, with a shared store
(router/omnibus/router/admission/store.py, --limits-store), once for every router. With a store, this
router's memory still counts every request it runs and the tokens it charged, so that
when the store is down and the router fails open, its own limits hold what it already
runs (per router, as before the store existed)."""

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

    def charge(self, n: int) -> None:
        """Takes n tokens admitted elsewhere (the shared store), down to an empty bucket."""
        self._refill()
        self._level = max(0.0, self._level - n)

    def give_back(self, n: int) -> None:
        self._refill()
        self._level = min(self.capacity, self._level + n)

    def _refill(self) -> None:
        now = self._clock()
        self._level = min(self.capacity, self._level + (now - self._last) * self._rate)
        self._last = now


@dataclass(frozen=True)
class Cost:
    """What a request may take from its tenant's budget: `choices` requests run side by
    side (HTTP's n), each its prompt (an Embed request's inputs) + max_tokens."""

    prompt: int  # tokens of the prompt, or of every input of an Embed request
    max_tokens: int = 0  # the most each choice may generate; 0: an Embed request
    choices: int = 1

    @property
    def each(self) -> int:
        """Tokens one choice may span."""
        return self.prompt + self.max_tokens

    @property
    def total(self) -> int:
        return self.each * self.choices


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
    """Tenant limits counted for every router (router/omnibus/router/admission/store.py)."""

    async def acquire(self, tenant: Tenant, cost: Cost) -> list[Permit] | None:
        """One permit per choice, all taken at once, or RequestError(RESOURCE_EXHAUSTED)
        over a limit; None when the store is unreachable and the router should fall back
        to its own limits."""

    def adopt(self, tenant: Tenant, cost: Cost) -> list[Permit]:
        """Permits for choices the router admitted under its own limits (acquire gave
        None), to be counted in the store once it answers again."""

    async def close(self) -> None:
        """Stop renewing and close the connection (the router is stopping)."""


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


class _CountedPermit:
    """A shared store's permit, also counted in this router's memory."""

    def __init__(self, shared: Permit, local: LocalPermit) -> None:
        self._shared = shared
        self._local = local

    def release(self, used_tokens: int) -> None:
        self._shared.release(used_tokens)
        self._local.release(used_tokens)


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

    async def close(self) -> None:
        """Close the shared store's connection and background tasks, if any."""
        if self._shared is not None:
            await self._shared.close()

    def active(self, tenant: str) -> int:
        """Requests the tenant has admitted on this router and not released."""
        usage = self._tenants.get(tenant)
        return usage.active if usage else 0

    async def admit(
        self, tenant: Tenant, cost: Cost, queued_requests: int, queued_tokens: int
    ) -> list[Permit]:
        """Admits the `cost.choices` requests of one client request together, given what
        is queued now: one permit per choice, or none at all (nothing charged) when any
        limit refuses. Raises RequestError: INVALID_ARGUMENT when the tenant's limits could
        never admit them, RESOURCE_EXHAUSTED over a limit now, UNAVAILABLE when the shared
        store is down and the router fails closed."""
        never = never_admitted(tenant, cost)
        if never is not None:
            raise never
        if self._shared is None:
            return self.admit_local(tenant, cost, queued_requests, queued_tokens)
        self._check_queue(cost, queued_requests, queued_tokens)
        shared = await self._shared.acquire(tenant, cost)
        if shared is None:  # the store is down and the router fails open: its own limits
            local = self.admit_local(tenant, cost, queued_requests, queued_tokens)
            shared = self._shared.adopt(tenant, cost)
        else:
            local = self._count(tenant, cost)
        return [_CountedPermit(s, lp) for s, lp in zip(shared, local)]

    def admit_local(
        self, tenant: Tenant, cost: Cost, queued_requests: int, queued_tokens: int
    ) -> list[LocalPermit]:
        """`admit` counting in this router's memory only."""
        usage = self._usage(tenant)
        limit = tenant.limits.max_concurrent
        if limit and usage.active + cost.choices > limit:
            raise concurrency_refusal(tenant, cost)
        self._check_queue(cost, queued_requests, queued_tokens)
        if usage.bucket is not None:
            wait = usage.bucket.take(cost.total)
            if wait:
                raise budget_refusal(tenant, cost, wait, usage.bucket.level)
        return self._hold(usage, cost)

    def _count(self, tenant: Tenant, cost: Cost) -> list[LocalPermit]:
        """Counts choices the shared store admitted, as if this router had: its own
        limits are what it falls back to when the store is down."""
        usage = self._usage(tenant)
        if usage.bucket is not None:
            usage.bucket.charge(cost.total)
        return self._hold(usage, cost)

    @staticmethod
    def _hold(usage: _TenantUsage, cost: Cost) -> list[LocalPermit]:
        usage.active += cost.choices
        return [LocalPermit(usage, cost.each) for _ in range(cost.choices)]

    def _check_queue(self, cost: Cost, queued_requests: int, queued_tokens: int) -> None:
        adds = f", this request adds {cost.choices}" if cost.choices > 1 else ""
        if queued_requests + cost.choices > self._max_requests:
            raise _exhausted(
                f"server overloaded, retry later ({queued_requests} requests are queued{adds}, "
                f"the limit is {self._max_requests})",
                "overloaded",
            )
        # An empty queue takes any request, or one larger than the cap could never run.
        if queued_requests and queued_tokens + cost.total > self._max_tokens:
            raise _exhausted(
                f"server overloaded, retry later ({queued_tokens} tokens are queued, this "
                f"request adds {cost.total}, the limit is {self._max_tokens})",
                "overloaded",
            )

    def _usage(self, tenant: Tenant) -> _TenantUsage:
        usage = self._tenants.get(tenant.name)
        if usage is None:
            per_minute = tenant.limits.tokens_per_minute
            bucket = TokenBucket(per_minute, self._clock) if per_minute else None
            usage = self._tenants[tenant.name] = _TenantUsage(bucket=bucket)
        return usage


def concurrency_refusal(tenant: Tenant, cost: Cost) -> RequestError:
    side = f" (this request runs {cost.choices} choices side by side)" if cost.choices > 1 else ""
    return _exhausted(
        f"tenant {tenant.name!r} has reached its limit of {tenant.limits.max_concurrent} "
        f"concurrent requests{side}; retry when one of them has finished",
        "tenant_concurrency",
    )


def never_admitted(tenant: Tenant, cost: Cost) -> RequestError | None:
    """INVALID_ARGUMENT when the request is over the tenant's limits even when it runs
    nothing else: waiting cannot help, so this is not a RESOURCE_EXHAUSTED to retry. The
    message says what to change, and `param` names that field."""
    limits = tenant.limits
    if limits.max_concurrent and cost.choices > limits.max_concurrent:
        return RequestError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"n={cost.choices} choices run side by side but tenant {tenant.name!r} may run "
            f"{limits.max_concurrent} requests at once; lower n",
            "tenant_concurrency",
            param="n",
        )
    budget = limits.tokens_per_minute
    if not budget or cost.total <= budget:
        return None
    advice, param = _budget_advice(cost, budget)
    if not cost.max_tokens:
        needs = f"this request's inputs have {cost.prompt} tokens"
    else:
        each = f"a prompt of {cost.prompt} + max_tokens {cost.max_tokens}"
        if cost.choices > 1:
            each = f"{cost.choices} choices of {each}"
        needs = f"this request needs {cost.total} tokens ({each})"
    return RequestError(
        grpc.StatusCode.INVALID_ARGUMENT,
        f"{needs} but tenant {tenant.name!r} has a budget of {budget} tokens per minute, so it "
        f"can never be admitted; {advice}",
        "tenant_budget",
        param=param,
    )


def _budget_advice(cost: Cost, budget: int) -> tuple[str, str]:
    """What to change so that `cost` fits in `budget`, and the field to blame."""
    if not cost.max_tokens:
        return "send fewer or shorter inputs", "input"
    if cost.prompt >= budget:  # not even one token of output fits beside the prompt
        return "shorten the prompt", "prompt"
    fit = budget // cost.choices - cost.prompt  # the most max_tokens that fits
    if fit >= 1:
        or_n = " or lower n" if cost.choices > 1 else ""
        return f"lower max_tokens to at most {fit}{or_n}", "max_tokens"
    if cost.each <= budget:
        return f"lower n to at most {budget // cost.each}", "n"
    return f"lower n to 1 and max_tokens to at most {budget - cost.prompt}", "n"


def budget_refusal(tenant: Tenant, cost: Cost, wait: float, level: float) -> RequestError:
    """The tenant's budget has `level` tokens and `cost` fits in `wait` seconds (inf: never)."""
    budget = tenant.limits.tokens_per_minute
    if math.isinf(wait):  # a budget that changed under a request (checked before admission)
        return never_admitted(tenant, cost) or _exhausted(
            f"tenant {tenant.name!r} is over its budget of {budget} tokens per minute",
            "tenant_budget",
        )
    needs = f"{cost.total}" + (f" for its {cost.choices} choices" if cost.choices > 1 else "")
    return _exhausted(
        f"tenant {tenant.name!r} is over its budget of {budget} tokens per minute "
        f"(this request needs {needs}, {int(level)} are left); "
        f"retry in {math.ceil(wait)} s",
        "tenant_budget",
        retry_after_s=wait,
    )


def _exhausted(message: str, reason: str, retry_after_s: float | None = None) -> RequestError:
    return RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED, message, reason, retry_after_s)
