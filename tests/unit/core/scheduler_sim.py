"""A scheduler simulator: the real Scheduler, BlockAllocator, waiting queue and batching
policies on a simulated clock, with no model and no torch.

A deterministic fake model (each token a hash of the context and the adapter) and a fake
adapter manager (few slots, loads that take steps, adapters that fail to load) stand in
for the worker. Random workloads mix tenants with weights, priorities, tight and loose
deadlines, adapters, cancels, shared prefixes, tiny KV pools, chunked prefill and
overlapped steps (tokens reported a step late) under all four batching policies.

After every step `Simulator` checks the invariants the scheduler promises and raises
`InvariantViolation` naming the broken one:

- `schedule()` returns within its bound (a counting allocator stops a livelock), and no
  request is seated or evicted twice in one call;
- every displacement is stable: once seated, the request that displaced another precedes
  it in the order and could not be displaced back by it;
- the plan stays within the token budget and the seat cap; planned requests are unique;
- KV integrity: the allocator's own check, adapter slot pins match the running set,
  and every KV slot a request reads holds its own token, written under its own adapter
  and cache group (prefix-cache hits included: tenants t1 and t2 share a cache salt,
  t0 has none, so a block shared across groups is caught);
- no request whose deadline passed is prefilled;
- priority order: no request is seated while an eligible waiting one of higher
  priority stays behind;
- once arrivals stop, every request ends within a bounded number of steps (liveness),
  and every finished output equals the model's output for that prompt alone;
- tenants continuously backlogged together stay within the VTC bound of each other.

With KV transfer (`SimConfig.kv`, a fake connector: `FakeKv`) some requests are prefill
hops (max_tokens 1, `kv_hold`) whose continuations read the hop's held blocks, and in
some runs the engine migrates (a drain) mid-run and every request goes on as a
continuation reading its own held KV; reads land a few steps late or fail (garbage in the
blocks), holders are released by the continuation or by their lease. In half of those
runs prefill hops hand their KV on when seated (early handles): their continuations read
each block once the hop has computed it, while the hop still runs, and fail when the hop
ends first (preempted, cancelled, drained). The KV check above then also proves that a
read's blocks hold the right tokens when used, a failed read is recomputed, and held
blocks are never reused while held.
"""

from __future__ import annotations

import random
import zlib
from dataclasses import dataclass, field

from omnibus.common.sampling import SamplingParams
from omnibus.engine.core.block_allocator import BlockAllocator
from omnibus.engine.core.policies import make_policy
from omnibus.engine.core.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from omnibus.engine.core.sequence import RequestOutput, SamplerOutput, Sequence, SequenceStatus
from omnibus.engine.kv_transfer.handle import KvHandle
from omnibus.engine.spec import SpecConfig, Speculator
from omnibus.engine.spec.proposer import NgramProposer

EOS = 2
VOCAB = 40
T0 = 1000.0  # the simulated clock's start (monotonic seconds)
CACHE_SALTS = ("", "g1", "g1")  # tenant i's prefix-cache salt (the router's cache group): t0 unsalted


class InvariantViolation(AssertionError):
    """A promise of the scheduler did not hold; the message says which and where."""


class Livelock(InvariantViolation):
    """One schedule() call did more work than its bound allows (it would not return)."""


# ---- the fakes ----------------------------------------------------------------------


class CountingAllocator(BlockAllocator):
    """A BlockAllocator that raises Livelock when one schedule() frees more sequences'
    blocks than `limit` (each request can leave the running set at most once per call)."""

    limit: int | None = None
    frees = 0

    def free(self, seq: Sequence) -> None:
        self.frees += 1
        if self.limit is not None and self.frees > self.limit:
            raise Livelock(f"one schedule() freed blocks {self.frees} times (bound {self.limit})")
        super().free(seq)


@dataclass
class _Gate:
    slot: int | None = None
    error: str | None = None
    salt: str | None = None


class FakeAdapters:
    """The LoraManager verbs the scheduler calls (gate, release) over `slots` device slots:
    an adapter becomes ready `load_steps` steps after it is first wanted; a failing one
    ends its requests; a slot is reused (LRU) only when no running request pins it."""

    def __init__(self, slots: int, load_steps: int, failing: frozenset[str]) -> None:
        self.slots: list[str | None] = [None] * slots
        self.pins = [0] * slots
        self.last_used = [0] * slots
        self.load_steps = load_steps
        self.failing = failing
        self.first_wanted: dict[str, int] = {}
        self.step = 0
        self.waited: set[str] = set()  # adapters whose gate said "wait" during this step

    def gate(self, name: str) -> _Gate:
        if name in self.failing:
            return _Gate(error=f"adapter {name!r} failed to load")
        if self.step - self.first_wanted.setdefault(name, self.step) < self.load_steps:
            self.waited.add(name)
            return _Gate()
        slot = self.slots.index(name) if name in self.slots else None
        if slot is None:
            free = [i for i, p in enumerate(self.pins) if p == 0]
            if not free:
                self.waited.add(name)
                return _Gate()
            slot = min(free, key=lambda i: self.last_used[i])
            self.slots[slot] = name
        self.pins[slot] += 1
        self.last_used[slot] = self.step
        return _Gate(slot=slot, salt=f"salt-{name}")

    def release(self, name: str) -> None:
        slot = self.slots.index(name)
        if self.pins[slot] <= 0:
            raise InvariantViolation(f"adapter {name!r} released more often than pinned")
        self.pins[slot] -= 1


