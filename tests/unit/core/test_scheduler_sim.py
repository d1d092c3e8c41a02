"""The scheduler simulator (scheduler_sim.py) over random combined workloads, and the
multi-tenant cases that used to hang the engine. `make test` replays a fixed set of seeds;
`make fuzz-scheduler` draws many more (OMNIBUS_SIM_SEEDS, OMNIBUS_SIM_FIRST_SEED)."""

from __future__ import annotations

import os
from collections import Counter

from omnibus.common.sampling import SamplingParams
from omnibus.engine.core.sequence import Sequence

from .scheduler_sim import (
    T0, Arrival, InvariantViolation, SimConfig, Simulator, first_token_steps, flood_workload, simulate,
    two_tenant_flood)

SEEDS = int(os.environ.get("OMNIBUS_SIM_SEEDS", "160"))
FIRST_SEED = int(os.environ.get("OMNIBUS_SIM_FIRST_SEED", "0"))


def test_random_combined_workloads_hold_every_invariant():
    failures, worst = {}, 0
    for seed in range(FIRST_SEED, FIRST_SEED + SEEDS):
        cfg = SimConfig.random(seed)
        try:
            result = simulate(cfg)
        except InvariantViolation as e:
            failures[seed] = str(e)
            continue
        assert {f"r{i}" for i in range(cfg.num_requests)} <= set(result.finished)  # continuations too
        # evictions per step: each running request at most once
        assert result.max_preemptions_per_step <= cfg.max_num_seqs
        worst = max(worst, result.max_counter_gap / result.counter_bound)
    assert not failures, f"{len(failures)} of {SEEDS} seeds failed; first: {next(iter(failures.items()))}"
    assert worst <= 1.0


def test_the_fixed_seeds_cover_every_feature():
    """The replayed seeds draw every policy, both orders, overlap, adapters, one seat,
    tiny budgets, preemptions and host tiers: a regression anywhere shows up in `make test`."""
    cfgs = [SimConfig.random(seed) for seed in range(FIRST_SEED, FIRST_SEED + SEEDS)]
    assert {c.policy for c in cfgs} == {"continuous", "dynamic", "static", "none"}
    assert {c.waiting_order for c in cfgs} == {"slo", "fifo"}
    assert {c.overlap for c in cfgs} == {True, False} and {c.prefix_caching for c in cfgs} == {True, False}
    assert any(c.adapters >= 3 for c in cfgs) and any(c.max_num_seqs == 1 for c in cfgs)
    assert any(c.budget == 1 for c in cfgs)
    results = [simulate(c) for c in cfgs[:80]]
    assert sum(r.preemptions > 0 for r in results) >= 5
    assert sum(r.host_hits for r in results) > 0  # prefixes loaded back from a host tier (tiny ones too)
    # KV transfer: reads that landed and that failed, leases that ran out, drains that migrated
    assert sum(r.kv_loads[0] for r in results) >= 5 and sum(r.kv_loads[1] for r in results) >= 2
    assert sum(r.kv_expired for r in results) > 0 and sum(r.migrated for r in results) >= 3
    # early handles (--kv-transfer-overlap): given out, and some dropped mid-prefill
    assert sum(r.kv_early[0] for r in results) >= 5 and sum(r.kv_early[1] for r in results) >= 1


def test_tenants_that_preempt_each_other_on_a_tiny_pool_still_finish():
    """Seed 3955 of `make fuzz-scheduler`: two tenants, 15 blocks of 2 tokens, one token a
    step. While recomputing after a preemption was charged to the tenant's counter, the
    recomputing request passed the other's counter, became the next victim, and the two
    took turns losing their KV with no request ever finishing (liveness: 10 unfinished past
    the bound). A recompute is now free (Sequence.num_charged_tokens): every request ends
    and the counters still keep the VTC bound."""
    cfg = SimConfig.random(3955)
    assert (cfg.num_blocks, cfg.budget, cfg.waiting_order, len(cfg.tenants)) == (15, 1, "slo", 2)
    sim = Simulator(cfg)
    result = sim.run()
    assert {f"r{i}" for i in range(cfg.num_requests)} <= set(result.finished)
    assert result.preemptions > 0 and result.max_counter_gap <= result.counter_bound


