"""The shared limits store (router/omnibus/router/admission/store.py) against a real redis-server:
two routers' stores share one tenant's cap and budget, a crashed router's leases
expire while a live router's are renewed (and added again after Redis restarts empty),
and a store that is down fails open (counting what the router already runs) or closed
as configured."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from prometheus_client import CollectorRegistry

from omnibus.router.admission.auth import Tenant
from omnibus.router.admission.limits import Cost
from omnibus.router.admission.store import admission_for
from omnibus.router.config import RouterConfig, TenantLimits
from omnibus.router.service.errors import RequestError
from tests.redis_server import RedisServer


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    yield server
    server.stop()


_OPEN: list = []  # the admissions a test made: closed after it (their renewals stop)


@pytest.fixture(autouse=True)
async def close_stores():
    yield
    while _OPEN:
        await _OPEN.pop().close()


def router(url: str, failure: str = "open", lease: float = 15.0):
    """One router's Admission with the shared store, and its metrics registry."""
    config = RouterConfig(model="m", engines=("e:1",), limits_store=url,
                          limits_store_failure=failure, limits_store_lease_seconds=lease)
    registry = CollectorRegistry()
    admission = admission_for(config, registry)
    _OPEN.append(admission)
    return admission, registry


def restart_empty(server: RedisServer, log_dir, monkeypatch) -> RedisServer:
    """`server` killed and an empty one started at its address: a restart without
    persistence, as in Kubernetes."""
    server.stop()
    monkeypatch.setattr("tests.redis_server.free_port", lambda: server.port)
    log_dir.mkdir()
    return RedisServer(log_dir)


async def renew_until_it_answers(admission) -> None:
    """What a router does every lease/3 s; the first call after a restart may fail on the
    connection the old Redis closed, the next one reconnects."""
    for _ in range(2):
        await admission._shared._renew_live()
        if admission._shared._is_up:
            return
    raise AssertionError("the renewal never reached Redis")


async def admit(admission, tenant: Tenant, cost: Cost = Cost(10)):
    """The one permit of a request of `cost`."""
    (permit,) = await admission.admit(tenant, cost, 0, 0)
    return permit


async def refused(admission, tenant: Tenant, cost: Cost = Cost(10)) -> RequestError:
    with pytest.raises(RequestError) as err:
        await admission.admit(tenant, cost, 0, 0)
    return err.value


async def test_two_routers_share_one_tenants_cap(redis_server):
    (a, _), (b, _) = router(redis_server.url), router(redis_server.url)
    tenant = Tenant("cap-tenant", TenantLimits(max_concurrent=2))
    first = await admit(a, tenant, Cost(10))
    await admit(b, tenant, Cost(10))
    for admission in (a, b):  # the third is refused whichever router it reaches
        err = await refused(admission, tenant)
        assert (err.code, err.reason) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "tenant_concurrency")
        assert "tenant 'cap-tenant' has reached its limit of 2 concurrent requests" in err.message
    first.release(10)
    first.release(10)  # idempotent
    await asyncio.sleep(0.1)  # the release runs in the background
    await admit(b, tenant, Cost(10))
    await refused(a, tenant)


async def test_two_routers_share_one_tenants_token_budget(redis_server):
    (a, _), (b, _) = router(redis_server.url), router(redis_server.url)
    tenant = Tenant("budget-tenant", TenantLimits(tokens_per_minute=600))
    permit = await admit(a, tenant, Cost(500))
    err = await refused(b, tenant, Cost(200))
    assert err.reason == "tenant_budget"
    assert err.message.startswith(
        "tenant 'budget-tenant' is over its budget of 600 tokens per minute (this request needs 200, 100"
    )
    assert err.message.endswith("are left); retry in 10 s")
    permit.release(used_tokens=300)  # 200 charged tokens come back
    await asyncio.sleep(0.1)
    await admit(b, tenant, Cost(200))
    err = await refused(a, tenant, Cost(1, 600))
    assert "needs 601 tokens" in err.message and "lower max_tokens" in err.message


async def test_a_crashed_routers_leases_expire_and_a_live_routers_are_renewed(redis_server):
    (live, _), (crashed, _), (other, _) = (router(redis_server.url, lease=0.3) for _ in range(3))
    tenant = Tenant("lease-tenant", TenantLimits(max_concurrent=2))
    await admit(live, tenant, Cost(1))
    await admit(crashed, tenant, Cost(1))
    crashed._shared._renewer.cancel()  # the router is gone: nobody renews its lease
    await refused(other, tenant)
    await asyncio.sleep(0.6)  # two lease periods
    await admit(other, tenant, Cost(1))  # the crashed router's slot came back...
    await refused(other, tenant)  # ...but the live router's lease is still held


async def test_running_requests_count_again_after_redis_restarts_empty(tmp_path, monkeypatch):
    server = RedisServer(tmp_path)
    (a, _) = router(server.url)
    tenant = Tenant("restart-tenant", TenantLimits(max_concurrent=2))
    await admit(a, tenant)
    await admit(a, tenant)
    server = restart_empty(server, tmp_path / "restarted", monkeypatch)
    try:
        await renew_until_it_answers(a)
        (b, _) = router(server.url)  # a router whose connection is new
        err = await refused(b, tenant)  # a's two requests still run: the cap is full
        assert err.reason == "tenant_concurrency"
    finally:
        server.stop()


