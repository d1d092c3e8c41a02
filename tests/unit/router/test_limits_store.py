"""The shared limits store (router/admission/store.py) against a real redis-server:
two routers' stores share one tenant's cap and budget, a crashed router's leases
expire while a live router's are renewed, and a store that is down fails open or
closed as configured."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from prometheus_client import CollectorRegistry

from omnibus.router.admission.auth import Tenant
from omnibus.router.admission.limits import Cost, LocalPermit
from omnibus.router.admission.store import admission_for
from omnibus.router.config import RouterConfig, TenantLimits
from omnibus.router.service.errors import RequestError
from tests.redis_server import RedisServer


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    yield server
    server.stop()


def router(url: str, failure: str = "open", lease: float = 15.0):
    """One router's Admission with the shared store, and its metrics registry."""
    config = RouterConfig(model="m", engines=("e:1",), limits_store=url,
                          limits_store_failure=failure, limits_store_lease_seconds=lease)
    registry = CollectorRegistry()
    return admission_for(config, registry), registry


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


async def test_store_down_fails_open_to_the_routers_own_limits(tmp_path):
    server = RedisServer(tmp_path)
    admission, registry = router(server.url, failure="open")
    tenant = Tenant("open-tenant", TenantLimits(max_concurrent=1))
    assert not isinstance(await admit(admission, tenant, Cost(1)), LocalPermit)
    server.stop()
    permit = await admit(admission, tenant, Cost(1))  # the store's count is unreachable
    assert isinstance(permit, LocalPermit)
    err = await refused(admission, tenant)  # this router's own cap still holds
    assert err.reason == "tenant_concurrency"
    assert registry.get_sample_value("omnibus_router_limits_store_up") == 0
    assert registry.get_sample_value(
        "omnibus_router_limits_store_errors_total", {"operation": "acquire"}) == 1
    assert registry.get_sample_value(
        "omnibus_router_limits_store_fallbacks_total", {"mode": "open"}) == 2


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
