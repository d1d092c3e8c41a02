"""Late binding of queued requests to engines.

Requests wait in the router's queue until some engine has room; one task owns the
matching, so two requests never race for the same slot. It runs whenever something
changes (a request arrives, a request finishes, an engine reports) and hands each
request, best-ranked first, the engine with the most room.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field

from router.engines import EngineClient
from router.queue import RequestQueue


@dataclass(eq=False)
class Ticket:
    """A request's place in the queue; its future resolves to the engine it got."""

    priority: int
    cost: int  # prompt + max_tokens, for the queued-tokens cap
    arrival: float  # monotonic seconds
    future: asyncio.Future[EngineClient] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )


class Dispatcher:
    def __init__(self, engines: Sequence[EngineClient], queue: RequestQueue[Ticket]) -> None:
        self._engines = engines
        self.queue = queue
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="dispatcher")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def notify(self) -> None:
        """Something changed: re-run the matching soon."""
        self._wake.set()

    def submit(self, ticket: Ticket) -> None:
        self.queue.push(ticket, ticket.priority, ticket.cost, ticket.arrival)
        self.notify()

    def withdraw(self, ticket: Ticket) -> None:
        """The request stopped waiting (cancel, deadline): forget it, and give back the
        engine slot if one was assigned in the same instant."""
        self.queue.remove(ticket)
        if ticket.future.done() and not ticket.future.cancelled():
            ticket.future.result().release()
        else:
            ticket.future.cancel()

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            self._match()

    def _match(self) -> None:
        while len(self.queue):
            engine = self._best_engine()
            if engine is None:
                return
            ticket = self.queue.pop()
            if ticket.future.done():  # its waiter gave up and has yet to withdraw it
                continue
            engine.acquire()
            ticket.future.set_result(engine)

    def _best_engine(self) -> EngineClient | None:
        """The engine with the largest share of room, then the most free KV blocks."""
        open_ = [e for e in self._engines if e.room() > 0]
        if not open_:
            return None
        return max(open_, key=lambda e: (e.room() / e.capacity, e.free_block_share()))
