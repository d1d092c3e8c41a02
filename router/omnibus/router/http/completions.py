"""POST /v1/completions: one prompt or a batch (text or token ids), each run as `n`
choices; with echo the prompt comes back before the completion, and with logprobs and
echo the prompt's tokens are scored too (vLLM's prompt_logprobs)."""

from __future__ import annotations

import asyncio
import functools

from aiohttp import web

from omnibus.router.http import bodies, shapes, v1_requests
from omnibus.router.http.serving import Prepared, Serving


class CompletionServing(Serving):
    """The completions endpoint."""

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generation(request, bodies.CompletionBody, self._completion_request)

    async def _completion_request(self, body: bodies.CompletionBody) -> Prepared:
        # The cap on the inputs of one embeddings request caps a batch's prompts too.
        prompts = v1_requests.completion_prompts(body.prompt, self._config.max_embed_inputs)
        logprobs = None if body.logprobs is None else bodies.check_logprobs(body.logprobs, "logprobs")
        sampling = v1_requests.sampling(body, 1 if body.prompt_only else body.max_tokens, logprobs)
        if body.echo and logprobs is not None:  # the prompt's tokens scored too (vLLM's prompt_logprobs)
            sampling.prompt_logprobs = sampling.logprobs
        detokenizers, echoes = [], []
        tokenizer = self._pipeline.tokenizer
        for prompt in prompts:
            prompt.sampling.CopyFrom(sampling)
            is_text = prompt.WhichOneof("prompt") == "text"
            ids = [] if is_text else list(prompt.token_ids.ids)
            if logprobs is not None:  # text offsets: detokenized as the text is, after the prompt
                if is_text:
                    ids = (await asyncio.to_thread(tokenizer.encode, prompt.text)).ids
                detokenizers.append(functools.partial(self._pipeline.detokenizer, ids))
            if body.echo:
                text = prompt.text if is_text else await asyncio.to_thread(self._decoded, ids)
                echoes.append(shapes.Echo(text, ids if logprobs is not None else []))
        shape = shapes.CompletionShape(logprobs, body.return_token_ids, self._token_bytes,
                                       detokenizers or self._pipeline.detokenizer,
                                       echoes if body.echo else None, self._pipeline.detokenizer)
        return prompts, shape

    def _decoded(self, ids: list[int]) -> str:
        """A token-id prompt's text, as a completion's text is made (special tokens skipped)."""
        detokenizer = self._pipeline.detokenizer()
        return detokenizer.push(ids) + detokenizer.flush()
