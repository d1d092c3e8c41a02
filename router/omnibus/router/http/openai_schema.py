"""OpenAI request bodies in, omnibus.v1 requests out; omnibus.v1 responses in, OpenAI
JSON out. Only the shape changes here: every limit and range is checked by the one
Validator the gRPC API goes through (a sampling value out of range gets the same
message either way)."""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from omnibus.v1 import inference_pb2 as pb
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from omnibus.common.sampling import MAX_LOGPROBS, MAX_SEED
from omnibus.router.admission.validation import MAX_REQUEST_ID_CHARS
from omnibus.router.http.tool_parser import ToolCall
from omnibus.router.service.errors import invalid
from omnibus.router.text.detokenizer import IncrementalDetokenizer
from omnibus.router.text.token_bytes import TokenBytes

MIN_SEED = -(2**63)  # OpenAI's seed is an int64: a negative one is taken modulo 2**64
# An integer the protobuf field it goes to (int32) can hold: beyond, a 400 naming the
# field, where building the request would fail with a server error. Ranges are the
# Validator's to check, with the same messages as on gRPC.
Int32 = Annotated[int, Field(ge=-(2**31), le=2**31 - 1)]
FINISH_REASONS = {pb.STOP: "stop", pb.LENGTH: "length", pb.ABORTED: "abort"}


class _Strict(BaseModel):
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


class StreamOptions(_Strict):
    include_usage: bool = False
    include_obfuscation: bool = True  # accepted: nothing here is obfuscated
    # vLLM's extension (guidellm always sends it): every chunk carries the usage so far.
    continuous_usage_stats: bool = False


class _Body(_Strict):
    """Fields every generation body shares."""

    model: str
    max_tokens: Int32 | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stop: Any = None  # a string or a list of strings (checked by stop_strings)
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None  # only empty: no biasing here
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
    # (structured_output() reads them).
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def unsupported(self) -> tuple[str, str] | None:
        """The first field set to something this server cannot do, and a message."""
        if self.logit_bias:
            return "logit_bias", "logit_bias is not supported; remove it"
        if self.stream_options is not None and not self.stream:
            return "stream_options", "stream_options is only allowed with stream: true"
        return None


class CompletionBody(_Body):
    prompt: Any  # a string, strings, token ids or lists of token ids (completion_prompts)
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


class ChatBody(_Body):
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


class EmbeddingBody(_Strict):
    model: str
    input: Any  # a string, strings, token ids or lists of token ids
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    # Extensions: how token states become one vector. OpenAI's embeddings are unit length.
    pooling: Literal["mean", "last"] = "mean"
    normalize: bool = True
    priority: Int32 | None = None


class TokenizeBody(_Strict):
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


class DetokenizeBody(_Strict):
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


# ---- bodies → omnibus.v1 ------------------------------------------------------------


def _is_ids(value: object) -> bool:
    return isinstance(value, list) and all(type(v) is int for v in value)


def _token_ids(ids: list[int], field: str) -> pb.TokenIds:
    """Token ids for a protobuf field, or INVALID_ARGUMENT naming the first that no
    vocabulary holds (the Validator checks the rest against the model's)."""
    bad = next((t for t in ids if not -(2**31) <= t < 2**31), None)
    if bad is not None:
        raise invalid(f"{field}: token id {bad} is outside the vocabulary", field)
    return pb.TokenIds(ids=ids)


