"""Nothing lost (#16): a stream whose engine dies (SIGKILL, or its step-loop process
SIGKILLed) or stalls (SIGSTOP) goes on on the other engine as prompt + the tokens
already sent, and the client sees one uninterrupted stream equal, token for token, to an
undisturbed run (greedy, and seeded sampling with penalties), with usage counting each
token once."""

from __future__ import annotations

import os
import signal

import grpc
import pytest
from omnibus.v1 import inference_pb2_grpc
from omnibus.v1 import inference_pb2 as pb

from tests.grpc_helpers import (
    engine_healthy,
    engine_process,
    engine_stats,
    fake_engine_process,
    free_port,
    metric,
    router_process,
    run_all,
    scrape,
    tiny_checkpoint,
    wait_until,
)

FLAGS = ("--num-kv-blocks", "1200", "--block-size", "8", "--max-num-seqs", "16")
TOKENS = 300  # each stream, long enough to be cut mid-way (the fault lands after every first token)
N = 10


@pytest.fixture
def processes(tmp_path_factory, fault):
    model = tiny_checkpoint(tmp_path_factory)
    logs = tmp_path_factory.mktemp("logs")
    # A short drain: on SIGTERM the engine ends what is still running ABORTED after 0.5 s.
    # The step loop in a process of its own (as `--step-loop auto` runs it) where the fault
    # reaches it: core-SIGKILL kills that process, SIGTERM's drain talks to it; a SIGKILL or
    # SIGSTOP of the server takes either loop with it (the process one's own death watch:
    # tests/unit/core/test_step_loop_process.py), so those run it on a thread, one torch
    # import and model load less per engine.
    loop = "process" if fault in ("core-SIGKILL", "SIGTERM") else "thread"
    engines = [engine_process(model, logs, f"engine-{i}", *FLAGS, "--drain-seconds", "0.5", "--step-loop", loop)
               for i in range(2)]
    procs = list(engines)
    try:
        for proc in engines:
            proc.wait_serving()
        port = free_port()
        router = router_process(model, [e.address for e in engines], logs, "router",
                                f"--metrics-port={port}", "--engine-stale-seconds=1.5")
        procs.append(router)
        router.wait_serving()
        yield engines, router, port
    finally:
        for proc in reversed(procs):
            proc.signal(signal.SIGCONT)
            proc.stop()


_UNDISTURBED: list = []  # lose_an_engine's reference streams, once per worker


def requests() -> list[pb.GenerateRequest]:
    """Greedy and seeded (with penalties) requests, each long enough to be cut mid-way."""
    out = []
    for i in range(N):
        if i % 2:
            sampling = pb.SamplingParams(max_tokens=TOKENS, temperature=0.9, seed=100 + i,
                                         top_k=50, frequency_penalty=0.4, repetition_penalty=1.2,
                                         ignore_eos=True)
        else:
            sampling = pb.SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True)
        out.append(pb.GenerateRequest(text=f"story {i} began", sampling=sampling,
                                      request_id=f"r{i}"))
    return out


@pytest.mark.parametrize("fault", ["SIGKILL", "core-SIGKILL"])  # SIGSTOP, SIGTERM: test_continuation_stalled.py
def test_a_lost_engines_streams_continue_elsewhere_token_exact(processes, fault):
    lose_an_engine(processes, fault)


