"""Late binding of queued requests to engines.

Requests wait in the router's queue until some engine has room; one task owns the
matching, so two requests never race for the same slot. It runs whenever something
changes (a request arrives, a request finishes, an engine reports) and hands each
request, best-ranked first, the engine with the most room. A request for a LoRA
adapter goes only to engines that have the adapter, preferring the one where it is
most ready (adapter affinity: in a device slot, then in host memory, then on disk),
then the best score; while no engine with its adapter has room, requests behind it
that can run elsewhere pass it.

Prefix-aware routing (as SGLang's cache-aware router weighs them): an engine's score
is its share of room plus `prefix_weight` times the share of the prompt whose leading
KV blocks it reports cached (omnibus.common.prefix, the engine's own hashing), so a
request goes where its prefix is unless that engine is much busier than another.
An adapter request's blocks are salted with the adapter file's fingerprint, so its
keys are computed with the salt that engine reports for the adapter (none reported:
no prefix there), and every request's with its tenant's cache salt (auth.py), as the
router stamps it on the request: a tenant's score counts only its cache group's blocks.

Each dispatch charges the request's prompt tokens to its tenant's virtual token
counter (the pipeline charges output tokens as they stream), which orders the queue
under the "vtc" policy.

Fair over-admission ("vtc" only): the engines' in-flight caps would make a light
tenant wait for a heavy tenant's requests to finish, however few requests it has. So
while some tenant holds more than its weighted share of the total capacity
(capacity x weight / the weights of the tenants in flight or queued), a queued tenant
below its share is dispatched past the caps, up to twice an engine's capacity; the
engine's own fair-share rule (engine/omnibus/engine/core/waiting.py) then gives it a seat. Only a
request in the highest priority class waiting passes the caps: fair share is within a
class, and a lower class never goes ahead of a higher one.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from operator import methodcaller

from omnibus.common.fatal import exit_if_it_fails
from omnibus.common.prefix import leading_block_keys, matched_blocks
from omnibus.router.dispatch.adapters import Affinity
from omnibus.router.dispatch.engines import EngineClient
from omnibus.router.dispatch.fleet import Fleet
from omnibus.router.dispatch.queue import RequestQueue


@dataclass(eq=False)
class Ticket:
    """A request's place in the queue; its future resolves to the engine it got."""

    priority: int
    cost: int  # prompt + max_tokens, for the queued-tokens cap
    arrival: float  # monotonic seconds
    adapter: str = ""  # LoRA adapter; "" for the base model
    tenant: str = ""  # whose request (fair share)
    weight: float = 1.0  # the tenant's share
    prompt_ids: Sequence[int] = ()  # for prefix-aware routing and the prompt charge
    affinity: Affinity | None = None  # set on dispatch when there is an adapter
    avoid: frozenset[str] = frozenset()  # engines (addresses) that refused to continue it
    cache_salt: str = ""  # the tenant's prefix-cache salt (as sent to the engine)
    roles: frozenset[str] | None = None  # engines of these --role only (None: any)
    kv_layout: str = ""  # the layout of the KV it reads from another engine ("": none)
    # (block size, salt) -> leading block keys
    _keys: dict[tuple[int, str | None], list[int]] = field(default_factory=dict)
    future: asyncio.Future[EngineClient] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )

    def prefix_share(self, engine: EngineClient) -> float:
        """Share of the prompt in `engine`'s reported prefix cache (an adapter's blocks
        hashed with the salt `engine` reports for it, every block with the ticket's
        cache salt)."""
        bs = engine.load.block_size
        if not self.prompt_ids or not bs:
            return 0.0
        salt = None
        if self.adapter:
            salt = engine.load.adapter_salts.get(self.adapter)
            if salt is None:  # the engine has read no config of it: nothing cached
                return 0.0
        keys = self._keys.get((bs, salt))
        if keys is None:
            keys = self._keys[bs, salt] = leading_block_keys(
                self.prompt_ids, bs, salt, MAX_PREFIX_BLOCKS, self.cache_salt)
        return matched_blocks(keys, engine.load.prefix_keys) * bs / len(self.prompt_ids)


MAX_PREFIX_BLOCKS = 256  # leading blocks hashed per request at most


