"""End to end over real processes on loopback: routers in front of engine workers
serving a tiny random Llama checkpoint, checked against Hugging Face transformers.
Engine A and the solo router are the session's shared ones (tests/e2e/conftest.py)."""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)
from omnibus.v1 import engine_pb2_grpc, inference_pb2_grpc
from omnibus.v1 import inference_pb2 as pb
from tokenizers import Tokenizer

from tests.checkpoints import hf_greedy, load_hf
from tests.e2e.conftest import ENGINE_FLAGS, NUM_KV_BLOCKS
from tests.grpc_helpers import (
    ServerProcess,
    engine_process,
    engine_request,
    engine_stats,
    metric,
    router_process,
    scrape,
    wait_until,
)


@dataclass
class Cluster:
    model: Path
    tokenizer: Tokenizer
    engine_a: ServerProcess
    engine_b: ServerProcess
    engine_a_metrics: int
    solo: ServerProcess  # router in front of engine A only
    solo_metrics: int
    pair: ServerProcess  # router in front of both engines


@pytest.fixture(scope="module")
def cluster(tiny_model, tmp_path_factory, request):
    logs = tmp_path_factory.mktemp("logs")
    # A's twin, with its step loop in a process of its own (A's runs on a thread)
    engine_b = engine_process(tiny_model, logs, "engine-b", *ENGINE_FLAGS, "--step-loop", "process")
    procs = [engine_b]
    try:
        # Asked for only now, so that engine A (if no module started it yet) boots while B does.
        shared_engine = request.getfixturevalue("shared_engine")
        shared_router = request.getfixturevalue("shared_router")
        engine_b.wait_serving()
        both = [shared_engine.address, engine_b.address]
        pair = router_process(tiny_model, both, logs, "router-pair", "--max-queued-requests=500")
        procs.append(pair)
        pair.wait_serving()
        tokenizer = Tokenizer.from_file(str(tiny_model / "tokenizer.json"))
        yield Cluster(
            tiny_model,
            tokenizer,
            shared_engine.process,
            engine_b,
            shared_engine.metrics_port,
            shared_router.process,
            shared_router.metrics_port,
            pair,
        )
    finally:
        for proc in reversed(procs):
            proc.stop()


def stub(proc: ServerProcess) -> inference_pb2_grpc.InferenceStub:
    return inference_pb2_grpc.InferenceStub(grpc.insecure_channel(proc.address))


def engine_stub(proc: ServerProcess) -> engine_pb2_grpc.EngineStub:
    return engine_pb2_grpc.EngineStub(grpc.insecure_channel(proc.address))


def is_idle(address: str) -> bool:
    s = engine_stats(address)
    return s.num_active_streams == 0 and s.load.num_running == 0 and s.load.num_waiting == 0


def wait_idle_and_check_blocks(*engines: ServerProcess) -> None:
    """Every engine ends with no sequence and every KV block free."""
    for engine in engines:
        wait_until(lambda a=engine.address: is_idle(a), 60, f"{engine.address} to be idle")
        load = engine_stats(engine.address).load
        assert (load.num_free_blocks, load.num_total_blocks) == (
            NUM_KV_BLOCKS - 1,
            NUM_KV_BLOCKS - 1,
        )


def greedy(max_tokens: int, **kw) -> pb.SamplingParams:
    return pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


def test_greedy_stream_equals_transformers_generate(cluster):
    text = "Every day the fox ran to the river, café ☕."
    prompt = cluster.tokenizer.encode(text).ids
    responses = list(
        stub(cluster.solo).Generate(pb.GenerateRequest(text=text, sampling=greedy(24)))
    )
    ids = [t for r in responses for t in r.token_ids]
    assert ids == hf_greedy(load_hf(cluster.model), prompt, 24)
    assert "".join(r.text for r in responses) == cluster.tokenizer.decode(ids)
    last = responses[-1]
    assert last.finish_reason == pb.LENGTH
    assert last.usage == pb.Usage(
        prompt_tokens=len(prompt), completion_tokens=24, cached_prompt_tokens=0
    )
    assert 0 < last.timing.time_to_first_token_seconds <= last.timing.total_seconds


def test_the_process_step_loop_streams_transformers_greedy_tokens(cluster):
    """Engine B runs its step loop in a process of its own: the same tokens, and the last
    message's usage, come back through the pipe and the server."""
    prompt = cluster.tokenizer.encode("Once upon a time the quick brown fox").ids
    replies = list(engine_stub(cluster.engine_b).Generate(
        engine_request("process-core", prompt, max_tokens=20), timeout=30))
    assert [t for r in replies for t in r.token_ids] == hf_greedy(load_hf(cluster.model), prompt, 20)
    last = replies[-1]
    assert (last.finish_reason, last.num_prompt_tokens, last.num_output_tokens) == (
        pb.LENGTH, len(prompt), 20)
    wait_idle_and_check_blocks(cluster.engine_b)


