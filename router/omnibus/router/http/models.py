"""GET /v1/models and /v1/models/{id}: the base model and the adapters the caller may
use."""

from __future__ import annotations

import time
from typing import Any

from aiohttp import web

from omnibus.router.config import RouterConfig
from omnibus.router.http.chat_template import ChatTemplate
from omnibus.router.http.errors import error_response
from omnibus.router.http.serving import Serving, metadata
from omnibus.router.service.errors import RequestError
from omnibus.router.service.pipeline import Pipeline
from omnibus.router.text.token_bytes import TokenBytes


class ModelServing(Serving):
    """The model listing endpoints."""

    def __init__(self, pipeline: Pipeline, config: RouterConfig, chat: ChatTemplate | None,
                 token_bytes: TokenBytes) -> None:
        super().__init__(pipeline, config, chat, token_bytes)
        self._created = int(time.time())

    async def models(self, request: web.Request) -> web.Response:
        try:
            data = self._model_entries(request)
        except RequestError as err:
            return error_response(err)
        return web.json_response({"object": "list", "data": data})

    async def model(self, request: web.Request) -> web.Response:
        """GET /v1/models/{id}: one entry of the listing, or 404."""
        model_id = request.match_info["model"]
        try:
            found = [m for m in self._model_entries(request) if m["id"] == model_id]
        except RequestError as err:
            return error_response(err)
        if not found:
            return error_response(self._unknown_model(model_id))
        return web.json_response(found[0])

    def _model_entries(self, request: web.Request) -> list[dict[str, Any]]:
        """The base model and the adapters the caller may use (authenticates first)."""
        listing = self._pipeline.list_models(self._pipeline.authenticate(metadata(request)))
        base = listing.base_model
        entry = {"object": "model", "created": self._created, "owned_by": "omnibus"}
        data = [{**entry, "id": base.id, "root": base.id, "parent": None,
                 "max_model_len": base.max_context_length}]  # fmt: skip
        # An adapter named as the base model is reachable only through the x-adapter-id
        # header (`model` with that name means the base model): it is not listed twice.
        data += [{**entry, "id": a.id, "root": a.id, "parent": base.id,
                  "max_model_len": base.max_context_length}
                 for a in listing.adapters if a.id != base.id]  # fmt: skip
        return data
