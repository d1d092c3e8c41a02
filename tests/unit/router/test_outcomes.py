"""The outcome a request is counted under (omnibus_router_requests_total) when its client
goes away: a call the client's own deadline ended is a deadline, as the engine counts
it, not a cancel."""

from __future__ import annotations

import asyncio
import time

from omnibus.router.service.pipeline import Caller
from tests.unit.router.inprocess import Router, prompt

TENANTS = {"t": {"keys": ["sk-t"]}}


def counted(router: Router, outcome: str) -> float:
    return router.pipeline._metrics.requests.labels(outcome)._value.get()


async def test_a_call_its_deadline_ended_counts_as_a_deadline_a_cancel_as_a_cancel(tmp_path):
    router = await Router(tmp_path, TENANTS).start()
    try:
        async def stalled(request, timeout=None):  # never answers
            await asyncio.Event().wait()
            yield

        router.engine.generate = stalled
        tenant = router.pipeline.authenticate([("authorization", "Bearer sk-t")])

        async def cut(deadline: float | None, after: float) -> None:
            async def consume():
                return [r async for r in router.pipeline.generate(prompt(5, 10), Caller(tenant, deadline=deadline))]

            task = asyncio.create_task(consume())
            await asyncio.sleep(after)
            task.cancel()  # what gRPC does to the handler at the deadline, or when the client leaves
            await asyncio.gather(task, return_exceptions=True)

        await cut(time.monotonic() + 0.05, 0.1)
        await cut(time.monotonic() + 30, 0.05)
        await cut(None, 0.05)
        assert (counted(router, "deadline"), counted(router, "cancelled")) == (1, 2)
    finally:
        await router.close()
