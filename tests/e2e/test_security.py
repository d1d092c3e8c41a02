"""The secure setup end to end: a router serving TLS on its public port, reaching an engine
over mutual TLS with the shared engine token; the engine refuses every caller without
its client certificate (at the handshake) or without the token (UNAUTHENTICATED) — the
bypasses of issue #16: Generate at priority 2**31-1, Stats, LoadAdapter, UnloadAdapter.
Certificates are made at test time (tests/certs.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from omnibus.bench.processes import engine_args, router_args
from omnibus.v1 import engine_pb2, engine_pb2_grpc, inference_pb2, inference_pb2_grpc

from omnibus.common.security import ClientSecurity
from tests.certs import Pki, make_pki
from tests.grpc_helpers import START_TIMEOUT_S, ServerProcess, engine_request, free_port


class SecureProcess(ServerProcess):
    """A ServerProcess whose health is asked over `security`'s channel."""

    def __init__(self, args: list[str], log_path: Path, address: str, security: ClientSecurity) -> None:
        super().__init__(args, log_path, address)
        self.security = security

    def health(self, timeout: float = 1.0) -> int | None:
        with self.security.channel(self.address) as channel:
            try:
                return health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(), timeout=timeout).status
            except grpc.RpcError:
                return None


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def secure(tiny_model: Path, pki: Pki, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[tuple[SecureProcess, SecureProcess]]:
    logs = tmp_path_factory.mktemp("secure-logs")
    router_side = ClientSecurity.from_files(str(pki.ca), str(pki.client.cert), str(pki.client.key),
                                            str(pki.token))
    eport, rport = free_port(), free_port()
    engine = SecureProcess(
        engine_args(eport, tiny_model, "--num-kv-blocks", "64", "--block-size", "8",
                    "--tls-cert", str(pki.server.cert), "--tls-key", str(pki.server.key),
                    "--tls-client-ca", str(pki.ca), "--token-file", str(pki.token)),
        logs / "engine.log", f"127.0.0.1:{eport}", router_side)
    router = None
    try:
        engine.wait_serving()
        router = SecureProcess(
            router_args(rport, tiny_model, [engine.address],
                        "--tls-cert", str(pki.server.cert), "--tls-key", str(pki.server.key),
                        "--engine-tls-ca", str(pki.ca), "--engine-tls-cert", str(pki.client.cert),
                        "--engine-tls-key", str(pki.client.key),
                        "--engine-token-file", str(pki.token)),
            logs / "router.log", f"127.0.0.1:{rport}", ClientSecurity.from_files(str(pki.ca)))
        # SERVING means the router gets load reports: mTLS + token to the engine work.
        router.wait_serving(START_TIMEOUT_S)
        yield engine, router
    finally:
        if router is not None:
            router.stop()
            assert "s3cret" not in router.log_path.read_text()
        engine.stop()
        assert "s3cret" not in engine.log_path.read_text()


def _generate(channel: grpc.Channel) -> list[inference_pb2.GenerateResponse]:
    stub = inference_pb2_grpc.InferenceStub(channel)
    request = inference_pb2.GenerateRequest(
        text="hello", sampling=inference_pb2.SamplingParams(max_tokens=3, temperature=0.0))
    return list(stub.Generate(request, timeout=30))


def test_generate_over_tls_and_mutual_tls(secure: tuple[SecureProcess, SecureProcess], pki: Pki) -> None:
    _, router = secure
    with ClientSecurity.from_files(str(pki.ca)).channel(router.address) as channel:
        replies = _generate(channel)
    assert replies[-1].finish_reason == inference_pb2.LENGTH
    assert replies[-1].usage.completion_tokens == 3


def test_public_port_refuses_plaintext_and_untrusted(secure: tuple[SecureProcess, SecureProcess],
                                                     pki: Pki) -> None:
    _, router = secure
    for client in (ClientSecurity(), ClientSecurity.from_files(str(pki.wrong_ca))):
        with client.channel(router.address) as channel, pytest.raises(grpc.RpcError) as err:
            _generate(channel)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_engine_refuses_callers_without_client_certificate(
        secure: tuple[SecureProcess, SecureProcess], pki: Pki) -> None:
    engine, _ = secure
    token = str(pki.token)
    for client in (
        ClientSecurity(token=ClientSecurity.from_files(token_file=token).token),  # plaintext
        ClientSecurity.from_files(str(pki.ca), token_file=token),  # no certificate
        ClientSecurity.from_files(str(pki.ca), str(pki.expired_client.cert),
                                  str(pki.expired_client.key), token),
        ClientSecurity.from_files(str(pki.ca), str(pki.wrong_client.cert),
                                  str(pki.wrong_client.key), token),
    ):
        with client.channel(engine.address) as channel, pytest.raises(grpc.RpcError) as err:
            engine_pb2_grpc.EngineStub(channel).Stats(engine_pb2.StatsRequest(),
                                                      metadata=client.metadata(), timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE  # the handshake failed


def test_engine_refuses_calls_without_the_token(secure: tuple[SecureProcess, SecureProcess],
                                                pki: Pki) -> None:
    engine, _ = secure
    certified = ClientSecurity.from_files(str(pki.ca), str(pki.client.cert), str(pki.client.key))
    wrong = ClientSecurity.from_files(token_file=str(pki.wrong_token)).metadata()
    with certified.channel(engine.address) as channel:
        stub = engine_pb2_grpc.EngineStub(channel)
        bypass = engine_request("bypass")
        bypass.priority = 2**31 - 1
        calls = {
            "Generate at the top priority": lambda md: list(stub.Generate(bypass, metadata=md,
                                                                          timeout=10)),
            "Session at the top priority": lambda md: list(stub.Session(
                iter([engine_pb2.SessionRequest(add=[bypass])]), metadata=md, timeout=10)),
            "Stats": lambda md: stub.Stats(engine_pb2.StatsRequest(), metadata=md, timeout=10),
            "LoadAdapter": lambda md: stub.LoadAdapter(
                engine_pb2.LoadAdapterRequest(adapter="a"), metadata=md, timeout=10),
            "UnloadAdapter": lambda md: stub.UnloadAdapter(
                engine_pb2.UnloadAdapterRequest(adapter="a"), metadata=md, timeout=10),
        }
        token = ClientSecurity.from_files(token_file=str(pki.token)).metadata()
        before = stub.Stats(engine_pb2.StatsRequest(), metadata=token, timeout=10)
        for what, call in calls.items():
            for metadata in ((), wrong):
                with pytest.raises(grpc.RpcError) as err:
                    call(metadata)
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, what
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        after = stub.Stats(engine_pb2.StatsRequest(), metadata=token, timeout=10)
    # The refused Generate and Session calls never reached the engine's service.
    assert after.num_requests == before.num_requests
