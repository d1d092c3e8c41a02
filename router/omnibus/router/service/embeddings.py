"""Embeddings: validated and tokenized inputs handed to the least loaded engine taking
requests whose context holds them, whose dynamic batcher groups them with other
callers' (no router queue: the engine's embed queue has its own cap and timeouts)."""

from __future__ import annotations

import grpc
from omnibus.v1 import engine_pb2, inference_pb2

from omnibus.router.dispatch.fleet import Fleet
from omnibus.router.service.admit import Admitter, no_engine
from omnibus.router.service.errors import RequestError, invalid
from omnibus.router.service.job import Caller
from omnibus.router.service.metrics import RouterMetrics

# An engine's failure, as opposed to its refusal of the request (passed on as it is).
_ENGINE_FAILURES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL)


class Embedder:
    def __init__(self, admitter: Admitter, fleet: Fleet, metrics: RouterMetrics) -> None:
        self._admitter = admitter
        self._fleet = fleet
        self._metrics = metrics

    async def embed(
        self, request: inference_pb2.EmbedRequest, request_id: str, caller: Caller
    ) -> inference_pb2.EmbedResponse:
        self._admitter.check_embedding_adapter(caller.adapter)
        if request.pooling not in inference_pb2.Pooling.values():  # an enum value from a newer API
            raise invalid(f"pooling must be MEAN (1) or LAST (2), or unset for MEAN; got {request.pooling}")
        inputs = await self._admitter.embed_inputs(request)
        if not self._fleet.serving():
            raise no_engine()
        longest = max(map(len, inputs))
        engine = self._fleet.embed_target(longest)
        if engine is None:  # those with a long enough context (validated) are down
            raise RequestError(
                grpc.StatusCode.UNAVAILABLE,
                f"the engines whose context holds a {longest}-token input are down, restarting or "
                "draining; retry later",
                "no_engine",
            )
        tokens = sum(map(len, inputs))
        permit = await self._admitter.admit_embedding(caller.tenant, tokens)
        used = 0  # nothing unless the engine embeds them
        try:
            reply = await engine.link.embed(
                engine_pb2.EngineEmbedRequest(
                    inputs=[inference_pb2.TokenIds(ids=x) for x in inputs],
                    pooling=request.pooling,
                    normalize=request.normalize,
                    priority=request.priority,
                ),
                timeout=caller.time_remaining(),
            )
            used = tokens
        except grpc.aio.AioRpcError as exc:
            code = exc.code()
            if code in _ENGINE_FAILURES:
                message = f"engine {engine.address} failed the request: {exc.details()}"
                code = grpc.StatusCode.UNAVAILABLE
            else:  # INVALID_ARGUMENT, RESOURCE_EXHAUSTED, DEADLINE_EXCEEDED, CANCELLED: as is
                message = exc.details() or code.name
            raise RequestError(code, message, code.name.lower()) from None
        finally:
            permit.release(used)
        self._metrics.embed_requests.inc()
        self._metrics.embed_tokens.inc(tokens)
        return inference_pb2.EmbedResponse(
            request_id=request_id, embeddings=reply.embeddings, total_tokens=tokens)
