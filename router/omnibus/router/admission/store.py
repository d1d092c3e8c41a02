"""Tenant limits shared by every router: concurrency caps and token budgets in Redis.

With one router, limits live in its memory (limits.py). With N routers that would
allow N times every tenant's limits, so `--limits-store redis://...` counts them in
one Redis instead, each check-and-take one Lua script (atomic on the server):

- concurrency: a sorted set per tenant of leases (one per admitted request, scored by
  its expiry on Redis's clock). Admission drops expired leases, compares the count
  with the cap and adds a lease per request (the n choices of one HTTP request at
  once, or none); release removes one. Each router renews the leases of
  its live requests every lease/3 seconds, so a router that crashes stops counting
  after at most one lease period, without anyone cleaning up after it. Renewal adds a
  lease that is missing, so after Redis restarts empty (or comes back from an outage)
  every router's running requests count again at its next renewal that reaches Redis:
  within lease/3 seconds, or 2*lease/3 when the first call fails on the connection the
  old Redis closed. Until then the routers may admit over a cap.
- budget: a token bucket per tenant (level and last refill time, on Redis's clock),
  charged prompt + max_tokens on admission and refunded the unused part on release.

When Redis cannot be reached (connection refused, a timeout), --limits-store-failure
decides: `open` admits under this router's own in-memory limits (per router, as
before the store existed: limits.py counts every request the router runs, those the
store admitted too), `closed` refuses with UNAVAILABLE. A request admitted open holds a
lease that only renewal adds, so it counts in Redis once Redis answers again (its
tokens are charged only to this router's own budget). Either way the router
logs `limits_store_unavailable` once per outage, `limits_store_up` drops to 0, and
`limits_store_errors_total` counts the failed calls; after a failure the store is
tried again at most once a second, so an outage costs no per-request timeouts.
A single Redis (or one behind Sentinel), not Redis Cluster: renewal touches several
tenants' keys in one script.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from urllib.parse import urlsplit

import grpc
import redis.asyncio as aioredis
import structlog
from prometheus_client import CollectorRegistry, Counter, Gauge
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from omnibus.router.admission.auth import Tenant
from omnibus.router.admission.limits import (
    Admission,
    Cost,
    budget_refusal,
    concurrency_refusal,
)
from omnibus.router.config import RouterConfig
from omnibus.router.service.errors import RequestError

log = structlog.get_logger("router.limits_store")

KEY_PREFIX = "omnibus:limits:"
CALL_TIMEOUT_S = 0.5  # one Redis call; beyond this the store counts as unreachable
RETRY_AFTER_S = 1.0  # after a failure, requests skip the store this long

# Redis's clock in milliseconds, and a token bucket's level refilled up to now.
_PRELUDE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local function refilled(key, per_minute)
  local level = tonumber(redis.call('HGET', key, 'level') or per_minute)
  local last = tonumber(redis.call('HGET', key, 'ms') or now)
  return math.min(per_minute, level + (now - last) * per_minute / 60000)
end
local function store(key, level)
  redis.call('HSET', key, 'level', tostring(level), 'ms', now)
  redis.call('PEXPIRE', key, 120000)  -- idle a minute, a bucket is full: a missing key is too
end
"""

# KEYS: leases, bucket. ARGV: cap (0: none), per minute (0: none), cost of them all,
# lease ms, then one lease id per request admitted together (all or none).
# Returns {0} admitted, {1, active} over the cap, {2, wait ms, level} over the budget.
_ACQUIRE = _PRELUDE + """
local cap, per_minute = tonumber(ARGV[1]), tonumber(ARGV[2])
local cost, lease_ms = tonumber(ARGV[3]), tonumber(ARGV[4])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if cap > 0 then
  local active = redis.call('ZCARD', KEYS[1])
  if active + #ARGV - 4 > cap then return {1, active} end
end
if per_minute > 0 then
  local level = refilled(KEYS[2], per_minute)
  if cost > level then
    local wait = -1  -- never: more than a minute's budget
    if cost <= per_minute then wait = (cost - level) * 60000 / per_minute end
    return {2, tostring(wait), tostring(level)}
  end
  store(KEYS[2], level - cost)
end
for i = 5, #ARGV do
  redis.call('ZADD', KEYS[1], now + lease_ms, ARGV[i])
end
redis.call('PEXPIRE', KEYS[1], 2 * lease_ms)
return {0}
"""