def completion_prompts(prompt: object, max_prompts: int) -> list[pb.GenerateRequest]:
    """A GenerateRequest for each of the body's prompts: a string, a list of strings,
    token ids, or a list of token-id lists (OpenAI's four forms), at most `max_prompts`."""
    if isinstance(prompt, str) or (_is_ids(prompt) and prompt):
        prompt = [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise invalid("prompt must be a non-empty string or a non-empty list of token ids, or a "
                      "list of those", "prompt")
    if len(prompt) > max_prompts:
        raise invalid(f"prompt holds {len(prompt)} prompts; at most {max_prompts} per request",
                      "prompt")
    prompts = []
    for i, item in enumerate(prompt):
        field = "prompt" if len(prompt) == 1 else f"prompt.{i}"
        if isinstance(item, str):
            prompts.append(pb.GenerateRequest(text=item))
        elif _is_ids(item) and item:
            prompts.append(pb.GenerateRequest(token_ids=_token_ids(item, field)))
        else:
            raise invalid(f"{field} must be a non-empty string or a non-empty list of token ids",
                          field)
    return prompts


def stop_strings(stop: object) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return list(stop)
    raise invalid("stop must be a string or a list of strings", "stop")


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


def structured_output(body: _Body) -> tuple[pb.StructuredOutput, str] | None:
    """The format the body holds the output to, and the field that set it: OpenAI's
    `response_format` (`json_object`, or `json_schema` with `name`, `schema`, `strict`,
    `description`; `text` is none), vLLM's `structured_outputs` (`json`: a schema object
    or its text; `json_object`: true; `regex`, `choice`, `grammar`) or its older
    `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`, or a chat
    `tool_choice` that forces a call (Tools.forced: the field is the schema's). At most
    one of them. The schema itself is checked by the Validator (as JSON) and compiled by
    the engine, as are the regex and the grammar."""
    tools = body.tool_spec() if isinstance(body, ChatBody) else None
    forced = tools.forced() if tools is not None else None
    sources = [(name, value) for name, value in (
        ("tool_choice", forced),
        ("response_format", body.response_format), ("structured_outputs", body.structured_outputs),
        ("guided_json", body.guided_json), ("guided_regex", body.guided_regex),
        ("guided_choice", body.guided_choice), ("guided_grammar", body.guided_grammar),
    ) if value is not None]
    if len(sources) > 1:
        raise invalid(f"{sources[0][0]} and {sources[1][0]} both set the output's format; set one",
                      sources[1][0])
    if not sources:
        return None
    name, value = sources[0]
    if name == "tool_choice":
        return forced
    if name == "response_format":
        fmt = _response_format(value)
    elif name == "structured_outputs":
        fmt = _structured_outputs(value)
    elif name == "guided_json":
        fmt = pb.StructuredOutput(json_schema=_schema_text(value, name))
    else:
        fmt = _guided(name.removeprefix("guided_"), value, name)
    return None if fmt is None else (fmt, name)


def _response_format(value: dict[str, Any]) -> pb.StructuredOutput | None:
    kind = value.get("type")
    if kind == "text":
        _only_keys(value, {"type"}, "response_format")
        return None
    if kind == "json_object":
        _only_keys(value, {"type"}, "response_format")
        return pb.StructuredOutput(json_object=True)
    if kind != "json_schema":
        raise invalid(f"response_format.type must be text, json_object or json_schema, got {kind!r}",
                      "response_format.type")
    _only_keys(value, {"type", "json_schema"}, "response_format")
    spec = value.get("json_schema")
    where = "response_format.json_schema"
    if not isinstance(spec, dict):
        raise invalid(f"{where} must be an object with name and schema", where)
    _only_keys(spec, {"name", "schema", "strict", "description"}, where)
    if not isinstance(spec.get("name"), str) or not spec["name"]:
        raise invalid(f"{where}.name must be a non-empty string", f"{where}.name")
    for key, kind_ in (("strict", bool), ("description", str)):
        if spec.get(key) is not None and not isinstance(spec[key], kind_):
            raise invalid(f"{where}.{key} must be a {kind_.__name__}", f"{where}.{key}")
    if "schema" not in spec:
        raise invalid(f"{where}.schema is required: the JSON Schema the output must follow",
                      f"{where}.schema")
    # strict or not, the schema is enforced (properties it does not name are not generated)
    return pb.StructuredOutput(json_schema=_schema_text(spec["schema"], f"{where}.schema"))


_GUIDED_KINDS = ("regex", "choice", "grammar")


def _structured_outputs(value: dict[str, Any]) -> pb.StructuredOutput | None:
    """vLLM's structured_outputs: one of `json`, `json_object`, `regex`, `choice`,
    `grammar`; structural tags are not served."""
    kinds = ("json", "json_object", *_GUIDED_KINDS)
    for key in value:
        if key not in kinds:
            raise invalid(f"structured_outputs.{key} is not supported; use one of "
                          f"{', '.join(kinds)}", f"structured_outputs.{key}")
    json_object = value.get("json_object")
    if json_object is not None and not isinstance(json_object, bool):
        raise invalid("structured_outputs.json_object must be a boolean",
                      "structured_outputs.json_object")
    given = [k for k in kinds if value.get(k) is not None and value.get(k) is not False]
    if len(given) > 1:
        raise invalid(f"structured_outputs sets both {given[0]} and {given[1]}; set one",
                      "structured_outputs")
    if not given:
        return None
    kind = given[0]
    if kind == "json":
        schema = _schema_text(value["json"], "structured_outputs.json")
        return pb.StructuredOutput(json_schema=schema)
    if kind == "json_object":
        return pb.StructuredOutput(json_object=True)
    return _guided(kind, value[kind], f"structured_outputs.{kind}")


def _guided(kind: str, value: object, where: str) -> pb.StructuredOutput:
    """A regex (the whole output matches it), a choice (the output is one of the strings)
    or a grammar (EBNF, GBNF's dialect, from rule `root`). Compiling them is the engine's."""
    if kind == "choice":
        if not isinstance(value, list) or not value:
            raise invalid(f"{where} must be a non-empty list of strings", where)
        for i, option in enumerate(value):
            if not isinstance(option, str) or not option:
                raise invalid(f"{where}.{i} must be a non-empty string", f"{where}.{i}")
        return pb.StructuredOutput(choice=pb.Choices(options=value))
    if not isinstance(value, str) or not value:
        what = "a regular expression" if kind == "regex" else "an EBNF grammar (rule root first)"
        raise invalid(f"{where} must be {what}, as a non-empty string", where)
    return pb.StructuredOutput(**{kind: value})


def _schema_text(schema: object, where: str) -> str:
    """A JSON Schema given as an object (sent on as JSON text, its key order kept: the
    order properties are generated in) or as JSON text (vLLM's string form)."""
    if isinstance(schema, str):
        return schema  # the Validator checks that it is JSON
    if isinstance(schema, dict) or schema is True:
        return json.dumps(schema, ensure_ascii=False)
    raise invalid(f"{where} must be a JSON Schema object, got {type(schema).__name__}", where)


def _only_keys(value: dict[str, Any], allowed: set[str], where: str) -> None:
    extra = next((k for k in value if k not in allowed), None)
    if extra is not None:
        raise invalid(f"unknown field '{where}.{extra}'", f"{where}.{extra}")

# ---- tools (chat) -------------------------------------------------------------------

# OpenAI's rule for a function's name.
_FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_EMPTY_PARAMETERS = {"type": "object", "properties": {}}  # a function without parameters


@dataclass(frozen=True)
class Tools:
    """A chat request's tools, as sent (the template gets them so), and what its
    tool_choice asks: "none" (plain text), "auto" (the model may call: the parser finds
    calls in the text), "required" (one call or more) or "function" (a call of
    `function`). The last two hold the output to a JSON schema (`forced`)."""

    tools: list[dict[str, Any]]
    choice: Literal["none", "auto", "required", "function"]
    function: str = ""
    parallel: bool = True  # parallel_tool_calls: false allows one call at most

    def parameters(self, name: str) -> tuple[int, dict[str, Any]]:
        """The index of function `name` and its parameters' schema."""
        for i, tool in enumerate(self.tools):
            if tool["function"]["name"] == name:
                return i, tool["function"].get("parameters") or _EMPTY_PARAMETERS
        raise KeyError(name)

    def forced(self) -> tuple[pb.StructuredOutput, str] | None:
        """The format tool_choice holds the output to, and the field that gave its schema:
        for a named function its parameters (the output is the arguments); for required,
        as vLLM's, a JSON array of at least one {"name", "parameters"} object, each one
        of the tools (one at most without parallel calls)."""
        if self.choice == "function":
            i, schema = self.parameters(self.function)
            fmt = pb.StructuredOutput(json_schema=_schema_text(schema, ""))
            return fmt, f"tools.{i}.function.parameters"
        if self.choice != "required":
            return None
        calls: dict[str, Any] = {"type": "array", "minItems": 1}
        if not self.parallel:
            calls["maxItems"] = 1
        calls["items"] = {"type": "object", "anyOf": [
            {"properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},
                            "parameters": t["function"].get("parameters") or _EMPTY_PARAMETERS},
             "required": ["name", "parameters"]} for t in self.tools]}
        defs = _shared_defs(self.tools)
        if defs:  # a parameters' "$ref": "#/$defs/..." resolves from the root
            calls["$defs"] = defs
        return pb.StructuredOutput(json_schema=json.dumps(calls, ensure_ascii=False)), "tools"


