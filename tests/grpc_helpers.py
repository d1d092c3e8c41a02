"""Running router / engine processes on loopback for tests, and talking to them."""

from __future__ import annotations

import re
import threading
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import grpc
import pytest
from omnibus.bench import processes
from omnibus.bench.processes import (  # noqa: F401 (the tests import them from here)
    START_TIMEOUT_S,
    free_port,
    router_process,
    wait_until,
)
from omnibus.v1 import engine_pb2, engine_pb2_grpc

from tests.checkpoints import make_checkpoint

ROOT = Path(__file__).resolve().parents[1]


def engine_process(model: Path, log_dir: Path, name: str, *flags: str,
                   env: Mapping[str, str] | None = None) -> processes.ServerProcess:
    """An engine worker (processes.engine_process) with its step loop on a thread unless
    `flags` say otherwise: a step loop in a process of its own costs a second torch import
    and model load per engine, and the tests about that process ask for it
    (`--step-loop process`; a later flag wins)."""
    return processes.engine_process(model, log_dir, name, "--step-loop", "thread", *flags, env=env)


def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The test session's tiny random Llama checkpoint (tests/checkpoints.py), built once
    and shared by every module that serves it: building one takes seconds."""
    path = tmp_path_factory.getbasetemp() / "tiny-llama"
    if not (path / "tokenizer.json").exists():  # written last by make_checkpoint
        make_checkpoint(path)
    return path


class ServerProcess(processes.ServerProcess):
    """omnibus.bench.processes.ServerProcess started in the repository root, where
    `python -m tests.fake_engine` imports."""

    def __init__(
        self, args: list[str], log_path: Path, address: str, *, env: Mapping[str, str] | None = None
    ) -> None:
        super().__init__(args, log_path, address, env=env, cwd=ROOT)


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
    """The value of one sample in Prometheus text format (0.0 when absent). The sample's
    labels must be exactly `labels`, except model_name (on every series), which is
    compared only when given."""
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    pattern = re.compile(rf"^{re.escape(name)}(\{{(?P<labels>[^}}]*)\}})? (?P<value>\S+)$", re.M)
    for m in pattern.finditer(text):
        pairs = (m.group("labels") or "").split(",") if m.group("labels") else []
        if "model_name" not in labels:
            pairs = [p for p in pairs if not p.startswith("model_name=")]
        got = ",".join(sorted(pairs))
        if got == want:
            return float(m.group("value"))
    return 0.0


def engine_healthy(metrics_port: int, address: str) -> bool:
    """Whether the router serving metrics on `metrics_port` counts the engine at `address`
    healthy (reporting load, not draining)."""
    return metric(scrape(metrics_port), "omnibus_router_engine_healthy", engine=address) == 1.0


def collect(stub: Any, request: Any, first: threading.Barrier | None = None) -> tuple[list[int], str, Any]:
    """One Generate stream to its end: (token ids, text, last response); waits at `first`
    once the first response is in."""
    ids, text, last = [], "", None
    for response in stub.Generate(request, timeout=120):
        ids += response.token_ids
        text += response.text
        assert response.request_id == request.request_id
        last = response
        if first is not None:
            first.wait(timeout=60)
            first = None
    return ids, text, last


def run_all(stub: Any, requests: Sequence[Any], fault: Callable[[], None] | None = None) -> list:
    """Every request at once, each on its own thread; `fault` runs once each stream has its
    first token. Returns collect()'s result per request, in order."""
    results: list = [None] * len(requests)
    barrier = threading.Barrier(len(requests) + 1)

    def one(i: int, request: Any) -> None:
        results[i] = collect(stub, request, barrier)

    threads = [threading.Thread(target=one, args=(i, r)) for i, r in enumerate(requests)]
    for t in threads:
        t.start()
    barrier.wait(timeout=60)
    if fault is not None:
        fault()
    for t in threads:
        t.join(timeout=180)
    return results
