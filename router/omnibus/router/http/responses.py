"""The OpenAI Responses API (POST /v1/responses), the part a text model serves: a
Responses body becomes the chat request /v1/chat/completions would make of the same
messages (ResponsesBody.chat_body), which ResponsesServing serves as chat.py serves chat
(one chat template, the same admission, adapter and priority rules, the same Pipeline
calls), and the chat choice goes back as a `response` object or as its stream of typed
events.

Nothing is stored here, so `store: true` and `previous_response_id` are refused rather
than silently ignored; tools, images, files and audio are refused by name.
"""

from __future__ import annotations

import itertools
import json
import re
import time
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from typing import Any, Literal

import grpc
from aiohttp import web
from omnibus.v1 import inference_pb2 as pb

from omnibus.common import finish_reasons
from omnibus.router.http import bodies, shapes, v1_requests
from omnibus.router.http.bodies import Int32, Strict
from omnibus.router.http.chat import ChatServing
from omnibus.router.http.errors import REQUEST_ID_HEADER, error_response
from omnibus.router.http.serving import request_id_of
from omnibus.router.http.sse import first_of_each, send_sse
from omnibus.router.service.errors import RequestError, invalid

_ROLES = ("user", "system", "developer", "assistant")
# A message item's keys: what clients send, and what an output item resent as input holds.
_MESSAGE_KEYS = {"type", "role", "content", "id", "status", "phase"}
_TEXT_PARTS = {"input_text": {"type", "text"},
               "output_text": {"type", "text", "annotations", "logprobs"}}
_MEDIA_PARTS = ("input_image", "input_file", "input_audio")
# The chat path's field names in refusals, as a Responses body names them.
_FORMAT_NAME = re.compile(r"\bresponse_format(?:\.json_schema)?\b")
_INCOMPLETE = {"reason": "max_output_tokens"}  # the one way a response ends incomplete here


class TextConfig(Strict):
    format: dict[str, Any] | None = None  # text, json_object or json_schema (flat, as OpenAI's)


class ResponsesBody(Strict):
    """A POST /v1/responses body; unknown fields are refused by name (Strict)."""

    model: str
    input: str | list[Any]
    instructions: str | None = None  # a system message before the input
    max_output_tokens: Int32 | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    text: TextConfig | None = None
    stream: bool = False
    store: bool = False  # OpenAI's default is true; nothing is stored here (unsupported)
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None  # echoed back
    user: str | None = None  # echoed back; the OpenAI API only logs it
    truncation: Literal["auto", "disabled"] = "disabled"
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    priority: Int32 | None = None  # Omnibus's, as on chat; or the x-priority header

    def unsupported(self) -> tuple[str, str] | None:
        """The first field set to something this server cannot do, and a message."""
        if self.store:
            return "store", ("store: true is not supported: this server stores no responses; "
                             "send store: false or leave it out")
        if self.previous_response_id is not None:
            return "previous_response_id", (
                "previous_response_id is not supported: this server stores no responses, so "
                "there is none to continue; send the whole conversation in input")
        if self.tools or self.tool_choice not in (None, "none"):
            return "tools", "tools and tool_choice are not supported on /v1/responses"
        if self.truncation == "auto":
            return "truncation", ("truncation: auto (dropping the conversation's start to fit the "
                                  "context) is not supported; a prompt over the context is refused")
        if not self.input:
            return "input", "input must be a non-empty string or a non-empty list of messages"
        return None

    def chat_body(self) -> bodies.ChatBody:
        """The chat request of the same messages and settings."""
        items = [self.input] if isinstance(self.input, str) else self.input
        messages = [_message(item, i, isinstance(self.input, str)) for i, item in enumerate(items)]
        if self.instructions is not None:
            messages.insert(0, bodies.ChatMessage(role="system", content=self.instructions))
        return bodies.ChatBody(
            model=self.model, messages=messages, max_completion_tokens=self.max_output_tokens,
            temperature=self.temperature, top_p=self.top_p, seed=self.seed, stream=self.stream,
            response_format=self._response_format(), priority=self.priority, user=self.user,
        )  # fmt: skip

    def _response_format(self) -> dict[str, Any] | None:
        """text.format as chat's response_format, whose rules (structured.py) check it: the
        json_schema settings sit one level down there."""
        fmt = None if self.text is None else self.text.format
        if fmt is None or fmt.get("type") != "json_schema":
            return fmt
        return {"type": "json_schema", "json_schema": {k: v for k, v in fmt.items() if k != "type"}}


