"""POST /v1/chat/completions: the messages rendered by the model's chat template
(Serving._chat_prompt) and served as token ids, `n` choices; with tools the reply's
calls come back as tool_calls (the --tool-call-parser's, tool_parser.py)."""

from __future__ import annotations

from aiohttp import web
from omnibus.v1 import inference_pb2 as pb

from omnibus.router.http import bodies, shapes, v1_requests
from omnibus.router.http.serving import Prepared, Serving
from omnibus.router.http.tool_parser import PARSERS


class ChatServing(Serving):
    """The chat endpoint, and the chat request the Responses API makes (responses.py)."""

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generation(request, bodies.ChatBody, self._chat_request)

    async def _chat_request(self, body: bodies.ChatBody) -> Prepared:
        ids = await self._chat_prompt(body)
        # The newer name; 0 is refused, not unset. The Validator checks it as max_tokens, and
        # its refusals are named as sent (serving._as_sent).
        max_tokens = body.max_tokens if body.max_completion_tokens is None else body.max_completion_tokens
        if max_tokens is None:  # as the OpenAI API: up to the context (of an engine that takes it)
            max_tokens = self._pipeline.default_max_tokens(len(ids))
        logprobs = body.logprob_count
        prompt = pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids))
        prompt.sampling.CopyFrom(v1_requests.sampling(body, max_tokens, logprobs))
        tools = body.tool_spec()
        if tools is not None and tools.choice != "none":  # calls come back as tool_calls
            parser = PARSERS[self._config.tool_call_parser]
            return [prompt], shapes.ToolChatShape(logprobs, body.return_token_ids,
                                                  self._token_bytes, tools, parser)
        return [prompt], shapes.ChatShape(logprobs, body.return_token_ids, self._token_bytes)
