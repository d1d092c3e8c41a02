"""Runs the engine's step loop on its own thread and exposes it to asyncio.

The asyncio side never blocks on a step: it sends commands (add, abort) through a
thread-safe queue, and the step thread hands each request's outputs back with
`loop.call_soon_threadsafe`. The step thread never waits on the network.
"""

from __future__ import annotations

import asyncio
import collections
import queue
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass

import structlog

from engine.batcher import BatcherConfig, DynamicBatcher
from engine.engine import Engine, EngineStats
from engine.sampling import SamplingParams
from engine.sequence import RequestOutput

log = structlog.get_logger(__name__)

_IDLE_POLL_S = 0.001  # how often a loop with only not-yet-admissible work re-plans


@dataclass
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int
    adapter: str | None
    sink: "_Sink"


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Embed:
    inputs: list[list[int]]
    pooling: str
    normalize: bool
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future


class _Sink:
    """Where the step thread delivers one request's outputs (or its admission error)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

    def put(self, item: RequestOutput | BaseException) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class AsyncEngine:
    def __init__(self, engine: Engine, embed_batching: BatcherConfig | None = None) -> None:
        self.engine = engine
        self._commands: queue.SimpleQueue[_Add | _Abort | _Embed | None] = queue.SimpleQueue()
        self._embeds: collections.deque[_Embed] = collections.deque()  # step thread: one batch per step
        self._embed_config = embed_batching or BatcherConfig()
        self._batcher: DynamicBatcher | None = None
        self._sinks: dict[str, _Sink] = {}  # owned by the step thread
        self._stats = engine.stats()
        self._thread = threading.Thread(target=self._run, name="engine-step-loop", daemon=True)
        self._stopped = threading.Event()
        self.error: BaseException | None = None  # set if the step loop died

    def start(self) -> None:
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        if self._batcher is not None:
            self._batcher.close()
        self._stopped.set()
        self._commands.put(None)
        self._thread.join(timeout)

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def stats(self) -> EngineStats:
        """The latest snapshot, published by the step thread after every step."""
        return self._stats

    def abort(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       priority: int = 0, adapter: str | None = None) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs step by step. Raises ValueError / UnknownAdapterError
        if the engine refuses it. Leaving the loop early (break, cancel) aborts it."""
        if self.error is not None or not self._thread.is_alive():
            raise RuntimeError("the engine step loop is not running")
        sink = _Sink(asyncio.get_running_loop())
        self._commands.put(_Add(request_id, list(prompt_token_ids), params, priority, adapter, sink))
        finished = False
        try:
            while not finished:
                item = await sink.queue.get()
                if isinstance(item, BaseException):
                    finished = True  # refused: nothing to abort
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                self.abort(request_id)

    async def embed(self, inputs: list[list[int]], pooling: str = "mean", normalize: bool = False,
                    priority: int = 0, timeout_ms: float | None = None) -> list[list[float]]:
        """Embeddings, grouped with other requests by the dynamic batcher and computed on
        the step thread between generation steps. Raises ValueError, QueueFullError,
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
        loop = asyncio.get_running_loop()
        results: list[list[float] | None] = [None] * len(items)
        groups: dict[tuple[str, bool], list[int]] = {}
        for i, (_, pooling, normalize) in enumerate(items):
            groups.setdefault((pooling, normalize), []).append(i)
        for (pooling, normalize), idx in groups.items():
            fut = loop.create_future()
            self._commands.put(_Embed([items[i][0] for i in idx], pooling, normalize, loop, fut))
            for i, vec in zip(idx, await fut):
                results[i] = vec
        return results

    # ---- the step thread -----------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stopped.is_set():
                idle = not self.engine.has_unfinished() and not self._embeds
                if idle:
                    self.engine.check_integrity()  # cheap proof, run whenever the engine goes idle
                self._drain_commands(block=idle)
                if self._embeds:  # one embedding batch between two generation steps
                    self._run_embed(self._embeds.popleft())
                steps = self.engine.num_steps
                for out in self.engine.step():
                    sink = self._sinks.get(out.request_id)
                    if sink is not None:
                        sink.put(out)
                        if out.finished:
                            del self._sinks[out.request_id]
                self._stats = self.engine.stats()
                if self.engine.num_steps == steps and self.engine.has_unfinished():
                    self._drain_commands(block=True, timeout=_IDLE_POLL_S)  # waiting on a batch window
        except BaseException as exc:  # the loop must report, not vanish
            self.error = exc
            log.exception("engine_step_loop_crashed")
            for sink in self._sinks.values():
                sink.put(RuntimeError(f"engine step loop crashed: {exc!r}"))
            self._sinks.clear()

    def _drain_commands(self, block: bool, timeout: float | None = None) -> None:
        try:
            cmd = self._commands.get(timeout=timeout) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._apply(cmd)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return

    def _run_embed(self, cmd: _Embed) -> None:
        try:
            result = self.engine.embed(cmd.inputs, cmd.pooling, cmd.normalize)
        except Exception as exc:  # bad input: the caller gets it, the loop lives on
            cmd.loop.call_soon_threadsafe(_settle, cmd.future, None, exc)
            return
        cmd.loop.call_soon_threadsafe(_settle, cmd.future, result, None)

    def _apply(self, cmd: _Add | _Abort | _Embed | None) -> None:
        if cmd is None:
            return
        if isinstance(cmd, _Embed):
            self._embeds.append(cmd)
            return
        if isinstance(cmd, _Abort):
            self.engine.abort(cmd.request_id)
            return
        try:
            self.engine.add_request(cmd.request_id, cmd.prompt_token_ids, cmd.params, cmd.priority, cmd.adapter)
        except (ValueError, LookupError) as exc:
            cmd.sink.put(exc)
            return
        self._sinks[cmd.request_id] = cmd.sink


def _settle(future: asyncio.Future, result: object, exc: BaseException | None) -> None:
    if future.done():
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)
