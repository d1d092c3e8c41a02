"""TLS, mutual TLS and the shared engine token: where both processes get their gRPC
credentials, written once.

A server (`ServerSecurity`, given to `build_server`) may serve TLS (certificate + key),
require client certificates signed by a CA (mutual TLS: a client without one never
completes the handshake), and require a token: every call except the standard health
service then carries `authorization: Bearer <token>` or ends UNAUTHENTICATED. A client
(`ClientSecurity`) verifies the server against a CA, presents its own certificate and
adds the token to every call it makes on its channels. Both read their files with
`from_files`, which checks them with Python's ssl module (PEM certificates, a key that
matches its certificate), so a bad file is named at startup.

Tokens are compared in constant time (hmac.compare_digest) and never logged; a repr
of either class shows whether a token is set, not the token.

`http_ssl_context` is the same server-side TLS for an HTTP server (the router's OpenAI
front): the same files, the same checks, as a Python ssl context.
"""

from __future__ import annotations

import argparse
import dataclasses
import hmac
import ssl
import sys
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc

TOKEN_HEADER = "authorization"  # value: "Bearer <token>"
# Methods a caller may use without the token: probes (liveness, readiness) must not
# need a secret. Everything else, reflection included, needs it.
UNAUTHENTICATED_PREFIXES = ("/grpc.health.v1.Health/",)

if TYPE_CHECKING:
    _Handler = grpc.RpcMethodHandler[Any, Any]  # generic in gRPC's stubs only


def read_secret(path: str | None, what: str) -> bytes | None:
    """The contents of `path` (None when no path); ValueError naming `what` when the
    file cannot be read or is empty."""
    if path is None:
        return None
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"cannot read {what} {path}: {exc.strerror or exc}") from exc
    if not data.strip():
        raise ValueError(f"{what} {path} is empty")
    return data


