"""Router configuration: frozen dataclasses validated at construction."""

from __future__ import annotations

import ssl
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from omnibus.common.security import ClientSecurity, ServerSecurity, http_ssl_context
from omnibus.router.http.tool_parser import TOOL_CALL_PARSERS


def _check(ok: bool, name: str, allowed: str, value: object) -> None:
    if not ok:
        raise ValueError(f"{name} must be {allowed}, got {value!r}")


@dataclass(frozen=True)
class TenantLimits:
    """What one tenant may use. 0 means no limit."""

    max_concurrent: int = 0  # requests queued or running at once
    # Token-rate budget: prompt + max_tokens are charged when a request is admitted and
    # the unused part of max_tokens is refunded when it ends. Bursts up to one minute's worth.
    tokens_per_minute: int = 0

    def __post_init__(self) -> None:
        _check(self.max_concurrent >= 0, "max_concurrent", ">= 0 (0: no cap)", self.max_concurrent)
        _check(
            self.tokens_per_minute >= 0,
            "tokens_per_minute",
            ">= 0 (0: no budget)",
            self.tokens_per_minute,
        )


@dataclass(frozen=True)
class EngineTarget:
    """One --engine value: a fixed `host:port`, or a DNS name that resolves to every
    engine (`dns:///NAME:PORT`, gRPC's naming syntax; `dns://DNS_HOST:DNS_PORT/NAME:PORT`
    asks that DNS server instead of the system resolver)."""

    host: str
    port: int
    dns: bool = False  # re-resolved while the router runs; each address its own engine
    dns_server: tuple[str, int] | None = None  # None: the system resolver (getaddrinfo)

    @classmethod
    def parse(cls, text: str) -> EngineTarget:
        """Raises ValueError naming the accepted forms."""
        if not text.startswith("dns:"):
            host, port = _host_port(text)
            return cls(host, port)
        parts = urlsplit(text)
        name = parts.path.lstrip("/") if parts.netloc or text.startswith("dns:/") else parts.path
        host, port = _host_port(name)
        server = None
        if parts.netloc:
            server = (parts.hostname or "", parts.port or 53)
        return cls(host, port, dns=True, dns_server=server)

    def __str__(self) -> str:
        if not self.dns:
            return f"{self.host}:{self.port}"
        server = f"{self.dns_server[0]}:{self.dns_server[1]}" if self.dns_server else ""
        return f"dns://{server}/{self.host}:{self.port}"