def test_the_kv_check_catches_a_prefix_cache_shared_across_cache_groups(monkeypatch):
    """The simulated tenants send the same prompt families from different cache groups
    (scheduler_sim.CACHE_SALTS). Were block hashes blind to the cache salt (vLLM's
    CVE-2025-46570: one tenant's prompt warms another's cache), requests would read blocks
    another group wrote, and the KV check names the first such read."""
    import omnibus.engine.core.block_allocator as allocator

    salted = allocator.block_hash
    monkeypatch.setattr(allocator, "block_hash",
                        lambda parent, tokens, adapter_salt, _: salted(parent, tokens, adapter_salt, ""))
    caught = []
    for seed in range(10):
        try:
            simulate(SimConfig(seed=seed))
        except InvariantViolation as e:
            caught.append(str(e))
    assert len(caught) >= 5 and all(e.startswith("KV: ") for e in caught)  # 9 of 10 when written


def test_a_flooding_tenant_with_client_timeouts_does_not_starve_a_light_one():
    """The reported hang: tenant A sends 48 requests of 100-300 tokens at once, B sends 4
    short ones 100 steps later, everyone with a 600 s client timeout, 2 seats. Before the
    one order, B's head and A's displaced request traded the seat forever inside one
    schedule() (the simulator's counting allocator stopped it). Now B's first tokens come
    within a few steps of its arrival, while A's backlog is still draining."""
    cfg = two_tenant_flood()
    first, done = first_token_steps(cfg, flood_workload(cfg))
    b_first = [first[f"b{i}"] for i in range(4)]
    assert all(100 <= step <= 140 for step in b_first), b_first
    a_left = sum(1 for rid, step in done.items() if rid.startswith("a") and step > max(b_first))
    assert a_left >= 40  # of A's 48


def test_weighted_tenants_backlogged_together_share_tokens_by_weight():
    """Three tenants (weights 1, 2, 1) keep a backlog on 4 seats. While all three are
    backlogged, each one's tokens over its weight stay within the VTC bound of the others'
    (2 x (a request + the batch in flight)), over a stretch several bounds long: a scheduler
    that ignored the weights would give t1 half its due, far past the bound."""
    cfg = SimConfig(seed=7, num_blocks=400, block_size=4, max_num_seqs=4, budget=32, max_model_len=64,
                    tenants=(1.0, 2.0, 1.0), adapters=0, num_requests=0)
    sim = Simulator(cfg)
    prompt_len, max_tokens = 8, 24
    arrivals = []
    for i in range(300):
        tenant = i % 3
        seq = Sequence(f"t{tenant}-{i}", [3 + (i * 7 + k) % 30 for k in range(prompt_len)],
                       SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0),
                       tenant=f"t{tenant}", weight=cfg.tenants[tenant], arrival_time=T0)
        arrivals.append(Arrival(0, seq, None))
    sim.arrivals = arrivals
    served: Counter[str] = Counter()
    schedule = sim.scheduler.schedule

    def counting(now=None):
        plan = schedule(now)
        if sorted(sim.scheduler.lifecycle.waiting.backlogged()) == ["t0", "t1", "t2"]:
            for item in plan.scheduled:
                served[item.seq.tenant] += item.num_tokens
        return plan

    sim.scheduler.schedule = counting  # type: ignore[method-assign]
    result = sim.run()
    assert result.max_counter_gap <= result.counter_bound
    request = prompt_len + max_tokens
    bound = 2 * (request + cfg.max_num_seqs * request) / min(cfg.tenants)
    weighted = {t: served[t] / w for t, w in zip(("t0", "t1", "t2"), cfg.tenants)}
    assert min(weighted.values()) > 4 * bound, served  # the stretch measured is long
    assert max(weighted.values()) - min(weighted.values()) <= bound, served