def _pem_context() -> ssl.SSLContext:
    """A context that only parses: security level 0, so a key size or digest that this
    Python's OpenSSL dislikes is left for gRPC's own TLS to judge."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.set_ciphers("DEFAULT:@SECLEVEL=0")
    return context


def _check_certificates(path: str | None, what: str) -> None:
    """ValueError naming `what` unless `path` (if any) holds PEM certificates: gRPC would
    refuse it only once it listens or connects, with a message that names no file."""
    if path is None:
        return
    try:
        _pem_context().load_verify_locations(cafile=path)
    except ssl.SSLError:
        raise ValueError(f"{what} {path} does not hold valid PEM certificates") from None


def _check_key(cert: str | None, key: str | None, what: str) -> None:
    """ValueError naming `what` unless `key` is the PEM private key of the (checked)
    certificate in `cert`, unencrypted as gRPC needs it."""
    if cert is None or key is None:
        return
    try:
        # A password callback: an encrypted key fails here instead of prompting on a tty.
        _pem_context().load_cert_chain(cert, key, password=lambda: b"")
    except ssl.SSLError as exc:
        if exc.reason == "KEY_VALUES_MISMATCH":
            raise ValueError(f"{what} {key} is not the key of the certificate in {cert}") from None
        raise ValueError(f"{what} {key} does not hold an unencrypted PEM private key") from None


def read_token(path: str | None) -> str | None:
    """The token in `path` (surrounding whitespace dropped): one line of printable ASCII."""
    data = read_secret(path, "token file")
    if data is None:
        return None
    token = data.strip().decode("ascii", errors="replace")
    if not token.isprintable() or not token.isascii() or " " in token:
        raise ValueError(f"token file {path} must hold one word of printable ASCII")
    return token


@dataclass(frozen=True)
class ServerSecurity:
    """What a gRPC server demands of its callers. Empty: plaintext, no token."""

    cert_chain: bytes | None = None  # PEM certificate (chain) the server presents
    private_key: bytes | None = field(default=None, repr=False)  # PEM key of cert_chain
    client_ca: bytes | None = None  # PEM CA: clients must present a certificate it signed
    token: str | None = field(default=None, repr=False)  # callers send "Bearer <token>"

    def __post_init__(self) -> None:
        if (self.cert_chain is None) != (self.private_key is None):
            raise ValueError("a TLS certificate needs its key and a key its certificate")
        if self.client_ca is not None and self.cert_chain is None:
            raise ValueError("requiring client certificates (mutual TLS) needs the server's "
                             "own certificate and key")
        if self.token is not None and not self.token:
            raise ValueError("the token is empty")

    @classmethod
    def from_files(
        cls,
        cert: str | None = None,
        key: str | None = None,
        client_ca: str | None = None,
        token_file: str | None = None,
    ) -> ServerSecurity:
        """Reads the PEM files and the token file; ValueError names the one at fault."""
        security = cls(
            cert_chain=read_secret(cert, "TLS certificate"),
            private_key=read_secret(key, "TLS key"),
            client_ca=read_secret(client_ca, "client CA"),
            token=read_token(token_file),
        )
        _check_certificates(cert, "TLS certificate")
        _check_key(cert, key, "TLS key")
        _check_certificates(client_ca, "client CA")
        return security

    @property
    def tls(self) -> bool:
        return self.cert_chain is not None

    def describe(self) -> dict[str, bool]:
        """For the startup log line: what is on, never the secrets."""
        return {"tls": self.tls, "client_certs": self.client_ca is not None,
                "token": self.token is not None}

    def credentials(self) -> grpc.ServerCredentials | None:
        """TLS credentials for add_secure_port; None for plaintext."""
        if self.cert_chain is None or self.private_key is None:
            return None
        return grpc.ssl_server_credentials(
            [(self.private_key, self.cert_chain)],
            root_certificates=self.client_ca,
            require_client_auth=self.client_ca is not None,
        )

    def interceptors(self) -> list[grpc.aio.ServerInterceptor]:
        return [] if self.token is None else [RequireToken(self.token)]


@dataclass(frozen=True)
class ClientSecurity:
    """How a client reaches a server. Empty: plaintext, no token."""

    tls: bool = False  # TLS even without `ca` (the system's roots verify the server)
    ca: bytes | None = None  # PEM CA the server's certificate must chain to
    cert_chain: bytes | None = None  # PEM client certificate (mutual TLS)
    private_key: bytes | None = field(default=None, repr=False)
    token: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if (self.cert_chain is None) != (self.private_key is None):
            raise ValueError("a client certificate needs its key and a key its certificate")

    @classmethod
    def from_files(
        cls,
        ca: str | None = None,
        cert: str | None = None,
        key: str | None = None,
        token_file: str | None = None,
    ) -> ClientSecurity:
        """Reads the PEM files and the token file; TLS is on when any PEM file is given.
        ValueError names the file at fault."""
        security = cls(
            tls=any(p is not None for p in (ca, cert, key)),
            ca=read_secret(ca, "TLS CA"),
            cert_chain=read_secret(cert, "TLS client certificate"),
            private_key=read_secret(key, "TLS client key"),
            token=read_token(token_file),
        )
        _check_certificates(ca, "TLS CA")
        _check_certificates(cert, "TLS client certificate")
        _check_key(cert, key, "TLS client key")
        return security

    def credentials(self) -> grpc.ChannelCredentials | None:
        if not self.tls:
            return None
        return grpc.ssl_channel_credentials(self.ca, self.private_key, self.cert_chain)

    def metadata(self) -> tuple[tuple[str, str], ...]:
        """What every call carries (for synchronous callers; aio channels add it)."""
        return () if self.token is None else ((TOKEN_HEADER, f"Bearer {self.token}"),)

    def aio_channel(
        self, address: str, options: Sequence[tuple[str, Any]] = ()
    ) -> grpc.aio.Channel:
        """An asyncio channel to `address`: TLS when configured, the token on every call."""
        interceptors = [] if self.token is None else _token_interceptors(self.metadata())
        credentials = self.credentials()
        if credentials is None:
            return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)
        return grpc.aio.secure_channel(address, credentials, options=options,
                                       interceptors=interceptors)

    def channel(self, address: str, options: Sequence[tuple[str, Any]] = ()) -> grpc.Channel:
        """A synchronous channel to `address` (TLS when configured; pass `metadata()`)."""
        credentials = self.credentials()
        if credentials is None:
            return grpc.insecure_channel(address, options=options)
        return grpc.secure_channel(address, credentials, options=options)


def http_ssl_context(cert: str | None, key: str | None, client_ca: str | None = None
                     ) -> ssl.SSLContext | None:
    """The TLS context of an HTTP server presenting `cert` (None: plaintext); with
    `client_ca`, a client without a certificate it signed fails the handshake. The
    files are checked as ServerSecurity.from_files checks them (ValueError names the
    one at fault); Python's OpenSSL judges the rest (a key too small for its policy)."""
    ServerSecurity.from_files(cert, key, client_ca)
    if cert is None or key is None:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)  # TLS 1.2 or later
    try:
        context.load_cert_chain(cert, key)
    except ssl.SSLError as exc:
        raise ValueError(f"TLS certificate {cert} with key {key} is refused: {exc.reason}") from None
    if client_ca is not None:
        context.load_verify_locations(cafile=client_ca)
        context.verify_mode = ssl.CERT_REQUIRED
    return context


