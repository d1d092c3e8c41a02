"""The step loop's asyncio face.

The asyncio side never blocks on a step: it sends commands (add, abort, adapter and embed
calls) to the step loop, which runs on a thread of this process (`StepLoopThread`) or in a
process of its own (`StepLoopProcess`, step_loop_runners.py). After each step every output
comes back in one `loop.call_soon_threadsafe` per destination (a Session or Generate
stream of the server, or one in-process `generate` call's sink): one wake-up per step, not
one per request and token. The step loop never waits on the network.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

from omnibus.engine.core.sequence import RequestOutput
from omnibus.engine.engine import Engine, EngineStats
from omnibus.engine.lora import AdapterInventory, AdapterStateError, UnknownAdapterError
from omnibus.engine.serving.batcher import BatcherConfig, DynamicBatcher
from omnibus.engine.request import EngineRequest, as_request
from omnibus.engine.serving.step_loop import Abort, AdapterLoaded, Call, Delivery, Migrate, Refused
from omnibus.engine.serving.step_loop_runners import StepLoopRunner, StepLoopThread

__all__ = [
    "AdapterLoaded", "AdapterStateError", "AsyncEngine", "Delivery", "Destination", "Refused",
    "StepLoopDown", "UnknownAdapterError",
]


class StepLoopDown(RuntimeError):
    """The step loop is not running (it crashed, or its process died): what fails its
    requests and refuses new ones. The server answers UNAVAILABLE, so routers take the
    requests elsewhere (continuing started streams), as for an engine that died whole."""


class Destination(Protocol):
    """Where a request's outputs go: `deliver` runs on `loop`, once per step with every
    output of that step for this destination's requests, in order."""

    loop: asyncio.AbstractEventLoop

    def deliver(self, items: list[Delivery]) -> None: ...


