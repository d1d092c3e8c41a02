"""The engine worker's gRPC server process: start serving an engine, serve until SIGTERM
or SIGINT, drain, stop.

`start` puts the pieces together: the step loop's asyncio face (AsyncEngine, over a
StepLoopThread or a StepLoopProcess, `--step-loop`), the `omnibus.v1.Engine` service
(service.py), its metrics (metrics.py) and adapter catalog (catalog.py), health, the
watchdog and a guard that exits when the step loop dies. SIGTERM drains: health goes
NOT_SERVING, new requests get UNAVAILABLE, in-flight streams get `drain_seconds` to
finish and are aborted after.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
import structlog
from grpc_health.v1 import health, health_pb2
from omnibus.v1 import engine_pb2, engine_pb2_grpc

from omnibus.common.fatal import EXIT_CODE, exit_process
from omnibus.common.grpc_server import Service, build_server, set_health, stop_on_signal
from omnibus.common.heap import freeze_heap
from omnibus.common.metrics import serve_metrics
from omnibus.engine.engine import Engine
from omnibus.engine.serving.async_engine import AsyncEngine
from omnibus.engine.serving.catalog import AdapterCatalog
from omnibus.engine.serving.config import ServerConfig
from omnibus.engine.serving.metrics import EngineMetrics
from omnibus.engine.serving.service import EngineService
from omnibus.engine.serving.step_loop_runners import StepLoopProcess, StepLoopThread
from omnibus.engine.serving.watchdog import Watchdog

__all__ = ["RunningServer", "ServerConfig", "serve", "start"]

log = structlog.get_logger("engine.server")

SERVICE_NAME = engine_pb2.DESCRIPTOR.services_by_name["Engine"].full_name


@dataclass
class RunningServer:
    """An engine worker's gRPC server, started; `stop()` drains and shuts it down."""

    server: grpc.aio.Server
    service: EngineService
    aengine: AsyncEngine
    health_servicer: health.aio.HealthServicer
    tasks: list[asyncio.Task[None]]

    async def stop(self, drain_seconds: float) -> None:
        await _set_health(self.health_servicer, health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.service.drain(drain_seconds)
        await self.service.end_sessions()
        for task in self.tasks:
            task.cancel()
        await self.server.stop(0.2)  # what is left are load and health watches
        self.aengine.shutdown()


async def start(
    engine: Engine | StepLoopProcess, config: ServerConfig,
    watchdog_exit: Callable[[str], None] = exit_process,
) -> RunningServer:
    """Starts serving `engine` (already loaded and warmed up; its step loop then runs on a
    thread here) or a StepLoopProcess (the step loop in its own process) on the running event
    loop. `watchdog_exit` ends the process when a step stays stalled (tests record it)."""
    aengine = AsyncEngine(engine, config.embed_batching)
    aengine.start()
    metrics = EngineMetrics(aengine)
    catalog = AdapterCatalog(aengine.config.adapter_dir)
    service = EngineService(aengine, metrics, catalog)
    health_servicer = health.aio.HealthServicer()
    engine_service = Service(service, engine_pb2_grpc.add_EngineServicer_to_server, SERVICE_NAME)
    if config.metrics_port:  # first: a port in use fails before anything listens
        serve_metrics(metrics.registry, config.metrics_port, Path(aengine.config.model).name)
    server = build_server(config.host, config.port, [engine_service], health_servicer,
                          security=config.security)
    await server.start()
    tasks = [asyncio.create_task(catalog.run(), name="adapter-catalog")]

    async def stalled(stalled: bool) -> None:
        service.stalled = stalled
        if not service.draining:
            status = health_pb2.HealthCheckResponse
            await _set_health(health_servicer, status.NOT_SERVING if stalled else status.SERVING)

    watchdog = Watchdog(aengine.heartbeat, config.watchdog, stalled, watchdog_exit)
    tasks.append(asyncio.create_task(watchdog.run(), name="watchdog"))
    tasks.append(asyncio.create_task(_exit_when_the_step_loop_dies(aengine, health_servicer, watchdog_exit),
                                     name="step-loop-guard"))
    await _set_health(health_servicer, health_pb2.HealthCheckResponse.SERVING)
    stats = aengine.stats()
    log.info(
        "engine_serving",
        port=config.port,
        **config.security.describe(),
        model=aengine.config.model,
        step_loop="thread" if isinstance(aengine.runner, StepLoopThread) else "process",
        kv_blocks=stats.num_total_blocks,
        max_num_seqs=aengine.config.max_num_seqs,
        max_model_len=aengine.max_model_len,
        adapters=len(catalog.names) if aengine.config.adapter_dir else None,
        cached_adapters=list(stats.cached_adapters),
    )
    return RunningServer(server, service, aengine, health_servicer, tasks)


STEP_LOOP_POLL_S = 0.25
LAST_WORDS_S = 1.0  # after a step-loop death, before exiting: the failed streams' errors go out


async def _exit_when_the_step_loop_dies(
    aengine: AsyncEngine, health_servicer: health.aio.HealthServicer, exit: Callable[[str], None],
) -> None:
    """A step loop that died (an exception out of it, or its process killed: OOM, a device
    fault) is not coming back, and a server without one serves nothing: health goes
    NOT_SERVING, and once its requests' errors and the load reports' end have gone out the
    process exits (code 70) so the orchestrator restarts the worker. Cancelled when the
    server stops on purpose."""
    while aengine.error is None and aengine.is_alive:
        await asyncio.sleep(STEP_LOOP_POLL_S)
    error = aengine.error or RuntimeError("the step loop ended")
    message = f"engine step loop died ({error!r}); exiting so the worker is restarted"
    log.critical("engine_step_loop_died", error=repr(error), exit_code=EXIT_CODE, message=message)
    await _set_health(health_servicer, health_pb2.HealthCheckResponse.NOT_SERVING)
    await asyncio.sleep(LAST_WORDS_S)
    exit(message)


async def serve(engine: Engine | StepLoopProcess, config: ServerConfig) -> None:
    """Serves `engine` (see `start`) until SIGTERM or SIGINT, then drains."""
    stop = stop_on_signal()
    running = await start(engine, config)
    freeze_heap()
    await stop.wait()
    log.info(
        "engine_draining", in_flight=running.service.num_active, grace_seconds=config.drain_seconds
    )
    await running.stop(config.drain_seconds)
    log.info("engine_stopped")


async def _set_health(servicer: health.aio.HealthServicer, status: int) -> None:
    await set_health(servicer, (SERVICE_NAME,), status)