# KEYS: leases, bucket. ARGV: lease id, tokens to refund, per minute.
_RELEASE = _PRELUDE + """
redis.call('ZREM', KEYS[1], ARGV[1])
local refund, per_minute = tonumber(ARGV[2]), tonumber(ARGV[3])
if refund > 0 and per_minute > 0 and redis.call('EXISTS', KEYS[2]) == 1 then
  store(KEYS[2], math.min(per_minute, refilled(KEYS[2], per_minute) + refund))
end
return 0
"""

# KEYS: one leases key per lease. ARGV: lease ms, then the lease ids in KEYS' order.
# A missing lease is added again: these requests are still running, whether Redis lost
# the lease (a restart, an expiry while the router stalled) or never had it (admitted
# while Redis was down). A release that reaches Redis first is undone by this; the
# router removes such leases again once the renewal has answered (_renew_live).
_RENEW = _PRELUDE + """
local lease_ms = tonumber(ARGV[1])
for i, key in ipairs(KEYS) do
  redis.call('ZADD', key, now + lease_ms, ARGV[i + 1])
  redis.call('PEXPIRE', key, 2 * lease_ms)
end
return 0
"""


def admission_for(config: RouterConfig, registry: CollectorRegistry) -> Admission:
    """The router's Admission: in memory, or shared through config.limits_store."""
    shared = RedisLimits(config, registry) if config.limits_store else None
    return Admission(config.max_queued_requests, config.max_queued_tokens, shared=shared)


class RedisPermit:
    """A lease in Redis; release() removes it (in the background) exactly once."""

    def __init__(self, store: RedisLimits, tenant: Tenant, lease: str, cost: int) -> None:
        self._store = store
        self._tenant = tenant
        self.lease = lease
        self._cost = cost
        self._released = False

    def release(self, used_tokens: int) -> None:
        if self._released:
            return
        self._released = True
        self._store.release(self, self._tenant, max(0, self._cost - used_tokens))


