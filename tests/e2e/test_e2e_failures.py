"""Engines going away: SIGKILL mid-stream (the stream continues on the other engine,
which keeps serving) and SIGTERM (the engine drains)."""

from __future__ import annotations

import signal

import grpc
import pytest
from grpc_health.v1 import health_pb2
from omnibus.v1 import engine_pb2_grpc, inference_pb2_grpc
from omnibus.v1 import inference_pb2 as pb

from tests.grpc_helpers import (
    ServerProcess,
    engine_process,
    engine_request,
    engine_stats,
    free_port,
    metric,
    router_process,
    scrape,
    tiny_checkpoint,
    wait_until,
)

FLAGS = ("--num-kv-blocks", "128", "--block-size", "8", "--max-num-seqs", "4")
LONG = 900  # tokens: far longer than any of these tests waits


@pytest.fixture(scope="module")
def processes(tmp_path_factory):
    model = tiny_checkpoint(tmp_path_factory)
    logs = tmp_path_factory.mktemp("logs")
    engines = {
        "a": engine_process(model, logs, "engine-a", *FLAGS),
        "b": engine_process(model, logs, "engine-b", *FLAGS),
        "drain": engine_process(model, logs, "engine-drain", *FLAGS, "--drain-seconds", "60"),
        "grace": engine_process(model, logs, "engine-grace", *FLAGS, "--drain-seconds", "0.3"),
    }
    procs = list(engines.values())
    try:
        for proc in procs:
            proc.wait_serving()
        metrics_port = free_port()
        backends = [engines["a"].address, engines["b"].address]
        router = router_process(model, backends, logs, "router", f"--metrics-port={metrics_port}")
        procs.append(router)
        router.wait_serving()
        yield {**engines, "router": router, "router_metrics": metrics_port}
    finally:
        for proc in reversed(procs):
            proc.stop()


def long_request(prompt: str, max_tokens: int = LONG) -> pb.GenerateRequest:
    sampling = pb.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return pb.GenerateRequest(text=prompt, sampling=sampling)


def test_sigkill_mid_stream_continues_on_the_other_engine_and_the_router_keeps_serving(processes):
    router: ServerProcess = processes["router"]
    client = inference_pb2_grpc.InferenceStub(grpc.insecure_channel(router.address))
    call = client.Generate(long_request("Once upon a time"))
    first = next(call)
    victim = next(
        e
        for e in (processes["a"], processes["b"])
        if engine_stats(e.address).num_active_streams == 1
    )
    survivor = processes["b"] if victim is processes["a"] else processes["a"]
    victim.signal(signal.SIGKILL)
    rest = list(call)  # one stream: the survivor goes on after the tokens already sent
    assert len(first.token_ids) + sum(len(r.token_ids) for r in rest) == LONG
    assert rest[-1].finish_reason == pb.LENGTH
    assert rest[-1].usage.completion_tokens == LONG
    for i in range(3):
        done = list(client.Generate(long_request(f"again {i}", max_tokens=5)))
        assert done[-1].finish_reason == pb.LENGTH
    assert router.health() == health_pb2.HealthCheckResponse.SERVING
    text = scrape(processes["router_metrics"])
    assert metric(text, "omnibus_router_engine_healthy", engine=victim.address) == 0
    assert metric(text, "omnibus_router_engine_healthy", engine=survivor.address) == 1


def test_sigterm_refuses_new_requests_and_lets_in_flight_streams_finish(processes):
    engine: ServerProcess = processes["drain"]
    stub = engine_pb2_grpc.EngineStub(grpc.insecure_channel(engine.address))
    in_flight = stub.Generate(engine_request("in-flight", max_tokens=LONG))
    next(in_flight)
    engine.signal(signal.SIGTERM)
    wait_until(
        lambda: engine.health() == health_pb2.HealthCheckResponse.NOT_SERVING, 30, "NOT_SERVING"
    )
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(engine_request("late")))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert err.value.details() == "the engine is shutting down; send the request to another engine"
    rest = list(in_flight)
    assert rest[-1].finish_reason == pb.LENGTH
    assert rest[-1].num_output_tokens == LONG
    assert engine.wait_exit() == 0


def test_streams_still_running_when_the_grace_period_ends_are_aborted(processes):
    engine: ServerProcess = processes["grace"]  # 0.3 s of grace
    stub = engine_pb2_grpc.EngineStub(grpc.insecure_channel(engine.address))
    in_flight = stub.Generate(engine_request("too-long", max_tokens=LONG))
    next(in_flight)
    engine.signal(signal.SIGTERM)
    rest = list(in_flight)
    assert rest[-1].finish_reason == pb.ABORTED
    assert 0 < rest[-1].num_output_tokens < LONG
    assert engine.wait_exit() == 0
