"""The engine's step loop: applies commands between steps, runs steps, hands results over.

It knows nothing of its transport: commands come from an `Inbox` (a pipe's `poll` and
`recv`), each step's outputs and the replies to calls go to an `Outlet`. It runs on a
thread of the server's process, or in a process of its own (step_loop_runners.py), where
the loop that feeds the device never waits for the GIL held by the server's gRPC and
asyncio work. Every command is plain picklable data.

The LoRA manager belongs to this loop: adapter calls run here, between steps, so they
never race a step that uses the device slots. A structured-output format compiles on a
thread beside the loop (xgrammar releases the GIL), so a schema that takes seconds to
compile delays only its own request; the request is added once its grammar is cached.
"""

from __future__ import annotations

import collections
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Protocol

import structlog

from omnibus.common.threads import name_this_thread
from omnibus.engine.core.sequence import RequestOutput
from omnibus.engine.engine import Engine, EngineStats
from omnibus.engine.request import EngineRequest
from omnibus.engine.lora import AdapterInventory, AdapterLoadError, AdapterStateError, UnknownAdapterError
from omnibus.engine.serving.watchdog import Heartbeat, StallStacks
from omnibus.engine.worker.model_runner import bind_device

log = structlog.get_logger(__name__)

IDLE_POLL_S = 0.001  # how often a loop with only not-yet-admissible work re-plans
# An idle engine proves its KV bookkeeping (an O(blocks) walk) once per idle spell, after
# this long without a command, so a request arriving just after the last one finished
# does not wait for the walk.
IDLE_CHECK_AFTER_S = 0.25
KV_HOLD_POLL_S = 0.25  # an idle loop holding KV for other engines steps this often (leases end)
STATS_EVERY_S = 0.005  # a busy loop publishes its stats this often (routers read them every 50 ms)
STEP_THREAD_NAME = "omnibus-step"  # the loop's native thread name (top -H, /proc/<pid>/task)


@dataclass(frozen=True)
class Refused:
    """A request the engine would not admit, delivered in place of its outputs."""

    request_id: str
    error: BaseException  # ValueError / LookupError (the request's fault) or RuntimeError


Delivery = RequestOutput | Refused


@dataclass
class Abort:
    request_id: str


@dataclass
class Migrate:
    """A drain: end every request for another engine to go on with, running ones' KV held
    for the engines that read it (Engine.migrate)."""


@dataclass
class Call:
    """A command with one reply, `Outlet.reply(call_id, ...)`: op "load", "unload" or
    "list" (adapters; args: the name) or "embed" (args: inputs, pooling, normalize)."""

    call_id: int
    op: str
    args: tuple = ()
    was_loaded: bool = False  # load: the adapter was in host memory when its load began


@dataclass(frozen=True)
class AdapterLoaded:
    """The reply to a load call."""

    adapter: str
    resident: bool  # in a device slot now (False: every slot is held by running sequences)
    was_loaded: bool  # it was in host memory already: no disk read


Command = EngineRequest | Abort | Migrate | Call | None  # an EngineRequest: add it; None: stop


class Inbox(Protocol):
    """Where commands come from: the step loop's end of its pipe, or `StepLoopThread`."""

    def poll(self, timeout: float | None) -> bool:
        """Whether a command waits, after up to `timeout` s (0: none; None: until one does)."""

    def recv(self) -> Command:
        """The next command; EOFError when the sender has gone (the loop stops)."""


class Outlet(Protocol):
    def step(self, outputs: list[Delivery], stats: EngineStats | None, settled: bool) -> None:
        """One step's outputs (or refusals), and a snapshot of the engine after it at most
        every STATS_EVERY_S and whenever it settles (None otherwise); `settled`: the engine
        has no work left or its adapters changed."""

    def reply(self, call_id: int, result: object, error: BaseException | None) -> None: ...

    def crashed(self, error: BaseException) -> None:
        """The loop died; nothing more comes."""


class _Stop(Exception):
    pass