def chat_tools(tools: list[dict[str, Any]] | None, choice: object, parallel: bool) -> Tools | None:
    """`tools` and `tool_choice` checked (RequestError naming the first bad field)."""
    names = [_tool_name(tool, i) for i, tool in enumerate(tools or [])]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise invalid(f"tools.{i}.function.name: {name!r} is also tools.{names.index(name)}'s "
                          "name; each function needs its own", f"tools.{i}.function.name")
    if choice is None:
        choice = "auto" if names else "none"
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise invalid(f"tool_choice must be none, auto, required or {{\"type\": \"function\", "
                          f"\"function\": {{\"name\": ...}}}}, got {choice!r}", "tool_choice")
        function = ""
    else:
        function = _named_choice(choice)
        choice = "function"
    if not names:
        if choice == "none":
            return None
        shown = choice if choice != "function" else repr(function)
        raise invalid(f"tool_choice {shown} needs tools: send the functions in tools", "tool_choice")
    if function and function not in names:
        raise invalid(f"tool_choice names function {function!r}, which tools does not define "
                      f"(it has {', '.join(names)})", "tool_choice.function.name")
    return Tools(list(tools or []), choice, function, parallel)


def _tool_name(tool: dict[str, Any], i: int) -> str:
    """Tool i's function name, once its shape is checked: {"type": "function", "function":
    {"name", "description", "parameters", "strict"}}."""
    where = f"tools.{i}"
    _only_keys(tool, {"type", "function"}, where)
    if tool.get("type") != "function":
        raise invalid(f"{where}.type must be \"function\", got {tool.get('type')!r}",
                      f"{where}.type")
    spec = tool.get("function")
    where += ".function"
    if not isinstance(spec, dict):
        raise invalid(f"{where} must be an object with name (and description, parameters)", where)
    _only_keys(spec, {"name", "description", "parameters", "strict"}, where)
    name = spec.get("name")
    if not isinstance(name, str) or not _FUNCTION_NAME.fullmatch(name):
        raise invalid(f"{where}.name must be 1 to 64 letters, digits, _ or -, got {name!r}",
                      f"{where}.name")
    for key, kind in (("description", str), ("strict", bool), ("parameters", dict)):
        if spec.get(key) is not None and not isinstance(spec[key], kind):
            what = "a JSON Schema object" if key == "parameters" else f"a {kind.__name__}"
            raise invalid(f"{where}.{key} must be {what}, got {type(spec[key]).__name__}",
                          f"{where}.{key}")
    return name


