"""A network partition between the router and an engine (#16's fault matrix): the engine
runs in a network namespace of its own, joined to this one by a veth pair; taking the
engine's end of the link down cuts it off silently (established connections stall, as a
switch failure would, rather than being reset). The router stops hearing the engine's
load reports, marks it unhealthy after --engine-stale-seconds and continues its streams
on the other engine, token for token as an undisturbed run. Needs root and iproute2,
as the test suite has on its machines."""

from __future__ import annotations

import os
import subprocess

import grpc
import pytest
from omnibus.v1 import inference_pb2_grpc
from omnibus.v1 import inference_pb2 as pb

from omnibus.bench.processes import ServerProcess, engine_args
from tests.grpc_helpers import (
    engine_healthy,
    engine_process,
    engine_stats,
    free_port,
    metric,
    router_process,
    run_all,
    scrape,
    tiny_checkpoint,
)

FLAGS = ("--num-kv-blocks", "1200", "--block-size", "8", "--max-num-seqs", "16")
TOKENS, N = 400, 6


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


@pytest.fixture
def namespace():
    """A network namespace reachable at `address` over a veth pair; yields (name, address,
    the namespace-side link name)."""
    tag = f"{os.getpid() % 100000}"
    ns, host_if, ns_if = f"omnibus-part-{tag}", f"obh{tag}", f"obn{tag}"
    subnet = f"10.{200 + os.getpid() % 50}.{os.getpid() % 250}"
    ip("netns", "add", ns)
    try:
        ip("link", "add", host_if, "type", "veth", "peer", "name", ns_if)
        ip("link", "set", ns_if, "netns", ns)
        ip("addr", "add", f"{subnet}.1/24", "dev", host_if)
        ip("link", "set", host_if, "up")
        for cmd in (("addr", "add", f"{subnet}.2/24", "dev", ns_if), ("link", "set", ns_if, "up"),
                    ("link", "set", "lo", "up")):
            ip("netns", "exec", ns, "ip", *cmd)
        yield ns, f"{subnet}.2", ns_if
    finally:
        subprocess.run(["ip", "link", "del", host_if], capture_output=True)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def requests() -> list[pb.GenerateRequest]:
    sampling = pb.SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True)
    return [pb.GenerateRequest(text=f"tale {i}", sampling=sampling, request_id=f"p{i}")
            for i in range(N)]


def test_a_partitioned_engines_streams_continue_elsewhere(tmp_path_factory, namespace):
    ns, ns_address, ns_if = namespace
    model = tiny_checkpoint(tmp_path_factory)
    logs = tmp_path_factory.mktemp("partition")
    port = free_port()
    args = engine_args(port, model, *FLAGS, "--host", ns_address, "--drain-seconds", "1")
    cut_off = ServerProcess(args, logs / "cut-off.log", f"{ns_address}:{port}",
                            prefix=("ip", "netns", "exec", ns))
    survivor = engine_process(model, logs, "survivor", *FLAGS)
    procs = [cut_off, survivor]
    try:
        cut_off.wait_serving()
        survivor.wait_serving()
        metrics_port = free_port()
        router = router_process(model, [cut_off.address, survivor.address], logs, "router",
                                f"--metrics-port={metrics_port}", "--engine-stale-seconds=1.5")
        procs.append(router)
        router.wait_serving()
        stub = inference_pb2_grpc.InferenceStub(grpc.insecure_channel(router.address))
        undisturbed = run_all(stub, requests())
        victims: list[int] = []

        def partition() -> None:
            victims.append(engine_stats(cut_off.address).num_active_streams)
            ip("netns", "exec", ns, "ip", "link", "set", ns_if, "down")

        disturbed = run_all(stub, requests(), partition)
        assert victims[0] > 0, "no stream ran on the engine that was cut off"
        for (ids, _, last), (ref_ids, _, _) in zip(disturbed, undisturbed):
            assert ids == ref_ids and len(ids) == TOKENS
            assert last.finish_reason == pb.LENGTH and last.usage.completion_tokens == TOKENS
        assert not engine_healthy(metrics_port, cut_off.address)
        metrics = scrape(metrics_port)
        moved = metric(metrics, "omnibus_router_continued_streams_total", reason="engine_unhealthy")
        assert moved == victims[0]
        assert metric(metrics, "omnibus_router_requests_total", outcome="length") == 2 * N
    finally:
        for proc in reversed(procs):
            proc.stop()
