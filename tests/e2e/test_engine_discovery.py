"""Engines found by DNS: one router process with `--engine dns://DNS/engines.test:PORT`,
fake engine processes on 127.0.0.1-4 (one port, several loopback addresses) and a
DNS server the test controls (tests/dns_server.py).

Three engines with room for 2, 4 and 6 requests get requests in proportion to their
room; then, under load, one engine leaves DNS (drained, then removed) and a fourth
joins, with no failed request.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from omnibus.v1 import inference_pb2 as pb
from omnibus.v1 import inference_pb2_grpc

from tests.dns_server import DnsServer
from tests.grpc_helpers import (
    ServerProcess,
    engine_stats,
    free_port,
    router_process,
    scrape,
    tiny_checkpoint,
    wait_until,
)

NAME = "engines.test"
ROOMS = {"127.0.0.1": 2, "127.0.0.2": 4, "127.0.0.3": 6, "127.0.0.4": 4}
FIRST = ["127.0.0.1", "127.0.0.2", "127.0.0.3"]
STEP_MS = 20
MAX_TOKENS = 10  # a request holds its engine slot for 10 steps
CLIENTS = 20  # more than the 12 slots of the first three engines: each stays full


def port_free_on_every_address() -> int:
    while True:
        port = free_port()
        try:
            for ip in ROOMS:
                with socket.socket() as s:
                    s.bind((ip, port))
        except OSError:
            continue
        return port


def fake_engine_at(ip: str, port: int, logs) -> ServerProcess:
    flags = ["--host", ip, "--port", str(port), "--max-num-seqs", str(ROOMS[ip])]
    args = ["-m", "tests.fake_engine", *flags, "--step-ms", str(STEP_MS)]
    return ServerProcess(args, logs / f"fake-{ip}.log", f"{ip}:{port}")


class Load:
    """CLIENTS threads sending requests back to back until stopped; counts outcomes."""

    def __init__(self, router: ServerProcess) -> None:
        self._channel = grpc.insecure_channel(router.address)
        self._stub = inference_pb2_grpc.InferenceStub(self._channel)
        self.done = 0
        self.failures: list[str] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._client) for _ in range(CLIENTS)]

    def __enter__(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join()
        self._channel.close()

    def _client(self) -> None:
        request = pb.GenerateRequest(
            text="a fox", sampling=pb.SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
        )
        while not self._stop.is_set():
            try:
                *_, last = self._stub.Generate(request, timeout=30)
                ok = last.finish_reason == pb.LENGTH
                error = "" if ok else f"finish reason {last.finish_reason}"
            except grpc.RpcError as exc:
                error = f"{exc.code().name}: {exc.details()}"
            with self._lock:
                if error:
                    self.failures.append(error)
                else:
                    self.done += 1


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> Iterator[tuple[ServerProcess, dict[str, ServerProcess], DnsServer, int]]:
    model = tiny_checkpoint(tmp_path_factory)
    logs = tmp_path_factory.mktemp("discovery")
    dns_server = DnsServer()
    port = port_free_on_every_address()
    engines = {ip: fake_engine_at(ip, port, logs) for ip in ROOMS}
    dns_server.set(NAME, FIRST)
    metrics_port = free_port()
    router = router_process(
        model,
        [f"dns://127.0.0.1:{dns_server.port}/{NAME}:{port}"],
        logs,
        "router-dns",
        *("--engine-resolve-seconds", "0.2", "--metrics-port", str(metrics_port)),
    )
    procs = [*engines.values(), router]
    try:
        for proc in procs:
            proc.wait_serving()
        wait_until(lambda: engines_seen(metrics_port) == {f"{ip}:{port}" for ip in FIRST}, 30,
                   "the router to add the three engines")
        yield router, engines, dns_server, metrics_port
    finally:
        for proc in reversed(procs):
            proc.stop()
        dns_server.close()


def engines_seen(metrics_port: int) -> set[str]:
    """Engines the router has (healthy or not), from its per-engine metric."""
    text = scrape(metrics_port)
    prefix = 'omnibus_router_engine_inflight{engine="'
    return {line[len(prefix):].split('"')[0] for line in text.splitlines()
            if line.startswith(prefix)}


def served(engines: dict[str, ServerProcess]) -> dict[str, int]:
    return {ip: engine_stats(e.address).num_requests for ip, e in engines.items()}


def test_three_engines_behind_one_name_get_requests_in_proportion_to_their_room(setup):
    router, engines, _, _ = setup
    first = {ip: engines[ip] for ip in FIRST}
    with Load(router) as load:
        time.sleep(1.0)  # every engine full, the queue non-empty
        before = served(first)
        time.sleep(4.0)
        after = served(first)
    assert load.failures == []
    counts = {ip: after[ip] - before[ip] for ip in FIRST}
    total = sum(counts.values())
    room = sum(ROOMS[ip] for ip in FIRST)
    shares = {ip: round(n / total, 3) for ip, n in counts.items()}
    expected = {ip: round(ROOMS[ip] / room, 3) for ip in FIRST}
    print(f"requests per engine {counts}, shares {shares}, room shares {expected}")
    assert total > 50
    for ip in FIRST:
        assert shares[ip] == pytest.approx(expected[ip], abs=0.06), (counts, expected)


def test_an_engine_leaves_and_one_joins_under_load_with_no_failed_request(setup):
    router, engines, dns_server, metrics_port = setup
    port = int(engines["127.0.0.1"].address.rsplit(":", 1)[1])
    leaving, joining = f"127.0.0.1:{port}", f"127.0.0.4:{port}"
    with Load(router) as load:
        wait_until(lambda: engine_stats(leaving).num_active_streams > 0, 10,
                   "requests in flight on the engine that will leave", poll=0.005)
        dns_server.set(NAME, ["127.0.0.2", "127.0.0.3", "127.0.0.4"])
        wait_until(lambda: engines_seen(metrics_port) == {
            f"{ip}:{port}" for ip in ("127.0.0.2", "127.0.0.3", "127.0.0.4")
        }, 30, "the router to drop 127.0.0.1 and add 127.0.0.4")
        # Removed only once drained: nothing of this router's is left on it.
        assert engine_stats(leaving).num_active_streams == 0
        left_with = engine_stats(leaving).num_requests
        engines["127.0.0.1"].stop()  # as Kubernetes ends the pod
        joined_at = engine_stats(joining).num_requests
        time.sleep(2.0)
        done = load.done
    assert load.failures == [], load.failures[:5]
    assert engine_stats(joining).num_requests - joined_at > 20  # the new engine takes its share
    assert done > 60
    print(f"{done} requests, 0 failed; 127.0.0.1 served {left_with} before leaving")


def test_without_engines_the_router_is_not_serving_but_alive(setup, tmp_path_factory):
    _, _, dns_server, _ = setup
    model = tiny_checkpoint(tmp_path_factory)
    metrics_port = free_port()
    lonely = router_process(model, [f"dns://127.0.0.1:{dns_server.port}/nobody.test:50061"],
                            tmp_path_factory.mktemp("lonely"), "router-lonely",
                            "--metrics-port", str(metrics_port))
    try:
        def liveness() -> int | None:
            with grpc.insecure_channel(lonely.address) as channel:
                try:
                    return health_pb2_grpc.HealthStub(channel).Check(
                        health_pb2.HealthCheckRequest(service="liveness"), timeout=1).status
                except grpc.RpcError:
                    return None

        wait_until(lambda: liveness() == health_pb2.HealthCheckResponse.SERVING, 60,
                   "the router's liveness service")
        assert lonely.health() == health_pb2.HealthCheckResponse.NOT_SERVING
        # The autoscaler's signal is there, at 0, with the model's name; process_* too.
        text = scrape(metrics_port)
        assert 'omnibus_router_queue_length{model_name="tiny-llama",priority="0"} 0.0' in text
        assert "process_resident_memory_bytes" in text
    finally:
        lonely.stop()
