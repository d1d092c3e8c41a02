"""Engine and router processes on loopback, for the studies and the tests: start
`python -m omnibus.engine|omnibus.router serve` with its output in a log file, wait until
its gRPC health is SERVING, signal it, stop it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

START_TIMEOUT_S = 120.0  # generous: a loaded 2-core machine importing torch


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(
    predicate: Callable[[], bool], timeout: float, what: str, poll: float = 0.02
) -> None:
    """Polls until `predicate()` holds; raises AssertionError naming `what` after `timeout`
    s. A bound on waiting, not a timing assertion: the timeouts are far above need."""
    end = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(poll)


class ServerProcess:
    """One `python <args>` child serving gRPC at `address`, its output in `log_path`.
    `env` adds to the inherited environment; `cwd` is where it starts (None: here);
    `prefix` runs it through another command (e.g. `ip netns exec NS`)."""

    def __init__(
        self,
        args: list[str],
        log_path: Path,
        address: str,
        *,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
        prefix: Sequence[str] = (),
    ) -> None:
        self.args = args
        self.address = address
        self.log_path = log_path
        self._log = open(log_path, "wb")  # noqa: SIM115 (closed by stop())
        self.proc = subprocess.Popen(
            [*prefix, sys.executable, *args],
            cwd=cwd,
            env=dict(os.environ, PYTHONUNBUFFERED="1", **(env or {})),
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def health(self, timeout: float = 1.0) -> int | None:
        """The process's overall health status, or None when it does not answer."""
        with grpc.insecure_channel(self.address) as channel:
            try:
                reply = health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(), timeout=timeout
                )
            except grpc.RpcError:
                return None
        return reply.status

    def wait_serving(self, timeout: float = START_TIMEOUT_S) -> ServerProcess:
        end = time.monotonic() + timeout
        while self.health() != health_pb2.HealthCheckResponse.SERVING:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.args} exited with {self.proc.returncode}:\n{self.log_tail()}"
                )
            if time.monotonic() > end:
                raise RuntimeError(f"{self.args} not SERVING after {timeout} s:\n{self.log_tail()}")
            time.sleep(0.1)
        return self

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def wait_exit(self, timeout: float = 60.0) -> int:
        return self.proc.wait(timeout)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def step_loop_pid(engine_pid: int) -> int | None:
    """The engine's step-loop process (`--step-loop process`), if it runs one."""
    task = Path(f"/proc/{engine_pid}/task")
    for t in task.iterdir():
        for child in (t / "children").read_text().split():
            if b"resource_tracker" not in Path(f"/proc/{child}/cmdline").read_bytes():
                return int(child)
    return None


def engine_args(port: int | str, model: Path | str, *flags: str) -> list[str]:
    """`python` arguments of an engine worker serving `model` on `port`."""
    return ["-m", "omnibus.engine", "serve", "--port", str(port), "--model", str(model), *flags]


def engine_configs(model: Path | str, *flags: str):
    """The (EngineConfig, ServerConfig) an engine worker started with `flags` serves with,
    read by its own parser: for in-process runs that must match a served one."""
    from omnibus.engine.serving.cli import build_parser, configs_from_args

    return configs_from_args(build_parser().parse_args(engine_args(0, model, *flags)[2:]))


def router_args(port: int | str, model: Path | str, engines: list[str], *flags: str) -> list[str]:
    """`python` arguments of a router on `port` in front of `engines` (host:port each)."""
    engine_flags = [f for address in engines for f in ("--engine", address)]
    return [
        "-m",
        "omnibus.router",
        "serve",
        "--port",
        str(port),
        "--model",
        str(model),
        *engine_flags,
        *flags,
    ]


def engine_process(
    model: Path, log_dir: Path, name: str, *flags: str, env: Mapping[str, str] | None = None
) -> ServerProcess:
    """An engine worker on a free port, logging to log_dir/name.log (not yet waited for)."""
    port = free_port()
    args = engine_args(port, model, *flags)
    return ServerProcess(args, log_dir / f"{name}.log", f"127.0.0.1:{port}", env=env)


def router_process(
    model: Path, engines: list[str], log_dir: Path, name: str, *flags: str
) -> ServerProcess:
    """A router on a free port in front of `engines`, logging to log_dir/name.log."""
    port = free_port()
    args = router_args(port, model, engines, *flags)
    return ServerProcess(args, log_dir / f"{name}.log", f"127.0.0.1:{port}")


@contextmanager
def engine_and_router(
    model: Path,
    log_dir: Path,
    engine_flags: Sequence[str] = (),
    router_flags: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
) -> Iterator[tuple[ServerProcess, ServerProcess]]:
    """One engine worker (`env` added to its environment) and a router in front of it,
    both SERVING; both are stopped on leaving."""
    engine = engine_process(model, log_dir, "engine", *engine_flags, env=env)
    router = None
    try:
        router = router_process(model, [engine.address], log_dir, "router", *router_flags)
        engine.wait_serving()
        router.wait_serving()  # SERVING once its engine reports load
        yield engine, router
    finally:
        for child in (router, engine):
            if child is not None:
                child.stop()


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """This process's torch intra-op threads set to `n` inside the block, restored after
    (an in-process engine measured as an engine process with OMP_NUM_THREADS=n runs)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