class _Sink:
    """One in-process request's destination (`AsyncEngine.generate`): its outputs, queued."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[Delivery] = asyncio.Queue()

    def deliver(self, items: list[Delivery]) -> None:
        for item in items:
            self.queue.put_nowait(item)


class AsyncEngine:
    """`runner`: an Engine (its step loop then runs on a thread here) or a built
    StepLoopProcess. The outlet methods (`step`, `reply`, `crashed`) run on the step thread
    or the step-loop process's reader thread, never on an event loop."""

    def __init__(self, runner: Engine | StepLoopRunner,
                 embed_batching: BatcherConfig | None = None) -> None:
        self.runner = StepLoopThread(runner) if isinstance(runner, Engine) else runner
        self.config = self.runner.config
        self.max_model_len = self.runner.max_model_len
        self.heartbeat = self.runner.heartbeat  # beaten around each step, read by the watchdog
        self._stats = self.runner.first_stats
        self._dests: dict[str, Destination] = {}  # request id -> where its outputs go
        self._calls: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future[Any]]] = {}
        self._call_ids = itertools.count()
        self._embed_config = embed_batching or BatcherConfig()
        self._batcher: DynamicBatcher | None = None
        self.error: BaseException | None = None  # set if the step loop died

    def start(self) -> None:
        self.runner.start(self)

    def shutdown(self, timeout: float = 10.0) -> None:
        if self._batcher is not None:
            self._batcher.close()
        self.runner.stop(timeout)

    @property
    def is_alive(self) -> bool:
        return self.runner.is_alive()

    def stats(self) -> EngineStats:
        """The latest snapshot the step loop published."""
        return self._stats

    def _check_running(self) -> None:
        if self.error is not None or not self.runner.is_alive():  # not started, or gone
            raise StepLoopDown("the engine step loop is not running")

    def abort(self, request_id: str) -> None:
        self.runner.send(Abort(request_id))

    def migrate(self) -> None:
        """Ends every request for another engine to go on with (a drain; StepLoop's Migrate)."""
        self.runner.send(Migrate())

    def add(self, request: EngineRequest, dest: Destination) -> None:
        """Queues `request`, whose outputs (or Refused) go to `dest` step by step. Raises
        StepLoopDown (a RuntimeError) if the step loop is not running."""
        self._check_running()
        request_id = request.request_id
        self._dests[request_id] = dest
        self.runner.send(request)
        if self.error is not None and self._dests.pop(request_id, None) is not None:
            # the loop died after the check and before `crashed` saw this destination
            raise StepLoopDown("the engine step loop is not running")

    async def generate(self, request: EngineRequest | str, *fields: Any,
                       **named: Any) -> AsyncIterator[RequestOutput]:
        """Yield the outputs of `request` (or of the EngineRequest of its loose fields)
        step by step, in process (benchmarks, tests; the gRPC service serves its requests
        through session.py). Raises ValueError / UnknownAdapterError if the engine refuses
        it. Leaving the loop early (break, cancel) aborts it."""
        request = as_request(request, *fields, **named)
        request_id = request.request_id
        sink = _Sink(asyncio.get_running_loop())
        self.add(request, sink)
        finished = False
        try:
            while not finished:
                item = await sink.queue.get()
                if isinstance(item, Refused):
                    finished = True  # refused: nothing to abort
                    raise item.error
                finished = item.finished
                yield item
        finally:
            if not finished:
                self.abort(request_id)

    async def embed(self, inputs: list[list[int]], pooling: str = "mean", normalize: bool = False,
                    priority: int = 0, timeout_ms: float | None = None) -> list[list[float]]:
        """Embeddings, grouped with other requests by the dynamic batcher and computed by
        the step loop between generation steps. Raises ValueError, QueueFullError,
        QueueTimeoutError."""
        if self._batcher is None:
            self._batcher = DynamicBatcher(self._embed_config, self._run_embed_batch)
            self._batcher.start()
        items = [(list(ids), pooling, normalize) for ids in inputs]
        if not items:
            raise ValueError("no inputs to embed")
        return await self._batcher.submit(items, priority, timeout_ms)

    @property
    def embed_batch_sizes(self) -> list[int]:
        return [] if self._batcher is None else self._batcher.batch_sizes

    async def _run_embed_batch(self, items: list[tuple[list[int], str, bool]]) -> list[list[float]]:
        results: list[list[float] | None] = [None] * len(items)
        groups: dict[tuple[str, bool], list[int]] = {}
        for i, (_, pooling, normalize) in enumerate(items):
            groups.setdefault((pooling, normalize), []).append(i)
        for (pooling, normalize), idx in groups.items():
            vectors = await self._call("embed", [items[i][0] for i in idx], pooling, normalize)
            for i, vec in zip(idx, vectors):
                results[i] = vec
        return results

    # ---- adapters ------------------------------------------------------------

    async def load_adapter(self, name: str) -> AdapterLoaded:
        """Loads `name` into host memory and a device slot; returns once it is ready.
        Raises AdapterError (bad name or adapter), UnknownAdapterError, AdapterStateError
        (no adapters served, or the weights failed to load)."""
        return await self._call("load", name)

    async def unload_adapter(self, name: str) -> bool:
        """Drops `name` from device slots and host memory; False when it was not loaded.
        Raises AdapterError, UnknownAdapterError (neither loaded nor on disk),
        AdapterStateError (running sequences use it, or it is still loading)."""
        return await self._call("unload", name)

    async def list_adapters(self) -> AdapterInventory:
        """The adapters in device slots and in host memory now."""
        return await self._call("list")

    async def _call(self, op: str, *args: Any) -> Any:
        self._check_running()
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        call_id = next(self._call_ids)
        self._calls[call_id] = (loop, future)
        self.runner.send(Call(call_id, op, args))
        try:
            return await future
        finally:
            self._calls.pop(call_id, None)

    # ---- the outlet: called by the step loop's thread or the process's reader ---

    def step(self, outputs: list[Delivery], stats: EngineStats | None, settled: bool) -> None:
        if outputs:  # before the stats: whoever sees the engine settled has its outputs queued
            self._deliver(outputs)
        if stats is not None:
            self._stats = stats

    def _deliver(self, items: list[Delivery]) -> None:
        """One call per destination; a finished or refused request's destination is dropped."""
        dests = self._dests
        batches: dict[Destination, list[Delivery]] = {}
        for item in items:
            if isinstance(item, Refused) or item.finished:
                dest = dests.pop(item.request_id, None)
            else:
                dest = dests.get(item.request_id)
            if dest is not None:
                batch = batches.get(dest)
                if batch is None:
                    batches[dest] = [item]
                else:
                    batch.append(item)
        for dest, batch in batches.items():
            _call_soon(dest.loop, dest.deliver, batch)

    def reply(self, call_id: int, result: object, error: BaseException | None) -> None:
        call = self._calls.get(call_id)
        if call is not None:
            loop, future = call
            _call_soon(loop, _settle, future, result, error)

    def crashed(self, error: BaseException) -> None:
        self.error = error
        failure = StepLoopDown(f"engine step loop crashed: {error!r}")
        self._deliver([Refused(rid, failure) for rid in list(self._dests)])
        for call_id in list(self._calls):
            self.reply(call_id, None, failure)


def _call_soon(loop: asyncio.AbstractEventLoop, fn: Callable[..., None], *args: object) -> None:
    """`fn(*args)` on `loop`; nothing if that loop has closed (its caller is gone), which
    must not kill the thread handing outputs over."""
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # "Event loop is closed"
        pass


def _settle(future: asyncio.Future, result: object, exc: BaseException | None) -> None:
    if future.done():
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)
