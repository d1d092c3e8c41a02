"""vLLM's tokenizer endpoints: POST /tokenize, POST /detokenize and GET /tokenizer_info.
(Not tokenize.py: that name is the standard library's.)"""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from omnibus.common.sampling import check_token_ids
from omnibus.router.config import RouterConfig
from omnibus.router.dispatch.adapters import ADAPTER_HEADER
from omnibus.router.http import bodies
from omnibus.router.http.chat_template import ChatTemplate
from omnibus.router.http.chat_template import tokenizer_info as read_tokenizer_info
from omnibus.router.http.errors import error_response
from omnibus.router.http.serving import Serving, metadata
from omnibus.router.service.errors import RequestError, invalid
from omnibus.router.service.pipeline import Pipeline
from omnibus.router.text.token_bytes import TokenBytes


class TokenizationServing(Serving):
    """The tokenizer endpoints."""

    def __init__(self, pipeline: Pipeline, config: RouterConfig, chat: ChatTemplate | None,
                 token_bytes: TokenBytes) -> None:
        super().__init__(pipeline, config, chat, token_bytes)
        self._tokenizer_info = read_tokenizer_info(config.model)

    async def tokenize(self, request: web.Request) -> web.Response:
        """vLLM's POST /tokenize: a prompt's token ids as /v1/completions gets them (with
        the special tokens the tokenizer adds, unless add_special_tokens is false), or
        chat messages' as /v1/chat/completions gets them."""
        try:
            body = await self._tokenizer_body(request, bodies.TokenizeBody)
            if body.messages is not None:
                ids = await self._chat_prompt(body, body.add_generation_prompt is not False,
                                              body.add_special_tokens is True)
            else:
                add = body.add_special_tokens is not False
                ids = (await asyncio.to_thread(self._pipeline.tokenizer.encode, body.prompt,
                                               add_special_tokens=add)).ids
        except RequestError as err:
            return error_response(err)
        spell = self._pipeline.tokenizer.id_to_token
        return web.json_response({
            "count": len(ids), "max_model_len": self._pipeline.limits.context, "tokens": ids,
            "token_strs": [spell(i) for i in ids] if body.return_token_strs else None,
        })  # fmt: skip

    async def detokenize(self, request: web.Request) -> web.Response:
        """vLLM's POST /detokenize: the text of token ids, special tokens included (as
        transformers' decode)."""
        try:
            body = await self._tokenizer_body(request, bodies.DetokenizeBody)
            if body.tokens:  # ids the model has, as a prompt's are checked
                try:
                    check_token_ids(body.tokens, self._pipeline.limits.vocab_size, "tokens")
                except ValueError as exc:
                    raise invalid(str(exc), "tokens") from None
        except RequestError as err:
            return error_response(err)
        text = await asyncio.to_thread(self._pipeline.tokenizer.decode, body.tokens,
                                       skip_special_tokens=False)
        return web.json_response({"prompt": text})

    async def tokenizer_info(self, request: web.Request) -> web.Response:
        """vLLM's GET /tokenizer_info: the tokenizer's settings, special tokens and chat
        template (chat_template.tokenizer_info), with the context served now."""
        try:
            self._pipeline.authenticate(metadata(request))
        except RequestError as err:
            return error_response(err)
        info = {**self._tokenizer_info, "model_max_length": self._pipeline.limits.context}
        return web.json_response(info)

    async def _tokenizer_body(self, request: web.Request, kind: type) -> Any:
        """A /tokenize or /detokenize body from a caller with a key, its `model` (if set)
        the base model or an adapter the caller may use: they share the tokenizer."""
        tenant = self._pipeline.authenticate(metadata(request))
        body = bodies.parse(kind, await request.read())
        if body.model is not None:
            self._adapter(body.model, request.headers.get(ADAPTER_HEADER), tenant)
        return body
