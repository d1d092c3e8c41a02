"""omnibus.common.security through build_server, in process: the token interceptor (health
passes, everything else needs the token, unknown methods too), TLS and mutual TLS
credentials, and the file checks. The engine and router processes: tests/e2e/test_security.py."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from omnibus.common.grpc_server import build_server
from omnibus.common.security import ClientSecurity, ServerSecurity, read_token
from tests.certs import Pair, Pki, make_pki
from tests.grpc_helpers import free_port


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


async def _serve(security: ServerSecurity) -> tuple[grpc.aio.Server, str]:
    servicer = health.aio.HealthServicer()
    port = free_port()
    server = build_server("127.0.0.1", port, [], servicer, security=security)
    await server.start()
    await servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    return server, f"127.0.0.1:{port}"


@pytest.fixture
async def token_server(pki: Pki) -> AsyncIterator[str]:
    server, address = await _serve(ServerSecurity.from_files(token_file=str(pki.token)))
    yield address
    await server.stop(0)


async def _health(channel: grpc.aio.Channel) -> int:
    reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    return reply.status


async def _reflect(channel: grpc.aio.Channel) -> reflection_pb2.ServerReflectionResponse:
    """One stream-stream call (reflection): needs the token like every other method."""
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    call = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                     timeout=5)
    async for reply in call:
        return reply
    raise AssertionError("no reflection reply")


async def _refused(channel: grpc.aio.Channel, metadata: tuple = ()) -> tuple[grpc.StatusCode, str]:
    """The status of a reflection stream opened with `metadata` and never written to. (A
    write racing the server's early status can turn it into INTERNAL "Failed execute_batch"
    on the client: grpc/grpc#36066, open as of grpcio 1.8x; the server's refusal is what is
    under test, so nothing is written.)"""
    call = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(metadata=metadata, timeout=5)
    code, details = await call.code(), await call.details()
    call.cancel()
    return code, details


async def test_token_guards_every_method_but_health(token_server: str, pki: Pki) -> None:
    async with grpc.aio.insecure_channel(token_server) as channel:
        assert await _health(channel) == health_pb2.HealthCheckResponse.SERVING
        code, details = await _refused(channel)
        assert code == grpc.StatusCode.UNAUTHENTICATED and "token" in details
        # An unknown method is refused the same way: no token, no map of the API.
        unknown = channel.unary_unary("/omnibus.v1.Engine/Nope")
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await unknown(b"\xff\x00garbage", timeout=5)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    wrong = ClientSecurity.from_files(token_file=str(pki.wrong_token))
    async with wrong.aio_channel(token_server) as channel:
        assert (await _refused(channel))[0] == grpc.StatusCode.UNAUTHENTICATED
    right = ClientSecurity.from_files(token_file=str(pki.token))
    async with right.aio_channel(token_server) as channel:
        reply = await _reflect(channel)
        names = {s.name for s in reply.list_services_response.service}
        assert "grpc.health.v1.Health" in names
        # With the token, an unknown method is what it is.
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await channel.unary_unary("/omnibus.v1.Engine/Nope")(b"", timeout=5)
        assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED


async def test_token_in_other_forms_is_refused(token_server: str) -> None:
    async with grpc.aio.insecure_channel(token_server) as channel:
        for metadata in [
            (("authorization", "s3cret-engine-token"),),  # no "Bearer "
            (("authorization", "Bearer s3cret-engine-token "),),
            (("authorization", "bearer s3cret-engine-token"),),
            (("x-engine-token", "s3cret-engine-token"),),
            (("authorization-bin", b"Bearer s3cret-engine-token"),),
        ]:
            assert (await _refused(channel, metadata))[0] == grpc.StatusCode.UNAUTHENTICATED, metadata


async def test_mutual_tls(pki: Pki) -> None:
    security = ServerSecurity.from_files(str(pki.server.cert), str(pki.server.key), str(pki.ca))
    server, address = await _serve(security)
    try:
        good = ClientSecurity.from_files(str(pki.ca), str(pki.client.cert), str(pki.client.key))
        async with good.aio_channel(address) as channel:
            assert await _health(channel) == health_pb2.HealthCheckResponse.SERVING
        refused = {
            "plaintext": ClientSecurity(),
            "no client certificate": ClientSecurity.from_files(str(pki.ca)),
            "expired client certificate": ClientSecurity.from_files(
                str(pki.ca), str(pki.expired_client.cert), str(pki.expired_client.key)),
            "client certificate of another CA": ClientSecurity.from_files(
                str(pki.ca), str(pki.wrong_client.cert), str(pki.wrong_client.key)),
            "server checked against another CA": ClientSecurity.from_files(
                str(pki.wrong_ca), str(pki.client.cert), str(pki.client.key)),
        }
        for what, client in refused.items():
            async with client.aio_channel(address) as channel:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await _health(channel)
                # The handshake fails: the call never reaches the server.
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE, what
    finally:
        await server.stop(0)


def test_files_are_checked(pki: Pki, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="needs its key"):
        ServerSecurity.from_files(cert=str(pki.server.cert))
    with pytest.raises(ValueError, match="mutual TLS"):
        ServerSecurity.from_files(client_ca=str(pki.ca))
    with pytest.raises(ValueError, match="cannot read TLS key"):
        ServerSecurity.from_files(str(pki.server.cert), str(tmp_path / "missing.key"))
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="is empty"):
        read_token(str(tmp_path / "empty"))
    (tmp_path / "two").write_text("two words\n")
    with pytest.raises(ValueError, match="one word"):
        read_token(str(tmp_path / "two"))
    security = ServerSecurity.from_files(token_file=str(pki.token))
    assert "s3cret" not in repr(security)
    assert "s3cret" not in repr(ClientSecurity.from_files(token_file=str(pki.token)))
    assert security.describe() == {"tls": False, "client_certs": False, "token": True}


def test_unusable_pem_files_are_named_at_startup(pki: Pki, tmp_path: Path) -> None:
    """What gRPC would refuse only when it listens ("port in use") or connects (a failed
    handshake) is refused with the file and the problem when the files are read."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a pem\n")
    encrypted = tmp_path / "encrypted.key"
    encrypted.write_bytes(ec.generate_private_key(ec.SECP256R1()).private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.BestAvailableEncryption(b"password")))
    cert, key, ca = str(pki.server.cert), str(pki.server.key), str(pki.ca)
    refused = {
        f"TLS certificate {garbage} does not hold valid PEM certificates":
            lambda: ServerSecurity.from_files(str(garbage), key),
        f"TLS key {pki.client.key} is not the key of the certificate in {cert}":
            lambda: ServerSecurity.from_files(cert, str(pki.client.key)),
        f"TLS key {cert} does not hold an unencrypted PEM private key":
            lambda: ServerSecurity.from_files(cert, cert),
        f"TLS key {encrypted} does not hold an unencrypted PEM private key":
            lambda: ServerSecurity.from_files(cert, str(encrypted)),
        f"client CA {garbage} does not hold valid PEM certificates":
            lambda: ServerSecurity.from_files(cert, key, str(garbage)),
        f"client CA {key} does not hold valid PEM certificates":  # a key is no certificate
            lambda: ServerSecurity.from_files(cert, key, key),
        f"TLS CA {garbage} does not hold valid PEM certificates":
            lambda: ClientSecurity.from_files(str(garbage)),
        f"TLS client certificate {garbage} does not hold valid PEM certificates":
            lambda: ClientSecurity.from_files(ca, str(garbage), str(pki.client.key)),
        f"TLS client key {key} is not the key of the certificate in {pki.client.cert}":
            lambda: ClientSecurity.from_files(ca, str(pki.client.cert), key),
    }
    for message, read in refused.items():
        with pytest.raises(ValueError) as err:
            read()
        assert str(err.value) == message
    # The real files pass; an expired certificate or a small RSA key too: the handshake
    # and gRPC's TLS judge those, not this Python's OpenSSL policy.
    ServerSecurity.from_files(cert, key, ca)
    ClientSecurity.from_files(ca, str(pki.expired_client.cert), str(pki.expired_client.key))
    small = _self_signed_rsa(tmp_path, bits=1024)
    ServerSecurity.from_files(str(small.cert), str(small.key))