async def test_a_release_racing_a_renewal_does_not_bring_its_lease_back(redis_server):
    (a, _), (b, _) = router(redis_server.url), router(redis_server.url)
    tenant = Tenant("race-tenant", TenantLimits(max_concurrent=1))
    permit = await admit(a, tenant)
    store = a._shared
    renew = store._renew

    async def released_first(keys, args):
        permit.release(1)  # the request ends while the renewal is on its way...
        await asyncio.gather(*store._tasks)  # ...and its release reaches Redis first
        return await renew(keys=keys, args=args)

    store._renew = released_first
    await store._renew_live()
    await admit(b, tenant)  # the slot is free: the renewal did not revive the lease


async def test_store_down_fails_open_counting_what_the_router_already_runs(tmp_path):
    """Fail-open is this router's own limits as if it had always been alone: the request
    it admitted through Redis holds a seat and its tokens."""
    server = RedisServer(tmp_path)
    admission, registry = router(server.url, failure="open")
    tenant = Tenant("open-tenant", TenantLimits(max_concurrent=2, tokens_per_minute=60))
    await admit(admission, tenant, Cost(40))  # through Redis: 20 tokens left
    server.stop()
    permit = await admit(admission, tenant, Cost(10))  # the store is unreachable: 10 left
    err = await refused(admission, tenant, Cost(1))  # two running: the cap holds
    assert err.reason == "tenant_concurrency"
    permit.release(10)
    err = await refused(admission, tenant, Cost(30))
    assert err.reason == "tenant_budget"
    assert err.message.startswith("tenant 'open-tenant' is over its budget of 60 tokens per "
                                  "minute (this request needs 30, 10 are left)")
    assert registry.get_sample_value("omnibus_router_limits_store_up") == 0
    assert registry.get_sample_value(
        "omnibus_router_limits_store_errors_total", {"operation": "acquire"}) == 1
    assert registry.get_sample_value(
        "omnibus_router_limits_store_fallbacks_total", {"mode": "open"}) == 3


async def test_requests_admitted_while_redis_was_down_count_once_it_is_back(tmp_path, monkeypatch):
    server = RedisServer(tmp_path)
    (a, _) = router(server.url)
    tenant = Tenant("adopted-tenant", TenantLimits(max_concurrent=1))
    server.stop()
    await admit(a, tenant)  # fails open
    server = restart_empty(server, tmp_path / "restarted", monkeypatch)
    try:
        await renew_until_it_answers(a)
        (b, _) = router(server.url)
        err = await refused(b, tenant)
        assert err.reason == "tenant_concurrency"
    finally:
        server.stop()


async def test_store_down_fails_closed_with_unavailable(tmp_path):
    server = RedisServer(tmp_path)
    admission, registry = router(server.url, failure="closed")
    tenant = Tenant("closed-tenant", TenantLimits(max_concurrent=5))
    await admit(admission, tenant, Cost(1))
    server.stop()
    err = await refused(admission, tenant)
    assert (err.code, err.reason) == (grpc.StatusCode.UNAVAILABLE, "limits_store_unavailable")
    assert "unreachable and this router fails closed" in err.message
    assert registry.get_sample_value("omnibus_router_limits_store_up") == 0
    # A tenant without limits needs no store: admitted even now.
    await admit(admission, Tenant("free"), Cost(1))


async def test_the_choices_of_one_request_take_the_shared_limits_all_or_none(redis_server):
    (a, _), (b, _) = router(redis_server.url), router(redis_server.url)
    tenant = Tenant("choices-tenant", TenantLimits(tokens_per_minute=60, max_concurrent=4))
    spent = await admit(a, tenant, Cost(5, 40))
    spent.release(45)
    await asyncio.sleep(0.1)  # ~15 tokens left
    err = await refused(b, tenant, Cost(5, 5, 4))  # 4 choices of 10
    assert err.message.startswith("tenant 'choices-tenant' is over its budget of 60 tokens per "
                                  "minute (this request needs 40 for its 4 choices, 15 are left)")
    assert 24 < err.retry_after_s <= 25
    three = await a.admit(tenant, Cost(1, 2, 3), 0, 0)  # 9 tokens: nothing was taken above
    assert len(three) == 3
    err = await refused(b, tenant, Cost(1, 1, 2))  # 3 of 4 seats held: 2 more do not fit
    assert err.reason == "tenant_concurrency" and "runs 2 choices side by side" in err.message
    for permit in three:
        permit.release(3)
    await asyncio.sleep(0.1)
    assert len(await b.admit(tenant, Cost(1, 1, 2), 0, 0)) == 2


async def test_close_ends_the_renewals_even_when_a_cancel_is_taken_for_a_timeout(redis_server):
    """A cancel that lands as a Redis call's own timeout fires can be swallowed inside the
    client (read as that timeout and retried): the renewal loop must end on close anyway,
    or the router's (and a test's) event loop waits on it forever at shutdown."""
    admission, _ = router(redis_server.url, lease=0.03)
    await admit(admission, Tenant("close-tenant", TenantLimits(max_concurrent=1)), Cost(1))
    store = admission._shared
    swallowed = []

    async def renew_swallowing_one_cancel():
        try:
            await asyncio.sleep(0.2)  # where the cancel lands (the loop's own sleep is 10 ms)
        except asyncio.CancelledError:
            swallowed.append(True)  # as a client retrying what it took for its timeout

    store._renew_live = renew_swallowing_one_cancel
    await asyncio.sleep(0.05)  # the loop runs
    await asyncio.wait_for(admission.close(), 2)
    assert store._renewer.done()
    _OPEN.remove(admission)
