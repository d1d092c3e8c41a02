"""A request as the engine takes it: one value from the gRPC service, through
`AsyncEngine` and the step loop (pickled when the loop runs in a process of its own),
to `Engine.add_request`, which builds the scheduler's `Sequence` from it.

A new request field is written here, where the request is built (`from_proto`) and
where it is used; the layers in between pass the request on unopened. Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from omnibus.common.sampling import SamplingParams
from omnibus.engine.kv_transfer.handle import KvHandle

if TYPE_CHECKING:
    from omnibus.v1 import engine_pb2


@dataclass(frozen=True)
class EngineRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]  # any sequence of ids; kept as a tuple (a copy)
    params: SamplingParams
    priority: int = 0  # higher runs first
    adapter: str | None = None  # LoRA adapter name; None or "": the base model
    tenant: str = ""  # whose request (fair share between tenants); "": one shared tenant
    weight: float = 1.0  # the tenant's share
    deadline: float | None = None  # time.monotonic() seconds (one clock for all processes)
    cache_salt: str = ""  # the tenant's cache group (omnibus.common.prefix); "": unsalted
    kv_hold: bool = False  # keep its KV for another engine when it ends by length (a prefill)
    kv_source: KvHandle | None = None  # its first tokens' KV on another engine, read if it can be

    def __post_init__(self) -> None:
        # The caller's list may change after it is queued; the step loop reads this one.
        object.__setattr__(self, "prompt_token_ids", tuple(self.prompt_token_ids))

    @classmethod
    def from_proto(cls, msg: engine_pb2.EngineGenerateRequest, deadline: float | None) -> EngineRequest:
        """The engine's request for a router's message (`deadline`: time.monotonic()
        seconds, what the caller made of deadline_ms and the call's own deadline).
        ValueError if its sampling parameters are out of range."""
        return cls(
            request_id=msg.request_id,
            prompt_token_ids=tuple(msg.prompt_token_ids),
            params=SamplingParams.from_proto(msg.sampling),
            priority=msg.priority,
            adapter=msg.adapter or None,
            tenant=msg.tenant,
            weight=msg.tenant_weight or 1.0,
            cache_salt=msg.cache_salt,
            deadline=deadline,
            kv_hold=msg.kv_hold,
            kv_source=KvHandle.from_proto(msg.kv_source) if msg.HasField("kv_source") else None,
        )


def as_request(request: EngineRequest | str, *fields: Any, **named: Any) -> EngineRequest:
    """`request` itself, or the EngineRequest of loose fields in its order (request_id,
    prompt_token_ids, params, priority, ...) or by name: how tests and offline callers
    spell a request."""
    if isinstance(request, EngineRequest):
        if fields or named:
            raise TypeError("an EngineRequest takes no further fields")
        return request
    return EngineRequest(request, *fields, **named)