def lose_an_engine(processes, fault: str) -> None:
    """All N streams on one engine (the other is held stopped until they have their first
    token, so the router sends them all to the victim), then the victim is lost: killed,
    stopped, drained past its grace period (its streams end ABORTED), or left without its
    step-loop process (an OOM kill: its requests fail UNAVAILABLE, its load reports end)."""
    from omnibus.bench.processes import step_loop_pid

    engines, router, port = processes
    victim, survivor = engines
    stub = inference_pb2_grpc.InferenceStub(grpc.insecure_channel(router.address))
    # The undisturbed run is the same for every fault (same checkpoint, requests and seeds):
    # the first case of a worker streams it, the others reuse it.
    ran_reference = not _UNDISTURBED
    if ran_reference:
        reference = run_all(stub, requests())
        assert None not in reference, "an undisturbed stream did not end within run_all's wait"
        _UNDISTURBED.extend(reference)
    undisturbed = list(_UNDISTURBED)
    survivor.signal(signal.SIGSTOP)
    wait_until(lambda: not engine_healthy(port, survivor.address), 30,
               "the router to mark the survivor unhealthy")

    def hit():
        assert engine_stats(victim.address).num_active_streams == N
        survivor.signal(signal.SIGCONT)
        wait_until(lambda: engine_healthy(port, survivor.address), 30, "the survivor to report again")
        if fault == "core-SIGKILL":
            os.kill(step_loop_pid(victim.proc.pid), signal.SIGKILL)
        else:
            victim.signal(getattr(signal, fault))

    disturbed = run_all(stub, requests(), hit)
    for (ids, text, last), (ref_ids, ref_text, ref_last) in zip(disturbed, undisturbed):
        assert ids == ref_ids and len(ids) == TOKENS
        assert text == ref_text
        assert last.finish_reason == pb.LENGTH
        assert last.usage.completion_tokens == TOKENS
        assert last.usage.prompt_tokens == ref_last.usage.prompt_tokens
    metrics = scrape(port)
    # The lost step loop reaches the router two ways at once (each request UNAVAILABLE, the
    # load stream's end): either takes a stream elsewhere, and only once.
    reasons = {"SIGKILL": ["engine_unavailable"], "SIGSTOP": ["engine_unhealthy"],
               "SIGTERM": ["engine_drained"], "core-SIGKILL": ["engine_unavailable", "engine_unhealthy"]}[fault]
    continued = sum(metric(metrics, "omnibus_router_continued_streams_total", reason=r) for r in reasons)
    assert continued == N
    assert metric(metrics, "omnibus_router_requests_total", outcome="length") == N * (1 + ran_reference)


def test_a_router_drain_that_runs_out_ends_streams_aborted_with_usage_and_queued_unavailable(
    tmp_path_factory,
):
    """SIGTERM to a router whose --drain-seconds runs out: the stream still decoding (a
    slow fake engine: 1000 tokens at 50 ms a step) ends with a final ABORTED message whose
    usage counts the tokens sent; the request queued behind it (the engine has one seat)
    ends UNAVAILABLE without reaching an engine."""
    model = tiny_checkpoint(tmp_path_factory)
    logs = tmp_path_factory.mktemp("drain")
    engine = fake_engine_process(logs, "slow-engine", "--step-ms", "50", "--max-num-seqs", "1")
    procs = [engine]
    try:
        engine.wait_serving()
        port = free_port()
        router = router_process(model, [engine.address], logs, "draining-router",
                                "--drain-seconds=1", "--max-inflight-per-engine=1",
                                f"--metrics-port={port}")
        procs.append(router)
        router.wait_serving()
        stub = inference_pb2_grpc.InferenceStub(grpc.insecure_channel(router.address))
        prompt = [5, 6, 7]
        sampling = pb.SamplingParams(max_tokens=1000, ignore_eos=True)
        running = stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt),
                                                   sampling=sampling))
        received = [next(running)]  # decoding on the engine's one seat
        queued = stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt),
                                                  sampling=sampling))
        wait_until(lambda: metric(scrape(port), "omnibus_router_queue_length", priority="0") == 1,
                   30, "the second request to be queued")
        router.signal(signal.SIGTERM)
        received += list(running)
        final = received[-1]
        sent = sum(len(r.token_ids) for r in received)
        assert final.finish_reason == pb.ABORTED
        assert (final.usage.prompt_tokens, final.usage.completion_tokens) == (len(prompt), sent)
        assert 0 < sent < 1000
        with pytest.raises(grpc.RpcError) as err:
            list(queued)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert router.wait_exit() == 0
    finally:
        for proc in reversed(procs):
            proc.stop()
