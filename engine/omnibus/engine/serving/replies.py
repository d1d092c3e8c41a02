"""What the engine's gRPC service answers, written once for its requests (Session and
Generate: session.py) and its other calls: an output as a response message, and the one
mapping from a failure to a gRPC status."""

from __future__ import annotations

import grpc
from omnibus.v1 import engine_pb2, inference_pb2

from omnibus.common import finish_reasons
from omnibus.engine.core.sequence import RequestOutput, TokenLogprobs
from omnibus.engine.lora import AdapterStateError, UnknownAdapterError
from omnibus.engine.serving.async_engine import StepLoopDown
from omnibus.engine.serving.batcher import QueueFullError, QueueTimeoutError

SHUTTING_DOWN = "the engine is shutting down; send the request to another engine"
STALLED = "the engine's step loop is stalled (watchdog); send the request to another engine"


_STATUS_CODES = {code.value[0]: code for code in grpc.StatusCode}


class Refusal(Exception):
    """A request the service did not admit, and the status that says why."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


def fill(msg: engine_pb2.EngineGenerateResponse, out: RequestOutput) -> engine_pb2.EngineGenerateResponse:
    """Writes `out` into `msg` field by field (no keyword dict: this runs for every
    token of every step); returns `msg`."""
    msg.token_ids.extend(out.new_token_ids)
    if out.finished and out.finish_reason:
        msg.finish_reason = finish_reasons.PROTO[out.finish_reason]
    msg.num_prompt_tokens = out.num_prompt_tokens
    msg.num_cached_tokens = out.num_cached_tokens
    msg.num_output_tokens = out.num_output_tokens
    if out.new_logprobs:
        msg.logprobs.extend(_logprobs(out.new_logprobs))
    if out.prompt_logprobs:
        msg.prompt_logprobs.extend(_logprobs(out.prompt_logprobs))
    if out.kv_handle is not None:
        msg.kv_handle.CopyFrom(out.kv_handle.to_proto())
    return msg


def _logprobs(logprobs: list[TokenLogprobs]) -> list[inference_pb2.TokenLogprob]:
    return [
        inference_pb2.TokenLogprob(
            token_id=lp.token_id,
            logprob=lp.logprob,
            top=[inference_pb2.TopLogprob(token_id=t, logprob=v) for t, v in lp.top],
        )
        for lp in logprobs
    ]


def output_error(out: RequestOutput) -> Exception | None:
    """The failure an output reports, when the engine ended the request itself: its
    deadline passed before its first token (TimeoutError), or its adapter failed to load
    (AdapterStateError); None for any other output."""
    if out.finish_reason == finish_reasons.DEADLINE:
        return TimeoutError(out.error) if out.error else TimeoutError()
    if out.error is not None:
        return AdapterStateError(out.error)
    return None


def error_status(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status a request or call that failed with `exc` ends with."""
    if isinstance(exc, QueueFullError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, f"embed {exc}"
    if isinstance(exc, QueueTimeoutError):
        return grpc.StatusCode.DEADLINE_EXCEEDED, f"embed request {exc}"
    if isinstance(exc, UnknownAdapterError):
        return grpc.StatusCode.NOT_FOUND, str(exc)
    if isinstance(exc, AdapterStateError):
        return grpc.StatusCode.FAILED_PRECONDITION, str(exc)
    if isinstance(exc, ValueError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    if isinstance(exc, StepLoopDown):  # the engine is gone in all but name: retry elsewhere
        return grpc.StatusCode.UNAVAILABLE, str(exc)
    if isinstance(exc, TimeoutError):
        return grpc.StatusCode.DEADLINE_EXCEEDED, str(exc) or "the request's deadline passed; it was aborted"
    return grpc.StatusCode.INTERNAL, f"engine failure: {exc}"


def status_code(number: int) -> grpc.StatusCode:
    """The status whose number an output's status_code holds."""
    return _STATUS_CODES[number]
