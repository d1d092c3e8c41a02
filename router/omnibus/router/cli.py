"""`omnibus-router serve ...` (or `python -m omnibus.router serve ...`): the router process. `--help` lists every limit."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import fields

from omnibus.common.cli import HelpFormatter, config_error
from omnibus.router.config import RouterConfig, TenantLimits
from omnibus.router.http.tool_parser import TOOL_CALL_PARSERS

_DEFAULTS = {f.name: f.default for f in fields(RouterConfig)}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="omnibus-router", description="Omnibus router")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser(
        "serve",
        help="serve omnibus.v1.Inference in front of engine workers",
        formatter_class=HelpFormatter,
    )
    p.add_argument(
        "--host", default=_DEFAULTS["host"], help="address to listen on (0.0.0.0: all interfaces)"
    )
    p.add_argument("--port", type=int, default=_DEFAULTS["port"], help="gRPC port")
    p.add_argument(
        "--engine",
        dest="engines",
        action="append",
        required=True,
        metavar="HOST:PORT|dns:///NAME:PORT",
        help="an engine worker, or a DNS name resolving to every engine (re-resolved; "
        "each address its own engine); repeat for several, each engine once",
    )
    p.add_argument("--model", required=True,
                   help="model directory (tokenizer.json, config.json) or .gguf file")
    p.add_argument(
        "--model-name",
        default=_DEFAULTS["model_name"],
        help="public model id (default: the model directory or file name)",
    )
    p.add_argument(
        "--max-model-len", type=int, default=None, help="context cap below the model's own"
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        default=_DEFAULTS["metrics_port"],
        help="Prometheus /metrics port; 0: off",
    )
    p.add_argument(
        "--http-port",
        type=int,
        default=_DEFAULTS["http_port"],
        help="OpenAI-compatible HTTP API port (/v1/completions, /v1/chat/completions, "
        "/v1/embeddings, /v1/models) on --host; 0: off",
    )
    p.add_argument(
        "--tool-call-parser",
        default=_DEFAULTS["tool_call_parser"],
        choices=list(TOOL_CALL_PARSERS),
        help="how /v1/chat/completions finds tool calls in the output when tool_choice is "
        "auto (hermes: <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call>)",
    )
    p.add_argument(
        "--log-level", default=_DEFAULTS["log_level"], choices=["debug", "info", "warning", "error"],
        help="JSON log lines on stderr at this level and above",
    )
    _auth_flags(p)
    _tls_flags(p)
    _validation_flags(p)
    _queue_flags(p)
    _engine_flags(p)
    return parser


def _auth_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("tenants")
    g.add_argument(
        "--keys-file",
        default=None,
        help="JSON file of tenants and their API keys (see router/omnibus/router/admission/auth.py); "
        "without it every caller is tenant 'default'",
    )
    g.add_argument(
        "--admin-key-file",
        default=None,
        help="file holding one admin key for the omnibus.v1.Admin service (adapter load / "
        "unload); tenants marked \"admin\": true in the keys file are admins too; "
        "without either the admin API is off",
    )
    g.add_argument(
        "--tenant-max-concurrent",
        type=int,
        default=0,
        help="default cap on a tenant's queued + running requests; 0: none",
    )
    g.add_argument(
        "--tenant-tokens-per-minute",
        type=int,
        default=0,
        help="default tenant budget of prompt + max_tokens per minute; 0: none",
    )
    g.add_argument(
        "--limits-store",
        default=_DEFAULTS["limits_store"],
        metavar="redis://HOST:PORT/DB",
        help="count tenant caps and budgets in Redis, shared by every router; "
        "default: in this router's memory",
    )
    g.add_argument(
        "--limits-store-failure",
        default=_DEFAULTS["limits_store_failure"],
        choices=["open", "closed"],
        help="when the store is unreachable: open = fall back to this router's own "
        "in-memory limits, closed = refuse requests with UNAVAILABLE",
    )
    g.add_argument(
        "--limits-store-lease-seconds",
        type=float,
        default=_DEFAULTS["limits_store_lease_seconds"],
        help="a router renews its requests' leases; a crashed router's stop counting after this",
    )


def _tls_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("TLS and engine authentication")
    g.add_argument("--tls-cert", default=None, metavar="PEM",
                   help="serve the public gRPC port over TLS with this certificate")
    g.add_argument("--tls-key", default=None, metavar="PEM", help="the key of --tls-cert")
    g.add_argument("--engine-tls-ca", default=None, metavar="PEM",
                   help="reach engines over TLS, verifying them against this CA")
    g.add_argument("--engine-tls-cert", default=None, metavar="PEM",
                   help="mutual TLS: the client certificate shown to engines (their --tls-client-ca)")
    g.add_argument("--engine-tls-key", default=None, metavar="PEM",
                   help="the key of --engine-tls-cert")
    g.add_argument("--engine-token-file", default=None, metavar="FILE",
                   help="send the token in FILE on every engine call (the engines' --token-file)")
    g.add_argument("--http-tls-cert", default=None, metavar="PEM",
                   help="serve the OpenAI HTTP front (--http-port) over HTTPS with this certificate")
    g.add_argument("--http-tls-key", default=None, metavar="PEM", help="the key of --http-tls-cert")
    g.add_argument("--http-tls-client-ca", default=None, metavar="PEM",
                   help="mutual TLS on the HTTP front: clients must present a certificate this CA signed")


def _validation_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("request limits")
    g.add_argument(
        "--max-prompt-tokens", type=int, default=None, help="default: the context length - 1"
    )
    g.add_argument(
        "--max-tokens-limit",
        type=int,
        default=_DEFAULTS["max_tokens_limit"],
        help="largest max_tokens",
    )
    g.add_argument("--max-stop-strings", type=int, default=_DEFAULTS["max_stop_strings"],
                   help="stop strings per request at most")
    g.add_argument("--max-stop-string-chars", type=int, default=_DEFAULTS["max_stop_string_chars"],
                   help="characters of one stop string at most")
    g.add_argument("--max-request-bytes", type=int, default=_DEFAULTS["max_request_bytes"],
                   help="a request's serialized size at most (HTTP: its body; over: 413)")
    g.add_argument("--max-embed-inputs", type=int, default=_DEFAULTS["max_embed_inputs"],
                   help="inputs of one Embed request at most")
    g.add_argument("--max-n", type=int, default=_DEFAULTS["max_n"],
                   help="most choices (n) of one HTTP completion; each is its own engine request")
    g.add_argument(
        "--max-abs-priority",
        type=int,
        default=_DEFAULTS["max_abs_priority"],
        help="priorities must lie in [-N, N]",
    )


def _queue_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("admission and queueing")
    g.add_argument("--max-queued-requests", type=int, default=_DEFAULTS["max_queued_requests"],
                   help="requests waiting for an engine at most (over: RESOURCE_EXHAUSTED, 429)")
    g.add_argument(
        "--max-queued-tokens",
        type=int,
        default=_DEFAULTS["max_queued_tokens"],
        help="cap on prompt + max_tokens over the queued requests",
    )
    g.add_argument(
        "--max-queue-seconds",
        type=float,
        default=_DEFAULTS["max_queue_seconds"],
        help="longest time a request may wait for an engine, all its waits added up (a stream "
        "continued on another engine waits again), before DEADLINE_EXCEEDED",
    )
    g.add_argument(
        "--priority-aging-seconds",
        type=float,
        default=_DEFAULTS["priority_aging_seconds"],
        help="waiting this long raises a request by one priority level; 0: no aging",
    )
    g.add_argument(
        "--queue-policy",
        default=_DEFAULTS["queue_policy"],
        choices=["vtc", "fifo"],
        help="order within a priority: vtc = the tenant with the smallest virtual token "
        "counter (fair share, weights in the keys file), fifo = arrival",
    )


def _engine_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engines")
    g.add_argument(
        "--max-inflight-per-engine",
        type=int,
        default=_DEFAULTS["max_inflight_per_engine"],
        help="requests kept on one engine; 0: the engine's max_num_seqs plus an eighth",
    )
    g.add_argument(
        "--prefix-weight",
        type=float,
        default=_DEFAULTS["prefix_weight"],
        help="prefix-aware routing: an engine scores its share of room plus this times the "
        "share of the prompt in its prefix cache; 0: load only",
    )
    g.add_argument(
        "--engine-report-interval-ms", type=int, default=_DEFAULTS["engine_report_interval_ms"],
        help="how often each engine sends its load report",
    )
    g.add_argument(
        "--engine-resolve-seconds",
        type=float,
        default=_DEFAULTS["engine_resolve_seconds"],
        help="how often dns:/// engine names are re-resolved (also soon after an engine fails)",
    )
    g.add_argument(
        "--engine-stale-seconds",
        type=float,
        default=_DEFAULTS["engine_stale_seconds"],
        help="an engine silent this long is marked unhealthy",
    )
    g.add_argument(
        "--engine-retry-initial-seconds",
        type=float,
        default=_DEFAULTS["engine_retry_initial_seconds"],
        help="first wait before reconnecting to an engine that went away (doubling)",
    )
    g.add_argument(
        "--engine-retry-max-seconds", type=float, default=_DEFAULTS["engine_retry_max_seconds"],
        help="longest wait between reconnection attempts",
    )
    g.add_argument(
        "--max-engine-attempts",
        type=int,
        default=_DEFAULTS["max_engine_attempts"],
        help="engines a request may use: one whose engine dies, drains or stalls (before or "
        "during its stream) continues on another, as prompt + the tokens already sent",
    )
    g.add_argument(
        "--client-stall-seconds",
        type=float,
        default=_DEFAULTS["client_stall_seconds"],
        help="a client whose stream writes have not completed for this long (it stopped "
        "reading) has its engine work aborted and its seat freed (outcome client_stalled)",
    )
    g.add_argument(
        "--stream-interval",
        type=int,
        default=_DEFAULTS["stream_interval"],
        help="send a client message once this many new tokens are ready (the first token and "
        "the finish go at once): fewer, larger messages cost the router less CPU per token; "
        "1: every engine update as it arrives",
    )
    g.add_argument(
        "--drain-seconds",
        type=float,
        default=_DEFAULTS["drain_seconds"],
        help="on SIGTERM, how long in-flight streams may take to finish",
    )


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    values = {k: v for k, v in vars(args).items() if k != "command"}
    limits = TenantLimits(
        max_concurrent=values.pop("tenant_max_concurrent"),
        tokens_per_minute=values.pop("tenant_tokens_per_minute"),
    )
    values["engines"] = tuple(values["engines"])
    config = RouterConfig(tenant_limits=limits, **values)
    config.public_security()  # unreadable or unpaired TLS and token files: exit 2 now
    config.engine_security()
    config.http_tls()
    return config


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = config_from_args(args)
    except ValueError as exc:
        print(f"error: {config_error(exc, parser)}", file=sys.stderr)
        return 2
    import uvloop

    from omnibus.common.logs import configure_logging
    from omnibus.router.service.server import serve

    configure_logging(config.log_level)
    try:
        uvloop.run(serve(config))
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