def _self_signed_rsa(folder: Path, bits: int) -> Pair:
    import datetime as dt

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import rsa
    from cryptography.x509.oid import NameOID

    key = rsa.generate_private_key(65537, bits)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "small")])
    now = dt.datetime.now(dt.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(1)
            .not_valid_before(now).not_valid_after(now + dt.timedelta(days=1))
            .sign(key, hashes.SHA256()))
    pair = Pair(folder / "small.crt", folder / "small.key")
    pair.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    pair.key.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.TraditionalOpenSSL,
                                           serialization.NoEncryption()))
    return pair


def test_router_and_engine_name_a_bad_tls_file_at_startup(pki: Pki, tmp_path: Path) -> None:
    """Both processes build their credentials through from_files while reading their
    flags (a ValueError there: "error: ..." and exit 2, before anything listens)."""
    from omnibus.bench.processes import engine_configs
    from omnibus.router.cli import build_parser, config_from_args

    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a pem\n")
    cert, key = str(pki.server.cert), str(pki.server.key)
    with pytest.raises(ValueError, match=f"client CA {garbage} does not hold valid PEM"):
        engine_configs("model", "--tls-cert", cert, "--tls-key", key, "--tls-client-ca", str(garbage))

    def router(*flags: str) -> None:
        config_from_args(build_parser().parse_args(
            ["serve", "--engine", "127.0.0.1:1", "--model", "model", *flags]))

    with pytest.raises(ValueError, match=f"TLS certificate {garbage} does not hold valid PEM"):
        router("--tls-cert", str(garbage), "--tls-key", key)
    with pytest.raises(ValueError, match=f"TLS client key {key} is not the key of the certificate"):
        router("--engine-tls-ca", str(pki.ca), "--engine-tls-cert", str(pki.client.cert),
               "--engine-tls-key", key)
