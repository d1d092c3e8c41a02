"""The gRPC server bootstrap both processes use: one aio server with the standard health
and reflection services, listening on one address (plaintext, TLS or mutual TLS, with or
without a token: omnibus.common.security), and the signal that starts a drain."""

from __future__ import annotations

import asyncio
import inspect
import signal
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from omnibus.common.security import ServerSecurity

HEALTH_SERVICE_NAME = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
# A health "service" that is SERVING while the process runs, whatever the overall status
# says (a router is NOT_SERVING without engines): what a liveness probe asks.
LIVENESS = "liveness"

if TYPE_CHECKING:
    # Generic in gRPC's stubs only. A handler is a namedtuple at run time (its `_replace`
    # below), which the stubs do not say.
    _Handler = grpc.RpcMethodHandler[Any, Any]
    _Context = grpc.aio.ServicerContext[Any, Any]


@dataclass(frozen=True)
class Service:
    """One servicer and how to register it: `add(servicer, server)` is the generated
    `add_XServicer_to_server`; `name` is its full name (for reflection and health)."""

    servicer: Any
    add: Callable[[Any, grpc.aio.Server], None]
    name: str


def build_server(
    host: str,
    port: int,
    services: Sequence[Service],
    health_servicer: health.aio.HealthServicer,
    options: Sequence[tuple[str, Any]] = (),
    security: ServerSecurity = ServerSecurity(),
) -> grpc.aio.Server:
    """A server (not started) with `services`, health and reflection, bound to host:port:
    TLS, client certificates and a token as `security` demands (omnibus.common.security).
    Raises OSError when the address cannot be bound."""
    # The token check comes first: a caller without it learns nothing, not even whether
    # its bytes parse.
    interceptors = [*security.interceptors(), _DecodeErrorsAreInvalid()]
    # gRPC turns SO_REUSEPORT on by default: a second server on a port in use would then
    # start and silently take a share of its connections. A port in use is an error.
    options = [("grpc.so_reuseport", 0), *options]
    server = grpc.aio.server(options=options, interceptors=interceptors)
    for s in services:
        s.add(s.servicer, server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = (*(s.name for s in services), HEALTH_SERVICE_NAME, reflection.SERVICE_NAME)
    reflection.enable_server_reflection(names, server)
    address = f"{host}:{port}"
    credentials = security.credentials()
    try:
        bound = (server.add_insecure_port(address) if credentials is None
                 else server.add_secure_port(address, credentials))
    except RuntimeError:  # grpc >= 1.5x raises where older versions returned 0
        bound = 0
    if bound == 0:
        # ServerSecurity.from_files has checked the PEM files, so this is almost always the
        # address; credentials made another way may still be what gRPC refused.
        tls = "" if credentials is None else (
            " (or gRPC refused the TLS certificate or key: see its log line above)")
        raise OSError(f"cannot listen on {address}: the port is in use, or the host is not "
                      f"an address of this machine{tls}")
    return server


class _DecodeErrorsAreInvalid(grpc.aio.ServerInterceptor):
    """Bytes that do not parse as the method's request message get INVALID_ARGUMENT with a
    message naming the expected type, not gRPC's UNKNOWN "Unexpected DecodeError"."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[_Handler | None]],
        details: grpc.HandlerCallDetails,
    ) -> _Handler | None:
        handler = await continuation(details)
        if handler is None or handler.request_deserializer is None or handler.request_streaming:
            return handler
        parse = handler.request_deserializer
        kind = "unary_stream" if handler.response_streaming else "unary_unary"
        behavior = getattr(handler, kind)
        type_name = getattr(getattr(parse, "__self__", None), "DESCRIPTOR", None)
        expected = type_name.full_name if type_name is not None else "request"

        def decode(raw: bytes, context: _Context) -> Any:
            try:
                return parse(raw)
            except DecodeError:
                return _UNDECODABLE

        async def refuse(context: _Context) -> None:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"the request is not a valid {expected} message (protobuf wire format)",
            )

        if handler.response_streaming and inspect.isasyncgenfunction(behavior):

            async def unary_stream(raw: bytes, context: _Context) -> Any:
                request = decode(raw, context)
                if request is _UNDECODABLE:
                    await refuse(context)
                async for item in behavior(request, context):
                    yield item

            return handler._replace(  # type: ignore[attr-defined, no-any-return]
                request_deserializer=None, unary_stream=unary_stream)
        if handler.response_streaming:  # a coroutine that writes with context.write

            async def unary_stream_writer(raw: bytes, context: _Context) -> None:
                request = decode(raw, context)
                if request is _UNDECODABLE:
                    await refuse(context)
                await behavior(request, context)

            return handler._replace(  # type: ignore[attr-defined, no-any-return]
                request_deserializer=None, unary_stream=unary_stream_writer)

        async def unary_unary(raw: bytes, context: _Context) -> Any:
            request = decode(raw, context)
            if request is _UNDECODABLE:
                await refuse(context)
            return await behavior(request, context)

        return handler._replace(  # type: ignore[attr-defined, no-any-return]
            request_deserializer=None, unary_unary=unary_unary)


_UNDECODABLE = object()


async def set_health(
    servicer: health.aio.HealthServicer, services: Sequence[str], status: int
) -> None:
    """Sets the overall status ("") and each named service's to `status`."""
    for name in ("", *services):
        await servicer.set(name, status)


def stop_on_signal() -> asyncio.Event:
    """An event set at the first SIGTERM or SIGINT (what starts a drain). The handlers are
    on the running loop from now on: call it before starting, so a signal that comes while
    the server starts is a drain once it has started, not a traceback."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    return stop
