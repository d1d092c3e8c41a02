"""Where the step loop runs: on a thread of the server's process (`ThreadCore`) or in a
process of its own (`ProcessCore`, `omnibus-engine serve --step-loop process`).

In its own process the loop that feeds the device shares no GIL with the server's gRPC
and asyncio work (as vLLM v1's EngineCore and SGLang's scheduler run): commands go down a
pipe as pickled dataclasses, and each step comes back as one message with every output
of that step (and, when the step loop publishes them, its stats). A
reader thread in the server's process hands them to `AsyncEngine`. The step loop beats
the watchdog's heartbeat in shared memory. The process is spawned, not forked, so CUDA
starts clean in it; it ignores SIGINT (the server drains and then stops it) and exits
when the server's end of the pipe closes.
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
import time
from pathlib import Path

import structlog

from omnibus.common.heap import freeze_heap
from omnibus.common.threads import name_this_thread
from omnibus.engine.config import EngineConfig
from omnibus.engine.core.sequence import RequestOutput
from omnibus.engine.engine import AdapterError, Engine, EngineStats
from omnibus.engine.serving.step_loop import Command, Delivery, Outlet, QueueInbox, Refused, StepLoop
from omnibus.engine.serving.watchdog import Heartbeat

log = structlog.get_logger(__name__)

PRELOAD_TIMEOUT_S = 300.0


class EngineLoadError(Exception):
    """The engine could not be built: the message says what to fix."""


def load_engine(config: EngineConfig) -> Engine:
    """The engine of `config`, warmed up, with its --preload-adapters in host memory.
    Raises EngineLoadError."""
    if config.adapter_dir is not None and not Path(config.adapter_dir).is_dir():
        raise EngineLoadError(f"--adapter-dir {config.adapter_dir} is not a directory")
    if config.device.startswith("cuda"):
        _check_cuda(config.device)
    if config.load_format == "null" and config.device == "cpu":
        import torch

        # The null model's CPU tensors are a few hundred elements: more intra-op threads
        # only add the CPU they spin on (on a GPU these ops are the device's), which would
        # count against the host path the null model exists to measure.
        torch.set_num_threads(1)
    try:
        engine = Engine(config)
        engine.warmup()
    except AdapterError as exc:  # a --preload-adapters adapter this engine cannot serve
        raise EngineLoadError(f"--preload-adapters: {exc}") from exc
    except (OSError, ValueError) as exc:  # ModelLoadError
        raise EngineLoadError(f"cannot load {config.model}: {exc}") from exc
    except LookupError as exc:  # UnknownAdapterError: a --preload-adapters name
        raise EngineLoadError(f"--preload-adapters: {exc}") from exc
    except (MemoryError, RuntimeError) as exc:
        if not _out_of_memory(exc):
            raise
        raise EngineLoadError(
            f"cannot load {config.model}: out of {config.device} memory "
            f"({str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__}); the weights, "
            "the KV pool (--kv-cache-memory, --num-kv-blocks) and the rotary tables, one row per position "
            "up to --max-model-len (default: config.json's max_position_embeddings), must fit: lower "
            "those or use a larger device") from exc
    preload(engine)
    return engine


def _out_of_memory(exc: BaseException) -> bool:
    """torch's allocation failures: torch.OutOfMemoryError (CUDA), a RuntimeError from the
    CPU allocator, or Python's MemoryError."""
    import torch

    return (isinstance(exc, (MemoryError, torch.OutOfMemoryError))
            or "can't allocate memory" in str(exc) or "out of memory" in str(exc))


def _check_cuda(device: str) -> None:
    """EngineLoadError when `device` (cuda or cuda:N) is not a GPU this process can use."""
    import torch

    if not torch.cuda.is_available():
        why = ("this torch build has no CUDA" if torch.version.cuda is None
               else f"torch (CUDA {torch.version.cuda}) finds no GPU: check the driver and CUDA_VISIBLE_DEVICES")
        raise EngineLoadError(f"--device {device}: {why}; use --device cpu to run on the CPU")
    index = int(device.partition(":")[2] or 0)
    if index >= torch.cuda.device_count():
        raise EngineLoadError(f"--device {device}: there are {torch.cuda.device_count()} GPUs "
                              f"(cuda:0 to cuda:{torch.cuda.device_count() - 1})")


