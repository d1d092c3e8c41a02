"""How a request ends, in one table: the engine's finish reasons (`RequestOutput.finish_reason`),
the wire's `FinishReason` (inference.proto, engine.proto), and the words the router's
metrics and each HTTP API use for them.

| engine     | FinishReason | router outcome | OpenAI finish_reason | Responses status |
|------------|--------------|----------------|----------------------|------------------|
| "stop"     | STOP         | stop           | stop                 | completed        |
| "length"   | LENGTH       | length         | length               | incomplete       |
| "abort"    | ABORTED      | aborted        | abort                | failed           |
| "deadline" | none: the request ends with DEADLINE_EXCEEDED (`output_error`) |

A fourth column or a new reason is one row here.
"""

from __future__ import annotations

from dataclasses import dataclass

from omnibus.v1 import inference_pb2 as pb

DEADLINE = "deadline"  # the engine's reason for a request whose deadline passed: a status, no FinishReason


@dataclass(frozen=True)
class Finish:
    engine: str  # RequestOutput.finish_reason
    proto: int  # FinishReason
    outcome: str  # the router's omnibus_router_requests_total{outcome}
    openai: str  # an OpenAI choice's finish_reason
    responses: str  # a Responses API response's status


FINISHES = (
    Finish("stop", pb.STOP, "stop", "stop", "completed"),
    Finish("length", pb.LENGTH, "length", "length", "incomplete"),
    Finish("abort", pb.ABORTED, "aborted", "abort", "failed"),
)
ENGINE_REASONS = (*(f.engine for f in FINISHES), DEADLINE)  # every RequestOutput.finish_reason
PROTO = {f.engine: f.proto for f in FINISHES}  # engine reason -> FinishReason
OUTCOME = {f.proto: f.outcome for f in FINISHES}  # FinishReason -> the router's outcome label
OPENAI = {f.proto: f.openai for f in FINISHES}  # FinishReason -> an OpenAI finish_reason
RESPONSES_STATUS = {f.openai: f.responses for f in FINISHES}  # OpenAI finish_reason -> a Responses status
