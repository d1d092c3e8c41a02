"""Why an engine is down is in the router's log: an engine that refuses the router (its
token, its certificate) never comes up, so the reason is logged at its first failure,
again when it changes, and not at every retry."""

from __future__ import annotations

import asyncio

import grpc
from grpc_health.v1 import health
from structlog.testing import capture_logs

from omnibus.common.grpc_server import build_server
from omnibus.common.security import ServerSecurity
from omnibus.router.config import RouterConfig
from omnibus.router.dispatch.engines import EngineClient
from omnibus.v1 import engine_pb2, engine_pb2_grpc
from tests.grpc_helpers import free_port

REFUSED = "UNAUTHENTICATED: missing or wrong engine token (send 'authorization: Bearer <token>')"


def _unhealthy(logs: list[dict]) -> list[tuple[str, str]]:
    return [(e["log_level"], e["reason"]) for e in logs if e["event"] == "engine_unhealthy"]


class Counted:
    """An engine stub whose WatchLoad calls are counted: the client's retries."""

    def __init__(self, stub: engine_pb2_grpc.EngineStub) -> None:
        self.stub, self.tries = stub, 0

    def WatchLoad(self, *args, **kwargs):  # noqa: N802 (the RPC's name)
        self.tries += 1
        return self.stub.WatchLoad(*args, **kwargs)


class Scripted:
    """An engine stub whose WatchLoad streams follow a script, one item a call: an
    (code, details) error at the first read, or a report and then the next item's error;
    past the script, a stream that never ends."""

    def __init__(self, script: list) -> None:
        self.script = list(script)

    def WatchLoad(self, *args, **kwargs):  # noqa: N802
        return _Call(self.script)


class _Call:
    def __init__(self, script: list) -> None:
        self.script = script

    async def read(self):
        if not self.script:
            await asyncio.Event().wait()  # quiet from here on
        item = self.script.pop(0)
        if isinstance(item, engine_pb2.LoadReport):
            return item
        code, details = item
        raise grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)

    def cancel(self) -> None:
        pass


async def test_an_engine_refusing_the_token_is_logged_once_not_at_every_retry():
    port = free_port()
    server = build_server("127.0.0.1", port, [], health.aio.HealthServicer(),
                          security=ServerSecurity(token="the-engine-token"))
    await server.start()
    address = f"127.0.0.1:{port}"
    config = RouterConfig(model="m", engines=(address,), engine_retry_initial_seconds=0.01,
                          engine_retry_max_seconds=0.01)
    channel = grpc.aio.insecure_channel(address)
    stub = Counted(engine_pb2_grpc.EngineStub(channel))  # no token: every WatchLoad refused
    client = EngineClient(address, config, lambda: None, stub=stub)
    try:
        with capture_logs() as logs:
            client.start()
            async with asyncio.timeout(30):
                while stub.tries < 4:
                    await asyncio.sleep(0.01)
        assert _unhealthy(logs) == [("warning", REFUSED)]
        assert not client.link.healthy
    finally:
        await client.close()
        await channel.close()
        await server.stop(0)


async def test_a_new_reason_or_a_new_failure_is_logged_again():
    unavailable = (grpc.StatusCode.UNAVAILABLE, "connection refused")
    refused = (grpc.StatusCode.UNAUTHENTICATED, REFUSED.split(": ", 1)[1])
    report = engine_pb2.LoadReport(max_num_seqs=4)
    script = [unavailable, unavailable, refused, refused, report, refused]
    config = RouterConfig(model="m", engines=("127.0.0.1:1",), engine_retry_initial_seconds=0.01,
                          engine_retry_max_seconds=0.01)
    stub = Scripted(script)
    client = EngineClient("127.0.0.1:1", config, lambda: None, stub=stub)
    try:
        with capture_logs() as logs:
            client.start()
            async with asyncio.timeout(30):
                while stub.script:
                    await asyncio.sleep(0.01)
                await asyncio.sleep(0.05)  # the last failure's log
        assert _unhealthy(logs) == [("warning", "UNAVAILABLE: connection refused"),
                                    ("warning", REFUSED), ("warning", REFUSED)]
        assert [e["event"] for e in logs if e["log_level"] == "info"] == ["engine_healthy"]
        assert not client.link.healthy
    finally:
        await client.close()
