"""Where the step loop runs: on a thread of the server's process (`StepLoopThread`) or in a
process of its own (`StepLoopProcess`, `omnibus-engine serve --step-loop process`).

In its own process the loop that feeds the device shares no GIL with the server's gRPC
and asyncio work (as vLLM v1's EngineCore and SGLang's scheduler run): commands go down a
pipe as pickled dataclasses, and each step comes back as one message with every output
of that step (and, when the step loop publishes them, its stats). A reader thread in the
server's process hands them to `AsyncEngine`. The step loop reads its commands from the
pipe itself (the pipe's `poll` and `recv` are its inbox) and beats the watchdog's
heartbeat in shared memory. The process is spawned, not forked, so CUDA starts clean in
it; it ignores SIGINT (the server drains and then stops it) and exits when the server's
end of the pipe closes.

On a thread, commands wait in a queue that `StepLoopThread` itself hands the loop with
the pipe's two verbs, and outputs go straight to `AsyncEngine`: the same objects, not
pickled.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import multiprocessing.connection
import operator
import os
import pickle
import queue
import signal
import sys
import threading
from collections.abc import MutableSequence

import structlog

from omnibus.common.heap import freeze_heap
from omnibus.common.threads import name_this_thread
from omnibus.engine.config import EngineConfig
from omnibus.engine.core.sequence import RequestOutput
from omnibus.engine.engine import Engine, EngineStats
from omnibus.engine.serving.loading import EngineLoadError, load_engine
from omnibus.engine.serving.step_loop import Command, Delivery, Outlet, Refused, StepLoop
from omnibus.engine.serving.watchdog import Heartbeat

log = structlog.get_logger(__name__)


def resolve_step_loop(requested: str, config: EngineConfig) -> str:
    """Where `--step-loop` `requested` runs the step loop: "process" or "thread". `auto` is
    a process of its own, except for the null model on a CPU. On a thread, every torch op
    the loop dispatches waits for the GIL whenever the gRPC server holds it (and, we infer
    without having measured it, with several compute threads each wait stalls a parallel
    region): served through the router
    on a 2-core CPU, the process ran 1.07-1.41x the tokens/s of the thread at 2 compute
    threads and 1.03-1.13x at 1 (docs/benchmarks/offline.md). The null model's forward is
    near-free, so there the pipe's hop would be much of the host path it exists to measure."""
    if requested != "auto":
        return requested
    return "thread" if config.device == "cpu" and config.load_format == "null" else "process"


