"""How the router comes back to an engine that went away: as soon as its channel
connects again (the channel's own backoff paces the attempts), not after a retry delay
on top of it; an engine that answers but fails is retried after the (doubling) delay."""

from __future__ import annotations

import asyncio

import grpc

from omnibus.router.config import RouterConfig
from omnibus.router.dispatch.engines import EngineClient


class FakeChannel:
    def __init__(self) -> None:
        self.connected = asyncio.Event()

    def get_state(self, try_to_connect: bool = False) -> grpc.ChannelConnectivity:
        return grpc.ChannelConnectivity.READY if self.connected.is_set() else grpc.ChannelConnectivity.TRANSIENT_FAILURE

    async def channel_ready(self) -> None:
        await self.connected.wait()

    async def close(self, grace=None) -> None:
        pass


async def test_a_lost_engine_is_tried_again_once_its_channel_connects():
    config = RouterConfig(model="m", engines=("127.0.0.1:1",), engine_retry_initial_seconds=60,
                          engine_retry_max_seconds=60)
    client = EngineClient("127.0.0.1:1", config, lambda: None)
    channel, tries = FakeChannel(), []

    async def follow_reports() -> str:
        tries.append(channel.get_state())
        return "UNAVAILABLE: connection refused"

    client.link._channel, client.link._follow_reports = channel, follow_reports
    client.start()
    try:
        while not tries:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)
        assert len(tries) == 1  # down: waits for the channel (or the 60 s delay)
        channel.connected.set()  # the engine is back
        async with asyncio.timeout(5):  # well before the 60 s retry delay
            while len(tries) < 2:
                await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)
        assert tries == [grpc.ChannelConnectivity.TRANSIENT_FAILURE, grpc.ChannelConnectivity.READY]
    finally:
        await client.close()
