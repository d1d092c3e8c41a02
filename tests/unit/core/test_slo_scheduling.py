"""SLO-aware scheduling without a model: near deadlines first (far ones rank like none),
deadline expiry, preemption in the one order, tenant fair share (virtual token counters,
seat shares) in the engine's waiting queue, and the prefix hash the router shares with
the allocator."""

from __future__ import annotations

import math

import pytest

from omnibus.common.fairness import VirtualTokenCounters
from omnibus.common.prefix import block_hash, block_key, leading_block_keys, matched_blocks
from omnibus.engine.core.block_allocator import BlockAllocator
from omnibus.engine.core.policies import make_policy
from omnibus.engine.core.scheduler import Scheduler, SchedulerConfig
from omnibus.engine.core.sequence import Sequence
from omnibus.engine.core.order import SchedulingOrder
from omnibus.engine.worker.sampling import SamplerOutput, SamplingParams

NOW = 1000.0


def make_scheduler(order="slo", num_blocks=64, block_size=4, max_seqs=8, budget=32) -> Scheduler:
    alloc = BlockAllocator(num_blocks, block_size)
    return Scheduler(SchedulerConfig(max_seqs, budget, 512, order), alloc, make_policy("continuous"), (2,))


def seq(rid, n_prompt, max_tokens=4, priority=0, tenant="", deadline=None, weight=1.0, start=10):
    return Sequence(rid, list(range(start, start + n_prompt)),
                    SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0),
                    priority=priority, tenant=tenant, deadline=deadline, weight=weight)


def step(s: Scheduler, now: float = NOW):
    plan = s.schedule(now)
    n = sum(item.samples for item in plan.scheduled)
    outs = s.take_aborted() + s.update(plan, SamplerOutput([7] * n, [None] * n))
    s.allocator.check_integrity(s.block_tables())
    return plan, outs


def planned(plan) -> list[tuple[str, int]]:
    return [(i.seq.request_id, i.num_tokens) for i in plan.scheduled]


# ---- deadlines ----------------------------------------------------------------


@pytest.mark.parametrize("order, expected", [
    ("slo", [("soon", 8), ("none", 2)]),  # the near deadline first; the far one ranks like none
    ("fifo", [("none", 8), ("late", 2)]),  # arrival, whatever the deadlines
])
def test_a_near_deadline_is_admitted_first_and_a_far_one_ranks_like_none(order, expected):
    s = make_scheduler(order=order, budget=10)
    s.add(seq("none", 8))
    s.add(seq("late", 8, deadline=NOW + 9))
    # 1 prefill + 4 decode steps at the assumed 0.05 s: near within 2 x 0.25 s of its deadline
    s.add(seq("soon", 8, deadline=NOW + 0.4))
    plan, _ = step(s)
    assert planned(plan) == expected


def test_a_deadline_becomes_near_as_the_clock_passes():
    s = make_scheduler(budget=8, max_seqs=1)
    s.add(seq("first", 8, max_tokens=50))
    s.add(seq("none", 8, start=100))
    s.add(seq("timed", 8, deadline=NOW + 10, start=200))  # near from NOW + 9.5 (1 + 4 steps, twice 0.25 s)
    step(s, NOW)
    assert s.order.urgent_at(s.requests["timed"]) == pytest.approx(NOW + 9.5)
    s.abort("first")
    plan, _ = step(s, NOW + 1)
    assert planned(plan) == [("none", 8)]  # far: arrival decides
    s.abort("none")
    s.add(seq("later", 8, start=300))
    plan, _ = step(s, NOW + 9.6)
    assert planned(plan) == [("timed", 8)]


def test_client_timeouts_on_every_request_leave_fair_share_in_charge():
    """Every client sets a 600 s deadline, as gRPC advises: that is no SLO, so a light
    tenant is not queued behind a flood that arrived first (it took no seat before)."""
    s = make_scheduler(budget=64, max_seqs=2, num_blocks=200)
    for i in range(8):
        s.add(seq(f"a{i}", 8, max_tokens=30, tenant="a", deadline=NOW + 600, start=10 * i))
    step(s)
    step(s)
    s.add(seq("b0", 8, max_tokens=4, tenant="b", deadline=NOW + 600, start=200))
    plan, _ = step(s)
    assert [v.request_id for v in plan.preempted] == ["a1"] and ("b0", 8) in planned(plan)


