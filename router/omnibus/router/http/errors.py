"""A refusal as the HTTP front answers it: the HTTP status and OpenAI error type of its
gRPC status, in OpenAI's error JSON; and the x-request-id every reply echoes, refusals
included. Every endpoint module, the SSE stream (sse.py) and the application's
middleware (app.py) answer errors through here.
"""

from __future__ import annotations

from typing import Any

import grpc
from aiohttp import web

from omnibus.router.service.errors import TOO_LARGE, RequestError

REQUEST_ID_HEADER = "x-request-id"
REQUEST_ID = web.RequestKey("omnibus.request_id", str)  # the request's id, echoed in x-request-id
# gRPC status → HTTP status and OpenAI error type.
_HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.CANCELLED: (499, "cancelled"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable_error"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout_error"),
}


def http_status(code: grpc.StatusCode) -> tuple[int, str]:
    return _HTTP_STATUS.get(code, (500, "server_error"))


def error_body(message: str, kind: str, code: str | None, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


# Refusals whose message points to ListModels (the pipeline's unknown_adapter, adapter_denied).
_POINTS_TO_LIST_MODELS = frozenset({"unknown_adapter", "adapter_denied"})


def error_response(err: RequestError) -> web.Response:
    status, kind = http_status(err.code)
    if err.reason == TOO_LARGE:  # as aiohttp's refusal of a body past its own limit
        status = 413
    headers = {}
    message = err.message
    if err.reason in _POINTS_TO_LIST_MODELS:  # where the listing is over HTTP
        message += " (GET /v1/models over HTTP)"
    if status == 429:  # whole seconds, at least one
        headers["Retry-After"] = str(max(1, int(-(-(err.retry_after_s or 1) // 1))))
    return web.json_response(error_body(message, kind, err.reason, err.param), status=status,
                             headers=headers)