def model_token(context: list[int], salt: str | None, eos_ok: bool) -> int:
    """The fake model's greedy pick: a function of the whole context and the adapter that
    often repeats what came 4 tokens before (so n-gram guesses are sometimes right)."""
    h = zlib.crc32(repr((salt, context)).encode())
    if eos_ok and h % 11 == 0:
        return EOS
    if len(context) >= 4 and h % 3:
        return context[-4]
    return 3 + h % (VOCAB - 3)


def solo_output(prompt: list[int], salt: str | None, max_tokens: int, ignore_eos: bool) -> list[int]:
    """What the request generates alone."""
    ctx, out = list(prompt), []
    while len(out) < max_tokens:
        t = model_token(ctx, salt, not ignore_eos)
        ctx.append(t)
        out.append(t)
        if t == EOS and not ignore_eos:
            break
    return out


# ---- the workload -------------------------------------------------------------------


@dataclass(frozen=True)
class SimConfig:
    seed: int
    policy: str = "continuous"  # continuous | dynamic | static | none
    waiting_order: str = "slo"
    num_blocks: int = 24
    block_size: int = 4
    max_num_seqs: int = 3
    budget: int = 16  # max_num_batched_tokens
    max_model_len: int = 64
    prefix_caching: bool = True
    overlap: bool = False
    tenants: tuple[float, ...] = (1.0, 2.0, 1.0)  # weights
    adapters: int = 2  # adapter names a0..; 0: a base-model engine
    adapter_slots: int = 1
    adapter_load_steps: int = 2
    num_requests: int = 40
    arrival_steps: int = 60  # arrivals spread over these steps (a flood at step 0 too)
    step_seconds: float = 0.01  # simulated time of one step
    speculative: bool = False  # n-gram speculation (engine/omnibus/engine/spec)
    host_blocks: int = 0  # the prefix cache's host tier (--kv-offload-bytes), in blocks
    kv: bool = False  # KV transfer: prefill hops and their continuations (FakeKv)
    migrate_step: int | None = None  # with kv: the step at which the engine migrates (a drain)
    kv_early: bool = False  # with kv: prefill hops hand their KV on when seated (FakeKv)

    @staticmethod
    def random(seed: int) -> "SimConfig":
        r = random.Random(seed)
        block_size = r.choice([2, 4, 8])
        max_len = r.choice([24, 48, 64])
        return SimConfig(
            seed=seed,
            policy=r.choice(["continuous", "continuous", "continuous", "dynamic", "static", "none"]),
            waiting_order=r.choice(["slo", "slo", "fifo"]),
            num_blocks=r.randint(max_len // block_size + 2, max_len // block_size + 20),
            block_size=block_size,
            max_num_seqs=r.randint(1, 5),
            budget=r.choice([1, 3, 8, 16, 32]),
            max_model_len=max_len,
            prefix_caching=r.random() < 0.8,
            overlap=r.random() < 0.4,
            tenants=tuple(r.choice([1.0, 1.0, 2.0, 3.0]) for _ in range(r.randint(1, 3))),
            adapters=r.choice([0, 0, 1, 3]),
            adapter_slots=r.randint(1, 2),
            adapter_load_steps=r.randint(0, 3),
            num_requests=r.randint(10, 60),
            arrival_steps=r.randint(1, 80),
            speculative=r.random() < 0.35,
            host_blocks=r.choice([0, 0, 3, 16]),
            kv=(kv := r.random() < 0.35),
            migrate_step=r.randint(2, 40) if kv and r.random() < 0.4 else None,
            kv_early=kv and r.random() < 0.5,  # (the last draw: the fields above stay each seed's)
        )


@dataclass
class Arrival:
    step: int
    seq: Sequence
    cancel_after: int | None  # abort once it has this many output tokens (or waited this many steps)
    expected: list[int] = field(default_factory=list)


def make_workload(cfg: SimConfig, rng: random.Random) -> list[Arrival]:
    """Tenant 0 floods at step 0 with long outputs and loose (client-timeout) deadlines;
    the rest arrive over `arrival_steps` with every mix of features."""
    families = [[rng.randrange(3, VOCAB) for _ in range(rng.randint(4, 16))] for _ in range(3)]
    adapters = [f"a{i}" for i in range(cfg.adapters)]
    arrivals = []
    for i in range(cfg.num_requests):
        flood = i < cfg.num_requests // 3
        tenant = 0 if flood else rng.randrange(len(cfg.tenants))
        step = 0 if flood else rng.randrange(cfg.arrival_steps)
        t = T0 + step * cfg.step_seconds
        max_tokens = rng.randint(1, 20 if flood else 12)
        room = cfg.max_model_len - max_tokens
        prompt = (rng.choice(families) if rng.random() < 0.5 else [])[:room - 1]
        prompt = prompt + [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, max(1, min(20, room - len(prompt)))))]
        prompt = prompt[:room]
        kind = rng.random()
        deadline = (t + 600.0 if flood or kind < 0.3 else  # a client timeout, far away
                    t + rng.uniform(0.5, 30) * cfg.step_seconds if kind < 0.5 else  # tight
                    None)
        adapter = rng.choice(adapters) if adapters and rng.random() < 0.5 else None
        ignore_eos = flood or rng.random() < 0.5
        hop = cfg.kv and not flood and rng.random() < 0.3  # a prefill for a decode engine
        if hop:
            max_tokens, ignore_eos = 1, True
        seq = Sequence(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos,
                                                       temperature=0.0), kv_hold=hop,
                       priority=5 if rng.random() < 0.15 and not flood else 0, adapter=adapter,
                       adapter_salt=f"salt-{adapter}" if adapter else None,
                       cache_salt=CACHE_SALTS[tenant % len(CACHE_SALTS)], tenant=f"t{tenant}",
                       weight=cfg.tenants[tenant], deadline=deadline, arrival_time=t)
        cancel = rng.randint(0, 6) if rng.random() < 0.12 else None
        arrivals.append(Arrival(step, seq, cancel))
    arrivals.sort(key=lambda a: (a.step, a.seq.arrival_index))
    return arrivals


