"""The gRPC bootstrap both processes share (omnibus.common.grpc_server): bytes that are
not the method's request message get INVALID_ARGUMENT naming the expected type, and a
port in use (gRPC's, or the metrics endpoint's) is an error, which on a TLS port may
also be credentials gRPC refused."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health
from omnibus.v1 import inference_pb2, inference_pb2_grpc

from omnibus.common.grpc_server import Service, build_server
from tests.grpc_helpers import free_port

GARBAGE = [b"\xff\xff\xff\xff", b"\x0a\x05ab", b"\x08" + b"\xff" * 11]  # bad tag, truncated, varint overflow


class _Echo(inference_pb2_grpc.InferenceServicer):
    async def ListModels(self, request, context):
        return inference_pb2.ListModelsResponse()

    async def Generate(self, request, context):
        yield inference_pb2.GenerateResponse(text=request.text)


@pytest.fixture
async def address():
    port = free_port()
    service = Service(_Echo(), inference_pb2_grpc.add_InferenceServicer_to_server, "omnibus.v1.Inference")
    server = build_server("127.0.0.1", port, [service], health.aio.HealthServicer())
    await server.start()
    yield f"127.0.0.1:{port}"
    await server.stop(0)


@pytest.mark.parametrize("raw", GARBAGE)
async def test_undecodable_requests_are_invalid_argument(address, raw):
    async with grpc.aio.insecure_channel(address) as channel:
        unary = channel.unary_unary("/omnibus.v1.Inference/ListModels")
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await unary(raw)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details() == (
            "the request is not a valid omnibus.v1.ListModelsRequest message (protobuf wire format)"
        )
        stream = channel.unary_stream("/omnibus.v1.Inference/Generate")
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in stream(raw):
                pass
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "DecodeError" not in err.value.details()
        assert "omnibus.v1.GenerateRequest" in err.value.details()


async def test_valid_requests_still_reach_the_servicer(address):
    async with grpc.aio.insecure_channel(address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        replies = [r.text async for r in stub.Generate(inference_pb2.GenerateRequest(text="hi"))]
        assert replies == ["hi"]
        assert await stub.ListModels(inference_pb2.ListModelsRequest()) == inference_pb2.ListModelsResponse()


async def test_a_port_in_use_is_an_error_not_a_shared_port(address):
    """gRPC's default SO_REUSEPORT would let a second server start on a serving port and
    take a share of its connections; here it is refused with a message, and the first
    server still answers alone."""
    service = Service(_Echo(), inference_pb2_grpc.add_InferenceServicer_to_server, "omnibus.v1.Inference")
    host, port = address.rsplit(":", 1)
    with pytest.raises(OSError, match=f"cannot listen on {address}: the port is in use"):
        build_server(host, int(port), [service], health.aio.HealthServicer())
    await test_valid_requests_still_reach_the_servicer(address)


async def test_a_tls_port_that_fails_may_be_its_credentials():
    """gRPC answers a certificate it cannot use like a port in use; PEM files are checked
    before (omnibus.common.security), credentials made from bytes may still get here."""
    from omnibus.common.security import ServerSecurity

    service = Service(_Echo(), inference_pb2_grpc.add_InferenceServicer_to_server, "omnibus.v1.Inference")
    port = free_port()
    security = ServerSecurity(cert_chain=b"not a pem", private_key=b"not a pem")
    with pytest.raises(OSError) as err:
        build_server("127.0.0.1", port, [service], health.aio.HealthServicer(), security=security)
    assert str(err.value) == (
        f"cannot listen on 127.0.0.1:{port}: the port is in use, or the host is not an address of "
        "this machine (or gRPC refused the TLS certificate or key: see its log line above)")


def test_a_metrics_port_in_use_is_an_error_naming_it():
    import socket

    from prometheus_client import CollectorRegistry

    from omnibus.common.metrics import serve_metrics

    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(OSError, match=f"--metrics-port {port}: cannot listen: Address already in use"):
            serve_metrics(CollectorRegistry(), port, "m")
