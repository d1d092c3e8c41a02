"""The one exception type the router uses to refuse or end a request."""

from __future__ import annotations

import grpc

TOO_LARGE = "request_too_large"  # the reason of a refusal of the request's size (HTTP 413)


class RequestError(Exception):
    """A request ends with this gRPC status and message.

    `reason` is a short, fixed label for metrics and logs (never user text);
    `retry_after_s`, when known, how long a RESOURCE_EXHAUSTED caller should wait
    (HTTP's Retry-After); `param`, when one field is to blame, its name (the `param` of
    an OpenAI error).
    """

    def __init__(
        self,
        code: grpc.StatusCode,
        message: str,
        reason: str,
        retry_after_s: float | None = None,
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.reason = reason
        self.retry_after_s = retry_after_s
        self.param = param
        self.counted = False  # Pipeline.refused has counted and logged it


def invalid(message: str, param: str | None = None) -> RequestError:
    """INVALID_ARGUMENT: the client must change the request (field `param`, if one)."""
    return RequestError(grpc.StatusCode.INVALID_ARGUMENT, message, "invalid_argument", param=param)