def _named_choice(choice: object) -> str:
    if not isinstance(choice, dict):
        raise invalid(f"tool_choice must be a string or an object, got {type(choice).__name__}",
                      "tool_choice")
    _only_keys(choice, {"type", "function"}, "tool_choice")
    if choice.get("type") != "function":
        raise invalid(f"tool_choice.type must be \"function\", got {choice.get('type')!r}",
                      "tool_choice.type")
    spec = choice.get("function")
    if not isinstance(spec, dict):
        raise invalid("tool_choice.function must be an object with name", "tool_choice.function")
    _only_keys(spec, {"name"}, "tool_choice.function")
    if not isinstance(spec.get("name"), str):
        raise invalid("tool_choice.function.name must be a string", "tool_choice.function.name")
    return spec["name"]


def _shared_defs(tools: list[dict[str, Any]]) -> dict[str, Any]:
    """The $defs of every tool's parameters in one (required's schema is one document);
    two tools defining one name differently is a 400 naming the second."""
    defs: dict[str, Any] = {}
    for i, tool in enumerate(tools):
        own = (tool["function"].get("parameters") or {}).get("$defs") or {}
        if not isinstance(own, dict):
            raise invalid(f"tools.{i}.function.parameters.$defs must be an object",
                          f"tools.{i}.function.parameters.$defs")
        for key, value in own.items():
            if defs.setdefault(key, value) != value:
                raise invalid(f"tools.{i}.function.parameters.$defs.{key} differs from another "
                              "tool's definition of that name; with tool_choice required the "
                              "schemas share one $defs: rename one",
                              f"tools.{i}.function.parameters")
    return defs


def sampling(body: _Body, max_tokens: int | None, logprobs: int | None) -> pb.SamplingParams:
    """The body's sampling parameters as omnibus.v1's; unset stays unset (the
    Validator's defaults). `logprobs` 0 asks for the chosen token only: the engine is
    asked for one alternative, which the response leaves out."""
    params = pb.SamplingParams(
        top_k=body.top_k,
        min_p=body.min_p,
        stop=stop_strings(body.stop),
        stop_token_ids=body.stop_token_ids,
        ignore_eos=body.ignore_eos,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        logprobs=0 if logprobs is None else max(logprobs, 1),  # in range: check_logprobs
        speculative=pb.SPECULATIVE_OFF if body.speculative == "off" else pb.SPECULATIVE_AUTO,
    )
    for name, value in (
        ("max_tokens", max_tokens),
        ("temperature", body.temperature),
        ("top_p", body.top_p),
        ("repetition_penalty", body.repetition_penalty),
    ):
        if value is not None:
            setattr(params, name, value)
    fmt = structured_output(body)
    if fmt is not None:
        params.structured_output.CopyFrom(fmt[0])
    return params