def preload(engine: Engine, timeout: float = PRELOAD_TIMEOUT_S) -> None:
    """Waits until the --preload-adapters (whose loads Engine() started) are in host
    memory. Raises EngineLoadError naming an adapter that failed to load. Runs before the
    step loop starts, so polling the manager here is safe."""
    from omnibus.engine.lora import AdapterLoadError

    adapters = engine.adapters
    pending = list(engine.config.preload_adapters) if adapters is not None else []
    end = time.monotonic() + timeout
    while pending:
        for name in list(pending):
            try:
                if adapters.ready(name):
                    pending.remove(name)
            except AdapterLoadError as exc:
                raise EngineLoadError(f"cannot preload adapter {name!r}: {exc.reason}") from exc
        if pending and time.monotonic() > end:
            raise EngineLoadError(f"preloading {pending} took more than {timeout:.0f} s")
        time.sleep(0.005)


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


class ThreadCore:
    """The step loop on a thread of this process (tests, benchmarks, `--step-loop thread`)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.config = engine.config
        self.max_model_len = engine.model_config.max_model_len
        self.first_stats = engine.stats()
        self.heartbeat = Heartbeat()
        self._inbox = QueueInbox()
        self._thread: threading.Thread | None = None

    def start(self, outlet: Outlet) -> None:
        loop = StepLoop(self.engine, self._inbox, outlet, self.heartbeat)
        self._thread = threading.Thread(target=loop.run, name="engine-step-loop", daemon=True)
        self._thread.start()

    def send(self, cmd: Command) -> None:
        self._inbox.put(cmd)

    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self, timeout: float) -> None:
        self._inbox.put(None)
        if self._thread is not None:
            self._thread.join(timeout)


class ProcessCore:
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
        self._process = ctx.Process(target=_core_main,
                                    args=(config, child, shared, log_level, os.getpid()),
                                    name="omnibus-engine-core", daemon=True)
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
                f"the engine core process exited (code {self._process.exitcode}) while loading"
            ) from None
        if msg[0] == "failed":
            raise EngineLoadError(msg[1])
        return msg[1], msg[2]

    def start(self, outlet: Outlet) -> None:
        self._reader = threading.Thread(target=self._read, args=(outlet,), name="engine-core-reader",
                                        daemon=True)
        self._reader.start()

    def send(self, cmd: Command) -> None:
        try:
            with self._send_lock:
                self._conn.send(cmd)
        except OSError:  # the core is gone: its reader reports that (crashed) to everyone
            pass

    def is_alive(self) -> bool:
        return self._process.is_alive() and self._reader is not None and self._reader.is_alive()

    def stop(self, timeout: float) -> None:
        self._stopping = True
        self.send(None)
        self._process.join(timeout)
        if self._process.is_alive():
            log.warning("engine_core_kill", pid=self._process.pid)
            self._process.kill()
            self._process.join()
        if self._reader is not None:
            self._reader.join(timeout)
        self._conn.close()

    def _read(self, outlet: Outlet) -> None:
        """The reader thread: every message of the core, in order, handed to `outlet`."""
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
                f"the engine core process exited (code {self._process.exitcode})"))


# ---- the core process ----------------------------------------------------------


def _core_main(config: EngineConfig, conn: multiprocessing.connection.Connection,
               shared, log_level: str, server_pid: int) -> None:
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
    StepLoop(engine, _PipeInbox(conn), _PipeOutlet(conn), Heartbeat(shared)).run()


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


class _PipeInbox:
    def __init__(self, conn: multiprocessing.connection.Connection) -> None:
        self._conn = conn

    def get(self, timeout: float | None) -> Command:
        if not self._conn.poll(timeout):
            raise queue.Empty
        try:
            return self._conn.recv()
        except EOFError:  # the server is gone: stop
            return None

    def get_nowait(self) -> Command:
        return self.get(0.0)


class _PipeOutlet:
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

    def _send(self, msg: tuple) -> None:
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
