"""Runs the engine's step loop on its own thread and exposes it to asyncio.

The asyncio side never blocks on a step: it sends commands (add, abort, adapter
load / unload / list) through a thread-safe queue, and after each step the step thread
hands every output back in one `loop.call_soon_threadsafe` per destination (a router's
session, or one request's sink): one wake-up per step, not one per request and token.
The step thread never waits on the network. The LoRA manager belongs to the step thread: adapter commands run
there, between steps, so they never race a step that uses the device slots.
"""

from __future__ import annotations

import asyncio
import collections
import queue
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Protocol, TypeVar

import structlog

from omnibus.engine.serving.batcher import BatcherConfig, DynamicBatcher
from omnibus.engine.serving.watchdog import Heartbeat
from omnibus.engine.engine import Engine, EngineStats
from omnibus.engine.lora import AdapterInventory, AdapterLoadError, AdapterStateError, UnknownAdapterError
from omnibus.engine.worker.sampling import SamplingParams
from omnibus.engine.worker.model_runner import bind_device
from omnibus.engine.core.sequence import RequestOutput

log = structlog.get_logger(__name__)

_IDLE_POLL_S = 0.001  # how often a loop with only not-yet-admissible work re-plans
# An idle engine proves its KV bookkeeping (an O(blocks) walk) once per idle spell, after
# this long without a command, so a request arriving just after the last one finished
# does not wait for the walk.
_IDLE_CHECK_AFTER_S = 0.25


@dataclass(frozen=True)
class Refused:
    """A request the engine would not admit, delivered in place of its outputs."""

    request_id: str
    error: BaseException  # ValueError / LookupError (the request's fault) or RuntimeError


Delivery = RequestOutput | Refused


class Destination(Protocol):
    """Where the step thread sends outputs: `deliver` runs on `loop`, once per step with
    every output of that step for this destination's requests, in order."""

    loop: asyncio.AbstractEventLoop

    def deliver(self, items: list[Delivery]) -> None: ...


@dataclass
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int
    adapter: str | None
    dest: Destination
    tenant: str = ""
    weight: float = 1.0
    deadline: float | None = None  # time.monotonic() seconds


@dataclass
class _Abort:
    request_id: str


@dataclass(frozen=True)
class AdapterLoaded:
    """The outcome of `AsyncEngine.load_adapter`."""

    adapter: str
    resident: bool  # in a device slot now (False: every slot is held by running sequences)
    was_loaded: bool  # it was in host memory already: no disk read


@dataclass
class _LoadAdapter:
    name: str
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    was_loaded: bool = False  # set by the step thread when it starts the load


@dataclass
class _UnloadAdapter:
    name: str
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future


@dataclass
class _ListAdapters:
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future


@dataclass
class _Embed:
    inputs: list[list[int]]
    pooling: str
    normalize: bool
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future


_AdapterCommand = _LoadAdapter | _UnloadAdapter | _ListAdapters
_Command = _Add | _Abort | _Embed | _AdapterCommand | None
T = TypeVar("T")


