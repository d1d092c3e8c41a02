"""`omnibus-healthcheck HOST:PORT`: exit 0 when the process there reports
SERVING over the standard gRPC health protocol (for container healthchecks)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from omnibus.common.cli import seconds
from omnibus.common.grpc_server import LIVENESS
from omnibus.common.security import add_client_tls_flags, client_security_from_args
from omnibus.v1 import engine_pb2, inference_pb2

_INFERENCE = inference_pb2.DESCRIPTOR.services_by_name["Inference"].full_name
_ENGINE = engine_pb2.DESCRIPTOR.services_by_name["Engine"].full_name


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="omnibus-healthcheck", description=__doc__)
    p.add_argument("target", help="HOST:PORT of a router or engine")
    p.add_argument("--service", default="", help="service name; empty: the whole server")
    p.add_argument("--timeout", type=seconds, default=3.0, help="seconds (default 3)")
    add_client_tls_flags(p)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    security = client_security_from_args(args)
    with security.channel(args.target) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout
            )
        except grpc.RpcError as exc:
            details = exc.details()
            if exc.code() == grpc.StatusCode.NOT_FOUND:  # the server has no such service
                details = (f"no health status for service {args.service!r} (routers: '', "
                           f"{_INFERENCE!r}, {LIVENESS!r}; engines: '', {_ENGINE!r})")
            print(f"{args.target}: {exc.code().name}: {details}", file=sys.stderr)
            return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(f"{args.target}: {status}")
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1


if __name__ == "__main__":
    sys.exit(main())
