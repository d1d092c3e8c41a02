"""Why an engine is down is in the router's log: an engine that refuses the router (its
token, its certificate) never comes up, so the reason is logged at its first failure,
again when it changes, and not at every retry."""

from __future__ import annotations

import asyncio

from grpc_health.v1 import health
from structlog.testing import capture_logs

from omnibus.common.grpc_server import build_server
from omnibus.common.security import ServerSecurity
from omnibus.router.config import RouterConfig
from omnibus.router.dispatch.engines import EngineClient
from tests.grpc_helpers import free_port

REFUSED = "UNAUTHENTICATED: missing or wrong engine token (send 'authorization: Bearer <token>')"


def _unhealthy(logs: list[dict]) -> list[tuple[str, str]]:
    return [(e["log_level"], e["reason"]) for e in logs if e["event"] == "engine_unhealthy"]


async def test_an_engine_refusing_the_token_is_logged_once_not_at_every_retry():
    port = free_port()
    server = build_server("127.0.0.1", port, [], health.aio.HealthServicer(),
                          security=ServerSecurity(token="the-engine-token"))
    await server.start()
    address = f"127.0.0.1:{port}"
    config = RouterConfig(model="m", engines=(address,), engine_retry_initial_seconds=0.01,
                          engine_retry_max_seconds=0.01)
    client = EngineClient(address, config, lambda: None)  # no token: every WatchLoad refused
    tries = 0
    follow_reports = client._follow_reports

    async def counted() -> str:
        nonlocal tries
        tries += 1
        return await follow_reports()

    client._follow_reports = counted
    try:
        with capture_logs() as logs:
            client.start()
            async with asyncio.timeout(30):
                while tries < 4:
                    await asyncio.sleep(0.01)
        assert _unhealthy(logs) == [("warning", REFUSED)]
        assert not client.healthy
    finally:
        await client.close()
        await server.stop(0)


async def test_a_new_reason_or_a_new_failure_is_logged_again():
    client = EngineClient("127.0.0.1:1", RouterConfig(model="m", engines=("127.0.0.1:1",)),
                          lambda: None)
    try:
        with capture_logs() as logs:
            for reason in ("UNAVAILABLE: connection refused", "UNAVAILABLE: connection refused",
                           REFUSED, REFUSED):
                client._set_healthy(False, reason)
            client._set_healthy(True, "load report received")
            client._set_healthy(False, REFUSED)  # down again: said again
        assert _unhealthy(logs) == [("warning", "UNAVAILABLE: connection refused"),
                                    ("warning", REFUSED), ("warning", REFUSED)]
        assert [e["event"] for e in logs if e["log_level"] == "info"] == ["engine_healthy"]
    finally:
        await client.close()