class Dispatcher:
    def __init__(
        self, fleet: Fleet, queue: RequestQueue[Ticket], prefix_weight: float = 1.0
    ) -> None:
        self._engines = fleet
        self.queue = queue
        self._prefix_weight = prefix_weight
        self._weights: dict[str, float] = {}  # each tenant's share, as its tickets carry it
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = exit_if_it_fails(asyncio.create_task(self._run(), name="dispatcher"))

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def notify(self) -> None:
        """Something changed: re-run the matching soon."""
        self._wake.set()

    def submit(self, ticket: Ticket) -> None:
        self._weights[ticket.tenant] = ticket.weight
        self.queue.push(ticket, ticket.priority, ticket.cost, ticket.arrival, ticket.tenant)
        self.notify()

    def withdraw(self, ticket: Ticket) -> None:
        """The request stopped waiting (cancel, deadline): forget it, and give back the
        engine slot if one was assigned in the same instant."""
        self.queue.remove(ticket)
        if ticket.future.done() and not ticket.future.cancelled():
            ticket.future.result().seats.release(ticket.adapter, ticket.tenant)
        else:
            ticket.future.cancel()

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            self._match()

    def _match(self) -> None:
        passed: list[Ticket] = []  # no engine with their adapter has room: others go first
        try:
            while len(self.queue):
                overflow = not any(e.seats.room() > 0 for e in self._engines)
                if not overflow:
                    ticket = self.queue.pop()
                else:  # every engine is at its cap: only a tenant under its share passes it
                    under = self.under_share()
                    if not under or not any(e.seats.overflow_room() > 0 for e in self._engines):
                        break
                    try:
                        ticket = self.queue.pop(among=under)
                    except IndexError:  # theirs wait behind a higher class, or were passed
                        break
                if ticket.future.done():  # its waiter gave up and has yet to withdraw it
                    continue
                engine = self.best_engine(ticket, overflow)
                if engine is None:
                    passed.append(ticket)
                    continue
                if ticket.adapter:
                    ticket.affinity = engine.seats.affinity(ticket.adapter)
                engine.seats.acquire(ticket.adapter, ticket.tenant)
                self.queue.charge(ticket.tenant, len(ticket.prompt_ids), ticket.weight)
                ticket.future.set_result(engine)
        finally:
            for ticket in passed:  # same priority and arrival: the same place in line
                self.queue.push(
                    ticket, ticket.priority, ticket.cost, ticket.arrival, ticket.tenant, lift=False
                )

    def under_share(self) -> set[str]:
        """Queued tenants that may be dispatched past the caps (module docstring)."""
        if self.queue.policy != "vtc":
            return set()
        inflight: Counter[str] = Counter()
        for e in self._engines:
            inflight.update(e.seats.tenant_inflight)
        queued = self.queue.backlogged()
        active = inflight.keys() | set(queued)
        if len(active) < 2:
            return set()
        capacity = sum(e.seats.capacity for e in self._engines if e.seats.accepting)
        total = sum(self._weights.get(t, 1.0) for t in active)
        share = {t: capacity * self._weights.get(t, 1.0) / total for t in active}
        if not any(inflight[t] > share[t] for t in active):
            return set()
        # a seat that keeps it within its share (a share under one seat never passes: with
        # --max-inflight-per-engine 1, a second tenant waits as the cap says)
        return {t for t in queued if inflight[t] + 1 <= share[t]}

    def best_engine(self, ticket: Ticket, overflow: bool = False) -> EngineClient | None:
        """Among engines with room (`overflow`: room past the cap too), the ticket's
        adapter, if any, a KV pool that can hold it (engines' pools may differ) and not
        in its `avoid`: one that can read the KV the ticket's request reads (the same
        layout; another would recompute it), then the best adapter affinity, then the best
        score (room share + prefix_weight * prefix share), then the most free KV blocks."""
        adapter = ticket.adapter
        room = methodcaller("overflow_room" if overflow else "room")
        open_ = [
            e for e in self._engines
            if room(e.seats) > 0 and (not adapter or e.load.has_adapter(adapter)) and e.load.fits(ticket.cost)
            and e.address not in ticket.avoid and (ticket.roles is None or e.load.role in ticket.roles)
        ]
        if len(open_) < 2:  # nothing to weigh (one engine: no prompt hashed for prefix scores)
            return open_[0] if open_ else None
        weight = self._prefix_weight
        return max(
            open_,
            key=lambda e: (
                bool(ticket.kv_layout) and e.load.kv_layout == ticket.kv_layout,
                e.seats.affinity(adapter) if adapter else 0,
                room(e.seats) / e.seats.capacity + (weight * ticket.prefix_share(e) if weight else 0.0),
                e.load.free_block_share(),
            ),
        )
