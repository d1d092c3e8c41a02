"""The engine never hangs on a multi-tenant mix (issue 31), end to end over real processes:
two engines (3 seats each, a KV pool one tight-deadline request nearly fills, one LoRA
slot that adapters share, the default waiting order) behind a router with three tenants
of different weights. Each round, one tenant's long outputs take every seat, and a
moment later the others flood in: long base-model and adapter outputs, greedy requests,
priority-5 requests, tight client deadlines that must expire, and cancels after 3
tokens; every other call has a loose deadline (600 s, as gRPC clients set).

Every greedy output equals the output of its prompt served alone; every call ends with
its expected status (OK, DEADLINE_EXCEEDED, CANCELLED: never UNAVAILABLE, which a stalled
engine's streams would end with, since the router here tries one engine per request);
after each round both engines are idle with every KV block free; no engine logs a
stalled step. Before the scheduler's fix (0a9b65b) an engine livelocked in every run.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import pytest
from omnibus.v1 import inference_pb2 as pb
from omnibus.v1 import inference_pb2_grpc

from tests.grpc_helpers import (
    ServerProcess,
    engine_process,
    engine_stats,
    free_port,
    metric,
    router_process,
    scrape,
    tiny_checkpoint,
    wait_until,
)
from tests.oracle.test_lora import ADAPTERS, make_adapter

NUM_KV_BLOCKS = 48  # 47 usable (block 0 is the null block) of 4 tokens: 188 tokens an engine
ENGINE_FLAGS = (
    "--max-num-seqs", "3", "--block-size", "4", "--num-kv-blocks", str(NUM_KV_BLOCKS),
    "--max-num-batched-tokens", "32", "--max-loras", "1", "--max-cpu-loras", "3",
    "--step-loop", "thread", "--watchdog-step-seconds", "10",
)  # fmt: skip
NAMES = ("a-r2", "b-r8", "c-r4")
TENANTS = {
    "heavy": {"keys": ["key-heavy"], "weight": 1},
    "mid": {"keys": ["key-mid"], "weight": 2},
    "light": {"keys": ["key-light"], "weight": 4},
}
LOOSE_S = 600.0  # a gRPC client's usual deadline: no SLO
# Seconds after heavy's flood that the rest of the mix comes, one round each: the livelock
# hung on when the others arrived while heavy's requests held every seat.
ROUNDS = (0.05, 0.1, 0.2)
MIX_TIMEOUT_S = 120.0  # a bound on waiting, far above need (the mix takes seconds)


@dataclass(frozen=True)
class Call:
    """One request of the mix and the status it must end with."""

    name: str
    key: str
    prompt: tuple[int, ...]
    max_tokens: int
    adapter: str = ""
    priority: int = 0
    timeout: float = LOOSE_S
    cancel_after: int = 0  # cancel once this many tokens came (0: read to the end)
    greedy: bool = False  # its output must equal the prompt's served alone
    expect: grpc.StatusCode = grpc.StatusCode.OK
    start: float = 0.0  # sent this many seconds into the mix

    def request(self) -> pb.GenerateRequest:
        sampling = pb.SamplingParams(max_tokens=self.max_tokens, ignore_eos=True,
                                     temperature=0.0 if self.greedy else 1.0, seed=len(self.name))
        return pb.GenerateRequest(request_id=self.name, token_ids=pb.TokenIds(ids=self.prompt),
                                  sampling=sampling, priority=self.priority)

    def metadata(self) -> list[tuple[str, str]]:
        metadata = [("authorization", f"Bearer {self.key}")]
        return metadata + [("x-adapter-id", self.adapter)] if self.adapter else metadata


def prompt(seed: int, length: int = 12) -> tuple[int, ...]:
    return tuple(3 + (seed * 37 + i * 11) % 300 for i in range(length))


def the_mix(later: float) -> list[Call]:
    adapters = ("", *NAMES)
    # Heavy floods first, one long request per seat (issue 31: a later tenant's request,
    # over-admitted by the router's fair share, preempted one of them, which took its seat
    # back, and so on forever inside one schedule()). The rest comes `later` s after.
    calls = [Call(f"flood-heavy-{i}", "key-heavy", prompt(i, 8), 48) for i in range(6)]
    for i in range(8):  # the other tenants' flood, on the base model and each adapter
        calls.append(Call(f"flood-{i}", ("key-mid", "key-light")[i % 2], prompt(20 + i, 16), 40,
                          adapters[i % 4], start=later))
    for i in range(4):  # tight deadlines (176 tokens in 0.1 s: no), once the floods are in
        calls.append(Call(f"tight-{i}", ("key-light", "key-heavy")[i % 2], prompt(300 + i, 8), 176,
                          adapters[i % 4], timeout=0.1, expect=grpc.StatusCode.DEADLINE_EXCEEDED,
                          start=2 * later))
    for i in range(8):  # greedy, with known outputs
        key = ("key-mid", "key-light")[i % 2]
        calls.append(Call(f"greedy-{i}", key, prompt(100 + i), 10, adapters[i % 4], greedy=True,
                          start=later))
    for i in range(4):  # priority 5, greedy too
        calls.append(Call(f"urgent-{i}", "key-heavy", prompt(200 + i), 8, adapters[(i + 1) % 4],
                          priority=5, greedy=True, start=later))
    for i in range(4):  # cancelled after 3 tokens
        calls.append(Call(f"cancel-{i}", ("key-mid", "key-heavy")[i % 2], prompt(400 + i), 40,
                          adapters[(i + 2) % 4], cancel_after=3, expect=grpc.StatusCode.CANCELLED,
                          start=later))
    return calls


async def run_call(stub: inference_pb2_grpc.InferenceStub, call: Call) -> tuple[grpc.StatusCode, list[int]]:
    """The status the call ended with and the token ids it got."""
    await asyncio.sleep(call.start)
    stream = stub.Generate(call.request(), metadata=call.metadata(), timeout=call.timeout)
    ids: list[int] = []
    try:
        async for response in stream:
            ids += response.token_ids
            if call.cancel_after and len(ids) >= call.cancel_after:
                stream.cancel()
                break
    except grpc.aio.AioRpcError as err:
        return err.code(), ids
    return await stream.code(), ids


@dataclass
class Stack:
    engines: list[ServerProcess]
    router: ServerProcess
    router_metrics: int


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Iterator[Stack]:
    model = tiny_checkpoint(tmp_path_factory)
    root = tmp_path_factory.mktemp("mix")
    for seed, name in enumerate(NAMES):
        make_adapter(model, root / "adapters" / name, *ADAPTERS[name], seed=seed)
    keys = root / "keys.json"
    keys.write_text(json.dumps({"tenants": TENANTS}))
    flags = ("--adapter-dir", str(root / "adapters"), *ENGINE_FLAGS)
    engines = [engine_process(model, root, f"engine-{i}", *flags) for i in range(2)]
    router_metrics = free_port()
    router = router_process(model, [e.address for e in engines], root, "router",
                            f"--keys-file={keys}", f"--metrics-port={router_metrics}",
                            "--max-engine-attempts", "1")  # a lost engine shows, not continues
    procs = [*engines, router]
    try:
        for proc in procs:
            proc.wait_serving()

        def both_engines_reporting() -> bool:
            text = scrape(router_metrics)
            return all(metric(text, "omnibus_router_engine_adapters_available", engine=e.address)
                       == len(NAMES) for e in engines)

        wait_until(both_engines_reporting, 60, "the router to see both engines' adapters")
        yield Stack(engines, router, router_metrics)
    finally:
        for proc in reversed(procs):
            proc.stop()


def idle_and_free(address: str) -> bool:
    s = engine_stats(address)
    idle = s.num_active_streams == 0 and s.load.num_running == 0 and s.load.num_waiting == 0
    return idle and s.load.num_free_blocks == NUM_KV_BLOCKS - 1


async def test_a_multi_tenant_mix_ends_as_expected_and_frees_every_block(stack: Stack) -> None:
    async with grpc.aio.insecure_channel(stack.router.address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        alone: dict[str, list[int]] = {}
        for call in the_mix(0.0):  # each greedy prompt served alone first: the expected output
            if call.greedy:
                status, ids = await run_call(stub, call)
                assert status == grpc.StatusCode.OK and len(ids) == call.max_tokens, (call.name, status)
                alone[call.name] = ids
        for later in ROUNDS:
            calls = the_mix(later)
            try:
                results = await asyncio.wait_for(
                    asyncio.gather(*(run_call(stub, call) for call in calls)), MIX_TIMEOUT_S)
            except TimeoutError:
                raise AssertionError(f"the mix did not end in {MIX_TIMEOUT_S} s: an engine hangs "
                                     "(its log has engine_step_stalled and step_loop_stack)") from None
            statuses = {call.name: status for call, (status, _) in zip(calls, results)}
            assert statuses == {call.name: call.expect for call in calls}, (
                f"round {later}; the engines' logs are in {stack.router.log_path.parent}")
            for call, (_, ids) in zip(calls, results):
                if call.greedy:
                    assert ids == alone[call.name], (call.name, later)
                elif call.expect == grpc.StatusCode.OK:
                    assert len(ids) == call.max_tokens, (call.name, later)
            for address in (e.address for e in stack.engines):  # every block free, each round
                await asyncio.to_thread(wait_until, lambda: idle_and_free(address), 30,
                                        f"engine {address} to be idle with every KV block free")
    for proc in stack.engines:
        log = proc.log_path.read_text(errors="replace")
        assert "engine_step_stalled" not in log, proc.log_tail()
    router_log = stack.router.log_path.read_text(errors="replace")
    assert "request_continued" not in router_log and "request_retried" not in router_log