class _Sink:
    """One request's destination (`AsyncEngine.generate`): its outputs, queued."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[Delivery] = asyncio.Queue()

    def deliver(self, items: list[Delivery]) -> None:
        for item in items:
            self.queue.put_nowait(item)


class AsyncEngine:
    def __init__(self, engine: Engine, embed_batching: BatcherConfig | None = None) -> None:
        self.engine = engine
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._loads: list[_LoadAdapter] = []  # step thread: adapter loads waiting on the disk
        self._embeds: collections.deque[_Embed] = collections.deque()  # step thread: one batch per step
        self._embed_config = embed_batching or BatcherConfig()
        self._batcher: DynamicBatcher | None = None
        self._dests: dict[str, Destination] = {}  # owned by the step thread: where outputs go
        self._stats = engine.stats()
        self._thread = threading.Thread(target=self._run, name="engine-step-loop", daemon=True)
        self._stopped = threading.Event()
        self.error: BaseException | None = None  # set if the step loop died
        self.heartbeat = Heartbeat()  # beaten around each step, read by the watchdog

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

    def add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, dest: Destination,
            priority: int = 0, adapter: str | None = None, tenant: str = "", weight: float = 1.0,
            deadline: float | None = None) -> None:
        """Queues a request whose outputs (or Refused) go to `dest` step by step
        (`deadline`: time.monotonic() seconds). Raises RuntimeError if the step loop is
        not running."""
        if self.error is not None or not self._thread.is_alive():
            raise RuntimeError("the engine step loop is not running")
        self._commands.put(_Add(request_id, list(prompt_token_ids), params, priority, adapter, dest,
                                tenant, weight, deadline))

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       priority: int = 0, adapter: str | None = None, tenant: str = "",
                       weight: float = 1.0, deadline: float | None = None) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs step by step (`deadline`: time.monotonic() seconds).
        Raises ValueError / UnknownAdapterError if the engine refuses it. Leaving the loop
        early (break, cancel) aborts it."""
        sink = _Sink(asyncio.get_running_loop())
        self.add(request_id, prompt_token_ids, params, sink, priority, adapter, tenant, weight, deadline)
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

    # ---- adapters ------------------------------------------------------------

    async def load_adapter(self, name: str) -> AdapterLoaded:
        """Loads `name` into host memory and a device slot; returns once it is ready.
        Raises AdapterError (bad name or adapter), UnknownAdapterError, AdapterStateError
        (no adapters served, or the weights failed to load)."""
        return await self._submit(lambda loop, fut: _LoadAdapter(name, loop, fut))

    async def unload_adapter(self, name: str) -> bool:
        """Drops `name` from device slots and host memory; False when it was not loaded.
        Raises AdapterError, UnknownAdapterError (neither loaded nor on disk),
        AdapterStateError (running sequences use it, or it is still loading)."""
        return await self._submit(lambda loop, fut: _UnloadAdapter(name, loop, fut))

    async def list_adapters(self) -> AdapterInventory:
        """The adapters in device slots and in host memory now."""
        return await self._submit(lambda loop, fut: _ListAdapters(loop, fut))

    async def _submit(
        self, make: Callable[[asyncio.AbstractEventLoop, asyncio.Future[T]], _AdapterCommand]
    ) -> T:
        if self.error is not None or not self._thread.is_alive():
            raise RuntimeError("the engine step loop is not running")
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._commands.put(make(loop, future))
        return await future

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
        bind_device(self.engine.runner.device)  # the current CUDA device is per thread
        try:
            checked = -1  # the step count at the last check
            while not self._stopped.is_set():
                idle = not self.engine.has_unfinished() and not self._embeds
                if idle and not self._loads and checked != self.engine.num_steps:
                    if not self._drain_commands(block=True, timeout=_IDLE_CHECK_AFTER_S):
                        self.engine.check_integrity()
                        checked = self.engine.num_steps
                    continue
                self._drain_commands(block=idle and not self._loads)
                self.heartbeat.begin()
                if self._embeds:  # one embedding batch between two generation steps
                    self._run_embed(self._embeds.popleft())
                steps = self.engine.num_steps
                outputs = self.engine.step()
                self.heartbeat.end()
                self._send(outputs)
                self._stats = self.engine.stats()
                if self._loads:
                    self._poll_loads()
                if self.engine.num_steps == steps and (self.engine.has_unfinished() or self._loads):
                    # waiting on a batch window, an adapter load or a busy adapter slot
                    self._drain_commands(block=True, timeout=_IDLE_POLL_S)
        except BaseException as exc:  # the loop must report, not vanish
            self.error = exc
            self.heartbeat.end()  # crashed, not stalled: requests get INTERNAL
            log.exception("engine_step_loop_crashed")
            error = RuntimeError(f"engine step loop crashed: {exc!r}")
            self._send_each([Refused(rid, error) for rid in self._dests], self._dests)
            self._dests.clear()
            for load in self._loads:
                _reply(load, None, RuntimeError(f"engine step loop crashed: {exc!r}"))
            self._loads.clear()

    def _send(self, outputs: list[RequestOutput]) -> None:
        """Hands one step's outputs over: one call per destination."""
        dests = self._dests
        self._send_each(outputs, dests)
        for out in outputs:
            if out.finished:
                dests.pop(out.request_id, None)

    @staticmethod
    def _send_each(items: list[Delivery], dests: dict[str, Destination]) -> None:
        batches: dict[Destination, list[Delivery]] = {}
        for item in items:
            dest = dests.get(item.request_id)
            if dest is not None:
                batch = batches.get(dest)
                if batch is None:
                    batches[dest] = [item]
                else:
                    batch.append(item)
        for dest, batch in batches.items():
            dest.loop.call_soon_threadsafe(dest.deliver, batch)

    def _drain_commands(self, block: bool, timeout: float | None = None) -> bool:
        """Applies the queued commands (waiting for one when `block`); False if none came."""
        try:
            cmd = self._commands.get(timeout=timeout) if block else self._commands.get_nowait()
        except queue.Empty:
            return False
        while True:
            self._apply(cmd)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _run_embed(self, cmd: _Embed) -> None:
        try:
            result = self.engine.embed(cmd.inputs, cmd.pooling, cmd.normalize)
        except Exception as exc:  # bad input: the caller gets it, the loop lives on
            cmd.loop.call_soon_threadsafe(_settle, cmd.future, None, exc)
            return
        cmd.loop.call_soon_threadsafe(_settle, cmd.future, result, None)

    def _apply(self, cmd: _Command) -> None:
        if cmd is None:
            return
        if isinstance(cmd, _Embed):
            self._embeds.append(cmd)
            return
        if isinstance(cmd, _Abort):
            self.engine.abort(cmd.request_id)
            return
        if isinstance(cmd, (_LoadAdapter, _UnloadAdapter, _ListAdapters)):
            self._apply_adapter_command(cmd)
            return
        try:
            self.engine.add_request(cmd.request_id, cmd.prompt_token_ids, cmd.params, cmd.priority, cmd.adapter,
                                    cmd.tenant, cmd.weight, cmd.deadline)
        except (ValueError, LookupError) as exc:
            _refuse(cmd, exc)
            return
        except Exception as exc:  # e.g. an adapter file vanishing mid-read: refuse this request only
            log.exception("add_request_failed", request_id=cmd.request_id)
            _refuse(cmd, RuntimeError(f"the engine could not admit the request: {exc!r}"))
            return
        self._dests[cmd.request_id] = cmd.dest

    # ---- adapters, on the step thread ------------------------------------------

    def _apply_adapter_command(self, cmd: _AdapterCommand) -> None:
        try:
            if isinstance(cmd, _ListAdapters):
                _reply(cmd, self._inventory(), None)
            elif isinstance(cmd, _UnloadAdapter):
                _reply(cmd, self._unload(cmd.name), None)
            else:
                self._start_load(cmd)
        except (ValueError, LookupError, AdapterStateError) as exc:  # AdapterError is a ValueError
            _reply(cmd, None, exc)
        except OSError as exc:  # e.g. an unreadable adapter_config.json: the caller hears why
            name = "" if isinstance(cmd, _ListAdapters) else cmd.name
            _reply(cmd, None, AdapterStateError(f"cannot read adapter {name!r}: {exc}"))

    def _inventory(self) -> AdapterInventory:
        adapters = self.engine.adapters
        return AdapterInventory((), ()) if adapters is None else adapters.inventory()

    def _start_load(self, cmd: _LoadAdapter) -> None:
        adapters = self.engine.adapters
        if adapters is None:
            raise AdapterStateError(
                f"cannot load adapter {cmd.name!r}: this engine serves no adapters "
                "(start it with --adapter-dir)")
        cmd.was_loaded = adapters.load(cmd.name)
        self._loads.append(cmd)

    def _poll_loads(self) -> None:
        """Answers the adapter loads whose disk read has ended (between two steps, so
        filling a device slot never races a forward pass)."""
        adapters = self.engine.adapters
        assert adapters is not None  # loads are only started when adapters are served
        pending, done = [], []
        for cmd in self._loads:
            try:
                resident = adapters.place(cmd.name)
            except AdapterLoadError as exc:
                done.append((cmd, None, exc))
                continue
            if resident is None:
                pending.append(cmd)
            else:
                done.append((cmd, AdapterLoaded(cmd.name, resident, cmd.was_loaded), None))
        self._loads = pending
        if done:
            self._stats = self.engine.stats()  # load reports show the new residents before the reply
        for cmd, result, exc in done:
            _reply(cmd, result, exc)

    def _unload(self, name: str) -> bool:
        adapters = self.engine.adapters
        if adapters is None:
            raise UnknownAdapterError(f"adapter {name!r} not found: this engine serves no adapters")
        if not adapters.unload(name):
            return False
        self._stats = self.engine.stats()
        return True


def _refuse(cmd: _Add, exc: BaseException) -> None:
    cmd.dest.loop.call_soon_threadsafe(cmd.dest.deliver, [Refused(cmd.request_id, exc)])


def _reply(cmd: _AdapterCommand, result: object, exc: BaseException | None) -> None:
    cmd.loop.call_soon_threadsafe(_settle, cmd.future, result, exc)


def _settle(future: asyncio.Future, result: object, exc: BaseException | None) -> None:
    if future.done():
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)