def test_a_request_whose_deadline_passed_is_never_prefilled():
    s = make_scheduler()
    s.add(seq("missed", 8, deadline=NOW - 0.5))
    s.add(seq("ok", 8, deadline=NOW + 5))
    plan, outs = step(s)
    assert planned(plan) == [("ok", 8)]
    missed = next(o for o in outs if o.request_id == "missed")
    assert (missed.finished, missed.finish_reason, missed.new_token_ids) == (True, "deadline", [])
    assert missed.error == "the request's deadline passed 0.500 s before the engine could prefill it"
    assert "missed" not in s.requests and s.num_waiting == 0


@pytest.mark.parametrize("deadline", [NOW + 1, None])
def test_a_request_whose_deadline_passes_mid_prefill_gets_no_further_chunk(deadline):
    s = make_scheduler(budget=8)
    dec = seq("dec", 4, max_tokens=20)  # no deadline, decoding throughout
    s.add(dec)
    step(s, NOW - 1)
    long = seq("long", 21, deadline=deadline, start=100)  # 3 chunks of 7 beside dec's decode
    s.add(long)
    plan, _ = step(s, NOW)
    assert planned(plan) == [("dec", 1), ("long", 7)]
    plan, outs = step(s, NOW + 2)  # the deadline, if any, passed after chunk 1
    if deadline is None:  # unaffected: chunk 2, then chunk 3 samples its first token
        assert planned(plan) == [("dec", 1), ("long", 7)]
        plan, outs = step(s, NOW + 3)
        assert planned(plan) == [("dec", 1), ("long", 7)]
        assert [(o.request_id, o.new_token_ids) for o in outs] == [("dec", [7]), ("long", [7])]
        return
    assert planned(plan) == [("dec", 1)]
    ended = next(o for o in outs if o.request_id == "long")
    assert (ended.finished, ended.finish_reason, ended.new_token_ids) == (True, "deadline", [])
    assert ended.error == ("the request's deadline passed 1.000 s into its prefill "
                           "(7 of 21 prompt tokens computed)")
    assert "long" not in s.requests and s.running == [dec] and s.num_waiting == 0
    assert long.block_table == [] and s.allocator.counts().referenced == len(dec.block_table)


def test_blocks_running_out_preempt_the_last_in_the_order():
    # 6 usable blocks of 4 tokens: three 8-token prompts take all of them.
    s = make_scheduler(num_blocks=7, max_seqs=3)
    s.add(seq("tight", 8, max_tokens=8, deadline=NOW + 0.5))  # near: 9 steps, twice 0.45 s
    s.add(seq("none", 8, max_tokens=8))
    s.add(seq("loose", 8, max_tokens=8, deadline=NOW + 60))  # far: ranks like none
    step(s)
    plan, _ = step(s)  # each decode needs a fifth token's block: someone must go
    assert [v.request_id for v in plan.preempted] == ["loose"]  # no near deadline, latest arrival
    assert sorted(r for r, _ in planned(plan)) == ["none", "tight"]


def test_near_deadlines_rank_below_priority_in_the_victim_choice():
    order = SchedulingOrder("slo")
    order.now = NOW
    low = seq("low", 4, priority=0, deadline=NOW + 0.1)
    high = seq("high", 4, priority=1)
    later = seq("later", 4, priority=0, deadline=NOW + 0.2)
    none = seq("none", 4, priority=0)
    for s in (low, high, later, none):
        s.urgent_at = order.urgent_at(s)
    assert order.victim([high, low]) is low
    assert order.victim([later, low]) is later  # both near: the later deadline
    assert order.victim([none, low, later]) is none  # no near deadline ranks after any


# ---- fair share in the engine -----------------------------------------------------


def test_waiting_requests_of_the_least_served_tenant_go_first():
    s = make_scheduler(budget=8, max_seqs=4)
    s.add(seq("a1", 8, tenant="a", max_tokens=1))
    plan, _ = step(s)
    assert planned(plan) == [("a1", 8)]  # a has now been served 8 tokens
    s.add(seq("b1", 8, tenant="b", start=100))  # nobody backlogged: lifted to the last leaver's 0
    s.add(seq("a2", 8, tenant="a", start=200))  # lifted to b's 0 at most: a keeps its 8
    plan, _ = step(s)
    assert planned(plan) == [("b1", 8)]
    assert s.order.counters.snapshot() == {"a": 8.0, "b": 8.0}  # noqa: SLF001