def _message(item: object, index: int, bare: bool) -> bodies.ChatMessage:
    """Input item `index` (a bare string input: a user message) as a chat message."""
    if bare:
        return bodies.ChatMessage(role="user", content=item)
    where = f"input.{index}"
    if not isinstance(item, dict):
        raise invalid(f"{where} must be a message object with role and content", where)
    kind = item.get("type", "message")
    if kind != "message":
        raise invalid(f"{where}: input items of type {kind!r} are not supported; only messages "
                      "(role and content) are", f"{where}.type")
    extra = next((k for k in item if k not in _MESSAGE_KEYS), None)
    if extra is not None:
        raise invalid(f"unknown field '{where}.{extra}'", f"{where}.{extra}")
    role = item.get("role")
    if role not in _ROLES:
        raise invalid(f"{where}.role must be one of {', '.join(_ROLES)}, got {role!r}",
                      f"{where}.role")
    return bodies.ChatMessage(role=role, content=_content(item.get("content"), f"{where}.content"))


def _content(content: object, where: str) -> str | list[dict[str, str]]:
    """A message's content as chat content: a string, or its text parts as chat's text
    parts (which chat joins, one per line)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(f"{where} must be a string or a list of input_text parts", where)
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in _MEDIA_PARTS:
            raise invalid(f"{where}.{j}: {kind} parts are not supported: this server serves a "
                          "text model; send input_text parts", f"{where}.{j}")
        if kind not in _TEXT_PARTS:
            raise invalid(f"{where}.{j}: only input_text and output_text parts are supported, "
                          f"got {kind if isinstance(part, dict) else type(part).__name__!r}",
                          f"{where}.{j}")
        extra = next((k for k in part if k not in _TEXT_PARTS[kind]), None)
        if extra is not None:
            raise invalid(f"unknown field '{where}.{j}.{extra}'", f"{where}.{j}.{extra}")
        if not isinstance(part.get("text"), str):
            raise invalid(f"{where}.{j}.text must be a string", f"{where}.{j}.text")
        parts.append({"type": "text", "text": part["text"]})
    return parts


def as_sent(err: RequestError) -> RequestError:
    """A refusal of the chat request, naming the fields the Responses body sent: its
    max_tokens is max_output_tokens, and its structured output (response_format, or the
    schema the Validator or an engine refused) is text.format."""
    if err.param == "max_tokens":
        err.param = "max_output_tokens"
        err.message = re.sub(r"\bmax_tokens\b", "max_output_tokens", err.message)
    elif err.param == "structured_output":
        err.param = "text.format"
        err.message = re.sub(r"^structured_output\b", "text.format", err.message)
    elif err.param is not None and err.param.startswith("response_format"):
        err.param = _FORMAT_NAME.sub("text.format", err.param)
        err.message = _FORMAT_NAME.sub("text.format", err.message)
    return err


class Reply:
    """One response as it is generated: its id, its one output message, and the
    `response` object at any point."""

    def __init__(self, body: ResponsesBody, request_id: str) -> None:
        self.id = "resp_" + request_id
        self.item_id = "msg_" + request_id
        self.created_at = int(time.time())
        self.choice = shapes.Choice(0)
        self.error: RequestError | None = None  # set once the stream failed
        self._body = body

    @property
    def text(self) -> str:
        return "".join(self.choice.text)

    @property
    def status(self) -> str:
        if self.error is not None:
            return "failed"
        return finish_reasons.RESPONSES_STATUS[self.choice.finish] if self.choice.finish else "in_progress"

    def part(self, text: str) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def item(self) -> dict[str, Any]:
        status = self.status if self.status in ("completed", "in_progress") else "incomplete"
        content = [] if status == "in_progress" else [self.part(self.text)]
        return {"id": self.item_id, "type": "message", "status": status, "role": "assistant",
                "content": content}

    def object(self) -> dict[str, Any]:
        """The `response` object now; its output is empty until the choice has finished."""
        status, body = self.status, self._body
        done = status != "in_progress"
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "completed_at": int(time.time()) if status == "completed" else None,
            "error": None if self.error is None else _error(self.error),
            "incomplete_details": _INCOMPLETE if status == "incomplete" else None,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "model": body.model, "output": [self.item()] if done and self.error is None else [],
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": None,
            "reasoning": None, "store": False, "temperature": body.temperature,
            "text": {"format": (body.text and body.text.format) or {"type": "text"}},
            "tool_choice": "none", "tools": [], "top_p": body.top_p, "truncation": body.truncation,
            "usage": self._usage() if done else None, "user": body.user,
            "metadata": body.metadata or {},
        }  # fmt: skip

    def _usage(self) -> dict[str, Any] | None:
        usage = self.choice.usage
        if usage is None:
            return None
        return {
            "input_tokens": usage.prompt_tokens, "output_tokens": usage.completion_tokens,
            "total_tokens": usage.prompt_tokens + usage.completion_tokens,
            # cache writes: OpenAI's explicit prompt caching, which this server does not have
            "input_tokens_details": {"cached_tokens": usage.cached_prompt_tokens,
                                     "cache_write_tokens": 0},
            "output_tokens_details": {"reasoning_tokens": 0},
        }  # fmt: skip


def _error(err: RequestError) -> dict[str, Any]:
    """A failed response's `error`, its code one of those the Responses API names."""
    if err.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        code = "rate_limit_exceeded"
    elif err.code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE):
        code = "invalid_prompt"
    else:
        code = "server_error"
    return {"code": code, "message": err.message}


