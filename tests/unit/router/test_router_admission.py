"""Admission control (tenant caps and budgets, queue caps) and API keys, with a fake clock."""

from __future__ import annotations

import json
import math

import grpc
import pytest

from omnibus.router.admission.limits import Admission, TokenBucket
from omnibus.router.admission.auth import KeyStore, Tenant
from omnibus.router.config import TenantLimits
from omnibus.router.service.errors import RequestError


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_token_bucket_refills_at_the_per_minute_rate_up_to_capacity():
    clock = FakeClock()
    bucket = TokenBucket(120, clock)  # 2 tokens per second
    assert bucket.take(100) == 0.0
    assert bucket.take(30) == pytest.approx(5.0)  # 20 left, 10 more needed at 2/s
    clock.now += 5
    assert bucket.take(30) == 0.0
    assert bucket.take(121) == math.inf
    clock.now += 3600
    assert bucket.level == 120  # never above capacity
    bucket.give_back(50)
    assert bucket.level == 120


def test_tenant_concurrency_cap_names_the_tenant_and_limit_and_frees_on_release():
    admission = Admission(max_queued_requests=100, max_queued_tokens=10_000)
    alice = Tenant("alice", TenantLimits(max_concurrent=2))
    first = admission.admit_local(alice, 10, 0, 0)
    admission.admit_local(alice, 10, 0, 0)
    with pytest.raises(RequestError) as err:
        admission.admit_local(alice, 10, 0, 0)
    assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert err.value.reason == "tenant_concurrency"
    assert "tenant 'alice' has reached its limit of 2 concurrent requests" in err.value.message
    first.release(used_tokens=10)
    first.release(used_tokens=10)  # idempotent
    assert admission.active("alice") == 1
    admission.admit_local(alice, 10, 0, 0)
    # Another tenant is not affected by alice's cap.
    admission.admit_local(Tenant("bob", TenantLimits(max_concurrent=1)), 10, 0, 0)


def test_token_budget_refuses_with_retry_time_and_refunds_unused_tokens():
    clock = FakeClock()
    admission = Admission(100, 10_000, clock)
    bob = Tenant("bob", TenantLimits(tokens_per_minute=600))  # 10 per second
    permit = admission.admit_local(bob, 500, 0, 0)
    with pytest.raises(RequestError) as err:
        admission.admit_local(bob, 200, 0, 0)
    assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert err.value.reason == "tenant_budget"
    assert err.value.message == (
        "tenant 'bob' is over its budget of 600 tokens per minute "
        "(this request needs 200, 100 are left); retry in 10 s"
    )
    permit.release(used_tokens=300)  # 200 of the 500 charged were not used
    admission.admit_local(bob, 200, 0, 0)
    with pytest.raises(RequestError, match="needs 601 tokens .* budget of 600 tokens per minute"):
        admission.admit_local(bob, 601, 0, 0)


async def test_requests_the_limits_can_never_admit_are_invalid_not_retryable():
    admission = Admission(100, 10_000, FakeClock())
    carol = Tenant("carol", TenantLimits(tokens_per_minute=600, max_concurrent=2))
    for cost, choices, param, message in (
        (601, 1, "max_tokens", "this request needs 601 tokens (prompt + max_tokens) but tenant "
         "'carol' has a budget of 600 tokens per minute, so it can never be admitted; lower max_tokens"),
        (301, 2, "max_tokens", "this request needs 2 choices of 301 tokens (prompt + max_tokens) but "
         "tenant 'carol' has a budget of 600 tokens per minute, so it can never be admitted; lower "
         "max_tokens or n"),
        (10, 3, "n", "n=3 choices run side by side but tenant 'carol' may run 2 requests at once; lower n"),
    ):
        with pytest.raises(RequestError) as err:
            await admission.admit(carol, cost, 0, 0, choices)
        assert (err.value.code, err.value.param, err.value.message) == (
            grpc.StatusCode.INVALID_ARGUMENT, param, message)
        assert err.value.retry_after_s is None
    assert admission.active("carol") == 0  # nothing was taken
    await admission.admit(carol, 300, 0, 0, 2)  # exactly the budget, two at once


def test_queue_caps_say_server_overloaded():
    admission = Admission(max_queued_requests=3, max_queued_tokens=1000)
    anyone = Tenant("default")
    with pytest.raises(RequestError) as err:
        admission.admit_local(anyone, 10, queued_requests=3, queued_tokens=30)
    assert (err.value.code, err.value.reason) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "overloaded")
    assert err.value.message.startswith("server overloaded, retry later")
    with pytest.raises(
        RequestError, match="server overloaded, retry later .*900 tokens are queued"
    ):
        admission.admit_local(anyone, 101, queued_requests=1, queued_tokens=900)
    admission.admit_local(anyone, 100, queued_requests=1, queued_tokens=900)
    admission.admit_local(
        anyone, 5000, queued_requests=0, queued_tokens=0
    )  # an empty queue takes anything
    assert admission.active("default") == 2


def write_keys(tmp_path, tenants: dict) -> str:
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"tenants": tenants}))
    return str(path)


def test_without_keys_everyone_is_the_default_tenant():
    store = KeyStore.open(None, TenantLimits(max_concurrent=3))
    tenant = store.authenticate([])
    assert (tenant.name, tenant.limits.max_concurrent) == ("default", 3)


def test_keys_map_to_tenants_with_their_limits_or_the_defaults(tmp_path):
    path = write_keys(
        tmp_path,
        {
            "alice": {"keys": ["ka1", "ka2"], "max_concurrent": 1},
            "bob": {"keys": ["kb"], "tokens_per_minute": 50, "adapters": ["x"]},
        },
    )
    store = KeyStore.open(path, TenantLimits(max_concurrent=9, tokens_per_minute=7))
    alice = store.authenticate([("authorization", "Bearer ka2")])
    bob = store.authenticate([("authorization", "bearer kb")])
    assert alice == Tenant("alice", TenantLimits(max_concurrent=1, tokens_per_minute=7))
    assert bob == Tenant("bob", TenantLimits(max_concurrent=9, tokens_per_minute=50), ("x",))


@pytest.mark.parametrize(
    "metadata, message",
    [
        ([], "missing 'authorization: Bearer <key>' header"),
        ([("authorization", "ka1")], "the authorization header must be 'Bearer <key>'"),
        ([("authorization", "Basic ka1")], "the authorization header must be 'Bearer <key>'"),
        ([("authorization", "Bearer nope")], "invalid API key"),
    ],
)
def test_bad_credentials_are_unauthenticated(tmp_path, metadata, message):
    store = KeyStore.open(write_keys(tmp_path, {"alice": {"keys": ["ka1"]}}), TenantLimits())
    with pytest.raises(RequestError) as err:
        store.authenticate(metadata)
    assert (err.value.code, err.value.message) == (grpc.StatusCode.UNAUTHENTICATED, message)


@pytest.mark.parametrize(
    "tenants, message",
    [
        ({}, "non-empty 'tenants' object"),
        ({"a": {"keys": []}}, "'keys' must be a non-empty list"),
        ({"a": {"keys": ["k"], "max_concurent": 1}}, "unknown fields \\['max_concurent'\\]"),
        ({"a": {"keys": ["k"]}, "b": {"keys": ["k"]}}, "used twice"),
        ({"a": {"keys": ["k"], "max_concurrent": -1}}, "max_concurrent must be >= 0"),
    ],
)
def test_bad_keys_files_are_refused_at_startup(tmp_path, tenants, message):
    with pytest.raises(ValueError, match=message):
        KeyStore.open(write_keys(tmp_path, tenants), TenantLimits())
