"""EngineDiscovery with an injected resolver and health probe (no network): --engine
forms, join only once SERVING, leave only once drained, lookups that fail keep the
engines, an engine failure triggers a lookup at once."""

from __future__ import annotations

import asyncio

import pytest
from omnibus.v1 import engine_pb2

from omnibus.router.config import EngineTarget, RouterConfig
from omnibus.router.dispatch.discovery import EngineDiscovery
from omnibus.router.dispatch.fleet import Fleet


@pytest.mark.parametrize(
    "text, target",
    [
        ("engine:50061", EngineTarget("engine", 50061)),
        ("dns:///engine:50061", EngineTarget("engine", 50061, dns=True)),
        ("dns:engine:50061", EngineTarget("engine", 50061, dns=True)),
        ("dns://10.0.0.2/e.svc:7", EngineTarget("e.svc", 7, dns=True, dns_server=("10.0.0.2", 53))),
        ("dns://127.0.0.1:5353/e:7", EngineTarget("e", 7, dns=True, dns_server=("127.0.0.1", 5353))),
    ],
)
def test_engine_targets(text, target):
    assert EngineTarget.parse(text) == target


@pytest.mark.parametrize("text", ["engine", "dns:///engine", "engine:0", "dns:///:5", "engine:x"])
def test_malformed_engine_targets_are_refused(text):
    with pytest.raises(ValueError, match="host:port or dns:///name:port"):
        RouterConfig(model="m", engines=(text,))


class World:
    """What DNS says and which addresses are SERVING; counts lookups."""

    def __init__(self) -> None:
        self.addresses: list[str] = []
        self.serving: set[str] = set()
        self.fail = False
        self.lookups = 0

    async def resolve(self, target: EngineTarget) -> list[str]:
        self.lookups += 1
        if self.fail:
            raise OSError("Temporary failure in name resolution")
        return list(self.addresses)

    async def probe(self, address: str) -> bool:
        return address in self.serving


def config(*engines: str) -> RouterConfig:
    return RouterConfig(
        model="m", engines=engines, engine_resolve_seconds=0.05, engine_retry_initial_seconds=0.01
    )


async def until(predicate, what: str) -> None:
    async with asyncio.timeout(5):
        while not predicate():
            await asyncio.sleep(0.01)


def addresses(engines: Fleet) -> list[str]:
    return sorted(e.address for e in engines)


async def test_static_engines_are_there_from_the_start_and_dns_ones_join_once_serving():
    world = World()
    world.addresses = ["10.0.0.1:7", "10.0.0.2:7"]
    world.serving = {"10.0.0.1:7"}
    engines = Fleet()
    discovery = EngineDiscovery(config("static:1", "dns:///e:7"), engines, world.resolve, world.probe)
    assert addresses(engines) == ["static:1"]
    discovery.start()
    try:
        await until(lambda: len(engines) == 2, "the serving engine to join")
        await asyncio.sleep(0.2)  # several lookups and probes later
        assert addresses(engines) == ["10.0.0.1:7", "static:1"]  # 10.0.0.2 still loading
        world.serving.add("10.0.0.2:7")
        await until(lambda: len(engines) == 3, "the second engine to join")
    finally:
        await discovery.close()


async def test_a_departed_engine_takes_no_new_requests_and_leaves_when_drained():
    world = World()
    world.addresses = world.serving = {"10.0.0.1:7", "10.0.0.2:7"}
    engines = Fleet()
    discovery = EngineDiscovery(config("dns:///e:7"), engines, world.resolve, world.probe)
    discovery.start()
    try:
        await until(lambda: len(engines) == 2, "both engines to join")
        leaving = next(e for e in engines if e.address == "10.0.0.1:7")
        leaving.seats.acquire()  # a request in flight
        world.addresses = {"10.0.0.2:7"}
        await until(lambda: leaving.seats.retiring, "the engine to retire")
        assert not leaving.seats.accepting and leaving.seats.room() == 0
        await asyncio.sleep(0.2)
        assert leaving in engines  # still streaming its request
        leaving.seats.release()
        await until(lambda: addresses(engines) == ["10.0.0.2:7"], "the drained engine to leave")
    finally:
        await discovery.close()


async def test_a_failed_lookup_keeps_the_engines_and_a_failure_triggers_a_lookup():
    world = World()
    world.addresses = world.serving = {"10.0.0.1:7"}
    engines = Fleet()
    cfg = RouterConfig(model="m", engines=("dns:///e:7",), engine_resolve_seconds=60,
                       engine_retry_initial_seconds=0.01)
    discovery = EngineDiscovery(cfg, engines, world.resolve, world.probe)
    discovery.start()
    try:
        await until(lambda: len(engines) == 1, "the engine to join")
        world.fail = True
        lookups = world.lookups
        (engine,) = engines
        engine.take_report(engine_pb2.LoadReport())  # healthy, as its first report makes it
        engine.link.mark_failed("connection refused")  # wakes the 60 s lookup loop
        await until(lambda: world.lookups > lookups, "a lookup soon after the failure")
        assert addresses(engines) == ["10.0.0.1:7"]  # the failed lookup dropped nothing
    finally:
        await discovery.close()