def _host_port(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not (sep and host and port.isdigit() and 0 < int(port) < 65536):
        raise ValueError(
            f"engine address must be host:port or dns:///name:port, got {address!r}"
        )
    return host, int(port)


LIMITS_STORE_FAILURE = ("open", "closed")


@dataclass(frozen=True)
class RouterConfig:
    """Everything `omnibus-router serve` is started with."""

    model: str  # HF model directory (tokenizer.json, config.json: limits) or a .gguf file
    engines: tuple[str, ...]  # engine targets: host:port or dns:///name:port (EngineTarget)
    host: str = "127.0.0.1"
    port: int = 50051
    model_name: str = ""  # public model id; "" = the model directory's name
    max_model_len: int | None = None  # context cap below the model's own
    metrics_port: int = 0  # Prometheus /metrics; 0 = off
    http_port: int = 0  # OpenAI-compatible HTTP API (omnibus.router.http); 0 = off
    # How chat requests with tools and tool_choice "auto" find calls in the output
    # (vLLM's --tool-call-parser; router/omnibus/router/http/tool_parser.py).
    tool_call_parser: str = "hermes"
    keys_file: str | None = None  # JSON tenants file; None = everyone is tenant "default"
    admin_key_file: str | None = None  # file holding an admin key (omnibus.v1.Admin)
    tenant_limits: TenantLimits = field(default_factory=TenantLimits)  # tenants without their own
    # Request validation.
    max_prompt_tokens: int | None = None  # None: the context length - 1
    max_tokens_limit: int = 4096  # largest max_tokens accepted
    max_stop_strings: int = 16
    max_stop_string_chars: int = 256
    max_request_bytes: int = 1 << 20  # serialized GenerateRequest
    max_abs_priority: int = 100  # priorities outside [-N, N] are refused
    max_embed_inputs: int = 64  # inputs of one Embed request at most
    max_n: int = 8  # choices (`n`) of one OpenAI-style completion at most
    # Admission control and queueing.
    max_queued_requests: int = 1024
    max_queued_tokens: int = 1 << 20  # prompt + max_tokens of every queued request
    # longest time queued for an engine, client deadline or not: all of a request's waits
    # added up (a stream continued on another engine queues again)
    max_queue_seconds: float = 60.0
    priority_aging_seconds: float = 10.0  # waiting this long is worth one priority level; 0 = off
    queue_policy: str = "vtc"  # within a priority: "vtc" = tenant fair share, "fifo" = arrival
    # Prefix-aware routing: an engine's score is its share of room plus this times the
    # share of the prompt it holds in its prefix cache; 0 = load only.
    prefix_weight: float = 1.0
    # Engines.
    max_inflight_per_engine: int = 0  # 0: the engine's reported max_num_seqs + 1/8 (a short engine queue)
    engine_report_interval_ms: int = 50
    engine_stale_seconds: float = 5.0  # no load report for this long: engine unhealthy
    engine_resolve_seconds: float = 5.0  # dns:/// targets are re-resolved this often
    engine_retry_initial_seconds: float = 0.2  # reconnect backoff, doubling up to the max
    engine_retry_max_seconds: float = 2.0
    # Engines a request may use: its engine failing (or draining, or going silent) before
    # or during the stream moves it to another, as prompt + the tokens already sent.
    max_engine_attempts: int = 3
    # A client whose stream writes have not completed for this long (it stopped reading):
    # its engine work is aborted and its seat freed; outcome client_stalled.
    client_stall_seconds: float = 30.0
    # A client message once this many new tokens are ready (the first token, the finish and
    # errors at once): fewer, larger messages and less router CPU per token; 1: every update.
    stream_interval: int = 1
    drain_seconds: float = 10.0  # SIGTERM: how long in-flight streams may take to finish
    # Tenant limits shared by every router: "" keeps them in this router's memory;
    # redis://host:port/db counts them in Redis (router/omnibus/router/admission/store.py).
    limits_store: str = ""
    limits_store_failure: str = "open"  # store unreachable: "open" = this router's own
    # in-memory limits, "closed" = refuse requests (UNAVAILABLE)
    limits_store_lease_seconds: float = 15.0  # a crashed router's requests stop counting after
    # Security (omnibus.common.security): TLS on the public gRPC port; TLS or mutual TLS
    # and a shared token towards the engines. Paths of PEM files and of the token file.
    tls_cert: str | None = None
    tls_key: str | None = None
    engine_tls_ca: str | None = None  # verify engines against this CA (TLS to engines)
    engine_tls_cert: str | None = None  # present this client certificate (mutual TLS)
    engine_tls_key: str | None = None
    engine_token_file: str | None = None  # send "authorization: Bearer <token>" to engines
    # TLS on the OpenAI HTTP front (--http-port): its certificate and key; with a client
    # CA, clients must present a certificate it signed (mutual TLS).
    http_tls_cert: str | None = None
    http_tls_key: str | None = None
    http_tls_client_ca: str | None = None
    log_level: str = "info"

    def public_security(self) -> ServerSecurity:
        """The public port's TLS, read from the files now; ValueError names a bad file."""
        return ServerSecurity.from_files(self.tls_cert, self.tls_key)

    def http_tls(self) -> ssl.SSLContext | None:
        """The HTTP front's TLS context (None: plaintext), read from the files now;
        ValueError names a bad file."""
        try:
            return http_ssl_context(self.http_tls_cert, self.http_tls_key, self.http_tls_client_ca)
        except ValueError as exc:
            raise ValueError(f"HTTP front (--http-tls-*): {exc}") from None

    def engine_security(self) -> ClientSecurity:
        """How to reach engines, read from the files now; ValueError names a bad file."""
        return ClientSecurity.from_files(
            self.engine_tls_ca, self.engine_tls_cert, self.engine_tls_key, self.engine_token_file
        )

    def __post_init__(self) -> None:
        _check(bool(self.engines), "engines", "at least one host:port", self.engines)
        # Raises ValueError on a malformed address. A repeated one would be two clients of
        # one engine, each filling it to its own cap.
        targets = [str(EngineTarget.parse(address)) for address in self.engines]
        repeated = sorted({t for t in targets if targets.count(t) > 1})
        if repeated:
            raise ValueError(f"engines must each be given once; repeated: {', '.join(repeated)}")
        _check(
            self.limits_store == "" or urlsplit(self.limits_store).scheme in ("redis", "rediss"),
            "limits_store",
            "empty (in memory) or a redis:// URL",
            self.limits_store,
        )
        _check(
            self.limits_store_failure in LIMITS_STORE_FAILURE,
            "limits_store_failure",
            " or ".join(LIMITS_STORE_FAILURE),
            self.limits_store_failure,
        )
        _check(self.tool_call_parser in TOOL_CALL_PARSERS, "tool_call_parser",
               " or ".join(TOOL_CALL_PARSERS), self.tool_call_parser)
        _check(self.queue_policy in ("vtc", "fifo"), "queue_policy", "vtc or fifo", self.queue_policy)
        _check(0 <= self.port < 65536, "port", "in [0, 65535]", self.port)
        _check(0 <= self.metrics_port < 65536, "metrics_port", "in [0, 65535]", self.metrics_port)
        _check(0 <= self.http_port < 65536, "http_port", "in [0, 65535]", self.http_port)
        if self.http_port == 0 and (self.http_tls_cert or self.http_tls_key or self.http_tls_client_ca):
            raise ValueError("--http-tls-cert, --http-tls-key and --http-tls-client-ca need the "
                             "HTTP front: set --http-port")
        _check(
            self.max_model_len is None or self.max_model_len >= 2,
            "max_model_len",
            ">= 2",
            self.max_model_len,
        )
        _check(
            self.max_prompt_tokens is None or self.max_prompt_tokens >= 1,
            "max_prompt_tokens",
            ">= 1",
            self.max_prompt_tokens,
        )
        positive = {
            "max_tokens_limit": self.max_tokens_limit,
            "max_stop_string_chars": self.max_stop_string_chars,
            "max_request_bytes": self.max_request_bytes,
            "max_embed_inputs": self.max_embed_inputs,
            "max_n": self.max_n,
            "max_queued_requests": self.max_queued_requests,
            "max_queued_tokens": self.max_queued_tokens,
            "max_queue_seconds": self.max_queue_seconds,
            "engine_report_interval_ms": self.engine_report_interval_ms,
            "engine_stale_seconds": self.engine_stale_seconds,
            "engine_resolve_seconds": self.engine_resolve_seconds,
            "limits_store_lease_seconds": self.limits_store_lease_seconds,
            "engine_retry_initial_seconds": self.engine_retry_initial_seconds,
            "max_engine_attempts": self.max_engine_attempts,
            "client_stall_seconds": self.client_stall_seconds,
            "stream_interval": self.stream_interval,
        }
        for name, value in positive.items():
            _check(value > 0, name, "> 0", value)
        non_negative = {
            "max_stop_strings": self.max_stop_strings,
            "max_abs_priority": self.max_abs_priority,
            "priority_aging_seconds": self.priority_aging_seconds,
            "prefix_weight": self.prefix_weight,
            "max_inflight_per_engine": self.max_inflight_per_engine,
            "drain_seconds": self.drain_seconds,
        }
        for name, value in non_negative.items():
            _check(value >= 0, name, ">= 0", value)
        _check(
            self.engine_retry_max_seconds >= self.engine_retry_initial_seconds,
            "engine_retry_max_seconds",
            ">= engine_retry_initial_seconds",
            self.engine_retry_max_seconds,
        )

