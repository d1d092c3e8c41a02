"""Processes that several e2e modules use alike, started once per test session (only when
a test asks for them): the tiny checkpoint, a real engine worker and a router in front of
it. Modules that need other flags (drain timings, adapters, fake engines) start their own.

Tests that use them must leave them as they found them: every request finished or
cancelled, every KV block free (test_e2e_streaming checks it after its tests)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.grpc_helpers import (
    ServerProcess,
    engine_process,
    free_port,
    router_process,
    tiny_checkpoint,
)

BLOCK_SIZE = 8
NUM_KV_BLOCKS = 128  # 127 usable: block 0 is the null block
ENGINE_FLAGS = (
    "--block-size",
    str(BLOCK_SIZE),
    "--num-kv-blocks",
    str(NUM_KV_BLOCKS),
    "--max-num-seqs",
    "2",
    "--max-num-batched-tokens",
    "32",
)  # small steps: long prompts prefill over several
# Embed batching: a long queue delay with preferred size 4, so batches of 4 leave at once
# and the rest wait (test_e2e_embed).
EMBED_FLAGS = (
    "--embed-max-batch-size",
    "8",
    "--embed-preferred-batch-sizes",
    "4",
    "--embed-max-queue-delay-ms",
    "200",
    "--embed-max-queue-size",
    "6",
)
ROUTER_FLAGS = ("--max-embed-inputs", "5")


@dataclass(frozen=True)
class Served:
    process: ServerProcess
    metrics_port: int  # its Prometheus /metrics

    @property
    def address(self) -> str:
        return self.process.address


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_checkpoint(tmp_path_factory)


@pytest.fixture(scope="session")
def one_adapter(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An adapter root for `--adapter-dir` holding one PEFT adapter of the tiny checkpoint,
    "b-r8" (tests/oracle/test_lora.py ADAPTERS), built once."""
    from tests.oracle.test_lora import ADAPTERS, make_adapter

    root = tmp_path_factory.mktemp("one-adapter")
    make_adapter(tiny_model, root / "b-r8", *ADAPTERS["b-r8"], seed=1)
    return root


@pytest.fixture(scope="session")
def shared_logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("shared-logs")


@pytest.fixture(scope="session")
def shared_engine(tiny_model: Path, shared_logs: Path) -> Iterator[Served]:
    """An engine worker serving the tiny checkpoint with ENGINE_FLAGS and EMBED_FLAGS, its
    step loop on a thread (engines started with the default run theirs in a process)."""
    port = free_port()
    flags = (*ENGINE_FLAGS, *EMBED_FLAGS, f"--metrics-port={port}", "--step-loop", "thread")
    engine = engine_process(tiny_model, shared_logs, "shared-engine", *flags)
    try:
        yield Served(engine.wait_serving(), port)
    finally:
        engine.stop()


@pytest.fixture(scope="session")
def shared_router(tiny_model: Path, shared_logs: Path, shared_engine: Served) -> Iterator[Served]:
    """A router in front of shared_engine alone, with ROUTER_FLAGS."""
    port = free_port()
    flags = (*ROUTER_FLAGS, f"--metrics-port={port}")
    router = router_process(
        tiny_model, [shared_engine.address], shared_logs, "shared-router", *flags
    )
    try:
        yield Served(router.wait_serving(), port)
    finally:
        router.stop()