def test_a_tenant_arriving_behind_a_backlog_is_lifted_to_its_counter():
    s = make_scheduler(budget=8, max_seqs=4)
    s.add(seq("a1", 8, tenant="a", max_tokens=1))
    step(s)
    s.add(seq("a2", 8, tenant="a", start=200))  # a is backlogged at 8
    s.add(seq("b1", 8, tenant="b", start=100))  # lifted from 0 to 8: equal counters, arrival decides
    plan, _ = step(s)
    assert planned(plan) == [("a2", 8)]
    assert s.order.counters.snapshot() == {"a": 16.0, "b": 8.0}  # noqa: SLF001
    plan, _ = step(s)
    assert planned(plan) == [("a2", 1), ("b1", 7)]  # a2's decode first, then b1 in the budget left


def test_a_tenant_below_its_seat_share_takes_a_seat_from_one_above_it_once():
    s = make_scheduler(budget=64, max_seqs=2)
    s.add(seq("a1", 12, tenant="a", max_tokens=50))
    s.add(seq("a2", 12, tenant="a", max_tokens=50))
    step(s)  # a: 24 tokens served, both seats
    s.add(seq("a3", 4, tenant="a"))
    plan, _ = step(s)
    assert plan.preempted == []  # one tenant never preempts itself
    s.add(seq("b1", 4, tenant="b"))  # lifted to a's 26 while a waits: no credit banked
    assert s.order.counters["b"] == s.order.counters["a"] == 26  # noqa: SLF001
    plan, _ = step(s)  # b holds 0 of its 1 seat, a 2 of its 1: a's latest gives one up
    assert [v.request_id for v in plan.preempted] == ["a2"]
    assert planned(plan) == [("a1", 1), ("b1", 4)]
    for _ in range(3):  # a (1 seat, its share) never takes it back; b never takes a's last
        plan, _ = step(s)
        assert plan.preempted == [] and planned(plan) == [("a1", 1), ("b1", 1)]


@pytest.mark.parametrize("order, expected", [
    ("slo", [("b1", 4), ("a1", 4)]),  # b's counter (0) ranks before a's (8): b first
    ("fifo", [("a1", 8)]),  # the running prefill first, by arrival
])
def test_running_prefill_chunks_take_their_turn_in_the_waiting_order(order, expected):
    s = make_scheduler(order=order, budget=8, max_seqs=3)
    s.add(seq("a1", 40, tenant="a", max_tokens=50))
    plan, _ = step(s)
    assert planned(plan) == [("a1", 8)]
    s.add(seq("b1", 4, tenant="b", start=100))
    plan, _ = step(s)
    assert planned(plan) == expected


def test_a_seat_taken_from_a_prefilling_request_comes_with_its_budget():
    s = make_scheduler(budget=8, max_seqs=2)
    s.add(seq("a1", 4, tenant="a", max_tokens=50))
    s.add(seq("a2", 40, tenant="a", max_tokens=50))
    step(s)
    plan, _ = step(s)
    assert planned(plan) == [("a1", 1), ("a2", 7)]  # a2's prefill takes the budget left
    s.add(seq("b1", 4, tenant="b", start=100))
    plan, _ = step(s)  # no budget and no seat, but b may take a's latest, mid-prefill
    assert [v.request_id for v in plan.preempted] == ["a2"]
    assert planned(plan) == [("a1", 1), ("b1", 4)]


def test_a_tenant_at_its_seat_share_is_never_displaced_whatever_the_counters():
    """Counters decide who is admitted next; taking a running request's seat needs its
    tenant to hold more than its share (two tenants at their shares never trade seats)."""
    s = make_scheduler(budget=64, max_seqs=2)
    s.add(seq("a1", 40, tenant="a", max_tokens=50))
    s.add(seq("b1", 4, tenant="b", max_tokens=50, start=100))
    step(s)  # a: 40 served, b: 4; one seat each (their shares)
    s.add(seq("b2", 4, tenant="b", start=200))  # b's counter far below a's
    for _ in range(3):
        plan, _ = step(s)
        assert plan.preempted == [] and planned(plan) == [("a1", 1), ("b1", 1)]


def test_a_higher_priority_head_displaces_once_and_is_seated_itself():
    """The request that displaces takes the seat it freed: the displaced one (earlier in
    arrival, same deadline) never gets it back within the step."""
    s = make_scheduler(budget=64, max_seqs=1)
    s.add(seq("low", 8, max_tokens=50, deadline=NOW + 600))
    step(s)
    s.add(seq("high", 8, priority=1, deadline=NOW + 600, start=100))
    plan, _ = step(s)
    assert [v.request_id for v in plan.preempted] == ["low"] and planned(plan) == [("high", 8)]