# ---- the token, server side ----------------------------------------------------


class RequireToken(grpc.aio.ServerInterceptor):
    """Ends every call without `authorization: Bearer <token>` UNAUTHENTICATED before
    its handler runs (and before its request is parsed); health checks pass."""

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

    def allows(self, metadata: Sequence[tuple[str, str | bytes]] | None) -> bool:
        ok = False
        for key, value in metadata or ():
            if key == TOKEN_HEADER and isinstance(value, str):
                # Every value is compared (no early exit): the time taken does not
                # depend on where a match is.
                ok |= hmac.compare_digest(value.encode("utf-8", "replace"), self._expected)
        return ok

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[_Handler | None]],
        details: grpc.HandlerCallDetails,
    ) -> _Handler | None:
        method = details.method or ""
        if method.startswith(UNAUTHENTICATED_PREFIXES) or self.allows(details.invocation_metadata):
            return await continuation(details)
        return _refusing(await continuation(details))


async def _unauthenticated(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> None:
    await context.abort(
        grpc.StatusCode.UNAUTHENTICATED,
        "missing or wrong engine token (send 'authorization: Bearer <token>')",
    )


def _refusing(handler: _Handler | None) -> _Handler:
    """A handler of `handler`'s kind that refuses, reading no request bytes. An unknown
    method is refused too: who may not call learns nothing of what exists."""
    if handler is None or not (handler.request_streaming or handler.response_streaming):
        return grpc.unary_unary_rpc_method_handler(_unauthenticated)
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(_unauthenticated)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(_unauthenticated)
    return grpc.unary_stream_rpc_method_handler(_unauthenticated)


# ---- the token, client side ------------------------------------------------------


def _with_metadata(details: grpc.aio.ClientCallDetails, extra: tuple[tuple[str, str], ...]
                   ) -> grpc.aio.ClientCallDetails:
    metadata = grpc.aio.Metadata(*(details.metadata or ()), *extra)
    return grpc.aio.ClientCallDetails(details.method, details.timeout, metadata,
                                      details.credentials, details.wait_for_ready)


class _AddMetadata:
    """Adds fixed metadata to each call; one subclass per call kind (a grpc.aio channel
    files each interceptor under the first kind it is an instance of)."""

    def __init__(self, extra: tuple[tuple[str, str], ...]) -> None:
        self._extra = extra

    async def _call(self, continuation: Any, details: grpc.aio.ClientCallDetails, request: Any) -> Any:
        return await continuation(_with_metadata(details, self._extra), request)


class _AddUnaryUnary(_AddMetadata, grpc.aio.UnaryUnaryClientInterceptor):
    # one body for the four kinds, whose parameters the stubs name apart
    intercept_unary_unary = _AddMetadata._call  # type: ignore[assignment]


class _AddUnaryStream(_AddMetadata, grpc.aio.UnaryStreamClientInterceptor):
    intercept_unary_stream = _AddMetadata._call  # type: ignore[assignment]


class _AddStreamUnary(_AddMetadata, grpc.aio.StreamUnaryClientInterceptor):
    intercept_stream_unary = _AddMetadata._call  # type: ignore[assignment]


class _AddStreamStream(_AddMetadata, grpc.aio.StreamStreamClientInterceptor):
    intercept_stream_stream = _AddMetadata._call  # type: ignore[assignment]


def _token_interceptors(extra: tuple[tuple[str, str], ...]) -> list[grpc.aio.ClientInterceptor]:
    return [_AddUnaryUnary(extra), _AddUnaryStream(extra), _AddStreamUnary(extra),
            _AddStreamStream(extra)]


# ---- command lines ----------------------------------------------------------------


def add_client_tls_flags(p: argparse.ArgumentParser) -> None:
    """--tls-ca / --tls-cert / --tls-key of the command-line clients."""
    g = p.add_argument_group("TLS (any of them turns it on)")
    g.add_argument("--tls-ca", default=None, metavar="PEM",
                   help="verify the server against this CA (default: the system's roots)")
    g.add_argument("--tls", action="store_true", help="TLS with the system's roots")
    g.add_argument("--tls-cert", default=None, metavar="PEM",
                   help="client certificate, for a server that requires one (mutual TLS)")
    g.add_argument("--tls-key", default=None, metavar="PEM", help="the key of --tls-cert")


def client_security_from_args(args: argparse.Namespace) -> ClientSecurity:
    """The ClientSecurity of add_client_tls_flags' flags; a bad file exits (code 2),
    naming it."""
    try:
        security = ClientSecurity.from_files(args.tls_ca, args.tls_cert, args.tls_key)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    return dataclasses.replace(security, tls=True) if args.tls else security