@dataclass
class StepLoop:
    engine: Engine
    inbox: Inbox
    outlet: Outlet
    heartbeat: Heartbeat
    _loads: list[Call] = field(default_factory=list)  # adapter loads waiting on the disk
    _embeds: collections.deque[Call] = field(default_factory=collections.deque)  # one per step
    _refused: list[Delivery] = field(default_factory=list)  # adds refused by this drain
    _stats_at: float = 0.0  # when the outlet last got the engine's stats
    # structured requests whose format compiles on the grammar thread, in arrival order:
    # request id -> (the request, its compile, aborted meanwhile)
    _compiling: dict[str, tuple[EngineRequest, Future, bool]] = field(default_factory=dict)
    _grammar_pool: ThreadPoolExecutor | None = None  # started by the first structured request

    def run(self) -> None:
        """Until a None command (or a closed inbox); a crash is reported, not raised."""
        engine = self.engine
        name_this_thread(STEP_THREAD_NAME)
        bind_device(engine.runner.device)  # the current CUDA device is per thread
        stacks = StallStacks(self.heartbeat)  # logs where this thread is when a step stalls
        stacks.start()
        try:
            checked = -1  # the step count at the last integrity check
            while True:
                idle = not engine.has_unfinished() and not self._embeds
                pending = bool(self._loads or self._compiling)  # finishing off the loop
                if idle and not pending and checked != engine.num_steps:
                    if not self._drain(timeout=IDLE_CHECK_AFTER_S):
                        engine.check_integrity()
                        checked = engine.num_steps
                    continue
                if idle and not pending:  # wait for a command (a lease may end meanwhile)
                    self._drain(timeout=KV_HOLD_POLL_S if engine.holds_kv() else None)
                else:
                    self._drain(timeout=0.0)
                self.heartbeat.begin()
                if self._embeds:  # one embedding batch between two generation steps
                    self._run_embed(self._embeds.popleft())
                steps = engine.num_steps
                outputs = engine.step()
                self.heartbeat.end()
                self._publish(outputs, self._settled())
                if self._loads:
                    self._poll_loads()
                if self._compiling:
                    self._poll_compiles()
                if engine.num_steps == steps and (engine.has_unfinished() or self._loads or self._compiling):
                    # waiting on a batch window, an adapter load, a busy adapter slot or a compile
                    self._drain(timeout=IDLE_POLL_S)
        except _Stop:
            return
        except BaseException as exc:  # the loop must report, not vanish
            self.heartbeat.end()  # crashed, not stalled: requests get INTERNAL
            log.exception("engine_step_loop_crashed")
            self.outlet.crashed(exc)
        finally:
            stacks.stop()
            if self._grammar_pool is not None:
                self._grammar_pool.shutdown(wait=False, cancel_futures=True)
            engine.close()  # tensor parallelism: the ranks stop with the loop

    def _drain(self, timeout: float | None) -> bool:
        """Applies the queued commands, waiting up to `timeout` s for the first (0: not at
        all); False if none came."""
        inbox = self.inbox
        if not inbox.poll(timeout):
            return False
        while True:
            try:
                cmd = inbox.recv()
            except EOFError:  # the server is gone: stop
                cmd = None
            self._apply(cmd)
            if not inbox.poll(0.0):
                break
        self._flush_refused()
        return True

    def _flush_refused(self) -> None:
        if self._refused:  # at once, not with the next step's outputs
            refused, self._refused = self._refused, []
            self._publish(refused, self._settled())

    def _settled(self) -> bool:
        """No work left: none in the engine, none compiling its format."""
        return not self.engine.has_unfinished() and not self._compiling

    def _publish(self, outputs: list[Delivery], settled: bool) -> None:
        """Hands `outputs` over, with the engine's stats when they are due. A request
        whose format compiles counts as waiting: admitted here, not yet scheduled."""
        stats = None
        now = time.monotonic()
        if settled or now - self._stats_at >= STATS_EVERY_S:
            self._stats_at, stats = now, self.engine.stats()
            if self._compiling:
                stats = replace(stats, num_waiting=stats.num_waiting + len(self._compiling))
        if outputs or stats is not None:
            self.outlet.step(outputs, stats, settled)

    def _apply(self, cmd: Command) -> None:
        if cmd is None:
            raise _Stop
        if isinstance(cmd, Abort):
            held = self.engine.holds_kv()
            self._abort(cmd.request_id)
            if held:  # KV held for a transfer may have been let go: the snapshot says so (drains wait on it)
                self._publish([], self._settled())
        elif isinstance(cmd, Migrate):
            self.engine.migrate()
        elif isinstance(cmd, EngineRequest):
            if cmd.params.structured_output is None:
                self._add(cmd)
            else:
                self._compile(cmd)
        elif cmd.op == "embed":
            self._embeds.append(cmd)
        else:
            self._adapter_call(cmd)

    def _add(self, request: EngineRequest) -> None:
        try:
            self.engine.add_request(request)
        except (ValueError, LookupError) as exc:
            self._refused.append(Refused(request.request_id, exc))
        except Exception as exc:  # e.g. an adapter file vanishing mid-read: refuse this request only
            log.exception("add_request_failed", request_id=request.request_id)
            error = RuntimeError(f"the engine could not admit the request: {exc!r}")
            self._refused.append(Refused(request.request_id, error))

    def _abort(self, request_id: str) -> None:
        compiling = self._compiling.get(request_id)
        if compiling is not None:  # added when compiled, then aborted: one way to end
            self._compiling[request_id] = (*compiling[:2], True)
        else:
            self.engine.abort(request_id)

    # ---- structured output: formats compile beside the loop ------------------------

    def _compile(self, request: EngineRequest) -> None:
        if self._grammar_pool is None:
            self._grammar_pool = ThreadPoolExecutor(1, thread_name_prefix="omnibus-grammar")
        fmt = request.params.structured_output
        self._compiling[request.request_id] = (
            request, self._grammar_pool.submit(self.engine.runner.compile_format, fmt), False)

    def _poll_compiles(self) -> None:
        """Adds the requests whose format has compiled (the engine finds it in the grammar
        cache), in arrival order; refuses those whose format does not compile."""
        for request_id, (request, compiled, aborted) in list(self._compiling.items()):
            if not compiled.done():
                break  # arrival order: a later one waits for the one before it
            del self._compiling[request_id]
            error = compiled.exception()
            if isinstance(error, ValueError):
                self._refused.append(Refused(request_id, error))
                continue
            self._add(request)  # another error raises again there, and is refused there
            if aborted:
                self.engine.abort(request_id)
        self._flush_refused()

    def _run_embed(self, cmd: Call) -> None:
        try:
            result = self.engine.embed(*cmd.args)
        except Exception as exc:  # bad input: the caller gets it, the loop lives on
            self.outlet.reply(cmd.call_id, None, exc)
            return
        self.outlet.reply(cmd.call_id, result, None)

    # ---- adapters --------------------------------------------------------------

    def _adapter_call(self, cmd: Call) -> None:
        name = cmd.args[0] if cmd.args else ""
        try:
            if cmd.op == "list":
                self.outlet.reply(cmd.call_id, self._inventory(), None)
            elif cmd.op == "unload":
                self.outlet.reply(cmd.call_id, self._unload(name), None)
            elif cmd.op == "load":
                self._start_load(cmd, name)
            else:
                raise ValueError(f"unknown engine call {cmd.op!r}")
        except (ValueError, LookupError, AdapterStateError) as exc:  # AdapterError is a ValueError
            self.outlet.reply(cmd.call_id, None, exc)
        except OSError as exc:  # e.g. an unreadable adapter_config.json: the caller hears why
            self.outlet.reply(cmd.call_id, None, AdapterStateError(f"cannot read adapter {name!r}: {exc}"))

    def _inventory(self) -> AdapterInventory:
        adapters = self.engine.adapters
        return AdapterInventory((), ()) if adapters is None else adapters.inventory()

    def _start_load(self, cmd: Call, name: str) -> None:
        adapters = self.engine.adapters
        if adapters is None:
            raise AdapterStateError(
                f"cannot load adapter {name!r}: this engine serves no adapters "
                "(start it with --adapter-dir)")
        cmd.was_loaded = adapters.load(name)
        self._loads.append(cmd)

    def _poll_loads(self) -> None:
        """Answers the adapter loads whose disk read has ended (between two steps, so
        filling a device slot never races a forward pass)."""
        adapters = self.engine.adapters
        assert adapters is not None  # loads are only started when adapters are served
        pending, done = [], []
        for cmd in self._loads:
            name = cmd.args[0]
            try:
                resident = adapters.place(name)
            except AdapterLoadError as exc:
                done.append((cmd, None, exc))
                continue
            if resident is None:
                pending.append(cmd)
            else:
                done.append((cmd, AdapterLoaded(name, resident, cmd.was_loaded), None))
        self._loads = pending
        if done:  # load reports show the new residents before the reply
            self._publish([], settled=True)
        for cmd, result, exc in done:
            self.outlet.reply(cmd.call_id, result, exc)

    def _unload(self, name: str) -> bool:
        adapters = self.engine.adapters
        if adapters is None:
            raise UnknownAdapterError(f"adapter {name!r} not found: this engine serves no adapters")
        if not adapters.unload(name):
            return False
        self._publish([], settled=True)
        return True

