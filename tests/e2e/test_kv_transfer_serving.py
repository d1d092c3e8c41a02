"""Disaggregated serving and live migration through the router (--kv-transfer mooncake,
--role): a prefill engine computes each prompt and its first token, a decode engine reads
that KV and goes on, token for token as one engine serves the request (greedy, seeded,
with a LoRA adapter); a decode engine drained mid-stream (SIGTERM) moves its running
streams' KV to the other decode engine, every stream completing token-exact with no
prompt recomputed (counted); a prefill engine killed mid-traffic leaves the decode engine
recomputing, token-exact, and the router serving. One decode engine stages its KV through
host memory (--kv-transfer-staging-bytes, as on a GPU), the others read in place: they
read each other's handles. The in-process faults are in
tests/oracle/test_kv_transfer.py."""

from __future__ import annotations

import random
import signal
import threading

import grpc
import pytest
from omnibus.v1 import engine_pb2_grpc
from omnibus.v1 import inference_pb2 as pb
from omnibus.v1 import inference_pb2_grpc

from omnibus.bench.processes import free_port
from tests.grpc_helpers import (
    engine_process, engine_request, engine_stats, metric, router_process, scrape, wait_until)

pytest.importorskip("mooncake.engine", reason="Mooncake's transfer engine is in `make setup`'s environment")

FLAGS = ("--num-kv-blocks", "600", "--block-size", "8", "--max-num-seqs", "16", "--max-loras", "2",
         "--kv-transfer", "mooncake", "--drain-seconds", "20")


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, tiny_model, one_adapter):
    model = tiny_model
    logs = tmp_path_factory.mktemp("logs")
    flags = (*FLAGS, "--adapter-dir", str(one_adapter))
    # decode-2 stages its KV through host memory as an engine on a GPU does (copied in when
    # read, out when held for a drain); the others read theirs in place
    staged = ("--kv-transfer-staging-bytes", str(32 << 20))
    engines = {name: engine_process(model, logs, name, *flags, "--role", role, *extra)
               for name, role, extra in (("prefill", "prefill", ()), ("decode-1", "decode", ()),
                                         ("decode-2", "decode", staged))}
    procs = list(engines.values())
    try:
        for proc in procs:
            proc.wait_serving()
        port = free_port()
        router = router_process(model, [e.address for e in engines.values()], logs, "router",
                                f"--metrics-port={port}", "--engine-stale-seconds=1.5")
        procs.append(router)
        router.wait_serving()
        yield {**engines, "router": inference_pb2_grpc.InferenceStub(grpc.insecure_channel(router.address)),
               "metrics": port}
    finally:
        for proc in reversed(procs):
            proc.stop()


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 250) for _ in range(n)]


def via_router(fleet, ids: list[int], max_tokens: int, adapter: str = "", **sampling) -> list[int]:
    req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), sampling=pb.SamplingParams(
        max_tokens=max_tokens, ignore_eos=True, **({"temperature": 0.0} | sampling)))
    metadata = (("x-adapter-id", adapter),) if adapter else ()
    return [t for r in fleet["router"].Generate(req, metadata=metadata) for t in r.token_ids]


def one_engine(fleet, ids: list[int], max_tokens: int, adapter: str = "", engine: str = "decode-2",
               **sampling) -> list[int]:
    """What one engine serves alone (no KV moved): a decode engine's own Generate."""
    with grpc.insecure_channel(fleet[engine].address) as channel:
        stub = engine_pb2_grpc.EngineStub(channel)
        req = engine_request(f"ref-{random.random()}", ids, adapter, max_tokens=max_tokens, **sampling)
        return [t for r in stub.Generate(req, timeout=60) for t in r.token_ids]


def loaded(fleet, *names: str) -> int:
    return sum(engine_stats(fleet[n].address).kv_transfer.loaded_tokens for n in names)