def fan_out(
    body: _Body, prompts: list[pb.GenerateRequest], max_n: int, request_id: str, priority: int
) -> list[pb.GenerateRequest]:
    """One GenerateRequest per choice, prompt-major: choice j of prompt p is index
    p * n + j, as OpenAI indexes them. Choice j of a seeded request gets choice_seed(seed,
    j), so the choices differ and each is reproducible on its own."""
    if not 1 <= body.n <= max_n:
        raise invalid(f"n must be in [1, {max_n}], got {body.n}", "n")
    seed = body.seed
    if seed is not None:
        if not MIN_SEED <= seed <= MAX_SEED:
            raise invalid(f"seed must be in [{MIN_SEED}, {MAX_SEED}], got {seed}", "seed")
        seed %= 2**64
    count = len(prompts) * body.n
    longest = MAX_REQUEST_ID_CHARS - len(f"-{count - 1}")
    if count > 1 and len(request_id) > longest:  # choice i's id is the request's + "-i"
        raise invalid(f"with {count} choices the request id (x-request-id) must be at most "
                      f"{longest} characters, as each choice's id appends -i; it has "
                      f"{len(request_id)}")
    requests = []
    for prompt in prompts:
        for j in range(body.n):
            one = pb.GenerateRequest()
            one.CopyFrom(prompt)
            one.priority = priority
            one.request_id = request_id if count == 1 else f"{request_id}-{len(requests)}"
            if seed is not None:
                one.sampling.seed = choice_seed(seed, j)
            requests.append(one)
    return requests


def choice_seed(seed: int, j: int) -> int:
    """The seed of choice j of a request seeded `seed`: the seed itself for choice 0 (as
    with n=1, or over gRPC), else a mix of (seed, j). Not seed + j: that is the first
    choice of the request seeded seed + j, which would share its tokens. For each j it is
    one-to-one in the seed, so two requests' choices j never share a seed."""
    if j == 0:
        return seed
    return _mix64(seed ^ _mix64(j))


def _mix64(x: int) -> int:
    """splitmix64's finalizer: a bijection of 64-bit integers, nearby inputs unrelated."""
    x = (x + 0x9E3779B97F4A7C15) & MAX_SEED
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MAX_SEED
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MAX_SEED
    return x ^ (x >> 31)


def embed_request(body: EmbeddingBody, request_id: str, priority: int) -> pb.EmbedRequest:
    if body.dimensions is not None:
        raise invalid("dimensions is not supported: embeddings have the model's hidden size",
                      "dimensions")
    items = body.input
    if items == []:
        raise invalid("input is empty: send a string, token ids, or a list of those", "input")
    if isinstance(items, str) or _is_ids(items):
        items = [items]
    if not isinstance(items, list) or not items:
        raise invalid("input must be a string, a list of strings, token ids or lists of token ids",
                      "input")
    inputs = []
    for i, item in enumerate(items):
        if isinstance(item, str):
            inputs.append(pb.EmbedInput(text=item))
        elif _is_ids(item):
            inputs.append(pb.EmbedInput(token_ids=_token_ids(item, f"input.{i}")))
        else:
            raise invalid(f"input {i} must be a string or a list of token ids", f"input.{i}")
    return pb.EmbedRequest(
        inputs=inputs,
        pooling=pb.LAST if body.pooling == "last" else pb.MEAN,
        normalize=body.normalize,
        priority=priority,
        request_id=request_id,
    )


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


# ---- omnibus.v1 → OpenAI JSON -------------------------------------------------------


class Choice:
    """What one choice (of prompt `prompt`, in a batch) has produced so far."""

    def __init__(self, index: int, prompt: int = 0) -> None:
        self.index = index
        self.prompt = prompt
        self.text: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs: list[pb.TokenLogprob] = []
        self.prompt_logprobs: list[pb.TokenLogprob] = []  # prompt tokens 1.. (echo with logprobs)
        self.finish: str | None = None
        self.usage: pb.Usage | None = None
        self.offset = 0  # characters of text the tokens so far gave (completions' text_offset)
        self.text_so_far: IncrementalDetokenizer | None = None  # for text_offset

    def add(self, response: pb.GenerateResponse) -> None:
        self.text.append(response.text)
        self.token_ids.extend(response.token_ids)
        self.logprobs.extend(response.logprobs)
        if response.prompt_logprobs:
            self.prompt_logprobs.extend(response.prompt_logprobs)
        if response.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
            self.finish = FINISH_REASONS[response.finish_reason]
            self.usage = response.usage


def total_usage(choices: list[Choice]) -> dict[str, Any]:
    """Each prompt counted once (its choices share it), completions summed."""
    prompts: dict[int, tuple[int, int]] = {}  # prompt -> its tokens, the fewest cached
    for c in choices:
        if c.usage is not None:
            tokens, cached = prompts.get(c.prompt, (0, c.usage.cached_prompt_tokens))
            prompts[c.prompt] = (c.usage.prompt_tokens, min(cached, c.usage.cached_prompt_tokens))
    return usage(
        sum(tokens for tokens, _ in prompts.values()),
        sum(c.usage.completion_tokens for c in choices if c.usage is not None),
        sum(cached for _, cached in prompts.values()),
    )


