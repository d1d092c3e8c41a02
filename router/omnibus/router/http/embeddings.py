"""POST /v1/embeddings: the base model's embeddings of one input or a batch, as floats
or OpenAI's base64."""

from __future__ import annotations

import base64
import sys
from array import array

from aiohttp import web

from omnibus.router.http import bodies, v1_requests
from omnibus.router.http.errors import error_response
from omnibus.router.http.serving import Serving, request_id_of
from omnibus.router.service.errors import RequestError


class EmbeddingServing(Serving):
    """The embeddings endpoint."""

    async def embeddings(self, request: web.Request) -> web.Response:
        request_id = request_id_of(request)
        try:
            caller, body = await self._start(request, bodies.EmbeddingBody, request_id)
            embed = v1_requests.embed_request(body, request_id, self._priority(request, body.priority))
        except RequestError as err:
            return error_response(self._pipeline.refused(err, request_id))
        try:
            reply = await self._pipeline.embed(embed, caller)
        except RequestError as err:
            return error_response(err)
        data = [
            {"object": "embedding", "index": i,
             "embedding": _encode(list(e.values), body.encoding_format)}
            for i, e in enumerate(reply.embeddings)
        ]  # fmt: skip
        return web.json_response({
            "object": "list", "data": data, "model": body.model,
            "usage": {"prompt_tokens": reply.total_tokens, "total_tokens": reply.total_tokens},
        })  # fmt: skip


def _encode(values: list[float], encoding: str) -> list[float] | str:
    """OpenAI's base64 encoding: little-endian float32."""
    if encoding == "float":
        return values
    packed = array("f", values)
    if sys.byteorder == "big":
        packed.byteswap()
    return base64.b64encode(packed.tobytes()).decode()