def test_fair_preemption_takes_the_latest_request_of_the_most_served_tenant():
    s = make_scheduler(budget=64, max_seqs=2)
    s.add(seq("a1", 12, tenant="a", max_tokens=50))
    s.add(seq("a2", 12, tenant="a", max_tokens=50))
    step(s)  # a: 24 served, nobody else backlogged
    s.add(seq("b1", 4, tenant="b"))  # nothing else waiting: lifted to the last leaver's 0
    plan, _ = step(s)
    assert [v.request_id for v in plan.preempted] == ["a2"]
    assert planned(plan) == [("a1", 1), ("b1", 4)]


def test_equal_tenants_never_preempt_under_the_fifo_order():
    s = make_scheduler(order="fifo", budget=64, max_seqs=2)
    s.add(seq("a1", 12, tenant="a", max_tokens=50))
    s.add(seq("a2", 12, tenant="a", max_tokens=50))
    step(s)
    s.add(seq("b1", 4, tenant="b"))
    plan, _ = step(s)
    assert plan.preempted == [] and planned(plan) == [("a1", 1), ("a2", 1)]


# ---- the shared rules -------------------------------------------------------------


def test_counters_grow_by_tokens_over_weight_and_lift_to_the_backlogged_minimum():
    c = VirtualTokenCounters()
    c.charge("a", 100, weight=2.0)
    c.charge("b", 30)
    c.lift("new", ["a", "b"])
    assert c.snapshot() == {"a": 50.0, "b": 30.0, "new": 30.0}
    c.lift("a", ["b"])  # never lowered
    assert c["a"] == 50.0
    c.left("b")
    c.lift("idle", [])  # nobody backlogged: the last leaver's counter
    assert c["idle"] == 30.0 and math.isclose(c["missing"], 0.0)


def test_router_block_keys_are_the_allocators_hashes():
    alloc = BlockAllocator(16, 4)
    s = seq("p", 14)
    alloc.allocate_prefix(s)
    alloc.allocate_slots(s, 14)
    s.num_computed_tokens = 14
    alloc.cache_blocks(s)
    keys = leading_block_keys(s.token_ids, 4, None, 64)
    assert keys == [block_key(h) for h in s.block_hashes[:3]]  # 3 full blocks before the last token
    assert set(alloc.cached_keys(10)) == set(keys) and alloc.cached_keys(2) == keys[::-1][:2]
    assert matched_blocks(keys, set(keys[:2])) == 2 and matched_blocks(keys, {keys[1]}) == 0
    assert leading_block_keys(s.token_ids, 4, "adapter-x", 64)[0] != keys[0]  # salted


@pytest.mark.parametrize("adapter_salt", [None, "a1@1024:17+0"])
def test_cache_salted_block_keys_are_the_allocators_hashes(adapter_salt):
    """A request's cache salt (its tenant's cache group) is chained after the adapter's
    identity: the router's keys with the same salts are the allocator's hashes, every
    block differs from the unsalted chain's and from another group's, and an empty cache
    salt is the unsalted chain itself."""
    alloc = BlockAllocator(32, 4)
    s = seq("p", 14)
    s.adapter_salt, s.cache_salt = adapter_salt, "group-a"
    alloc.allocate_prefix(s)
    alloc.allocate_slots(s, 14)
    s.num_computed_tokens = 14
    alloc.cache_blocks(s)
    keys = leading_block_keys(s.token_ids, 4, adapter_salt, 64, "group-a")
    assert keys == [block_key(h) for h in s.block_hashes[:3]]
    assert alloc.cached_keys(10) == keys[::-1]
    unsalted = leading_block_keys(s.token_ids, 4, adapter_salt, 64)
    other = leading_block_keys(s.token_ids, 4, adapter_salt, 64, "group-b")
    assert all(k not in unsalted and k not in other for k in keys)
    assert leading_block_keys(s.token_ids, 4, adapter_salt, 64, "") == unsalted
    # Without a cache salt a block hashes as before cache salts existed (routers and engines
    # of both versions agree on a fleet without keys files while it is upgraded).
    before = {None: "df21e1b3c0fbe7a18fb6c9639ddaf592", "a1@1024:17+0": "ef72b61146252bbef73a9b9b6dfcf588"}
    assert block_hash(b"", [10, 11, 12, 13], adapter_salt, "").hex() == before[adapter_salt]
    assert block_hash(b"", [10, 11, 12, 13], adapter_salt, "group-a").hex() != before[adapter_salt]
    assert block_hash(b"", [10, 11, 12, 13], None, "x") != block_hash(b"", [10, 11, 12, 13], "x", "")
