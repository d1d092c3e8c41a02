"""The OpenAI request bodies: one pydantic model per endpoint (completions, chat,
embeddings, tokenize, detokenize), `parse` to read one from raw JSON, and the 400
messages that name the bad field. Only types and shapes are checked here: every limit
and range is the Validator's (the gRPC API's), so a value out of range gets the same
message either way. v1_requests.py turns a body into omnibus.v1 requests."""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from omnibus.common.sampling import MAX_LOGPROBS
from omnibus.router.http.tools import Tools, chat_tools
from omnibus.router.service.errors import invalid

# An integer the protobuf field it goes to (int32) can hold: beyond, a 400 naming the
# field, where building the request would fail with a server error. Ranges are the
# Validator's to check, with the same messages as on gRPC.
Int32 = Annotated[int, Field(ge=-(2**31), le=2**31 - 1)]


class Strict(BaseModel):
    """A JSON object with typed fields: unknown fields are refused by name, and a value
    of the wrong JSON type ("5" or 5.0 or true for an integer) is refused, not converted.
    A field sent as null takes its default, as in the OpenAI API."""

    model_config = ConfigDict(extra="forbid", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None or k not in cls.model_fields}
        return data


class StreamOptions(Strict):
    include_usage: bool = False
    include_obfuscation: bool = True  # accepted: nothing here is obfuscated
    # vLLM's extension (guidellm always sends it): every chunk carries the usage so far.
    continuous_usage_stats: bool = False


class GenerationBody(Strict):
    """Fields every generation body shares."""

    model: str
    max_tokens: Int32 | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stop: Any = None  # a string or a list of strings (checked by v1_requests.stop_strings)
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None  # token id (as a string, OpenAI's) -> bias in [-100, 100]
    user: str | None = None  # accepted and ignored, as the OpenAI API only logs it
    # Extensions (vLLM's names): sampling the OpenAI API lacks, and scheduling.
    top_k: Int32 = 0
    min_p: float = 0.0
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    stop_token_ids: list[Int32] = Field(default_factory=list)
    priority: Int32 | None = None  # or the x-priority header
    return_token_ids: bool = False  # each choice (and chunk) also carries its token ids
    # Omnibus's: "off" never speculates for this request; "auto" leaves it to the engine.
    speculative: Literal["auto", "off"] = "auto"
    # Structured output: OpenAI's response_format, or vLLM's structured_outputs / guided_json
    # (v1_requests.structured_output reads them).
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def unsupported(self) -> tuple[str, str] | None:
        """The first field set to something this server cannot do, and a message."""
        if self.stream_options is not None and not self.stream:
            return "stream_options", "stream_options is only allowed with stream: true"
        return None


class CompletionBody(GenerationBody):
    # a string, strings, token ids or lists of token ids (v1_requests.completion_prompts)
    prompt: Any
    logprobs: Int32 | None = None  # alternatives per token, 0..20; None: no logprobs
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def unsupported(self) -> tuple[str, str] | None:
        if self.max_tokens == 0 and not self.echo:
            return "max_tokens", ("max_tokens must be at least 1, or 0 with echo: true (the prompt "
                                  "alone, with its logprobs)")
        if self.suffix:
            return "suffix", "suffix (insertion) is not supported"
        if self.best_of not in (None, 1):
            return "best_of", "best_of is not supported; use n for several completions"
        return super().unsupported()

    @property
    def prompt_only(self) -> bool:
        """echo with max_tokens 0 (vLLM's): the prompt (and its logprobs) and no completion.
        The engine is asked for one token, which is left out."""
        return self.echo and self.max_tokens == 0