def engine_outcome(cluster: Cluster, outcome: str) -> float:
    """Engine A's count of requests that ended with `outcome`."""
    text = scrape(cluster.engine_a_metrics)
    return metric(text, "omnibus_engine_requests_total", outcome=outcome)


def test_stop_string_across_tokens_cuts_the_text_and_cancels_the_engine_request(cluster):
    prompt = "Numbers like 12345 and symbols"
    first = list(stub(cluster.solo).Generate(pb.GenerateRequest(text=prompt, sampling=greedy(40))))
    ids = [t for r in first for t in r.token_ids]
    full, head = cluster.tokenizer.decode(ids), cluster.tokenizer.decode(ids[:10])
    assert full.startswith(head) and len(full) >= len(head) + 2
    stop = full[len(head) - 2 : len(head) + 2]  # spans the boundary after token 10
    before = {o: engine_outcome(cluster, o) for o in ("length", "cancelled")}
    request = pb.GenerateRequest(text=prompt, sampling=greedy(900, stop=[stop]))
    responses = list(stub(cluster.solo).Generate(request))
    assert "".join(r.text for r in responses) == full[: full.index(stop)]
    assert responses[-1].finish_reason == pb.STOP
    # The engine's request ends because the router cancelled it, not by running to its end.
    wait_until(
        lambda: engine_outcome(cluster, "cancelled") == before["cancelled"] + 1,
        30,
        "the engine to see its request cancelled",
    )
    assert engine_outcome(cluster, "length") == before["length"]


def test_logprobs_come_with_each_token(cluster):
    responses = list(
        stub(cluster.solo).Generate(
            pb.GenerateRequest(text="The quick brown dog", sampling=greedy(6, logprobs=3))
        )
    )
    entries = [lp for r in responses for lp in r.logprobs]
    assert [lp.token_id for lp in entries] == [t for r in responses for t in r.token_ids]
    for lp in entries:
        assert len(lp.top) == 3
        assert lp.top[0].token_id == lp.token_id  # greedy takes the most likely token
        assert lp.logprob == pytest.approx(lp.top[0].logprob)
        assert lp.top[0].logprob >= lp.top[1].logprob >= lp.top[2].logprob


def test_repeated_prompt_reports_cached_prompt_tokens(cluster):
    prompt = pb.TokenIds(ids=[(7 * i) % 300 + 3 for i in range(40)])
    usages = [
        list(stub(cluster.solo).Generate(pb.GenerateRequest(token_ids=prompt, sampling=greedy(2))))[
            -1
        ].usage
        for _ in range(2)
    ]
    # The second request reuses the 4 full blocks before the last prompt token.
    assert [(u.prompt_tokens, u.cached_prompt_tokens) for u in usages] == [(40, 0), (40, 32)]


def test_metrics_endpoints(cluster):
    list(stub(cluster.solo).Generate(pb.GenerateRequest(text="metrics", sampling=greedy(3))))
    router = scrape(cluster.solo_metrics)
    assert metric(router, "omnibus_router_time_to_first_token_seconds_count") >= 1
    assert metric(router, "omnibus_router_requests_total", outcome="length") >= 1
    engine = cluster.engine_a.address
    assert metric(router, "omnibus_router_engine_healthy", engine=engine) == 1
    assert (
        metric(router, "omnibus_router_engine_kv_blocks_total", engine=engine) == NUM_KV_BLOCKS - 1
    )
    wait_idle_and_check_blocks(cluster.engine_a)
    text = scrape(cluster.engine_a_metrics)
    assert metric(text, "omnibus_engine_kv_blocks_free") == NUM_KV_BLOCKS - 1
    assert metric(text, "omnibus_engine_kv_blocks_used") == 0
    assert metric(text, "omnibus_engine_running_sequences") == 0
    assert metric(text, "omnibus_engine_time_to_first_token_seconds_count") >= 1


def test_engine_health_and_reflection(cluster):
    with grpc.insecure_channel(cluster.engine_b.address) as channel:
        for service in ("", "omnibus.v1.Engine"):
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service)
            )
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        assert "omnibus.v1.Engine" in ProtoReflectionDescriptorDatabase(channel).get_services()


def test_two_engines_share_the_load(cluster):
    before = [engine_stats(e.address).num_requests for e in (cluster.engine_a, cluster.engine_b)]
    calls = [
        stub(cluster.pair).Generate(pb.GenerateRequest(text=f"story {i}", sampling=greedy(30)))
        for i in range(8)
    ]
    assert [list(c)[-1].usage.completion_tokens for c in calls] == [30] * 8
    after = [engine_stats(e.address).num_requests for e in (cluster.engine_a, cluster.engine_b)]
    served = [b - a for a, b in zip(before, after)]
    # Each engine runs 2 sequences at most, so the first 4 requests split 2 and 2.
    assert sum(served) == 8 and min(served) >= 2