class StepLoopThread:
    """The step loop on a thread of this process (tests, benchmarks, `--step-loop thread`).
    It is also the loop's inbox: `send` queues a command, `poll` and `recv` (a pipe's
    verbs, which the loop reads) take it off."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.config = engine.config
        self.max_model_len = engine.model_config.max_model_len
        self.first_stats = engine.stats()
        self.heartbeat = Heartbeat()
        self._queue: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._polled: list[Command] = []  # the command `poll` took off the queue, for `recv`
        self._thread: threading.Thread | None = None

    def start(self, outlet: Outlet) -> None:
        loop = StepLoop(self.engine, self, outlet, self.heartbeat)
        self._thread = threading.Thread(target=loop.run, name="engine-step-loop", daemon=True)
        self._thread.start()

    def send(self, cmd: Command) -> None:
        self._queue.put(cmd)

    def poll(self, timeout: float | None) -> bool:
        """Whether a command waits, after up to `timeout` s (None: until one does)."""
        if not self._polled:
            try:
                cmd = self._queue.get_nowait() if timeout == 0.0 else self._queue.get(timeout=timeout)
            except queue.Empty:
                return False
            self._polled.append(cmd)
        return True

    def recv(self) -> Command:
        """The next command (waiting for one if none has come)."""
        return self._polled.pop() if self._polled else self._queue.get()

    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self, timeout: float) -> None:
        self.send(None)
        if self._thread is not None:
            self._thread.join(timeout)


class StepLoopProcess:
    """The step loop in a spawned process of its own. Building it loads the engine there
    (model, warm-up, preloads) and raises EngineLoadError if that fails. Build it on a
    thread that lives as long as the server (the main thread): on Linux the process is
    killed when the thread that started it ends."""

    def __init__(self, config: EngineConfig, log_level: str = "info") -> None:
        ctx = multiprocessing.get_context("spawn")
        self.config = config
        self._conn, child = ctx.Pipe()
        shared = ctx.RawArray("d", Heartbeat.SLOTS)
        self.heartbeat = Heartbeat(shared)
        self._process = ctx.Process(target=_step_loop_main,
                                    args=(config, child, shared, log_level, os.getpid()),
                                    name="omnibus-step-loop", daemon=True)
        self._process.start()
        child.close()
        self._send_lock = threading.Lock()
        self._stopping = False
        self._reader: threading.Thread | None = None
        try:
            self.max_model_len, self.first_stats = self._wait_ready()
        except BaseException:
            self._process.kill()
            self._process.join()
            raise

    @property
    def pid(self) -> int | None:
        return self._process.pid

    def _wait_ready(self) -> tuple[int, EngineStats]:
        while not self._conn.poll(0.5) and self._process.is_alive():
            pass
        try:
            msg = self._conn.recv()
        except EOFError:  # it died without a word (killed, or a crash below Python)
            self._process.join(5.0)
            raise EngineLoadError(
                f"the step-loop process exited (code {self._process.exitcode}) while loading"
            ) from None
        if msg[0] == "failed":
            raise EngineLoadError(msg[1])
        return msg[1], msg[2]

    def start(self, outlet: Outlet) -> None:
        self._reader = threading.Thread(target=self._read, args=(outlet,), name="step-loop-reader",
                                        daemon=True)
        self._reader.start()

    def send(self, cmd: Command) -> None:
        try:
            with self._send_lock:
                self._conn.send(cmd)
        except OSError:  # the process is gone: its reader reports that (crashed) to everyone
            pass

    def is_alive(self) -> bool:
        return self._process.is_alive() and self._reader is not None and self._reader.is_alive()

    def stop(self, timeout: float) -> None:
        self._stopping = True
        self.send(None)
        self._process.join(timeout)
        if self._process.is_alive():
            log.warning("step_loop_process_kill", pid=self._process.pid)
            self._process.kill()
            self._process.join()
        if self._reader is not None:
            self._reader.join(timeout)
        self._conn.close()

    def _read(self, outlet: Outlet) -> None:
        """The reader thread: every message of the step loop, in order, handed to `outlet`."""
        name_this_thread("omnibus-reader")
        conn = self._conn
        try:
            while True:
                msg = conn.recv()
                kind = msg[0]
                if kind == "step":
                    _, packed, refused, stats, settled = msg
                    outputs: list[Delivery] = refused  # refusals come before the step's outputs
                    outputs += [RequestOutput(*fields) for fields in packed]
                    outlet.step(outputs, stats, settled)
                elif kind == "reply":
                    outlet.reply(msg[1], msg[2], msg[3])
                else:  # "crashed"
                    outlet.crashed(msg[1])
                    return
        except (EOFError, OSError):
            if self._stopping:
                return
            self._process.join(1.0)
            outlet.crashed(RuntimeError(
                f"the step-loop process exited (code {self._process.exitcode})"))


StepLoopRunner = StepLoopThread | StepLoopProcess


# ---- the step-loop process -------------------------------------------------------


def _step_loop_main(config: EngineConfig, conn: multiprocessing.connection.Connection,
                    shared: MutableSequence[float], log_level: str, server_pid: int) -> None:
    from omnibus.common.logs import configure_logging, quiet_shutdown

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the group: the server drains, then stops us
    _die_with(server_pid)
    configure_logging(log_level)
    quiet_shutdown()
    try:
        engine = load_engine(config)
    except EngineLoadError as exc:
        conn.send(("failed", str(exc)))
        return
    except Exception as exc:
        conn.send(("failed", f"cannot load {config.model}: {exc!r}"))
        return
    conn.send(("ready", engine.model_config.max_model_len, engine.stats()))
    freeze_heap()
    StepLoop(engine, conn, _PipeOutlet(conn), Heartbeat(shared)).run()


def _die_with(server_pid: int) -> None:
    """SIGKILL this process when the server process dies, however it dies (Linux): after
    the watchdog exits the server over a hung step, the step's process must not keep the
    device. The pipe's end covers a server that merely stops."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != server_pid:  # it died before the prctl
        os._exit(1)


class _PipeOutlet:
    """The step loop's outlet in its own process: each step, reply and crash up the pipe."""

    def __init__(self, conn: multiprocessing.connection.Connection) -> None:
        self._conn = conn

    def step(self, outputs: list[Delivery], stats: EngineStats | None, settled: bool) -> None:
        packed, refused = [], []
        for out in outputs:
            if isinstance(out, Refused):
                refused.append(out)
            else:
                packed.append(_fields(out))
        self._send(("step", packed, refused, stats, settled))

    def reply(self, call_id: int, result: object, error: BaseException | None) -> None:
        self._send(("reply", call_id, result, _portable(error)))

    def crashed(self, error: BaseException) -> None:
        self._send(("crashed", _portable(error)))

    def _send(self, msg: tuple[object, ...]) -> None:
        try:
            self._conn.send(msg)
        except OSError:  # BrokenPipeError: the server process is gone, nothing to serve
            os._exit(0)


# A RequestOutput as a plain tuple in field order: tuples of lists and ints pickle in C,
# a slotted dataclass through a Python __getstate__ per object.
_fields = operator.attrgetter(*(f.name for f in dataclasses.fields(RequestOutput)))


def _portable(error: BaseException | None) -> BaseException | None:
    """`error` if it survives pickling, else a RuntimeError that says what it was."""
    if error is None:
        return None
    try:
        pickle.loads(pickle.dumps(error))
    except Exception:
        return RuntimeError(repr(error))
    return error