class RedisLimits:
    """Tenant caps and budgets in Redis (see the module docstring)."""

    def __init__(self, config: RouterConfig, registry: CollectorRegistry) -> None:
        url = urlsplit(config.limits_store)
        self._where = f"{url.scheme}://{url.hostname}:{url.port or 6379}{url.path}"  # no password
        self._is_up = True
        self._fail_open = config.limits_store_failure == "open"
        self._lease_ms = int(config.limits_store_lease_seconds * 1000)
        self._redis = aioredis.Redis.from_url(
            config.limits_store,
            socket_timeout=CALL_TIMEOUT_S,
            socket_connect_timeout=CALL_TIMEOUT_S,
            retry=Retry(NoBackoff(), 0),
        )
        self._acquire = self._redis.register_script(_ACQUIRE)
        self._release = self._redis.register_script(_RELEASE)
        self._renew = self._redis.register_script(_RENEW)
        self._live: dict[str, tuple[str, RedisPermit]] = {}  # lease -> (leases key, permit)
        self._skip_until = 0.0  # monotonic: the store failed, skip it until then
        self._renewer: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._closed = False
        self.up = Gauge(
            "omnibus_router_limits_store_up",
            "1 while the shared limits store (--limits-store) answers, 0 while it does not",
            registry=registry,
        )
        self.up.set(1)
        self.errors = Counter(
            "omnibus_router_limits_store_errors",
            "Calls to the shared limits store that failed, by operation",
            ["operation"],
            registry=registry,
        )
        self.fallbacks = Counter(
            "omnibus_router_limits_store_fallbacks",
            "Requests decided without the store while it was down: admitted under this "
            "router's own limits (open) or refused (closed)",
            ["mode"],
            registry=registry,
        )

    async def acquire(self, tenant: Tenant, cost: Cost) -> list[RedisPermit] | None:
        """A permit per choice (all or none), RequestError over a limit, or (store down)
        None to fail open or RequestError(UNAVAILABLE) to fail closed."""
        limits = tenant.limits
        if not (limits.max_concurrent or limits.tokens_per_minute):  # nothing to count
            return [RedisPermit(self, tenant, "", 0) for _ in range(cost.choices)]
        if time.monotonic() >= self._skip_until:
            leases = [uuid.uuid4().hex for _ in range(cost.choices)]
            keys = _keys(tenant.name)
            args = [limits.max_concurrent, limits.tokens_per_minute, cost.total, self._lease_ms,
                    *leases]
            try:
                reply = await self._acquire(keys=keys, args=args)
            except (RedisError, OSError) as exc:
                self._failed("acquire", exc)
            else:
                self._answered()
                return self._permits(tenant, leases, cost, keys[0], reply)
        mode = "open" if self._fail_open else "closed"
        self.fallbacks.labels(mode).inc()
        if self._fail_open:
            return None
        raise RequestError(
            grpc.StatusCode.UNAVAILABLE,
            "the shared tenant limits store is unreachable and this router fails closed; "
            "retry later",
            "limits_store_unavailable",
        )

    def _permits(
        self, tenant: Tenant, leases: list[str], cost: Cost, key: str, reply: list
    ) -> list[RedisPermit]:
        status = int(reply[0])
        if status == 1:
            raise concurrency_refusal(tenant, cost)
        if status == 2:
            wait_ms, level = float(reply[1]), float(reply[2])
            raise budget_refusal(tenant, cost, wait_ms / 1000 if wait_ms >= 0 else float("inf"), level)
        return self._hold(key, [RedisPermit(self, tenant, lease, cost.each) for lease in leases])

    def adopt(self, tenant: Tenant, cost: Cost) -> list[RedisPermit]:
        """Permits for a request admitted under this router's own limits while the store
        was down: renewal adds their leases once it answers, so they count there too.
        Nothing was charged to the store's budget, so nothing is refunded to it."""
        permits = [RedisPermit(self, tenant, uuid.uuid4().hex, 0) for _ in range(cost.choices)]
        return self._hold(_keys(tenant.name)[0], permits)

    def _hold(self, key: str, permits: list[RedisPermit]) -> list[RedisPermit]:
        for permit in permits:
            self._live[permit.lease] = (key, permit)
        if self._renewer is None:
            self._renewer = asyncio.create_task(self._renew_forever(), name="limits-renew")
        return permits

    def release(self, permit: RedisPermit, tenant: Tenant, refund: int) -> None:
        """Removes the permit's lease and refunds `refund` tokens, in the background (a
        lease that cannot be removed now expires by itself)."""
        if not permit.lease:
            return
        self._live.pop(permit.lease, None)
        task = asyncio.get_running_loop().create_task(self._send_release(permit, tenant, refund))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _send_release(self, permit: RedisPermit, tenant: Tenant, refund: int) -> None:
        args = [permit.lease, refund, tenant.limits.tokens_per_minute]
        try:
            await self._release(keys=_keys(tenant.name), args=args)
        except (RedisError, OSError) as exc:
            self._failed("release", exc)
        else:
            self._answered()

    async def _renew_forever(self) -> None:
        # `_closed` as well as the cancel: a cancel that lands as a call's own timeout
        # fires can be taken for that timeout (and retried) inside the client
        while not self._closed:
            await asyncio.sleep(self._lease_ms / 3000)
            await self._renew_live()

    async def close(self) -> None:
        """Stop renewing, let queued releases go out (a bounded wait) and close the
        connection. The leases still held expire by themselves."""
        self._closed = True
        tasks = [t for t in (self._renewer, *self._tasks) if t is not None]
        if self._renewer is not None:
            self._renewer.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=CALL_TIMEOUT_S)
        await self._redis.aclose()

    async def _renew_live(self) -> None:
        """Renews (or adds again) the lease of every live request. A request released
        while the renewal ran may have had its release reach Redis first and its lease
        added back: its lease is removed again. (If the renewal runs in Redis but its
        answer is lost, such a lease stays until it expires, one lease period.)"""
        live = list(self._live.items())
        if not live:
            return
        keys = [key for _, (key, _) in live]
        args = [self._lease_ms, *(lease for lease, _ in live)]
        try:
            await self._renew(keys=keys, args=args)
            for lease, (key, _) in live:
                if lease not in self._live:  # released meanwhile
                    await self._redis.zrem(key, lease)
        except (RedisError, OSError) as exc:
            self._failed("renew", exc)
        else:
            self._answered()

    def _failed(self, operation: str, exc: BaseException) -> None:
        self.errors.labels(operation).inc()
        self._skip_until = time.monotonic() + RETRY_AFTER_S
        if self._is_up:  # once per outage
            log.warning(
                "limits_store_unavailable",
                store=self._where,
                operation=operation,
                error=f"{type(exc).__name__}: {exc}",
                failure_mode="open: this router's own limits"
                if self._fail_open
                else "closed: requests refused",
            )
        self._is_up = False
        self.up.set(0)

    def _answered(self) -> None:
        if not self._is_up:
            log.info("limits_store_recovered", store=self._where)
        self._is_up = True
        self.up.set(1)


def _keys(tenant: str) -> list[str]:
    # The hash tag {tenant} keeps both keys of a tenant in one slot.
    return [f"{KEY_PREFIX}{{{tenant}}}:leases", f"{KEY_PREFIX}{{{tenant}}}:tokens"]
