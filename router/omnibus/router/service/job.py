"""A request inside the router: who sent it (`Caller`), its state while it is served
(`Job`), and the watch over every live stream (`StreamWatch`)."""

from __future__ import annotations

import asyncio
import time
import weakref
from dataclasses import dataclass, field

from omnibus.v1 import engine_pb2

from omnibus.router.admission.auth import Tenant
from omnibus.router.admission.limits import Permit
from omnibus.router.admission.validation import ValidRequest
from omnibus.router.dispatch.engines import EngineClient
from omnibus.router.text.detokenizer import IncrementalDetokenizer
from omnibus.router.text.stop import StopStringMatcher


@dataclass(frozen=True)
class Caller:
    """Who sent a request and under which terms, whatever the transport."""

    tenant: Tenant
    adapter: str = ""  # LoRA adapter name as the client gave it; "" = the base model
    deadline: float | None = None  # monotonic seconds; None: the client set none

    def time_remaining(self) -> float | None:
        return None if self.deadline is None else self.deadline - time.monotonic()

    def deadline_passed(self, slack: float = 0.0) -> bool:
        """Whether the deadline has passed, or will within `slack` seconds."""
        return self.deadline is not None and time.monotonic() >= self.deadline - slack


@dataclass(eq=False)  # hashed by identity: StreamWatch keeps a set of them
class Job:
    """One admitted request while it is being served (on one engine after another)."""

    request: ValidRequest
    caller: Caller
    permit: Permit
    arrival: float  # monotonic seconds
    dispatched: float | None = None
    first_token: float | None = None
    engine: str = ""
    completion_tokens: int = 0
    cached_tokens: int = 0
    # Continuation: every token id sent so far (the next engine gets prompt + these), and
    # how many of them were sent before the current engine took over.
    sent_ids: list[int] = field(default_factory=list)
    offset: int = 0
    refused_by: set[str] = field(default_factory=set)  # engines that would not continue it
    # KV that moves: "prefill" while a prefill engine computes its prompt for a decode
    # engine (once: `prefilled` after); the KV the next engine reads (a handle from the
    # engine that holds it).
    hop: str = ""
    prefilled: bool = False
    kv_source: engine_pb2.KvHandle | None = None
    kv_holder: EngineClient | None = None
    queued_at: float = 0.0  # when it last entered the queue (a continuation re-enters it)
    queued_before: float = 0.0  # seconds queued before that: the queue limit is on the total
    detok: IncrementalDetokenizer | None = None  # one per stream, kept across engines
    stop: StopStringMatcher | None = None
    # Where the serving task waits now, for StreamWatch: "queue", "engine" (for its next
    # output), "client" (its last message is being written), "" (neither).
    waiting: str = ""
    waiting_since: float = 0.0
    serving: EngineClient | None = None
    task: asyncio.Task | None = None  # the task serving it (engine moves, drains cancel it)
    writer: asyncio.Task | None = None  # the one writing to the client, when another (HTTP n)
    interrupted: str = ""  # why StreamWatch interrupted it: "engine", "drain", "client_stalled"
    interrupt_note: str = ""

    @property
    def adapter(self) -> str:
        return self.caller.adapter

    @property
    def writing(self) -> asyncio.Task | None:
        """The task whose write to the client a stall holds up."""
        return self.writer or self.task

    def wait(self, where: str) -> None:
        self.waiting = where
        if where == "client":  # only a write's start is timed (StreamWatch: client_stalled)
            self.waiting_since = time.monotonic()

    def interrupt(self, why: str, note: str = "") -> None:
        """Cancels the serving task where it waits; the stream (stream.py) turns the cancellation
        into the move (engine), the final message (drain) or the end (client_stalled)."""
        if self.interrupted or self.task is None:
            return
        self.interrupted, self.interrupt_note = why, note
        if why == "client_stalled":  # the write that is stuck
            self.writing.cancel()
        elif why != "drain" or self.waiting != "client":  # a drain lets a write finish
            self.task.cancel()

    def take_interrupt(self) -> str:
        """Why StreamWatch cancelled the current task ("" when it did not: a real cancel)."""
        task = asyncio.current_task()
        if not self.interrupted or task is None or task.uncancel() > 0:
            return ""
        why, self.interrupted = self.interrupted, ""
        return why


class StreamWatch:
    """One task that checks every live stream a few times a second: moves those whose
    engine is marked unhealthy (a SIGSTOP'd or partitioned engine never closes its
    streams; its load reports stop), and ends those whose client has not taken a
    message for `stall` seconds. Costs nothing per token."""

    def __init__(self, stall: float) -> None:
        self.stall = stall
        self.jobs: set[Job] = set()
        self.stalled: weakref.WeakSet[asyncio.Task] = weakref.WeakSet()  # writers cancelled
        self._task: asyncio.Task | None = None

    def add(self, job: Job) -> None:
        job.task = asyncio.current_task()
        self.jobs.add(job)
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run(), name="stream-watch")

    async def _run(self) -> None:
        while self.jobs:
            await asyncio.sleep(min(0.25, self.stall / 4))
            now = time.monotonic()
            for job in list(self.jobs):
                engine = job.serving
                if job.waiting == "engine" and engine is not None and not engine.link.healthy:
                    job.interrupt("engine", f"engine {engine.address} was marked unhealthy")
                elif job.waiting == "client" and now - job.waiting_since > self.stall:
                    writer = job.writing
                    for other in self.jobs:  # the request's other choices share the write
                        if other.writing is writer:
                            other.interrupt("client_stalled")
                    self.stalled.add(writer)

    def drain(self) -> None:
        """Ends every stream now: those being served get a final ABORTED message."""
        for job in list(self.jobs):
            job.interrupt("drain")
