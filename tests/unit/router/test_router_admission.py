"""Admission control (tenant caps and budgets, queue caps) and API keys, with a fake clock."""

from __future__ import annotations

import json
import math

import grpc
import pytest

from omnibus.router.admission.limits import Admission, Cost, TokenBucket
from omnibus.router.admission.auth import KeyStore, Tenant, cache_salt
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
    (first,) = admission.admit_local(alice, Cost(10), 0, 0)
    admission.admit_local(alice, Cost(10), 0, 0)
    with pytest.raises(RequestError) as err:
        admission.admit_local(alice, Cost(10), 0, 0)
    assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert err.value.reason == "tenant_concurrency"
    assert "tenant 'alice' has reached its limit of 2 concurrent requests" in err.value.message
    first.release(used_tokens=10)
    first.release(used_tokens=10)  # idempotent
    assert admission.active("alice") == 1
    admission.admit_local(alice, Cost(10), 0, 0)
    # Another tenant is not affected by alice's cap.
    admission.admit_local(Tenant("bob", TenantLimits(max_concurrent=1)), Cost(10), 0, 0)


def test_token_budget_refuses_with_retry_time_and_refunds_unused_tokens():
    clock = FakeClock()
    admission = Admission(100, 10_000, clock)
    bob = Tenant("bob", TenantLimits(tokens_per_minute=600))  # 10 per second
    (permit,) = admission.admit_local(bob, Cost(500), 0, 0)
    with pytest.raises(RequestError) as err:
        admission.admit_local(bob, Cost(200), 0, 0)
    assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert err.value.reason == "tenant_budget"
    assert err.value.message == (
        "tenant 'bob' is over its budget of 600 tokens per minute "
        "(this request needs 200, 100 are left); retry in 10 s"
    )
    permit.release(used_tokens=300)  # 200 of the 500 charged were not used
    admission.admit_local(bob, Cost(200), 0, 0)
    with pytest.raises(RequestError, match="needs 601 tokens .* budget of 600 tokens per minute"):
        admission.admit_local(bob, Cost(1, 600), 0, 0)


BUDGET = " but tenant 'carol' has a budget of 600 tokens per minute, so it can never be admitted; "


@pytest.mark.parametrize("cost, param, message", [
    (Cost(5, 596), "max_tokens", "this request needs 601 tokens (a prompt of 5 + max_tokens 596)"
     + BUDGET + "lower max_tokens to at most 595"),
    # Lowering max_tokens cannot help a prompt that alone is over the budget.
    (Cost(600, 1), "prompt", "this request needs 601 tokens (a prompt of 600 + max_tokens 1)"
     + BUDGET + "shorten the prompt"),
    # Embeddings have no max_tokens: only the inputs can change.
    (Cost(601), "input", "this request's inputs have 601 tokens" + BUDGET
     + "send fewer or shorter inputs"),
    (Cost(1, 300, 2), "max_tokens", "this request needs 602 tokens (2 choices of a prompt of 1 + "
     "max_tokens 300)" + BUDGET + "lower max_tokens to at most 299 or lower n"),
    (Cost(300, 10, 2), "n", "this request needs 620 tokens (2 choices of a prompt of 300 + "
     "max_tokens 10)" + BUDGET + "lower n to at most 1"),
    (Cost(300, 400, 2), "n", "this request needs 1400 tokens (2 choices of a prompt of 300 + "
     "max_tokens 400)" + BUDGET + "lower n to 1 and max_tokens to at most 300"),
    (Cost(1, 9, 3), "n", "n=3 choices run side by side but tenant 'carol' may run 2 requests at "
     "once; lower n"),
])  # fmt: skip
async def test_requests_the_limits_can_never_admit_are_invalid_and_say_what_to_change(
    cost, param, message
):
    admission = Admission(100, 10_000, FakeClock())
    carol = Tenant("carol", TenantLimits(tokens_per_minute=600, max_concurrent=2))
    with pytest.raises(RequestError) as err:
        await admission.admit(carol, cost, 0, 0)
    assert (err.value.code, err.value.param, err.value.message) == (
        grpc.StatusCode.INVALID_ARGUMENT, param, message)
    assert err.value.retry_after_s is None
    assert admission.active("carol") == 0  # nothing was taken
    assert len(await admission.admit(carol, Cost(1, 299, 2), 0, 0)) == 2  # the budget, two at once


async def test_the_choices_of_one_request_are_admitted_all_or_none():
    clock = FakeClock()
    admission = Admission(100, 10_000, clock)
    dana = Tenant("dana", TenantLimits(tokens_per_minute=60, max_concurrent=4))  # 1 token/s
    (spent,) = await admission.admit(dana, Cost(5, 40), 0, 0)
    spent.release(used_tokens=45)  # 15 tokens left
    with pytest.raises(RequestError) as err:
        await admission.admit(dana, Cost(5, 5, 4), 0, 0)  # 4 choices of 10
    # The whole request's cost and wait, not one choice's.
    assert (err.value.code, err.value.retry_after_s) == (grpc.StatusCode.RESOURCE_EXHAUSTED, 25.0)
    assert err.value.message == (
        "tenant 'dana' is over its budget of 60 tokens per minute "
        "(this request needs 40 for its 4 choices, 15 are left); retry in 25 s"
    )
    assert admission.active("dana") == 0  # no choice was admitted, nothing charged
    clock.now += 25  # as Retry-After said
    permits = await admission.admit(dana, Cost(5, 5, 4), 0, 0)
    assert len(permits) == 4 and admission.active("dana") == 4
    for permit in permits:  # each choice releases its own share
        permit.release(used_tokens=7)
    assert admission.active("dana") == 0
    assert admission._tenants["dana"].bucket.level == 12  # noqa: SLF001 - 3 of each 10 refunded
    # The concurrency cap counts every choice, also all or none.
    await admission.admit(dana, Cost(1, 1, 3), 0, 0)
    with pytest.raises(RequestError) as err:
        await admission.admit(dana, Cost(1, 1, 2), 0, 0)
    assert err.value.message == (
        "tenant 'dana' has reached its limit of 4 concurrent requests (this request runs 2 choices "
        "side by side); retry when one of them has finished"
    )
    assert admission.active("dana") == 3


def test_queue_caps_say_server_overloaded():
    admission = Admission(max_queued_requests=3, max_queued_tokens=1000)
    anyone = Tenant("default")
    with pytest.raises(RequestError) as err:
        admission.admit_local(anyone, Cost(10), queued_requests=3, queued_tokens=30)
    assert (err.value.code, err.value.reason) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "overloaded")
    assert err.value.message.startswith("server overloaded, retry later")
    with pytest.raises(
        RequestError, match="server overloaded, retry later .*900 tokens are queued"
    ):
        admission.admit_local(anyone, Cost(101), queued_requests=1, queued_tokens=900)
    admission.admit_local(anyone, Cost(100), queued_requests=1, queued_tokens=900)
    admission.admit_local(
        anyone, Cost(5000), queued_requests=0, queued_tokens=0
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
    assert alice == Tenant("alice", TenantLimits(max_concurrent=1, tokens_per_minute=7),
                           cache_salt=cache_salt("alice", None))
    assert bob == Tenant("bob", TenantLimits(max_concurrent=9, tokens_per_minute=50), ("x",),
                         cache_salt=cache_salt("bob", None))


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