class ChatMessage(BaseModel):
    """One message; fields beyond role and content (name, tool_call_id...) reach the
    template as they are."""

    model_config = ConfigDict(extra="allow", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Any = None  # a string, a list of text parts, or null (an assistant's only)

    def for_template(self, index: int) -> dict[str, Any]:
        if self.content is None and self.role != "assistant":
            raise invalid(f"messages.{index}.content is required for a {self.role} message",
                          f"messages.{index}.content")
        extra = dict(self.model_extra or {})
        if self.role == "tool" and not isinstance(extra.get("tool_call_id"), str):
            raise invalid(f"messages.{index}.tool_call_id is required for a tool message: the id "
                          "of the call it answers, a string", f"messages.{index}.tool_call_id")
        if extra.get("tool_calls") is not None:
            where = f"messages.{index}.tool_calls"
            extra["tool_calls"] = _template_calls(extra["tool_calls"], where)
        return {**extra, "role": self.role, "content": _content(self.content, index)}


def _template_calls(calls: object, where: str) -> list[dict[str, Any]]:
    """An assistant's tool_calls as templates read them: each function's arguments (JSON
    text in OpenAI's API) as the object it holds, as vLLM and transformers give them
    (`{{ call.arguments | tojson }}`)."""
    if not isinstance(calls, list):
        raise invalid(f"{where} must be a list of tool calls", where)
    out = []
    for i, call in enumerate(calls):
        at = f"{where}.{i}"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise invalid(f"{at} must be {{\"id\", \"type\": \"function\", \"function\": "
                          f"{{\"name\", \"arguments\"}}}}", at)
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except (ValueError, RecursionError) as exc:
                raise invalid(f"{at}.function.arguments is not JSON: {exc}",
                              f"{at}.function.arguments") from None
        if not isinstance(arguments, dict):
            raise invalid(f"{at}.function.arguments must be a JSON object (as text)",
                          f"{at}.function.arguments")
        out.append({**call, "function": {**function, "arguments": arguments}})
    return out




def _content(content: object, index: int) -> str:
    """A message's text: a string, or the text parts of a list, one per line (as vLLM and
    TensorRT-LLM join them for string-content templates)."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(
                part.get("text"), str
            ):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise invalid(
                    f"messages.{index}.content: only text parts are supported "
                    f"({{\"type\": \"text\", \"text\": ...}}), got {kind!r}",
                    f"messages.{index}.content",
                )
            texts.append(part["text"])
        return "\n".join(texts)
    raise invalid(f"messages.{index}.content must be a string, a list of text parts or null",
                  f"messages.{index}.content")


class ChatBody(GenerationBody):
    messages: list[ChatMessage]
    max_completion_tokens: Int32 | None = None
    logprobs: bool = False
    top_logprobs: Int32 | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    # Accepted and ignored, as they change nothing a client gets back: nothing is stored
    # or billed per tier here, and prefixes are cached by content whatever the key.
    store: bool = False
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None

    def unsupported(self) -> tuple[str, str] | None:
        self.tool_spec()  # raises RequestError naming a bad tool or tool_choice
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            if self.max_tokens != self.max_completion_tokens:
                return "max_completion_tokens", "max_tokens and max_completion_tokens differ; set one of them"
        if not self.messages:
            return "messages", "messages must not be empty"
        return super().unsupported()

    def tool_spec(self) -> Tools | None:
        """The tools (the template shows them, whatever tool_choice is, as vLLM's does)
        and what tool_choice asks of them; None without tools (an empty list is none).
        Raises RequestError naming the bad field."""
        return chat_tools(self.tools, self.tool_choice, self.parallel_tool_calls is not False)

    @property
    def logprob_count(self) -> int | None:
        """Alternatives per token asked for; None: no logprobs."""
        if not self.logprobs:
            if self.top_logprobs:
                raise invalid("top_logprobs needs logprobs: true", "top_logprobs")
            return None
        return check_logprobs(self.top_logprobs or 0, "top_logprobs")


def check_logprobs(count: int, field: str) -> int:
    """`count` alternatives per token (the body's `field`), if in OpenAI's range."""
    if not 0 <= count <= MAX_LOGPROBS:
        raise invalid(f"{field} must be in [0, {MAX_LOGPROBS}], got {count}", field)
    return count


class EmbeddingBody(Strict):
    model: str
    input: Any  # a string, strings, token ids or lists of token ids
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    # Extensions: how token states become one vector. OpenAI's embeddings are unit length.
    pooling: Literal["mean", "last"] = "mean"
    normalize: bool = True
    priority: Int32 | None = None


class TokenizeBody(Strict):
    """POST /tokenize, in vLLM's shape: a prompt, tokenized as /v1/completions tokenizes
    it, or chat messages, rendered and tokenized as /v1/chat/completions does."""

    model: str | None = None  # the base model or an adapter (they share the tokenizer)
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages
    add_generation_prompt: bool | None = None  # messages only; default true
    tools: list[dict[str, Any]] | None = None  # messages only: rendered as chat renders them
    return_token_strs: bool = False  # also each token as the vocabulary spells it

    def unsupported(self) -> tuple[str, str] | None:
        if (self.prompt is None) == (self.messages is None):
            return "prompt", "send either prompt (text) or messages (a chat)"
        if self.messages is not None and not self.messages:
            return "messages", "messages must not be empty"
        for name in ("add_generation_prompt", "tools"):
            if self.prompt is not None and getattr(self, name) is not None:
                return name, f"{name} is for messages, not a prompt"
        self.tool_spec()
        return None

    def tool_spec(self) -> Tools | None:
        """The tools the template shows (checked as chat checks them)."""
        return chat_tools(self.tools, "none", True)


class DetokenizeBody(Strict):
    """POST /detokenize, in vLLM's shape."""

    model: str | None = None
    tokens: list[Int32]


_Bodies = CompletionBody | ChatBody | EmbeddingBody | TokenizeBody | DetokenizeBody


def parse(kind: type[_Bodies], raw: bytes) -> Any:
    """The body as `kind`. Raises RequestError(INVALID_ARGUMENT) naming the bad field."""
    try:
        data = json.loads(raw)
        if _SURROGATE_ESCAPE.search(raw):  # only a \uD800-\uDFFF escape can leave one behind
            _check_unicode(data, "")
    except (ValueError, UnicodeDecodeError) as exc:
        raise invalid(f"the request body must be a JSON object: {exc}") from None
    except RecursionError:  # arrays or objects nested ~1000 deep
        raise invalid("the request body is nested too deeply to be a request") from None
    if not isinstance(data, dict):
        raise invalid(f"the request body must be a JSON object, got {type(data).__name__}")
    try:
        body = kind.model_validate(data)
    except ValidationError as exc:
        raise invalid(*_describe(exc)) from None
    problem = body.unsupported() if hasattr(body, "unsupported") else None
    if problem:
        field, message = problem
        raise invalid(message, field)
    return body


# A JSON \u escape of a UTF-16 surrogate. A pair of them decodes to one character; a lone
# one stays in the str and no UTF-8 text (the tokenizer's, protobuf's) can hold it.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _check_unicode(value: object, where: str) -> None:
    """Raises RequestError(INVALID_ARGUMENT) naming the first string of `value` (a parsed
    JSON body) that holds a lone surrogate."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            where = where or "body"
            shown = where if len(where) <= 80 else where[:77] + "..."
            raise invalid(f"{shown}: the string holds a lone UTF-16 surrogate "
                          f"({value[exc.start]!r} at index {exc.start}), which is not Unicode "
                          "text; send it as a pair or as the character itself", where) from None
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_unicode(key, where or "body")
            _check_unicode(item, f"{where}.{key}" if where else str(key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _check_unicode(item, f"{where}.{i}")


def _describe(exc: ValidationError) -> tuple[str, str | None]:
    """The first few errors as one message, and the first error's field."""
    errors, parts = exc.errors(include_url=False), []
    for error in errors[:4]:
        where = ".".join(str(p) for p in error["loc"]) or "body"
        if error["type"] == "extra_forbidden":
            parts.append(f"unknown field {where!r}")
        elif error["type"] == "missing":
            parts.append(f"{where} is required")
        else:
            parts.append(f"{where}: {error['msg']}")
    first = errors[0]["loc"] if errors else ()
    return "; ".join(parts), ".".join(str(p) for p in first) or None