def aborted() -> RequestError:
    return RequestError(grpc.StatusCode.ABORTED, "the server ended the request (it is shutting "
                        "down) before it finished; retry it", "aborted")


def finished(reply: Reply, responses: list[tuple[int, pb.GenerateResponse]]) -> dict[str, Any]:
    """The whole response of a request that is not streamed."""
    for _, response in responses:
        reply.choice.add(response)
    if reply.status == "failed":  # the server ended it (ABORTED), as a stream would say
        reply.error = aborted()
    return reply.object()


async def events(
    reply: Reply,
    first: list[tuple[int, pb.GenerateResponse]],
    rest: AsyncIterator[tuple[int, pb.GenerateResponse]],
) -> AsyncGenerator[dict[str, Any], None]:
    """The stream's events, as the Responses API sends them: created, in_progress, the
    message item and its text part added, one output_text.delta per text chunk the engine
    sends, the text, part and item done, then completed, incomplete (the length limit)
    or failed. An error after the stream began is an `error` event, then response.failed."""
    numbers = itertools.count()

    def event(kind: str, **fields: Any) -> dict[str, Any]:
        return {"type": kind, "sequence_number": next(numbers), **fields}

    where = {"item_id": reply.item_id, "output_index": 0, "content_index": 0}
    yield event("response.created", response=reply.object())
    yield event("response.in_progress", response=reply.object())
    yield event("response.output_item.added", output_index=0, item=reply.item())
    yield event("response.content_part.added", **where, part=reply.part(""))
    try:
        async for _, response in _chain(first, rest):
            reply.choice.add(response)
            if response.text:
                yield event("response.output_text.delta", **where, delta=response.text, logprobs=[])
    except RequestError as err:
        reply.error = as_sent(err)
    if reply.error is None and reply.status == "failed":
        reply.error = aborted()
    if reply.error is not None:
        yield event("error", code=reply.error.reason, message=reply.error.message,
                    param=reply.error.param)
        yield event("response.failed", response=reply.object())
        return
    yield event("response.output_text.done", **where, text=reply.text, logprobs=[])
    yield event("response.content_part.done", **where, part=reply.part(reply.text))
    yield event("response.output_item.done", output_index=0, item=reply.item())
    yield event(f"response.{reply.status}", response=reply.object())


async def _chain(first: list, rest: AsyncIterator) -> AsyncIterator:
    for item in first:
        yield item
    async for item in rest:
        yield item


def sse(event: dict[str, Any]) -> bytes:
    """One event as the Responses API frames it: its type on an `event:` line."""
    data = json.dumps(event, separators=(",", ":"))
    return f"event: {event['type']}\ndata: {data}\n\n".encode()


class ResponsesServing(ChatServing):
    """The Responses endpoint: a chat request underneath (ChatServing._chat_request)."""

    async def responses(self, request: web.Request) -> web.StreamResponse:
        """POST /v1/responses: the chat request a Responses body makes, served as a chat
        request is, answered in the Responses API's shapes."""
        request_id = request_id_of(request)
        try:
            caller, body = await self._start(request, ResponsesBody, request_id)
            chat = body.chat_body()
            prompts, _ = await self._chat_request(chat)
            priority = self._priority(request, chat.priority)
            requests = v1_requests.fan_out(chat, prompts, 1, request_id, priority)
        except RequestError as err:
            return error_response(self._pipeline.refused(as_sent(err), request_id))
        reply = Reply(body, request_id)
        async with aclosing(self._pipeline.generate_choices(requests, caller, 1)) as merged:
            try:  # a stream's headers wait for its first tokens, as chat's: 429 is a status
                first = await (first_of_each(merged, 1) if body.stream else _all(merged))
            except RequestError as err:
                return error_response(as_sent(err))
            if not body.stream:
                return web.json_response(finished(reply, first),
                                         headers={REQUEST_ID_HEADER: request_id})
            stream = events(reply, first, merged)
            return await send_sse(request, stream, request_id, sse, done=b"")


async def _all(
    merged: AsyncIterator[tuple[int, pb.GenerateResponse]],
) -> list[tuple[int, pb.GenerateResponse]]:
    return [item async for item in merged]
