"""Server-sent events, as the streamed endpoints send them: the wait for every choice's
first message (so a refusal in the queue is still an HTTP status), the chunks of a
completion or chat stream, and the framing and sending of any stream (the Responses API
frames its events itself: responses.py `sse`). An error after the headers went out is
one last `data: {"error": ...}` event.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import aclosing
from typing import Any

import structlog
from aiohttp import web
from omnibus.v1 import inference_pb2 as pb

from omnibus.router.http import shapes
from omnibus.router.http.errors import REQUEST_ID_HEADER, error_body, http_status
from omnibus.router.service.errors import RequestError

log = structlog.get_logger("router.http")

_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
STREAMING = web.RequestKey("omnibus.streaming", bool)  # set on a request once its event stream's headers are sent


async def first_of_each(
    merged: AsyncIterator[tuple[int, pb.GenerateResponse]], n: int
) -> list[tuple[int, pb.GenerateResponse]]:
    """Reads until every choice has sent a message (each ends with a finish message, so
    this never runs out first)."""
    items, seen = [], set()
    while len(seen) < n:
        index, response = await anext(merged)
        items.append((index, response))
        seen.add(index)
    return items


async def sse_events(
    shape: shapes.CompletionShape | shapes.ChatShape,
    head: dict[str, Any],
    choices: list[shapes.Choice],
    first: list[tuple[int, pb.GenerateResponse]],
    merged: AsyncIterator[tuple[int, pb.GenerateResponse]],
    include_usage: bool,
    continuous: list[int] | None,
) -> AsyncGenerator[dict[str, Any], None]:
    """The stream's chunks, as the OpenAI API sends them: one per engine step and choice,
    the last with finish_reason; with include_usage, `usage: null` on each and a last
    chunk with no choices and the usage. With `continuous` (each choice's prompt tokens:
    vLLM's continuous_usage_stats) each chunk carries the usage so far instead of null."""
    started: set[int] = set()

    async def rest() -> AsyncIterator[tuple[int, pb.GenerateResponse]]:
        for item in first:
            yield item
        async for item in merged:
            yield item

    chunk = {**head, "object": shape.chunk_object}
    extra: dict[str, Any] = {"usage": None} if include_usage else {}
    prompt_tokens = 0 if continuous is None else shapes.prompt_total(choices, continuous)
    sent = 0  # tokens of every choice so far
    async for index, response in rest():
        choice = choices[index]
        choice.add(response)
        parts = shape.chunk_choices(choice, response, index not in started)
        started.add(index)
        if continuous is not None:
            sent += len(response.token_ids)
            extra = {"usage": shapes.usage_so_far(prompt_tokens, sent)}
        for part in parts:
            yield {**chunk, "choices": [part], **extra}
    if include_usage:
        yield {**chunk, "choices": [], "usage": shapes.total_usage(choices)}


async def send_sse(
    request: web.Request, events: AsyncGenerator[dict[str, Any], None], request_id: str,
    encode: Callable[[dict[str, Any]], bytes] | None = None, done: bytes = b"data: [DONE]\n\n",
) -> web.StreamResponse:
    """`events` framed by `encode` (default: `data:` lines), then `done` (the Responses API
    sends no [DONE])."""
    encode = encode or _sse
    response = web.StreamResponse(headers={**_SSE_HEADERS, REQUEST_ID_HEADER: request_id})
    await response.prepare(request)
    request[STREAMING] = True
    try:
        async with aclosing(events):
            try:
                async for event in events:
                    await response.write(encode(event))
            except RequestError as err:  # after the headers: an error event ends the stream
                status, kind = http_status(err.code)
                await response.write(_sse(error_body(err.message, kind, err.reason, err.param)))
        if done:
            await response.write(done)
        await response.write_eof()
    except ConnectionResetError:  # the client left; closing `events` cancelled the work
        log.info("http_client_gone", request_id=request_id)
    return response


def _sse(event: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(event, separators=(",", ":")).encode() + b"\n\n"
