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
    return router.pipeline.metrics.requests.labels(outcome)._value.get()


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

        from structlog.testing import capture_logs

        with capture_logs() as logs:
            await cut(time.monotonic() + 0.05, 0.1)
            await cut(time.monotonic() + 30, 0.05)
            await cut(None, 0.05)
        assert (counted(router, "deadline"), counted(router, "cancelled")) == (1, 2)
        assert not [e for e in logs if e["event"] == "client_stalled"]  # no client stalled here
    finally:
        await router.close()


async def test_embeds_served_are_counted_with_their_tokens(tmp_path):
    from types import SimpleNamespace

    from omnibus.v1 import engine_pb2, inference_pb2

    async def embed(request, timeout=None):
        return engine_pb2.EngineEmbedResponse(
            embeddings=[inference_pb2.Embedding(values=[0.5]) for _ in request.inputs])

    router = await Router(tmp_path, TENANTS, stub=SimpleNamespace(Embed=embed)).start()
    try:
        tenant = router.pipeline.authenticate([("authorization", "Bearer sk-t")])
        metrics = router.pipeline.metrics
        request = inference_pb2.EmbedRequest(inputs=[
            inference_pb2.EmbedInput(token_ids=inference_pb2.TokenIds(ids=[1, 2, 3])),
            inference_pb2.EmbedInput(text="w1 w2")])
        reply = await router.pipeline.embed(request, Caller(tenant))
        assert reply.total_tokens == 5 and len(reply.embeddings) == 2
        assert (metrics.embed_requests._value.get(), metrics.embed_tokens._value.get()) == (1, 5)
    finally:
        await router.close()


async def test_choices_whose_client_stops_reading_end_client_stalled(tmp_path):
    """Outside probe: HTTP's n choices went into an unbounded queue, so a client that
    stopped reading was never seen as stalled, the engine ran every choice to its end and
    the router held it all in memory. Now the choices wait on the client's write, which
    the stall watch ends (it cancels the writing task; the transport closes the call)."""
    from contextlib import aclosing

    router = await Router(tmp_path, TENANTS, client_stall_seconds=0.2).start()
    try:
        router.engine.tokens = 10_000
        tenant = router.pipeline.authenticate([("authorization", "Bearer sk-t")])
        stalled = []

        async def writer() -> None:
            choices = router.pipeline.generate_choices([prompt(5, 1000) for _ in range(3)],
                                                       Caller(tenant))
            async with aclosing(choices):
                await anext(choices)  # one message written; the next write never completes
                try:
                    await asyncio.sleep(3600)
                except asyncio.CancelledError:
                    stalled.append(router.pipeline.stall_error())
                    raise

        task = asyncio.create_task(writer())
        await asyncio.wait([task], timeout=10)
        assert task.cancelled()
        assert stalled[0] is not None and stalled[0].reason == "client_stalled"
        assert counted(router, "client_stalled") == 3 and counted(router, "length") == 0
        assert len(router.queue) == 0 and router.engine.seats.inflight == 0
    finally:
        await router.close()
