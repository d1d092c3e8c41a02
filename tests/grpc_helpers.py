"""Running router / engine processes on loopback for tests, and talking to them."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from omnibus.v1 import engine_pb2, engine_pb2_grpc

from tests.checkpoints import make_checkpoint

ROOT = Path(__file__).resolve().parents[1]
START_TIMEOUT_S = 120.0  # generous: a loaded 2-core CI machine importing torch


def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The test session's tiny random Llama checkpoint (tests/checkpoints.py), built once
    and shared by every module that serves it: building one takes seconds."""
    path = tmp_path_factory.getbasetemp() / "tiny-llama"
    if not (path / "tokenizer.json").exists():  # written last by make_checkpoint
        make_checkpoint(path)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(
    predicate: Callable[[], bool], timeout: float, what: str, poll: float = 0.02
) -> None:
    """Polls until `predicate()` holds; fails the test naming `what` after `timeout` s.
    A bound on waiting, not a timing assertion: the timeouts are far above need."""
    end = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(poll)


class ServerProcess:
    """One `python -m <module> ...` child with its stderr in a log file."""

    def __init__(self, args: list[str], log_path: Path, address: str) -> None:
        self.args = args
        self.address = address
        self.log_path = log_path
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, *args], cwd=ROOT, env=env, stdout=self._log, stderr=subprocess.STDOUT
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


def engine_process(model: Path, log_dir: Path, name: str, *flags: str) -> ServerProcess:
    port = free_port()
    args = ["-m", "omnibus.engine", "serve", "--port", str(port), "--model", str(model), *flags]
    return ServerProcess(args, log_dir / f"{name}.log", f"127.0.0.1:{port}")


def router_process(
    model: Path, engines: list[str], log_dir: Path, name: str, *flags: str
) -> ServerProcess:
    port = free_port()
    engine_flags = [f for address in engines for f in ("--engine", address)]
    args = [
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
    return ServerProcess(args, log_dir / f"{name}.log", f"127.0.0.1:{port}")


def fake_engine_process(log_dir: Path, name: str, *flags: str, port: int = 0) -> ServerProcess:
    """tests/fake_engine.py as a process, on `port` (0: a free one)."""
    port = port or free_port()
    args = ["-m", "tests.fake_engine", "--port", str(port), *flags]
    return ServerProcess(args, log_dir / f"{name}.log", f"127.0.0.1:{port}")


def engine_request(
    request_id: str = "test",
    prompt: Sequence[int] = (5, 6, 7),
    adapter: str = "",
    **sampling: float | int | bool,
) -> engine_pb2.EngineGenerateRequest:
    """A request straight to an engine: greedy, ignoring EOS, 4 tokens, unless overridden."""
    params: dict[str, Any] = dict(
        max_tokens=4, temperature=0.0, top_p=1.0, repetition_penalty=1.0, ignore_eos=True
    )
    return engine_pb2.EngineGenerateRequest(
        request_id=request_id,
        prompt_token_ids=prompt,
        adapter=adapter,
        sampling=engine_pb2.EngineSamplingParams(**(params | sampling)),
    )


def engine_stats(address: str) -> engine_pb2.StatsResponse:
    with grpc.insecure_channel(address) as channel:
        return engine_pb2_grpc.EngineStub(channel).Stats(engine_pb2.StatsRequest(), timeout=10)


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        return reply.read().decode()


def metric(text: str, name: str, **labels: str) -> float:
    """The value of one sample in Prometheus text format (0.0 when absent)."""
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    pattern = re.compile(rf"^{re.escape(name)}(\{{(?P<labels>[^}}]*)\}})? (?P<value>\S+)$", re.M)
    for m in pattern.finditer(text):
        got = ",".join(sorted((m.group("labels") or "").split(","))) if m.group("labels") else ""
        if got == want:
            return float(m.group("value"))
    return 0.0