@pytest.mark.parametrize("via_router", [True, False], ids=["via-router", "engine-direct"])
def test_deadline_during_decode_aborts_and_frees_blocks(cluster, via_router):
    engine = cluster.engine_a
    if via_router:
        request = pb.GenerateRequest(text="deadline", sampling=greedy(900))
        call = stub(cluster.solo).Generate(request, timeout=0.2)
    else:
        request = engine_request("direct-deadline", max_tokens=900)
        call = engine_stub(engine).Generate(request, timeout=0.2)
    with pytest.raises(grpc.RpcError) as err:
        list(call)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_idle_and_check_blocks(engine)


BAD_ENGINE_REQUESTS = {
    "empty-prompt": (engine_request(prompt=()), grpc.StatusCode.INVALID_ARGUMENT, "empty"),
    "bad-token": (engine_request(prompt=(1, 999)), grpc.StatusCode.INVALID_ARGUMENT, "999"),
    "bad-top-p": (engine_request(top_p=0.0), grpc.StatusCode.INVALID_ARGUMENT, "top_p"),
    "unknown-adapter": (engine_request(adapter="pirate"), grpc.StatusCode.NOT_FOUND, "'pirate'"),
    "no-request-id": (
        engine_request(request_id=""),
        grpc.StatusCode.INVALID_ARGUMENT,
        "request_id",
    ),
}


@pytest.mark.parametrize("name", BAD_ENGINE_REQUESTS)
def test_engine_refuses_bad_requests_with_their_status(cluster, name):
    """The engine's own checks (the router's are in test_router_service); `message` is
    the part of the engine's wording that names the culprit."""
    request_, code, message = BAD_ENGINE_REQUESTS[name]
    with pytest.raises(grpc.RpcError) as err:
        list(engine_stub(cluster.engine_b).Generate(request_, timeout=30))
    assert err.value.code() == code
    assert message in err.value.details()


async def test_cancelling_200_streams_at_random_moments_frees_every_kv_block(cluster):
    """Cancels land while requests wait in the router's queue, while they prefill
    (prompts up to 120 tokens, 32 tokens per step) and while they decode."""
    rng = random.Random(1234)
    channel = grpc.aio.insecure_channel(cluster.pair.address)
    client = inference_pb2_grpc.InferenceStub(channel)

    async def one(i: int) -> str:
        prompt = [rng.randrange(3, 384) for _ in range(rng.randint(1, 120))]
        call = client.Generate(
            pb.GenerateRequest(
                token_ids=pb.TokenIds(ids=prompt),
                sampling=greedy(rng.randint(4, 40)),
                priority=rng.randint(0, 3),
            )
        )
        messages, delay = rng.randint(0, 6), rng.uniform(0.0, 0.3)
        try:
            if messages == 0:
                await asyncio.sleep(delay)
            for _ in range(messages):
                await call.read()
        except grpc.aio.AioRpcError as exc:
            return exc.code().name
        call.cancel()
        return "cancelled"

    engines = (cluster.engine_a, cluster.engine_b)
    before = sum(engine_stats(e.address).num_requests for e in engines)
    outcomes = await asyncio.gather(*(one(i) for i in range(200)))
    await channel.close()
    assert outcomes.count("cancelled") == 200
    wait_idle_and_check_blocks(*engines)
    reached = sum(engine_stats(e.address).num_requests for e in engines) - before
    assert 0 < reached < 200  # some were cancelled before leaving the router's queue


def test_a_stream_interval_sends_fewer_larger_messages_with_the_same_tokens(cluster, tmp_path):
    """--stream-interval 4: after the first message (its token is never held: see
    test_session), messages of at least four tokens until the last; the tokens and text
    are the ones every update would have carried."""
    router = router_process(cluster.model, [cluster.engine_a.address], tmp_path, "router-interval",
                            "--stream-interval", "4")
    try:
        router.wait_serving()
        text = "Once upon a time the quick brown fox"
        responses = list(stub(router).Generate(pb.GenerateRequest(text=text, sampling=greedy(24))))
    finally:
        router.stop()
    ids = [t for r in responses for t in r.token_ids]
    prompt = cluster.tokenizer.encode(text).ids
    assert ids == hf_greedy(load_hf(cluster.model), prompt, 24)
    assert "".join(r.text for r in responses) == cluster.tokenizer.decode(ids)
    sizes = [len(r.token_ids) for r in responses]
    assert all(n >= 4 for n in sizes[1:-1]) and len(sizes) <= 1 + 23 // 4 + 1
    assert responses[-1].finish_reason == pb.LENGTH and responses[-1].usage.completion_tokens == 24


def test_a_deadline_of_months_is_served_as_a_deadline(cluster):
    """Outside probe: a client deadline beyond 2**32 ms (~49.7 days) failed UNKNOWN ("Value
    out of range") writing the engine request's uint32 deadline_ms."""
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5, 6, 7]), sampling=greedy(3))
    for timeout in (4_300_000.0, 1e8):
        responses = list(stub(cluster.solo).Generate(request, timeout=timeout))
        assert sum(len(r.token_ids) for r in responses) == 3
    wait_idle_and_check_blocks(cluster.engine_a)
