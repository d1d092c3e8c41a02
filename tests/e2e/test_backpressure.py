"""Backpressure end to end: a client that stops reading a stream frees its engine work,
its seat and its KV blocks once the router's write to it has not completed for
--client-stall-seconds.

gRPC buffers megabytes by default, so the client here opens its channel with a small
HTTP/2 flow-control window and BDP probing off: the router's writes then block after a
few KB, which a long greedy generation exceeds many times over.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest
from omnibus.v1 import inference_pb2 as pb
from omnibus.v1 import inference_pb2_grpc

from tests.e2e.conftest import NUM_KV_BLOCKS, Served
from tests.grpc_helpers import engine_stats, free_port, metric, router_process, scrape, wait_until

STALL_S = 1.0
SMALL_WINDOW = [
    ("grpc.http2.lookahead_bytes", 4096),
    ("grpc.http2.bdp_probe", 0),
]


def engine_idle_and_free(address: str) -> bool:
    s = engine_stats(address)
    idle = s.num_active_streams == 0 and s.load.num_running == 0 and s.load.num_waiting == 0
    return idle and s.load.num_free_blocks == NUM_KV_BLOCKS - 1


async def test_a_client_that_stops_reading_frees_its_seat_and_kv_within_the_stall_time(
    tiny_model, shared_engine: Served, tmp_path
):
    """...and when it reads again it gets what was buffered, then ABORTED naming the stall
    (outside probe: the call went silent, with no status, and a client without a deadline
    waited forever)."""
    metrics_port = free_port()
    router = router_process(
        tiny_model, [shared_engine.address], tmp_path, "stall-router",
        f"--client-stall-seconds={STALL_S}", f"--metrics-port={metrics_port}",
    ).wait_serving()
    try:
        # 1000 tokens: ~tens of KB of messages, far past the client's window.
        request = pb.GenerateRequest(
            token_ids=pb.TokenIds(ids=[5, 6, 7, 8]),
            sampling=pb.SamplingParams(max_tokens=1000, temperature=0.0, ignore_eos=True),
        )
        async with grpc.aio.insecure_channel(router.address, options=SMALL_WINDOW) as channel:
            call = inference_pb2_grpc.InferenceStub(channel).Generate(request)
            first = await call.read()  # the stream is flowing; from here on, nobody reads
            assert first.token_ids
            await asyncio.to_thread(
                wait_until,
                lambda: metric(scrape(metrics_port), "omnibus_router_requests_total",
                               outcome="client_stalled") == 1,
                60, "the router to end the stalled stream",
            )
            await asyncio.to_thread(
                wait_until, lambda: engine_idle_and_free(shared_engine.address), 30,
                "the engine to free the stalled stream's KV blocks",
            )
            text = scrape(metrics_port)
            assert metric(text, "omnibus_router_requests_total", outcome="length") == 0
            assert metric(text, "omnibus_router_engine_inflight",
                          engine=shared_engine.address) == 0

            async def rest() -> int:
                count = 0
                while await call.read() is not grpc.aio.EOF:
                    count += 1
                return count

            with pytest.raises(grpc.aio.AioRpcError) as err:
                await asyncio.wait_for(rest(), 30)
            assert err.value.code() == grpc.StatusCode.ABORTED
            assert "did not read its stream for 1 s (the router's --client-stall-seconds)" in err.value.details()
    finally:
        router.stop()