# ---- the run ------------------------------------------------------------------------


@dataclass
class SimResult:
    steps: int
    finished: dict[str, RequestOutput]
    preemptions: int
    max_preemptions_per_step: int
    max_counter_gap: float  # the largest gap seen between tenants backlogged together
    counter_bound: float  # the VTC bound it was checked against
    host_hits: int = 0  # prefix blocks loaded back from the host tier
    kv_loads: tuple[int, int] = (0, 0)  # KV reads that landed, and that failed
    kv_expired: int = 0  # holds whose lease ran out
    migrated: int = 0  # requests a migration continued with their KV
    kv_early: tuple[int, int] = (0, 0)  # early handles given out, and those dropped mid-prefill


@dataclass
class _SimLoad:
    """A read FakeKv runs: into `seq`'s blocks from `first` on, landing `lands_at` (set when
    launched) unless it fails (`lands` False: one in seven); an early handle's read copies
    blocks as they become final (`copied` so far, the last at step `moved`)."""

    seq: Sequence
    first: int
    src: KvHandle
    lands: bool
    copied: int
    moved: int
    lands_at: int | None = None


class FakeKv:
    """The KV connector's scheduler side (kv_transfer/connector.py) over the simulator's
    fake KV. A handle names blocks this engine holds; a read begins when the engine
    launches it (after the step's host-tier copies, which the simulator makes when it
    reports that step: so no read lands before a launch's copies, 2-4 steps later), copying
    the holder's blocks if the hold is still there (else, or in one read of seven, it fails
    and leaves garbage in the blocks), as the real lease check does.

    With early handles (`SimConfig.kv_early`, --kv-transfer-overlap) a prefill hop's handle
    goes out when it is seated: a read of it copies each block once the holder's KV of all
    its tokens is there (the simulator writes KV as steps report, as the real forward
    advances the progress words), fails when the hold ends first (the holder aborted,
    preempted or drained: `drop`) or nothing moved for STALL_STEPS, and checks the hold
    again once every block is copied."""

    HOLD_STEPS = 12  # the lease, in steps
    STALL_STEPS = 12  # an early handle's reader gives up after this many steps of no progress

    def __init__(self, sim: Simulator, early: bool = False) -> None:
        self.sim = sim
        self.overlaps = early
        self.held: dict[str, tuple[list[int], int, KvHandle]] = {}  # rid -> blocks, expiry step, handle
        self.live: dict[str, Sequence] = {}  # early holds whose request still runs: rid -> it
        self.loads: list[_SimLoad] = []
        self.landed = self.failed = self.expired_holds = self.early = self.dropped = 0

    def hold(self, seq: Sequence) -> KvHandle | None:
        if seq.request_id in self.live:  # an early hold's request ends: its blocks become the hold's
            self._settle(seq)
            return None
        n = min(seq.num_computed_tokens, seq.num_tokens - 1)
        if n <= 0 or seq.request_id in self.held:
            return None
        nb = -(-n // self.sim.cfg.block_size)
        blocks, seq.block_table = seq.block_table[:nb], seq.block_table[nb:]
        seq.num_registered_blocks = 0
        handle = KvHandle("sim", seq.request_id, n, tuple(blocks), (0, 0), 1, "sim", b"", 0, self.sim.step)
        self.held[seq.request_id] = (blocks, self.sim.step + self.HOLD_STEPS, handle)
        return handle

    def hold_early(self, seq: Sequence) -> KvHandle | None:
        n = seq.num_prompt_tokens - 1
        nb = -(-n // self.sim.cfg.block_size)
        if (not self.overlaps or n <= 0 or seq.num_output_tokens or len(seq.block_table) < nb
                or seq.request_id in self.held):
            return None
        handle = KvHandle("sim", seq.request_id, n, tuple(seq.block_table[:nb]), (0, 0), 1, "sim", b"", 0,
                          self.sim.step, progress_addr=1)
        self.held[seq.request_id] = (list(handle.blocks), 1 << 62, handle)  # no lease while it runs
        self.live[seq.request_id] = seq
        self.early += 1
        return handle

    def _settle(self, seq: Sequence) -> None:
        blocks, _, handle = self.held[seq.request_id]
        if self.final(seq, handle) < handle.num_tokens:  # ended mid-prefill
            self.drop(seq)
            return
        del self.live[seq.request_id]
        assert seq.block_table[:len(blocks)] == blocks, "an early hold's blocks moved under it"
        seq.block_table, seq.num_registered_blocks = seq.block_table[len(blocks):], 0
        self.held[seq.request_id] = (blocks, self.sim.step + self.HOLD_STEPS, handle)

    def drop(self, seq: Sequence) -> None:
        if self.live.pop(seq.request_id, None) is not None:
            del self.held[seq.request_id]
            self.dropped += 1

    def final(self, holder: Sequence, handle: KvHandle) -> int:
        """The holder's leading tokens of `handle` whose KV is in its blocks (its progress)."""
        bs, kv = self.sim.cfg.block_size, self.sim.kv
        for p in range(handle.num_tokens):
            if kv.get((handle.blocks[p // bs], p % bs)) != (holder.adapter_salt, holder.cache_salt,
                                                             holder.token_ids[p]):
                return p
        return handle.num_tokens

    def release(self, request_id: str) -> list[int] | None:
        if request_id in self.live:  # its request's own blocks: aborting it drops the hold
            return None
        held = self.held.pop(request_id, None)
        return None if held is None else held[0]

    def expired(self, now: float) -> list[list[int]]:
        gone = [rid for rid, (_, expiry, _) in self.held.items() if expiry <= self.sim.step]
        self.expired_holds += len(gone)
        return [self.held.pop(rid)[0] for rid in gone]

    def held_tables(self):
        return (blocks for rid, (blocks, _, _) in self.held.items() if rid not in self.live)

    def start_load(self, seq: Sequence, first_block: int) -> None:
        assert seq.kv_source is not None and seq.status is SequenceStatus.LOADING
        self.loads.append(_SimLoad(seq, first_block, seq.kv_source, self.sim.rng.random() < 6 / 7, first_block,
                                   self.sim.step))

    @property
    def queued(self) -> bool:
        return any(load.lands_at is None for load in self.loads)

    def launch_reads(self) -> None:
        for load in self.loads:
            if load.lands_at is None:
                load.lands_at = self.sim.step + self.sim.rng.randint(2, 4)

    def _leased(self, src: KvHandle) -> bool:
        held = self.held.get(src.request_id)
        return held is not None and held[2] is src

    def _copy(self, seq: Sequence, src: KvHandle, blocks: range, ok: bool = True) -> None:
        bs, kv = self.sim.cfg.block_size, self.sim.kv
        for i in blocks:  # a read writes whole blocks, landed or not
            for o in range(bs):
                kv[(seq.block_table[i], o)] = kv.get((src.blocks[i], o)) if ok else ("garbage", "", -2)

    def _follow(self, load: _SimLoad) -> bool | None:
        """An early handle's read: copies the blocks now final; True when all are and the
        hold is still there, False when it failed, None while it waits."""
        src, holder = load.src, self.live.get(load.src.request_id)
        if not self._leased(src):
            return False
        final = src.num_tokens if holder is None else self.final(holder, src)
        bs, total = self.sim.cfg.block_size, len(src.blocks)
        ready = total if final >= src.num_tokens else max(load.first, min(total, final // bs))
        if ready > load.copied:
            self._copy(load.seq, src, range(load.copied, ready))
            load.copied, load.moved = ready, self.sim.step
        if load.copied == total:
            return self._leased(src)
        return False if self.sim.step - load.moved > self.STALL_STEPS else None

    def finished(self) -> list[tuple[Sequence, int]]:
        done = []
        for load in [x for x in self.loads if x.lands_at is not None and x.lands_at <= self.sim.step]:
            seq, src, ok = load.seq, load.src, load.lands
            if src.progress_addr:
                followed = self._follow(load)
                if followed is None:
                    continue  # waits for the holder's progress
                ok = ok and followed
            else:
                ok = ok and self._leased(src)
                if ok:
                    self._copy(seq, src, range(load.first, len(src.blocks)))
            if not ok:
                self._copy(seq, src, range(load.first, len(src.blocks)), ok=False)
            self.loads.remove(load)
            self.landed += ok
            self.failed += not ok
            done.append((seq, src.num_tokens if ok else 0))
        return done


class Simulator:
    def __init__(self, cfg: SimConfig) -> None:
        self.cfg = cfg
        self.rng = random.Random(cfg.seed)
        self.allocator = CountingAllocator(cfg.num_blocks, cfg.block_size, cfg.prefix_caching,
                                           host_blocks=cfg.host_blocks)
        failing = frozenset({"a2"}) if cfg.adapters >= 3 else frozenset()
        self.adapters = FakeAdapters(cfg.adapter_slots, cfg.adapter_load_steps, failing) if cfg.adapters else None
        policy = make_policy(cfg.policy, max_batch_size=cfg.max_num_seqs, window_ms=30.0)
        speculator = Speculator(SpecConfig("ngram", num_tokens=3, max_batch=4), NgramProposer(3, 1)) \
            if cfg.speculative else None
        self.scheduler = Scheduler(
            SchedulerConfig(cfg.max_num_seqs, cfg.budget, cfg.max_model_len, cfg.waiting_order),
            self.allocator, policy, (EOS,), self.adapters, speculator,
            FakeKv(self, cfg.kv_early) if cfg.kv else None)  # type: ignore[arg-type]
        self.arrivals = make_workload(cfg, self.rng)
        self.pending: list[Arrival] = []
        self.extra_work = 0  # tokens of continuations added while running (the liveness bound grows)
        self.holders: dict[str, str] = {}  # continuation id -> the id holding its source KV
        self.migrated = 0
        self._watch_displacements()
        # (block, offset) -> (adapter salt, cache salt, token): whose KV the slot holds
        self.kv: dict[tuple[int, int], tuple[str | None, str, int]] = {}
        self.host_kv: dict[tuple[int, int], tuple[str | None, str, int] | None] = {}  # (slot, offset) -> the same
        self.tables: dict[int, list[list[int]]] = {}  # id(plan) -> its items' block tables at launch
        self.finished: dict[str, RequestOutput] = {}
        self.outputs: dict[str, list[int]] = {}
        self.cancels: dict[str, Arrival] = {}
        self.waited_steps: dict[str, int] = {}
        self.step = 0
        self.now = T0
        # fairness: counters when each pair of tenants became backlogged together
        self.together: dict[tuple[str, str], tuple[float, float]] = {}
        self.max_gap = 0.0
        weights = min(cfg.tenants)
        # VTC (Sheng et al., OSDI 2024, Thm 4.3): |dW_f - dW_g| <= 2 U, U the most one
        # admission can charge (a whole request: max_model_len tokens, recomputed once after
        # a preemption) plus what the batch in flight holds (its KV, at most every seat's
        # whole context) - per unit of weight.
        in_flight = min(cfg.num_blocks * cfg.block_size, cfg.max_num_seqs * cfg.max_model_len)
        self.counter_bound = 2 * (2 * cfg.max_model_len + in_flight) / weights
        self.max_preempt = 0

    # -- driving --

    def run(self) -> SimResult:
        pending = self.pending = list(self.arrivals)
        last_arrival = max(a.step for a in self.arrivals)
        # Liveness bound once arrivals stop: every remaining token computed one per step,
        # twice over (recompute after preemption), plus adapter loads and batch windows.
        work = sum(a.seq.num_prompt_tokens + a.seq.params.max_tokens for a in self.arrivals)
        limit = last_arrival + 2 * work + 10 * (self.cfg.adapter_load_steps + 1) + 50
        in_flight: SchedulerOutput | None = None
        kv = self.scheduler.lifecycle.kv  # held KV keeps the engine stepping until its lease ends
        while pending or self.scheduler.has_unfinished() or in_flight is not None or (kv and kv.held):
            if self.step > limit + 2 * self.extra_work:
                raise InvariantViolation(
                    f"liveness: {len(self.scheduler.requests)} requests unfinished {self.step - last_arrival} "
                    f"steps after the last arrival (bound {limit - last_arrival})")
            while pending and pending[0].step <= self.step:
                self._arrive(pending.pop(0))
            if not pending:
                self.scheduler.policy.close_arrivals()
            self._cancel()
            if self.step == self.cfg.migrate_step:  # a drain: the step in flight reports first
                if in_flight is not None:
                    self._report(in_flight)
                    in_flight = None
                self._migrate()
            plan = self._schedule()
            if in_flight is not None:
                self._report(in_flight)
            # overlapped: the plan runs while the next is made, unless it speculates (the
            # next plan needs to know how many guesses were kept), as Engine.step does
            if self.cfg.overlap and not plan.is_empty and not any(item.guess for item in plan.scheduled):
                in_flight = plan
            else:
                in_flight = None
                self._report(plan)
            self._report_aborted()
            self._check_after_step()
            self.step += 1
            self.now = T0 + self.step * self.cfg.step_seconds
        self._check_end()
        kv = self.scheduler.lifecycle.kv
        return SimResult(self.step, self.finished, self.scheduler.num_preemptions, self.max_preempt,
                         self.max_gap, self.counter_bound, self.allocator.num_host_hits,
                         (kv.landed, kv.failed) if kv else (0, 0), kv.expired_holds if kv else 0, self.migrated,
                         (kv.early, kv.dropped) if kv else (0, 0))

    def _migrate(self) -> None:
        """Engine.migrate: every request ends; each goes on as a continuation (prompt +
        outputs, the rest of its tokens) reading its KV where it is held."""
        alive = set(self.scheduler.requests)
        self.scheduler.migrate()
        for out in self.scheduler.take_aborted():
            self._record(out)
            if out.request_id in alive and out.request_id not in self.cancels:
                self.migrated += out.kv_handle is not None
                self._continue(out)

    def _continue(self, out: RequestOutput) -> None:
        """A continuation of `out`'s request on "another engine" (this one), reading the
        KV its handle names, if any; held KV is released once the continuation reports."""
        a = next(x for x in self.arrivals if x.seq.request_id == out.request_id)
        orig, sent = a.seq, self.outputs[out.request_id]
        left = orig.params.max_tokens - len(sent) if not orig.kv_hold else self.rng.randint(1, 8)
        prompt = orig.prompt_token_ids + sent
        left = min(left, self.cfg.max_model_len - len(prompt))
        if left <= 0 or (sent and sent[-1] == EOS and not orig.params.ignore_eos):
            if out.kv_handle is not None:
                self.scheduler.abort(out.request_id)  # nobody reads it
            return
        rid = f"{out.request_id}~"
        seq = Sequence(rid, prompt, SamplingParams(max_tokens=left, ignore_eos=orig.params.ignore_eos, temperature=0.0),
                       priority=orig.priority, adapter=orig.adapter, adapter_salt=orig.adapter_salt,
                       cache_salt=orig.cache_salt, tenant=orig.tenant, weight=orig.weight, deadline=orig.deadline,
                       arrival_time=self.now, kv_source=out.kv_handle)
        if out.kv_handle is not None and self.rng.random() < 0.85:  # else its lease ends it
            self.holders[rid] = out.request_id
        step = self.step + self.rng.randint(0, 2)
        cont = Arrival(step, seq, None)
        self.arrivals.append(cont)
        self.pending.append(cont)
        self.pending.sort(key=lambda x: (x.step, x.seq.arrival_index))
        self.extra_work += len(prompt) + left

    def _arrive(self, a: Arrival) -> None:
        s = a.seq
        a.expected = solo_output(s.prompt_token_ids, s.adapter_salt, min(s.params.max_tokens, self.cfg.max_model_len
                                                                        - s.num_prompt_tokens), s.params.ignore_eos)
        self.scheduler.add(s)
        self.outputs[s.request_id] = []
        if a.cancel_after is not None:
            self.cancels[s.request_id] = a

    def _cancel(self) -> None:
        for rid, a in list(self.cancels.items()):
            if rid not in self.scheduler.requests:
                del self.cancels[rid]
                continue
            waited = self.waited_steps[rid] = self.waited_steps.get(rid, 0) + 1
            if len(self.outputs[rid]) >= a.cancel_after or waited >= 4 * (a.cancel_after + 1):
                self.scheduler.abort(rid)
                del self.cancels[rid]

    def _schedule(self) -> SchedulerOutput:
        s = self.scheduler
        if self.adapters is not None:
            self.adapters.step, self.adapters.waited = self.step, set()
        before = {seq: seq.status for seq in s.requests.values()}
        self.allocator.frees, self.allocator.limit = 0, 2 * len(before) + 2
        try:
            plan = s.schedule(self.now)
            kv = s.lifecycle.kv
            # the engine makes the queued copies when it launches a step, or before it begins
            # reads from other engines (Engine.step); here they are made when it reports
            if not plan.is_empty or (kv is not None and kv.queued):
                plan.kv_copies = self.allocator.take_copies()
            if kv is not None:
                kv.launch_reads()
        finally:
            self.allocator.limit = None
        self._check_plan(plan, before)
        # the device writes and reads the KV through the block tables of launch time
        self.tables[id(plan)] = [list(item.seq.block_table) for item in plan.scheduled]
        return plan

    def _report(self, plan: SchedulerOutput) -> None:
        rows = []
        for item in plan.scheduled:
            if not item.samples:
                continue
            seq = item.seq
            for j in range(len(item.guess) + 1):  # a speculating decode: a pick after each guess
                rows.append(model_token(seq.token_ids + item.guess[:j], seq.adapter_salt, not seq.params.ignore_eos))
        self._check_kv(plan)
        for out in self.scheduler.update(plan, SamplerOutput(rows, [None] * len(rows))):
            self._record(out)

    def _report_aborted(self) -> None:
        for out in self.scheduler.take_aborted():
            self._record(out)

    def _record(self, out: RequestOutput) -> None:
        rid = out.request_id
        if rid in self.finished:
            raise InvariantViolation(f"{rid} reported after it finished")
        self.outputs[rid] += out.new_token_ids
        if rid in self.holders and (out.new_token_ids or out.finished):  # the reader's first output
            self.scheduler.abort(self.holders.pop(rid))
        if out.finished:
            self.finished[rid] = out
            if out.kv_handle is not None and out.finish_reason == "length":  # a prefill hop
                self._continue(out)

    # -- invariants --

    def _watch_displacements(self) -> None:
        """Checks each displacement right after the displacing request takes its seat."""
        life, order = self.scheduler.lifecycle, self.scheduler.order
        may_displace, seat = order.may_displace, life.seat
        displaced: dict[int, list[Sequence]] = {}  # id(displacing) -> displaced this step

        def watched_may_displace(seq: Sequence, running: Sequence, backlogged) -> bool:
            ok = may_displace(seq, running, backlogged)
            if ok:
                displaced.setdefault(id(seq), []).append(running)
            return ok

        def watched_seat(seq: Sequence, *args) -> None:
            seat(seq, *args)
            for victim in displaced.pop(id(seq), []):
                if victim.status is not SequenceStatus.WAITING:
                    continue  # not the request it displaced after all (only asked)
                if not order.key(seq) < order.key(victim) or may_displace(victim, seq, life.waiting.backlogged()):
                    raise InvariantViolation(f"unstable: {victim.request_id}, displaced by {seq.request_id}, "
                                             f"precedes it or could take its seat back, step {self.step} ({self.cfg})")
            displaced.clear()

        order.may_displace = watched_may_displace  # type: ignore[method-assign]
        life.seat = watched_seat  # type: ignore[method-assign]

    def _check_plan(self, plan: SchedulerOutput, before: dict[Sequence, SequenceStatus]) -> None:
        s, cfg, step = self.scheduler, self.cfg, self.step
        where = f"step {step} ({cfg})"
        evicted = plan.preempted
        if len(set(map(id, evicted))) != len(evicted):
            raise InvariantViolation(f"a request was evicted twice in one schedule(), {where}")
        self.max_preempt = max(self.max_preempt, len(evicted))
        running = set(map(id, s.running))
        for seq in evicted:
            if id(seq) in running:
                raise InvariantViolation(f"{seq.request_id} was evicted and seated again in one schedule(), {where}")
            if before.get(seq) is not SequenceStatus.RUNNING:
                raise InvariantViolation(f"{seq.request_id} was seated and evicted in one schedule(), {where}")
        ids = [id(item.seq) for item in plan.scheduled]
        if len(set(ids)) != len(ids):
            raise InvariantViolation(f"a request was planned twice in one step, {where}")
        if plan.num_batched_tokens > cfg.budget:
            raise InvariantViolation(f"{plan.num_batched_tokens} tokens planned, budget {cfg.budget}, {where}")
        if len(s.running) > cfg.max_num_seqs:
            raise InvariantViolation(f"{len(s.running)} running, cap {cfg.max_num_seqs}, {where}")
        for item in plan.scheduled:
            seq = item.seq
            if (seq.deadline is not None and self.now >= seq.deadline
                    and seq.num_output_tokens == 0 and seq.num_pending == item.samples):
                raise InvariantViolation(f"{seq.request_id} prefilled after its deadline, {where}")
        seated = [seq for seq in s.running if before.get(seq) is SequenceStatus.WAITING]
        if seated and not s.policy.forms_batches:
            waited = self.adapters.waited if self.adapters is not None else set()
            low = min(seq.priority for seq in seated)
            for seq in s.requests.values():
                if (seq.status is SequenceStatus.WAITING and seq.priority > low and not seq.num_pending
                        and before.get(seq) is SequenceStatus.WAITING and seq.adapter not in waited):
                    raise InvariantViolation(
                        f"priority: {seq.request_id} (priority {seq.priority}) left waiting while a "
                        f"priority-{low} request was seated, {where}")

    def _check_kv(self, plan: SchedulerOutput) -> None:
        """Runs the step on the fake KV, in launch order: writes each planned chunk's tokens
        through its block table of launch time and checks that every slot the chunk reads
        (its whole context) holds this request's token."""
        bs = self.cfg.block_size
        for copy in plan.kv_copies:  # the host tier's copies, before the step's forward
            assert 0 < copy.block < self.cfg.num_blocks and 0 <= copy.slot < self.cfg.host_blocks, copy
            for o in range(bs):
                if copy.save:
                    self.host_kv[(copy.slot, o)] = self.kv.get((copy.block, o))
                else:
                    self.kv[(copy.block, o)] = self.host_kv.get((copy.slot, o))  # type: ignore[assignment]
        for item, table in zip(plan.scheduled, self.tables.pop(id(plan))):
            seq = item.seq
            inputs = seq.token_ids + item.guess if item.guess else seq.token_ids
            for p in range(item.start, item.start + item.num_tokens):  # (-1: a token that never came)
                self.kv[(table[p // bs], p % bs)] = (
                    seq.adapter_salt, seq.cache_salt, inputs[p] if p < len(inputs) else -1)
            if seq.status is SequenceStatus.FINISHED and seq.finish_reason == "abort":
                continue  # aborted after launch: the step still ran, but nothing reads it
            for p in range(item.start + item.num_tokens):
                got = self.kv.get((table[p // bs], p % bs))
                want = (seq.adapter_salt, seq.cache_salt, inputs[p])
                if got != want:
                    raise InvariantViolation(
                        f"KV: {seq.request_id} position {p} reads {got}, expected {want}, step "
                        f"{self.step} ({self.cfg})")

    def _check_after_step(self) -> None:
        s = self.scheduler
        try:
            s.allocator.check_integrity(s.block_tables())
        except RuntimeError as e:
            raise InvariantViolation(f"{e}, step {self.step} ({self.cfg})") from None
        if self.adapters is not None:
            pinned = sum(1 for seq in s.running + s.lifecycle.loading if seq.lora_slot is not None)
            if pinned != sum(self.adapters.pins):
                raise InvariantViolation(f"adapter pins {sum(self.adapters.pins)} but {pinned} running "
                                         f"requests hold slots, step {self.step}")
        self._check_fairness()

    def _check_fairness(self) -> None:
        """VTC bound for every pair of equal-priority tenants backlogged together since
        they last both became so (deadlines and priorities reorder, so only requests with
        neither count as backlog)."""
        s = self.scheduler
        if s.config.waiting_order != "slo" or s.policy.forms_batches:
            return
        counters = s.order.counters
        backlog = {seq.tenant for seq in s.requests.values()
                   if seq.status is SequenceStatus.WAITING and seq.priority == 0 and seq.adapter is None
                   and seq.deadline is None}
        tenants = sorted(backlog)
        for pair in list(self.together):
            if not set(pair) <= backlog:
                del self.together[pair]
        for i, f in enumerate(tenants):
            for g in tenants[i + 1:]:
                start = self.together.setdefault((f, g), (counters[f], counters[g]))
                gap = abs((counters[f] - start[0]) - (counters[g] - start[1]))
                self.max_gap = max(self.max_gap, gap)
                if gap > self.counter_bound:
                    raise InvariantViolation(
                        f"fairness: tenants {f} and {g}, backlogged together, were served "
                        f"{gap:.0f} weighted tokens apart (bound {self.counter_bound:.0f}), step {self.step} "
                        f"({self.cfg})")

    def _check_end(self) -> None:
        counts = self.allocator.check_integrity([])
        if counts.referenced:
            raise InvariantViolation(f"{counts.referenced} KV blocks still referenced at the end ({self.cfg})")
        if self.adapters is not None and any(self.adapters.pins):
            raise InvariantViolation(f"adapter slots still pinned at the end ({self.cfg})")
        for a in self.arrivals:
            rid = a.seq.request_id
            out = self.finished.get(rid)
            if out is None:
                raise InvariantViolation(f"{rid} never finished ({self.cfg})")
            got = self.outputs[rid]
            early = out.kv_handle is not None and out.kv_handle.progress_addr  # its continuation samples it
            if out.finish_reason in ("stop", "length"):
                if got != ([] if early else a.expected):
                    raise InvariantViolation(f"{rid} generated {got}, alone it generates {a.expected} ({self.cfg})")
            elif got != a.expected[:len(got)]:
                raise InvariantViolation(f"{rid} ({out.finish_reason}) generated {got}, not a prefix of "
                                         f"{a.expected} ({self.cfg})")


def simulate(cfg: SimConfig) -> SimResult:
    return Simulator(cfg).run()


def two_tenant_flood(seed: int = 0, order: str = "slo") -> SimConfig:
    """The issue's reproduction, scaled down: tenant A floods 48 long requests with a 600 s
    client timeout, tenant B sends 4 short ones a moment later, 2 seats."""
    return SimConfig(seed=seed, waiting_order=order, num_blocks=200, block_size=4, max_num_seqs=2,
                     budget=64, max_model_len=400, tenants=(1.0, 1.0), adapters=0, num_requests=0)


def flood_workload(cfg: SimConfig) -> list[Arrival]:
    rng = random.Random(cfg.seed)
    arrivals = []
    for i in range(48):
        seq = Sequence(f"a{i}", [rng.randrange(3, VOCAB) for _ in range(8)],
                       SamplingParams(max_tokens=rng.randint(100, 300), ignore_eos=True, temperature=0.0),
                       tenant="A", deadline=T0 + 600.0, arrival_time=T0)
        arrivals.append(Arrival(0, seq, None))
    for i in range(4):
        t = T0 + 100 * cfg.step_seconds
        seq = Sequence(f"b{i}", [rng.randrange(3, VOCAB) for _ in range(8)],
                       SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.0),
                       tenant="B", deadline=t + 600.0, arrival_time=t)
        arrivals.append(Arrival(100, seq, None))
    return arrivals


def first_token_steps(cfg: SimConfig, arrivals: list[Arrival]) -> tuple[dict[str, int], dict[str, int]]:
    """Runs `arrivals` (the invariants checked every step) and returns the step at which each
    request's first output token was reported, and the step at which each finished."""
    sim = Simulator(cfg)
    sim.arrivals = arrivals
    first: dict[str, int] = {}
    done: dict[str, int] = {}
    record = sim._record

    def spy(out: RequestOutput) -> None:
        if out.new_token_ids and out.request_id not in first:
            first[out.request_id] = sim.step
        if out.finished:
            done[out.request_id] = sim.step
        record(out)

    sim._record = spy  # type: ignore[method-assign]
    sim.run()
    return first, done


__all__ = ["InvariantViolation", "Livelock", "SimConfig", "SimResult", "Simulator", "first_token_steps",
           "flood_workload", "simulate", "two_tenant_flood"]
