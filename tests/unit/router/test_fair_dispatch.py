"""The router's fair-share queue (virtual token counters within priority classes, the
lift of an idle tenant, aging, FIFO as the alternative) and the dispatcher's choice of
engine (prefix hits weighed against room)."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from omnibus.common.prefix import leading_block_keys
from omnibus.router.dispatch.dispatcher import Dispatcher, Ticket
from omnibus.router.dispatch.fleet import Fleet
from omnibus.router.dispatch.queue import RequestQueue


def drain(q: RequestQueue[str], now: float = 0.0) -> list[str]:
    return [q.pop(now) for _ in range(len(q))]


@pytest.mark.parametrize("policy, expected", [
    ("vtc", ["b1", "a1", "a2"]),  # b (0) before a (100), though a arrived first
    ("fifo", ["a1", "a2", "b1"]),  # arrival only
])
def test_the_backlogged_tenant_with_the_smallest_counter_goes_next(policy, expected):
    q: RequestQueue[str] = RequestQueue(aging_seconds=0, policy=policy)
    q.push("a1", 0, 1, 0.0, "a")
    q.push("a2", 0, 1, 1.0, "a")
    q.push("b1", 0, 1, 2.0, "b")
    q.charge("a", 100)
    assert q.pop() == expected[0]
    q.charge("b", 150)  # a (100) before b (150) from here
    assert drain(q) == expected[1:]


def test_priority_classes_come_before_counters():
    q: RequestQueue[str] = RequestQueue(aging_seconds=0)
    q.push("a-low", 0, 1, 0.0, "a")
    q.push("b-high", 1, 1, 1.0, "b")
    q.charge("b", 1000)
    assert drain(q) == ["b-high", "a-low"]


def test_weights_divide_the_charge():
    q: RequestQueue[str] = RequestQueue(aging_seconds=0)
    q.push("a1", 0, 1, 0.0, "a")
    q.push("b1", 0, 1, 1.0, "b")
    q.charge("a", 300, weight=3.0)  # a: 100
    q.charge("b", 150)  # b: 150
    assert q.pop() == "a1"
    assert q.counters.snapshot() == {"a": 100.0, "b": 150.0}


def test_a_tenant_back_from_idling_is_lifted_to_the_smallest_active_counter():
    q: RequestQueue[str] = RequestQueue(aging_seconds=0)
    q.push("a1", 0, 1, 0.0, "a")
    q.push("b1", 0, 1, 0.0, "b")
    q.charge("a", 500)
    q.charge("b", 700)
    q.push("c1", 0, 1, 1.0, "c")  # idle until now: lifted to min(500, 700)
    assert q.counters["c"] == 500.0
    assert drain(q) == ["a1", "c1", "b1"]  # a and c tie at 500: a's request is older


def test_aging_lifts_a_request_into_the_top_class_where_counters_decide():
    q: RequestQueue[str] = RequestQueue(aging_seconds=10.0)
    q.push("a-high", 1, 1, 20.0, "a")
    q.push("b-low", 0, 1, 0.0, "b")  # waited 20 s at pop time: class 0 + 2 = 2
    q.charge("b", 10_000)
    assert q.pop(now=20.0) == "b-low"  # class 2 beats class 1 whatever b's counter
    q.push("b-low2", 0, 1, 15.0, "b")  # waited 5 s at 20.0: class 0
    assert q.pop(now=20.0) == "a-high"


class _Engine:
    """What the dispatcher reads of an EngineClient (of its `seats` and its `load`, both
    this one object)."""

    def __init__(self, name: str, room: int, capacity: int = 8, keys: frozenset[int] = frozenset()):
        self.seats = self.load = self
        self.address, self._room, self.capacity, self.prefix_keys = name, room, capacity, keys
        self.block_size = 4
        self.acquired = 0
        self.accepting = True
        self.tenant_inflight: Counter[str] = Counter()

    def room(self) -> int:
        return self._room - self.acquired

    def overflow_room(self) -> int:
        return self.room() + self.capacity

    def free_block_share(self) -> float:
        return 0.5

    def fits(self, tokens: int) -> bool:
        return True

    def acquire(self, adapter: str = "", tenant: str = "") -> None:
        self.acquired += 1
        self.tenant_inflight[tenant] += 1


PROMPT = list(range(100, 117))  # 17 tokens: 4 reusable blocks of 4


def test_prefix_hits_are_weighed_against_room():
    async def main():
        keys = frozenset(leading_block_keys(PROMPT, 4, None, 64))
        busy_hit = _Engine("hit", room=2, keys=keys)  # 2/8 room + 1.0 * 16/17 of the prompt
        idle = _Engine("idle", room=8)  # 8/8 room, no hit
        d = Dispatcher(Fleet([idle, busy_hit]), RequestQueue(0), prefix_weight=1.0)
        ticket = Ticket(0, 1, 0.0, prompt_ids=PROMPT)
        assert d.best_engine(ticket) is busy_hit
        load_only = Dispatcher(Fleet([idle, busy_hit]), RequestQueue(0), prefix_weight=0.0)
        assert load_only.best_engine(ticket) is idle
        half = frozenset(leading_block_keys(PROMPT, 4, None, 2))  # 8/17 of the prompt
        d2 = Dispatcher(Fleet([idle, _Engine("half", room=1, keys=half)]), RequestQueue(0), 1.0)
        assert d2.best_engine(ticket) is idle  # 1/8 + 8/17 < 1

    asyncio.run(main())


def test_a_request_goes_to_the_engine_holding_its_cache_groups_prefix():
    """Engines report salted block keys; a tenant's ticket scores only the blocks hashed
    with its own cache salt (as the router stamps it on the request), so it goes where its
    group's prefix is, not where another group's copy of the same prompt is."""
    from omnibus.router.admission.auth import cache_salt

    salt_a, salt_b = cache_salt("a", "team"), cache_salt("b", None)
    assert cache_salt("c", "team") == salt_a and salt_b not in (salt_a, "")

    def cached(salt: str, room: int) -> _Engine:
        return _Engine(salt or "unsalted", room=room, keys=frozenset(leading_block_keys(PROMPT, 4, None, 64, salt)))

    async def main():
        group_a, group_b, unsalted = cached(salt_a, 2), cached(salt_b, 3), cached("", 4)
        d = Dispatcher(Fleet([unsalted, group_b, group_a]), RequestQueue(0))
        ticket_a = Ticket(0, 1, 0.0, tenant="c", prompt_ids=PROMPT, cache_salt=salt_a)
        ticket_b = Ticket(0, 1, 0.0, tenant="b", prompt_ids=PROMPT, cache_salt=salt_b)
        shares = [[t.prefix_share(e) for e in (group_a, group_b, unsalted)]
                  for t in (ticket_a, ticket_b, Ticket(0, 1, 0.0, prompt_ids=PROMPT))]
        assert shares == [[16 / 17, 0.0, 0.0], [0.0, 16 / 17, 0.0], [0.0, 0.0, 16 / 17]]
        assert d.best_engine(ticket_a) is group_a  # 2/8 room + 16/17 beats 4/8 room
        assert d.best_engine(ticket_b) is group_b

    asyncio.run(main())


def test_an_adapter_request_goes_to_the_engine_reporting_its_salted_prefix():
    from omnibus.router.config import RouterConfig
    from omnibus.router.dispatch.engines import EngineClient
    from omnibus.v1 import engine_pb2

    config = RouterConfig(model="m", engines=("127.0.0.1:1",))
    salt = "ad@1024:17"  # the adapter file's fingerprint, as the engine salts its blocks

    def engine(keys: list[int]) -> EngineClient:
        client = EngineClient("127.0.0.1:1", config, lambda: None)
        client.take_report(engine_pb2.LoadReport(
            max_num_seqs=4, num_total_blocks=8, block_size=4, available_adapters=["ad"],
            adapter_salts={"ad": salt}, prefix_generation=1, prefix_block_keys=keys))
        return client

    async def main():
        base_cached = engine(leading_block_keys(PROMPT, 4, None, 64))
        adapter_cached = engine(leading_block_keys(PROMPT, 4, salt, 64))
        try:
            assert adapter_cached.load.adapter_salts == {"ad": salt}
            d = Dispatcher(Fleet([base_cached, adapter_cached]), RequestQueue(0))
            ticket = Ticket(0, 1, 0.0, adapter="ad", prompt_ids=PROMPT)
            assert ticket.prefix_share(adapter_cached) == 16 / 17
            assert ticket.prefix_share(base_cached) == 0.0  # the same tokens, unsalted
            grouped = Ticket(0, 1, 0.0, adapter="ad", prompt_ids=PROMPT, cache_salt="g")
            assert grouped.prefix_share(adapter_cached) == 0.0  # the adapter's, another group's
            both = engine(leading_block_keys(PROMPT, 4, salt, 64, "g"))  # adapter, then group
            try:
                assert grouped.prefix_share(both) == 16 / 17 and ticket.prefix_share(both) == 0.0
            finally:
                await both.close()
            assert d.best_engine(ticket) is adapter_cached
            base = Ticket(0, 1, 0.0, prompt_ids=PROMPT)
            reverse = Dispatcher(Fleet([adapter_cached, base_cached]), RequestQueue(0))
            assert reverse.best_engine(base) is base_cached
            adapter_cached.take_report(engine_pb2.LoadReport(
                max_num_seqs=4, num_total_blocks=8, block_size=4, available_adapters=["ad"],
                adapter_salts={"ad": "ad@1024:18"}, prefix_generation=1))  # the file changed
            assert ticket.prefix_share(adapter_cached) == 0.0
        finally:
            await base_cached.close()
            await adapter_cached.close()

    asyncio.run(main())


def test_dispatch_charges_the_prompt_to_the_tenant():
    async def main():
        engine = _Engine("e", room=1)
        q: RequestQueue[Ticket] = RequestQueue(0)
        d = Dispatcher(Fleet([engine]), q)
        first = Ticket(0, 1, 0.0, tenant="a", weight=2.0, prompt_ids=PROMPT)
        second = Ticket(0, 1, 1.0, tenant="b", prompt_ids=PROMPT[:5])
        d.submit(first)
        d.submit(second)
        d._match()  # noqa: SLF001 - one matching round, no task
        assert first.future.result() is engine and not second.future.done()
        assert q.counters.snapshot() == {"a": 8.5, "b": 0.0}

    asyncio.run(main())


@pytest.mark.parametrize("policy", ["vtc", "fifo"])
def test_a_tenant_under_its_share_passes_the_cap_while_another_is_over_it(policy):
    async def main():
        engine = _one_engine(4, 4)
        d = Dispatcher(Fleet([engine]), RequestQueue(0, policy))

        def submit(tenant: str, n: int) -> list[Ticket]:
            tickets = [Ticket(0, 1, float(i), tenant=tenant) for i in range(n)]
            for t in tickets:
                d.submit(t)
            d._match()  # noqa: SLF001
            return tickets

        try:
            a = submit("a", 6)
            assert sum(t.future.done() for t in a) == 4  # alone, a fills the cap and no more
            b = submit("b", 3)  # shares: 4 x 1/2 = 2 each; a holds 4
            dispatched = [t.future.done() for t in b]
            if policy == "fifo":
                assert dispatched == [False] * 3 and engine.seats.inflight == 4
                return
            assert dispatched == [True, True, False]  # up to b's share, past the cap
            assert dict(engine.seats.tenant_inflight) == {"a": 4, "b": 2} and engine.seats.inflight == 6
            for t in a[:3]:  # a drops to 1, under its share: b is over, nobody may pass
                engine.seats.release("", "a")
            d._match()  # noqa: SLF001
            # room for one (cap 4, 3 in flight); counters tie (no prompts): queue order, a's
            assert [t.future.done() for t in a[4:]] + [b[2].future.done()] == [True, False, False]
            c = submit("c", 9)  # three tenants: shares 4/3; b holds 2, a 2
            assert sum(t.future.done() for t in c) == 1  # c's one seat of its share
            assert engine.seats.overflow_room() == 8 - 5
        finally:
            await engine.close()

    asyncio.run(main())


def test_picking_among_tenants_never_passes_a_higher_class():
    q: RequestQueue[str] = RequestQueue(aging_seconds=10.0)
    q.push("b-high", 50, 1, 0.0, "b")
    q.push("a-low", -100, 1, 0.0, "a")
    with pytest.raises(IndexError):  # a's best waits behind b's class
        q.pop(now=1.0, among={"a"})
    assert q.pop(now=1.0) == "b-high"
    assert q.pop(now=1.0, among={"a"}) == "a-low"  # the highest class waiting now
    q.push("b-aged", 0, 1, 0.0, "b")  # class 0 + 2 at 20 s
    q.push("a-mid", 1, 1, 20.0, "a")
    with pytest.raises(IndexError):
        q.pop(now=20.0, among={"a"})
    q.push("c-top", 2, 1, 20.0, "c")  # same class as b's: fair share picks within it
    assert q.pop(now=20.0, among={"a", "c"}) == "c-top"


def test_an_under_share_tenant_is_not_over_admitted_ahead_of_a_higher_priority():
    """b keeps both seats busy at priority 50 with 4 more queued; a's priority -100
    request is under its share but must not pass the cap ahead of them, nor take the
    first freed seat."""
    async def main():
        engine = _one_engine(2, 2)
        d = Dispatcher(Fleet([engine]), RequestQueue(10.0, "vtc"))
        try:
            b = [Ticket(50, 1, i * 0.01, tenant="b") for i in range(6)]
            for t in b:
                d.submit(t)
            d._match()  # noqa: SLF001
            a = Ticket(-100, 1, 0.5, tenant="a")
            d.submit(a)
            d._match()  # noqa: SLF001
            assert [t.future.done() for t in b] == [True, True, False, False, False, False]
            assert not a.future.done() and engine.seats.inflight == 2
            engine.seats.release("", "b")
            d._match()  # noqa: SLF001
            assert b[2].future.done() and not a.future.done()
        finally:
            await engine.close()

    asyncio.run(main())


def _one_engine(cap: int, max_num_seqs: int):
    """An EngineClient (never connected) that has reported `max_num_seqs` seats, behind a
    router with --max-inflight-per-engine `cap`."""
    from omnibus.router.config import RouterConfig
    from omnibus.router.dispatch.engines import EngineClient
    from omnibus.v1 import engine_pb2

    config = RouterConfig(model="m", engines=("127.0.0.1:1",), max_inflight_per_engine=cap)
    engine = EngineClient(config.engines[0], config, lambda: None)
    engine.take_report(engine_pb2.LoadReport(max_num_seqs=max_num_seqs, num_total_blocks=8))
    return engine


def test_a_request_that_reads_kv_goes_to_an_engine_that_can_read_it():
    """A decode hop (or a migrated stream) reading KV of layout L goes to an engine whose
    load report says it reads L, over one with more room that would have to recompute
    (another rank count, block or dtype); with no such engine, the roomiest one."""
    from omnibus.router.config import RouterConfig
    from omnibus.router.dispatch.engines import EngineClient
    from omnibus.v1 import engine_pb2

    config = RouterConfig(model="m", engines=("127.0.0.1:1",))

    def engine(address: str, layout: str, running: int) -> EngineClient:
        client = EngineClient(address, config, lambda: None)
        client.take_report(engine_pb2.LoadReport(max_num_seqs=8, num_running=running, num_total_blocks=64,
                                                 num_free_blocks=64, block_size=8, kv_transfer=True,
                                                 kv_layout=layout, role="decode"))
        return client

    async def main():
        busy_tp2 = engine("127.0.0.1:2", "2x8x1x32:float32/tp2", running=6)
        idle_tp1 = engine("127.0.0.1:3", "2x8x2x32:float32", running=0)
        try:
            d = Dispatcher(Fleet([idle_tp1, busy_tp2]), RequestQueue(0))
            assert busy_tp2.load.kv_layout == "2x8x1x32:float32/tp2"
            reads = Ticket(0, 1, 0.0, prompt_ids=PROMPT, kv_layout="2x8x1x32:float32/tp2")
            assert d.best_engine(reads) is busy_tp2
            assert d.best_engine(Ticket(0, 1, 0.0, prompt_ids=PROMPT)) is idle_tp1
            other = Ticket(0, 1, 0.0, prompt_ids=PROMPT, kv_layout="4x8x1x32:bfloat16")
            assert d.best_engine(other) is idle_tp1
        finally:
            await busy_tp2.close()
            await idle_tp1.close()

    asyncio.run(main())
