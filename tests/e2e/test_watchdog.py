"""The step-loop watchdog inside a live engine (in process, over real gRPC): a step that
stalls turns health NOT_SERVING, ends load reports UNAVAILABLE and refuses new requests;
a stall that lasts asks the process to exit; a step that ends puts the engine back."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from omnibus.v1 import engine_pb2, engine_pb2_grpc

from omnibus.engine.config import EngineConfig
from omnibus.engine.engine import Engine
from omnibus.engine.serving.server import ServerConfig, start
from omnibus.engine.serving.watchdog import WatchdogConfig
from tests.grpc_helpers import engine_request, free_port

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


async def _until(predicate, what: str, timeout: float = 20.0) -> None:  # type: ignore[no-untyped-def]
    end = asyncio.get_running_loop().time() + timeout
    while not await predicate():
        if asyncio.get_running_loop().time() > end:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(0.05)


async def test_a_stalled_step_trips_the_watchdog(tiny_model: Path) -> None:
    engine = Engine(EngineConfig(model=str(tiny_model), num_kv_blocks=32, block_size=8))
    engine.warmup()
    release, stalling = threading.Event(), threading.Event()
    real_step = engine.step

    def stalled_step():  # type: ignore[no-untyped-def]
        if engine.has_unfinished() and not release.is_set():
            stalling.set()
            release.wait(60)  # a hung kernel, until the test lets go
        return real_step()

    engine.step = stalled_step  # type: ignore[method-assign]
    exits: list[str] = []
    port = free_port()
    limits = WatchdogConfig(stall_seconds=0.5, first_step_seconds=0.5, exit_seconds=1.0)
    running = await start(engine, ServerConfig(port=port, watchdog=limits), exits.append)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = engine_pb2_grpc.EngineStub(channel)
            health = health_pb2_grpc.HealthStub(channel)

            async def status() -> int:
                return (await health.Check(health_pb2.HealthCheckRequest(), timeout=5)).status

            assert await status() == SERVING
            reports = stub.WatchLoad(engine_pb2.WatchLoadRequest(interval_ms=20))
            await reports.read()
            stuck = asyncio.create_task(_collect(stub.Generate(engine_request("stuck"), timeout=60)))

            async def not_serving() -> bool:
                return await status() == NOT_SERVING

            await _until(not_serving, "health NOT_SERVING")
            assert stalling.is_set()
            with pytest.raises(grpc.aio.AioRpcError) as err:
                while True:  # the load reports end: routers mark the engine unhealthy
                    await reports.read()
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "stalled" in err.value.details()
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await _collect(stub.Generate(engine_request("refused"), timeout=10))
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE

            async def exited() -> bool:
                return bool(exits)

            await _until(exited, "the watchdog's exit")
            assert len(exits) == 1 and "stalled for" in exits[0] and "restarted" in exits[0]

            release.set()  # the step ends: the engine is back
            replies = await stuck
            assert replies[-1].num_output_tokens == 4

            async def serving() -> bool:
                return await status() == SERVING

            await _until(serving, "health SERVING again")
            replies = await _collect(stub.Generate(engine_request("after"), timeout=30))
            assert replies[-1].num_output_tokens == 4
        assert engine.stats().num_free_blocks == engine.stats().num_total_blocks
    finally:
        release.set()
        await running.stop(1.0)


async def test_a_dead_step_loop_takes_the_worker_down(tiny_model: Path) -> None:
    """A step that raises (a device fault) ends the step loop for good: its requests fail
    UNAVAILABLE (routers continue them on another engine), health turns NOT_SERVING and
    the process asks to exit (code 70), so the orchestrator restarts the worker rather
    than keep a server that can serve nothing."""
    engine = Engine(EngineConfig(model=str(tiny_model), num_kv_blocks=32, block_size=8))
    engine.warmup()

    def faulty_step():  # type: ignore[no-untyped-def]
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    engine.step = faulty_step  # type: ignore[method-assign]
    exits: list[str] = []
    port = free_port()
    running = await start(engine, ServerConfig(port=port), exits.append)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = engine_pb2_grpc.EngineStub(channel)
            health = health_pb2_grpc.HealthStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await _collect(stub.Generate(engine_request("doomed"), timeout=30))
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE  # a router goes elsewhere
            assert "illegal memory access" in err.value.details()

            async def exited() -> bool:
                return bool(exits)

            await _until(exited, "the exit")
            assert "engine step loop died" in exits[0] and "restarted" in exits[0]
            status = await health.Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert status.status == NOT_SERVING
    finally:
        await running.stop(1.0)


async def _collect(call: grpc.aio.UnaryStreamCall) -> list[engine_pb2.EngineGenerateResponse]:
    return [reply async for reply in call]