def prompt_total(choices: list[Choice], prompt_tokens: list[int]) -> int:
    """The prompt tokens of a request whose choices have `prompt_tokens` each: each
    prompt once."""
    return sum({c.prompt: prompt_tokens[c.index] for c in choices}.values())


def usage_so_far(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    """vLLM's continuous_usage_stats: a chunk's usage, the tokens sent so far."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


class _Shape:
    """How an endpoint shapes choices: with logprobs (`logprobs` alternatives per token;
    None: none) and token ids or not; `tokens` gives a token's bytes and name."""

    def __init__(self, logprobs: int | None, token_ids: bool, tokens: TokenBytes) -> None:
        self._logprobs = logprobs
        self._token_ids = token_ids
        self._tokens = tokens


@dataclass(frozen=True)
class Echo:
    """A prompt that `echo` repeats before its completion: its text (the prompt as sent,
    or its token ids' text) and, when logprobs name its tokens, its token ids."""

    text: str
    ids: list[int]


class CompletionShape(_Shape):
    """/v1/completions: `text_completion` objects and chunks. `detokenizer` makes a
    stream's detokenizer, as the text's (for text_offset): one for every prompt, or a
    list of one per prompt of a batch. With `echoes` (one per prompt) each choice's text
    starts with its prompt and, with logprobs, its logprobs with the prompt's tokens
    (the first with null logprobs), whose text offsets `fresh` (a detokenizer with no
    context) gives."""

    object = chunk_object = "text_completion"
    id_prefix = "cmpl-"

    def __init__(self, logprobs: int | None, token_ids: bool, tokens: TokenBytes,
                 detokenizer: Callable[[], IncrementalDetokenizer]
                 | list[Callable[[], IncrementalDetokenizer]],
                 echoes: list[Echo] | None = None,
                 fresh: Callable[[], IncrementalDetokenizer] | None = None) -> None:
        super().__init__(logprobs, token_ids, tokens)
        self._detokenizers = detokenizer if isinstance(detokenizer, list) else [detokenizer]
        self._echoes = echoes
        self._fresh = fresh

    def choice(self, c: Choice) -> dict[str, Any]:
        echo = self._echo(c)
        text = "".join(c.text) if echo is None else echo.text + "".join(c.text)
        return self._choice(c.index, text, c.token_ids, c.logprobs, c.finish, c, echo)

    def chunk_choices(self, c: Choice, r: pb.GenerateResponse, first: bool) -> list[dict[str, Any]]:
        echo = self._echo(c) if first else None  # the prompt comes with the first chunk
        if not (echo or r.text or r.logprobs or c.finish or self._token_ids and r.token_ids):
            return []  # text held back (a partial character or stop string): nothing new
        text = r.text if echo is None else echo.text + r.text
        return [self._choice(c.index, text, r.token_ids, r.logprobs, c.finish, c, echo)]

    def _echo(self, c: Choice) -> Echo | None:
        return None if self._echoes is None else self._echoes[c.prompt]

    def _choice(self, index, text, ids, logprobs, finish, c: Choice,
                echo: Echo | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"index": index, "text": text, "logprobs": None, "finish_reason": finish}
        if self._logprobs is not None:
            out["logprobs"] = self._format(logprobs, c)
            if echo is not None:  # the prompt's tokens first
                prompt = self._prompt(echo, c.prompt_logprobs)
                out["logprobs"] = {key: prompt[key] + out["logprobs"][key] for key in prompt}
        if self._token_ids:
            out["token_ids"] = list(ids)
        return out

    def _format(self, logprobs, c: Choice) -> dict[str, Any]:
        """A token's text_offset is where it starts in the choice's text, detokenized as the
        text is: the text so far ends with the token's own text, unless it is held back (a
        run of byte tokens that later ones complete or close) or shorter (SentencePiece's
        stripped first space, a skipped special token). A token holding part of a
        character starts where that character does. An echoed prompt's text comes first."""
        if c.text_so_far is None:
            c.text_so_far = self._detokenizers[c.prompt if len(self._detokenizers) > 1 else 0]()
            echo = self._echo(c)
            c.offset = 0 if echo is None else len(echo.text)
        offsets = []
        for lp in logprobs:
            start, c.offset = self._offset(c.text_so_far, lp.token_id, c.offset)
            offsets.append(start)
        return {
            "tokens": [self._tokens.text(lp.token_id) for lp in logprobs],
            "token_logprobs": [json_logprob(lp.logprob) for lp in logprobs],
            "top_logprobs": [self._top(lp) for lp in logprobs],
            "text_offset": offsets,
        }

    def _prompt(self, echo: Echo, scored: list[pb.TokenLogprob]) -> dict[str, list]:
        """The echoed prompt's tokens in `_format`'s shape: entry i > 0 from scored[i - 1]
        (the engine's prompt logprobs), the first null (nothing precedes it). Offsets are
        into the prompt as its tokens decode, which is the prompt as sent wherever the
        tokenizer gives its text back."""
        detok, at, offsets = self._fresh(), 0, []
        for token in echo.ids:
            start, at = self._offset(detok, token, at)
            offsets.append(start)
        known = [None] + list(scored[:len(echo.ids) - 1])
        known += [None] * (len(echo.ids) - len(known))
        return {
            "tokens": [self._tokens.text(t) for t in echo.ids],
            "token_logprobs": [None if lp is None else json_logprob(lp.logprob) for lp in known],
            "top_logprobs": [None if lp is None else self._top(lp) for lp in known],
            "text_offset": offsets,
        }

    def _top(self, lp: pb.TokenLogprob) -> dict[str, float]:
        # The token's own logprob is always there, as in the OpenAI API (so up to
        # logprobs + 1 entries).
        name = self._tokens.text
        return ({name(t.token_id): json_logprob(t.logprob) for t in lp.top[: self._logprobs]}
                | {name(lp.token_id): json_logprob(lp.logprob)})

    def _offset(self, detok: IncrementalDetokenizer, token_id: int, at: int) -> tuple[int, int]:
        """Where `token_id` starts in a text `at` characters long so far, and the text's
        length after it (see `_format`)."""
        end = at + len(detok.push([token_id]))
        try:
            own = len(self._tokens.of(token_id).decode())
        except UnicodeDecodeError:  # part of a character
            own = end - at
        return max(at, end - own), end


def json_logprob(logprob: float) -> float:
    """A logprob JSON can carry: -inf (a token a penalty pushed below float32's range)
    and NaN are not JSON numbers, so anything below -9999 is sent as -9999.0 (vLLM's
    floor)."""
    return logprob if logprob >= -9999.0 else -9999.0


class ChatShape(_Shape):
    """/v1/chat/completions: `chat.completion` objects and `chat.completion.chunk`s (a
    first chunk with the role, content chunks, a last chunk with the finish reason)."""

    object = "chat.completion"
    chunk_object = "chat.completion.chunk"
    id_prefix = "chatcmpl-"

    def choice(self, c: Choice) -> dict[str, Any]:
        out = {
            "index": c.index,
            "message": {"role": "assistant", "content": "".join(c.text), "refusal": None},
            "logprobs": self._format(c.logprobs),
            "finish_reason": c.finish,
        }
        if self._token_ids:
            out["token_ids"] = c.token_ids
        return out

    def chunk_choices(self, c: Choice, r: pb.GenerateResponse, first: bool) -> list[dict[str, Any]]:
        chunks = []
        if first:
            chunks.append(self._delta(c.index, {"role": "assistant", "content": ""}, None))
        if r.text or r.logprobs or self._token_ids and r.token_ids:
            chunk = self._delta(c.index, {"content": r.text}, None)
            chunk["logprobs"] = self._format(r.logprobs)
            if self._token_ids:
                chunk["token_ids"] = list(r.token_ids)
            chunks.append(chunk)
        if c.finish is not None:
            chunks.append(self._delta(c.index, {}, c.finish))
        return chunks

    @staticmethod
    def _delta(index: int, delta: dict[str, Any], finish: str | None) -> dict[str, Any]:
        return {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}

    def _format(self, logprobs) -> dict[str, Any] | None:
        if self._logprobs is None:
            return None
        return {
            "content": [
                {
                    **self._token(lp.token_id, lp.logprob),
                    "top_logprobs": [self._token(t.token_id, t.logprob) for t in lp.top[: self._logprobs]],
                }
                for lp in logprobs
            ],
            "refusal": None,
        }

    def _token(self, token_id: int, logprob: float) -> dict[str, Any]:
        return {"token": self._tokens.text(token_id), "logprob": json_logprob(logprob),
                "bytes": list(self._tokens.of(token_id))}


class ToolChatShape(ChatShape):
    """/v1/chat/completions with tools that tool_choice lets the model call: each choice's
    output becomes content and `tool_calls` (ids `call_<random>`), `finish_reason`
    tool_calls when it made calls and ended by itself. A stream sends each call as OpenAI
    does: a delta with its index, id, type and name (arguments ""), then its arguments;
    the deltas add up to the non-streamed message. `parser` makes the --tool-call-parser
    for `auto` (given the most calls, or None)."""

    def __init__(self, logprobs: int | None, token_ids: bool, tokens: TokenBytes, tools: Tools,
                 parser: Callable[[int | None], Any]) -> None:
        super().__init__(logprobs, token_ids, tokens)
        self._tools = tools
        self._parser = parser
        self._streams: dict[int, _ToolCalls] = {}  # choice index -> its calls so far

    def choice(self, c: Choice) -> dict[str, Any]:
        out = super().choice(c)
        calls = _ToolCalls(self._tools, self._parser)
        content, found = calls.whole("".join(c.text))
        if found:
            out["message"]["tool_calls"] = [calls.entry(call) for call in found]
            out["message"]["content"] = content or None
            out["finish_reason"] = _tools_finish(c.finish)
        return out

    def chunk_choices(self, c: Choice, r: pb.GenerateResponse, first: bool) -> list[dict[str, Any]]:
        calls = self._streams.setdefault(c.index, _ToolCalls(self._tools, self._parser))
        chunks = [self._delta(c.index, {"role": "assistant", "content": ""}, None)] if first else []
        deltas = calls.push(r.text, c.finish is not None)
        extra = {}  # a step's logprobs and token ids ride on its last delta
        if self._logprobs is not None and r.logprobs:
            extra["logprobs"] = self._format(r.logprobs)
        if self._token_ids and r.token_ids:
            extra["token_ids"] = list(r.token_ids)
        if extra and not deltas:
            deltas.append({})
        chunks += [self._delta(c.index, delta, None) for delta in deltas]
        if extra:
            chunks[-1].update(extra)
        if c.finish is not None:
            finish = _tools_finish(c.finish) if calls.sent else c.finish
            chunks.append(self._delta(c.index, {}, finish))
        return chunks


def _tools_finish(finish: str | None) -> str | None:
    """A choice that made calls ends with tool_calls, unless cut short (length, abort)."""
    return "tool_calls" if finish == "stop" else finish


class _ToolCalls:
    """One choice's content and tool calls, from its whole output (`whole`) or as it
    comes (`push`, as OpenAI stream deltas)."""

    def __init__(self, tools: Tools, parser: Callable[[int | None], Any]) -> None:
        self._tools = tools
        self._parser = parser(None if tools.parallel else 1) if tools.choice == "auto" else None
        self._text: list[str] = []  # required: the output, parsed once it ends
        self.sent = 0  # calls sent so far

    def whole(self, text: str) -> tuple[str, list[ToolCall]]:
        if self._tools.choice == "function":
            return "", [ToolCall(self._tools.function, text)]
        if self._tools.choice == "required":
            return _required_calls(text)
        parsed = self._parser.push(text)
        parsed += self._parser.finish()
        return parsed.content, parsed.calls

    def push(self, text: str, done: bool) -> list[dict[str, Any]]:
        if self._tools.choice == "function":  # the output is the arguments, as it comes
            deltas = [] if self.sent else [self._head(self._tools.function)]
            return deltas + ([self._arguments(0, text)] if text else [])
        if self._tools.choice == "required":
            self._text.append(text)
            content, calls = _required_calls("".join(self._text)) if done else ("", [])
        else:
            parsed = self._parser.push(text)
            if done:
                parsed += self._parser.finish()
            content, calls = parsed.content, parsed.calls
        deltas = [{"content": content}] if content else []
        for call in calls:
            index = self.sent
            deltas += [self._head(call.name), self._arguments(index, call.arguments)]
        return deltas

    def entry(self, call: ToolCall) -> dict[str, Any]:
        """A call in a non-streamed message."""
        return {"id": _call_id(), "type": "function",
                "function": {"name": call.name, "arguments": call.arguments}}

    def _head(self, name: str) -> dict[str, Any]:
        """A call's first delta (it counts as sent)."""
        delta = {"tool_calls": [{"index": self.sent, "id": _call_id(), "type": "function",
                                 "function": {"name": name, "arguments": ""}}]}
        self.sent += 1
        return delta

    @staticmethod
    def _arguments(index: int, text: str) -> dict[str, Any]:
        return {"tool_calls": [{"index": index, "function": {"arguments": text}}]}


def _required_calls(text: str) -> tuple[str, list[ToolCall]]:
    """tool_choice required's output (Tools.forced: a JSON array of {"name",
    "parameters"}) as calls; output cut short is not an array and stays content."""
    try:
        items = json.loads(text)
    except (ValueError, RecursionError):
        return text, []
    if not (isinstance(items, list) and all(isinstance(i, dict) and isinstance(i.get("name"), str)
                                            and "parameters" in i for i in items)):
        return text, []  # (the grammar allows nothing else)
    return "", [ToolCall(item["name"], json.dumps(item["parameters"], ensure_ascii=False))
                for item in items]


def _call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]
