"""Tenant token budgets through the pipeline (tests/unit/router/inprocess.py: one
scripted engine, no process): a request is charged prompt + max_tokens on admission and
keeps, when it ends, what it used; one no engine ever started (cancelled or timed out
in the queue, refused by the engine) uses nothing, its prompt included."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from omnibus.router.service.errors import RequestError
from omnibus.router.service.pipeline import Caller
from tests.unit.router.inprocess import Router, prompt, refusal

BUDGET = 60  # tokens per minute: one a second, so a test's refill is under a token
TENANTS = {"t": {"keys": ["sk-t"], "tokens_per_minute": BUDGET}, "other": {"keys": ["sk-o"]}}


async def collect(router: Router, request) -> list:
    tenant = router.pipeline.authenticate([("authorization", "Bearer sk-t")])
    return [r async for r in router.pipeline.generate(request, Caller(tenant))]


async def whole_budget_is_left(router: Router) -> bool:
    """A request costing the whole budget is admitted (and served) now."""
    try:
        await collect(router, prompt(10, BUDGET - 10))
    except RequestError as err:
        assert err.code == grpc.StatusCode.RESOURCE_EXHAUSTED, err.message
        return False
    return True


async def queued(router: Router, request) -> asyncio.Task:
    """`request` waiting in the queue behind another tenant's request on the only seat."""
    router.engine.seats.acquire("", "other")
    task = asyncio.create_task(collect(router, request))
    while not len(router.queue):
        await asyncio.sleep(0.01)
    return task


async def cancelled_in_the_queue(router: Router) -> None:
    task = await queued(router, prompt(5, 50))
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    router.engine.seats.release("", "other")


async def timed_out_in_the_queue(router: Router) -> None:
    task = await queued(router, prompt(5, 50))
    with pytest.raises(RequestError) as err:
        await task
    assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    router.engine.seats.release("", "other")


async def refused_by_the_engine(router: Router) -> None:
    router.engine.error = refusal(grpc.StatusCode.INVALID_ARGUMENT, "needs more KV blocks")
    with pytest.raises(RequestError) as err:
        await collect(router, prompt(5, 50))
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    router.engine.error = None


@pytest.mark.parametrize("never_started", [
    cancelled_in_the_queue, timed_out_in_the_queue, refused_by_the_engine])
async def test_a_request_no_engine_started_uses_none_of_the_budget(tmp_path, never_started):
    router = await Router(tmp_path, TENANTS, max_inflight_per_engine=1,
                          max_queue_seconds=0.2).start()
    try:
        await never_started(router)  # 55 tokens charged on admission
        assert await whole_budget_is_left(router)
    finally:
        await router.close()


async def test_a_request_that_ran_uses_its_prompt_and_output(tmp_path):
    router = await Router(tmp_path, TENANTS).start()
    try:
        responses = await collect(router, prompt(5, 50))  # the engine sends 3 tokens
        assert responses[-1].usage.completion_tokens == 3
        with pytest.raises(RequestError) as err:
            await collect(router, prompt(10, BUDGET - 10))
        assert "52 are left" in err.value.message  # 60 - (5 + 3), the rest refunded
    finally:
        await router.close()


async def test_a_request_cancelled_after_dispatch_pays_its_prompt(tmp_path):
    """Without a token yet, but on an engine that may have prefilled it: a client that
    cancels just before the first token does not get the prefill for free."""
    router = await Router(tmp_path, TENANTS).start()
    try:
        started = []

        async def stalled(request, timeout=None):  # never answers: the request stays on it
            started.append(request)
            await asyncio.Event().wait()
            yield

        real, router.engine.generate = router.engine.generate, stalled
        task = asyncio.create_task(collect(router, prompt(5, 50)))
        while not started:
            await asyncio.sleep(0.01)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        router.engine.generate = real
        with pytest.raises(RequestError) as err:
            await collect(router, prompt(10, BUDGET - 10))
        assert "55 are left" in err.value.message  # 60 - 5: the prompt, the output refunded
    finally:
        await router.close()