def test_prefill_and_decode_on_two_engines_serve_what_one_engine_serves(fleet):
    cases = [(prompt(1, 45), 16, "", {}), (prompt(2, 160), 12, "", {}), (prompt(3, 30), 10, "b-r8", {}),
             (prompt(4, 50), 14, "", {"temperature": 0.8, "top_p": 0.9, "seed": 5})]
    before = loaded(fleet, "decode-1", "decode-2")
    for ids, n, adapter, sampling in cases:
        assert via_router(fleet, ids, n, adapter, **sampling) == one_engine(fleet, ids, n, adapter, **sampling)
    # each decode engine read the prompt's KV (every prompt token): none was computed twice
    assert loaded(fleet, "decode-1", "decode-2") - before == sum(len(c[0]) for c in cases)
    text = scrape(fleet["metrics"])
    assert metric(text, "omnibus_router_prefill_handoffs_total", kv_from="transfer") >= len(cases)
    prefill = fleet["prefill"].address
    wait_until(lambda: engine_stats(prefill).kv_transfer.held == 0, 10, "the router to release the held KV")
    stats = engine_stats(prefill).kv_transfer
    assert stats.released >= len(cases) and stats.expired == 0


def test_a_draining_decode_engine_moves_its_streams_with_their_kv(fleet):
    """SIGTERM to decode-1 while it streams: its running streams end there ABORTED with
    their KV's handles and go on on decode-2, which reads that KV."""
    cases = [(prompt(10 + i, 24 + 7 * i), 160) for i in range(8)]
    # computed on decode-1, whose prefix cache then draws the streams there (prefix-aware routing)
    expected = [one_engine(fleet, ids, n, engine="decode-1") for ids, n in cases]
    before = engine_stats(fleet["decode-2"].address).kv_transfer.loaded_tokens
    results: list[list[int] | BaseException] = [[] for _ in cases]
    started = threading.Barrier(len(cases) + 1)

    def stream(i: int) -> None:
        ids, n = cases[i]
        req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids),
                                 sampling=pb.SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
        try:
            for j, r in enumerate(fleet["router"].Generate(req, timeout=120)):
                results[i] += r.token_ids  # type: ignore[operator]
                if j == 2:
                    started.wait(60)
        except BaseException as exc:  # noqa: BLE001 (the assertion below names it)
            results[i] = exc

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(len(cases))]
    for t in threads:
        t.start()
    started.wait(60)  # every stream is decoding, on decode-1 or decode-2
    running = engine_stats(fleet["decode-1"].address).load.num_running
    fleet["decode-1"].signal(signal.SIGTERM)
    for t in threads:
        t.join(120)
    assert results == expected
    assert fleet["decode-1"].wait_exit(30) == 0
    text = scrape(fleet["metrics"])
    migrated = metric(text, "omnibus_router_continued_streams_total", reason="engine_migrated")
    assert migrated >= running > 0  # the streams decode-1 was running moved with their KV
    assert metric(text, "omnibus_router_continued_streams_total", reason="engine_drained") == 0
    # decode-2 read each moved stream's context: prompt + tokens sent, less the last token
    assert engine_stats(fleet["decode-2"].address).kv_transfer.loaded_tokens - before > running * 24


def test_a_prefill_engine_killed_mid_traffic_leaves_decode_recomputing_token_exact(fleet):
    cases = [(prompt(40 + i, 40), 20) for i in range(4)]
    expected = [one_engine(fleet, ids, n) for ids, n in cases]
    results: list[list[int]] = [[] for _ in cases]

    def stream(i: int) -> None:
        results[i] = via_router(fleet, *cases[i])

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(len(cases))]
    for t in threads:
        t.start()
    fleet["prefill"].signal(signal.SIGKILL)
    for t in threads:
        t.join(120)
    assert results == expected
    # the router serves on without a prefill engine: decode-2 takes whole requests
    ids = prompt(50, 33)
    assert via_router(fleet, ids, 8) == one_engine(fleet, ids, 8)
