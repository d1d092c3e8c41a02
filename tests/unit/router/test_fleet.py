"""The Fleet's answers about its engines, from their load reports (EngineClients handed
reports, never connected): which count for what, and when its subscribers hear of it."""

from __future__ import annotations

import pytest
from omnibus.v1 import engine_pb2

from omnibus.common.sampling import kv_tokens
from omnibus.router.config import RouterConfig
from omnibus.router.dispatch.engines import EngineClient
from omnibus.router.dispatch.fleet import Fleet

CONFIG = RouterConfig(model="m", engines=("127.0.0.1:1",))


def engine(address: str, **report) -> EngineClient:
    """A client of `address`; with `report` fields, as it reported them (else unheard)."""
    client = EngineClient(address, CONFIG, lambda: None)
    if report:
        client.take_report(engine_pb2.LoadReport(max_num_seqs=4, **report))
    return client


@pytest.fixture
async def fleet():
    """short: 48-token context, adapter a; long: 512, adapters a and b, a KV pool of 300
    tokens; silent: never reported."""
    engines = Fleet([
        engine("short:1", max_model_len=48, available_adapters=["a"]),
        engine("long:1", max_model_len=512, num_total_blocks=20, num_free_blocks=20, block_size=16,
               available_adapters=["a", "b"]),
        engine("silent:1"),
    ])
    yield engines
    for e in engines:
        await e.close()


async def test_the_served_context_is_the_longest_of_engines_not_leaving(fleet):
    short, long_, _ = fleet
    assert fleet.served_context() == 512
    long_.link.mark_failed("connection refused")  # down for now: its context still counts
    assert fleet.served_context() == 512 and fleet.accepting() == [short]
    long_.seats.retiring = True
    assert fleet.served_context() == 48


async def test_who_can_take_a_request_of_a_size(fleet):
    short, long_, _ = fleet
    pool = kv_tokens(20, 16)  # long_'s KV pool, by the engine's own rule: under its context
    assert pool < 512 and long_.load.max_request_tokens() == pool and short.load.max_request_tokens() == 48
    assert fleet.taking(tokens=pool) and not fleet.taking(tokens=pool + 1)
    assert not fleet.taking(tokens=49, avoid={"long:1"})
    assert fleet.taking("b", 100) and not fleet.taking("c")
    assert (fleet.most_request_tokens(), fleet.most_request_tokens("b"), fleet.fill_tokens()) == (pool, pool, pool)
    long_.link.mark_failed("connection refused")
    assert not fleet.taking(tokens=49) and fleet.fill_tokens() == 48
    assert fleet.most_request_tokens() == pool  # down, not gone: what it holds still counts


async def test_adapters_and_unheard_engines(fleet):
    short, long_, silent = fleet
    assert fleet.adapters() == {"a", "b"} and fleet.serves_adapter("b")
    assert (fleet.unheard(), fleet.healthy()) == (1, 2)
    long_.seats.retiring = True
    assert fleet.adapters() == {"a"} and not fleet.serves_adapter("b")
    silent.take_report(engine_pb2.LoadReport(available_adapters=["c"]))
    assert (fleet.unheard(), fleet.healthy(), fleet.adapters()) == (0, 3, {"a", "c"})


async def test_the_embeddings_target_is_the_least_loaded_whose_context_holds_the_input(fleet):
    short, long_, silent = fleet
    long_.seats.acquire()
    assert fleet.embed_target(40) is short  # both hold 40 tokens; short is idle
    assert fleet.embed_target(100) is long_
    long_.link.mark_failed("connection refused")
    assert fleet.embed_target(100) is None


async def test_membership_and_subscribers(fleet):
    heard: list[str] = []
    fleet.subscribe(lambda: heard.append("changed"))
    short, long_, silent = fleet
    assert fleet.get("long:1") is long_ and fleet.get("nowhere:1") is None
    fleet.remove(silent)
    assert fleet.addresses == ["short:1", "long:1"] and heard == ["changed"]
    fleet.add(silent)  # no report yet: no room changed, nothing to tell
    assert len(fleet) == 3 and heard == ["changed"]
