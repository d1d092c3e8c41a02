"""Sampling parameters and the limits on them: one definition, used by the router to
validate requests and by the engine to run them (torch-free).

Messages say what to change; every refusal is a ValueError, which the router turns into
INVALID_ARGUMENT and the engine's in-process API raises as is.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import numbers
import struct
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from omnibus.v1 import engine_pb2, inference_pb2

__all__ = ["MAX_LOGPROBS", "MAX_SEED", "SamplingParams", "StructuredOutput", "check_context",
           "check_seed", "check_token_ids"]

MAX_LOGPROBS = 20
# Temperatures below this are treated as greedy: dividing logits by them overflows float32
# to inf (and softmax to NaN), while the distribution is already a point mass at the argmax.
_GREEDY_TEMPERATURE = 1e-5
# torch.Generator.manual_seed takes any unsigned 64-bit value.
MAX_SEED = 2**64 - 1


class FieldError(ValueError):
    """A ValueError about one field, named in `field` (the router's OpenAI errors name it)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def _int_field(name: str, value: object, allowed: str, lo: int, hi: int | None = None) -> int:
    if type(value) is int:  # the common case, without the ABC check (every request, twice)
        v = value
    # bool is an int subclass, but `max_tokens=True` is a caller bug, not a count.
    elif isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise FieldError(name, f"{name} must be an integer {allowed}, got {value!r}")
    else:
        v = int(value)
    if v < lo or (hi is not None and v > hi):
        raise FieldError(name, f"{name} must be {allowed}, got {v}")
    return v


def _float_field(name: str, value: object, allowed: str, ok: Callable[[float], bool]) -> float:
    if type(value) is float or type(value) is int:  # the common cases, without the ABC check
        v = float(value)
    elif isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise FieldError(name, f"{name} must be a number {allowed}, got {value!r}")
    else:
        v = float(value)
    if not math.isfinite(v) or not ok(v):
        raise FieldError(name, f"{name} must be a finite number {allowed}, got {_shown(v)}")
    return v


def _shown(v: float) -> str:
    """`v` as its sender wrote it: a float32 field's -0.1 arrives as -0.10000000149011612,
    shown as the shortest decimal that is the same float32 (other values as repr)."""
    try:
        as_f32 = struct.unpack("f", struct.pack("f", v))[0]
    except OverflowError:
        return repr(v)
    if as_f32 != v:
        return repr(v)
    for digits in range(1, 10):
        shortest = float(f"{v:.{digits}g}")
        if struct.unpack("f", struct.pack("f", shortest))[0] == v:
            return repr(shortest)
    return repr(v)


@dataclass(frozen=True)
class StructuredOutput:
    """A format the output must follow (structured output). Validated at construction:
    what can be checked without the grammar engine (the kind, the schema being JSON, the
    choices); the engine compiles it and refuses what its grammar engine cannot."""

    kind: str  # one of KINDS
    # The format's text: json_schema: the JSON Schema (an object or true); regex: the
    # regular expression; grammar: the grammar (EBNF, GBNF dialect, rule `root`; or Lark, rule `start`); else "".
    schema: str = ""
    options: tuple[str, ...] = ()  # choice: the strings the output may be; else ()

    KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")

    def __post_init__(self) -> None:
        if self.kind not in self.KINDS:
            raise FieldError("structured_output",
                             f"structured_output must be one of {', '.join(self.KINDS)}, got {self.kind!r}")
        _text(f"the {_WHAT.get(self.kind, 'schema')}", self.schema)
        if self.kind == "choice":
            object.__setattr__(self, "options", _choices(self.schema, self.options))
            return
        if self.options:
            raise FieldError("structured_output",
                             f"structured_output: {self.kind} takes no options (only choice does)")
        if self.kind == "json_object":
            if self.schema:
                raise FieldError("structured_output", "json_object takes no schema")
        elif not self.schema:
            raise FieldError("structured_output", f"structured_output: the {_WHAT[self.kind]} is empty; "
                             "send the one the whole output must follow")
        elif self.kind != "json_schema" and len(self.schema) > MAX_FORMAT_CHARS:
            raise FieldError("structured_output",
                             f"structured_output: the {_WHAT[self.kind]} is {len(self.schema)} characters long, "
                             f"more than {MAX_FORMAT_CHARS}")
        elif self.kind == "json_schema":
            _check_json_schema(self.schema)

    @classmethod
    def from_proto(cls, p: inference_pb2.StructuredOutput) -> StructuredOutput | None:
        """The format of a StructuredOutput message; None when it asks for none."""
        which = p.WhichOneof("format")
        if which in ("json_schema", "regex", "grammar"):
            return cls(which, getattr(p, which))
        if which == "choice":
            return cls("choice", options=tuple(p.choice.options))
        if which == "json_object" and p.json_object:
            return cls("json_object")
        return None

    def to_proto(self) -> inference_pb2.StructuredOutput:
        if self.kind == "json_object":
            return inference_pb2.StructuredOutput(json_object=True)
        if self.kind == "choice":
            return inference_pb2.StructuredOutput(choice=inference_pb2.Choices(options=self.options))
        if self.kind == "regex":
            return inference_pb2.StructuredOutput(regex=self.schema)
        if self.kind == "grammar":
            return inference_pb2.StructuredOutput(grammar=self.schema)
        return inference_pb2.StructuredOutput(json_schema=self.schema)


# What each kind's text is, for messages.
_WHAT = {"json_schema": "JSON schema", "regex": "regular expression", "grammar": "grammar"}
# The size of a regex, a grammar, and a choice's options in all: the engine compiles a
# format on its step loop, and 64 Ki characters compile in about 0.25 s on 2 slow cores
# (a 200 Ki-character regex took 9 s, stalling every request of that engine meanwhile).
MAX_FORMAT_CHARS = 65536
MAX_CHOICES = 1024


def _text(what: str, value: object) -> None:
    """`value` is a str that UTF-8 can carry (as protobuf strings must be)."""
    if not isinstance(value, str):
        raise FieldError("structured_output",
                         f"structured_output: {what} must be text, got {type(value).__name__}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise FieldError("structured_output", f"structured_output: {what} is not valid Unicode text "
                         f"({exc.reason} at character {exc.start})") from None


def _check_json_schema(text: str) -> None:
    try:
        schema = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise FieldError("structured_output",
                         f"structured_output: the JSON schema is not valid JSON: {exc}") from None
    if not isinstance(schema, dict) and schema is not True:
        raise FieldError("structured_output",
                         "structured_output: a JSON schema must be a JSON object (or true), "
                         f"got {type(schema).__name__}")


def _choices(schema: str, options: object) -> tuple[str, ...]:
    """A choice's options as a tuple, checked: 1 to MAX_CHOICES non-empty strings of at
    most MAX_FORMAT_CHARS characters in all."""
    if schema:
        raise FieldError("structured_output", "structured_output: choice takes options, not a schema")
    if not isinstance(options, (list, tuple)):
        raise FieldError("structured_output",
                         "structured_output: choice options must be a list of strings, "
                         f"got {type(options).__name__}")
    if not options:
        raise FieldError("structured_output", "structured_output: choice needs at least one option")
    if len(options) > MAX_CHOICES:
        raise FieldError("structured_output",
                         f"structured_output: choice takes at most {MAX_CHOICES} options, got {len(options)} "
                         "(use a regex or a grammar for larger sets)")
    for i, option in enumerate(options):
        _text(f"choice option {i}", option)
        if not option:
            raise FieldError("structured_output", f"structured_output: choice option {i} is empty")
    total = sum(map(len, options))
    if total > MAX_FORMAT_CHARS:
        raise FieldError("structured_output", f"structured_output: the choice options hold {total} characters "
                         f"in all, more than {MAX_FORMAT_CHARS}")
    return tuple(options)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick the tokens of one request. Validated at construction.

    Numbers given as other numeric types (numpy scalars, ints for floats) are converted
    to plain int / float; bools, NaN and infinities are refused with ValueError.
    """

    max_tokens: int = 16  # >= 1; tokens to generate at most
    temperature: float = 1.0  # >= 0; below 1e-5 (and so 0) means greedy argmax
    top_p: float = 1.0  # in (0, 1]; nucleus size, 1 = off
    top_k: int = 0  # 0 = off (-1 too, vLLM's spelling: read as 0), else >= 1
    min_p: float = 0.0  # in [0, 1]; drop tokens with prob < min_p * max prob
    seed: int | None = None  # in [0, 2**64 - 1]; same seed => same tokens in any batch
    stop_token_ids: tuple[int, ...] = ()  # token ids >= 0 that end the request
    ignore_eos: bool = False  # keep generating past the model's EOS token
    repetition_penalty: float = 1.0  # > 0; HF semantics over prompt + output tokens
    presence_penalty: float = 0.0  # in [-2, 2]; OpenAI semantics over output tokens
    frequency_penalty: float = 0.0  # in [-2, 2]; OpenAI semantics over output tokens
    logprobs: int = 0  # in [0, 20]; top-n logprobs to return per generated token
    # >= 0; a continuation: the prompt's last output_offset tokens are this request's
    # earlier output (penalties count them as output; seeded draws start at this position)
    output_offset: int = 0
    speculative_off: bool = False  # True: the engine never speculates for this request
    # in [0, 20]; top-n logprobs per prompt token after the first (raw logits); 0: none
    prompt_logprobs: int = 0
    # The format the output must follow (structured output); None: free text. Sets
    # speculative_off: guesses are not masked by the grammar.
    structured_output: StructuredOutput | None = None
    # (token id, bias) pairs, ids ascending and distinct, added to those logits before the
    # penalties and sampling (OpenAI's logit_bias); biases in [-100, 100], at most
    # MAX_LOGIT_BIAS pairs. A dict or a proto map is read too.
    logit_bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        def put(name: str, value: object) -> None:
            object.__setattr__(self, name, value)  # frozen: normalize through the back door

        put("max_tokens", _int_field("max_tokens", self.max_tokens, ">= 1", lo=1))
        put("temperature", _float_field("temperature", self.temperature, ">= 0", lambda v: v >= 0))
        put("top_p", _float_field("top_p", self.top_p, "in (0, 1]", lambda v: 0 < v <= 1))
        top_k = _int_field("top_k", self.top_k, ">= 0 (0 or -1 disables it)", lo=-1)
        put("top_k", max(top_k, 0))
        put("min_p", _float_field("min_p", self.min_p, "in [0, 1]", lambda v: 0 <= v <= 1))
        if self.seed is not None:
            put("seed", check_seed(self.seed))
        put("stop_token_ids", _stop_ids(self.stop_token_ids))
        if not isinstance(self.ignore_eos, bool):
            raise FieldError("ignore_eos", f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        put(
            "repetition_penalty",
            _float_field("repetition_penalty", self.repetition_penalty, "> 0", lambda v: v > 0),
        )
        for name in ("presence_penalty", "frequency_penalty"):
            put(name, _float_field(name, getattr(self, name), "in [-2, 2]", lambda v: -2 <= v <= 2))
        lp_range = f"in [0, {MAX_LOGPROBS}]"
        put("logprobs", _int_field("logprobs", self.logprobs, lp_range, 0, MAX_LOGPROBS))
        put("prompt_logprobs",
            _int_field("prompt_logprobs", self.prompt_logprobs, lp_range, 0, MAX_LOGPROBS))
        put("output_offset", _int_field("output_offset", self.output_offset, ">= 0", lo=0))
        if not isinstance(self.speculative_off, bool):
            raise FieldError("speculative_off", f"speculative_off must be a bool, got {self.speculative_off!r}")
        put("logit_bias", _logit_bias(self.logit_bias))
        if self.structured_output is not None:
            if not isinstance(self.structured_output, StructuredOutput):
                raise FieldError("structured_output", "structured_output must be a StructuredOutput, "
                                 f"got {type(self.structured_output).__name__}")
            put("speculative_off", True)

    @classmethod
    def from_proto(cls, p: engine_pb2.EngineSamplingParams) -> SamplingParams:
        """The engine's reading of the router's message (ValueError if out of range)."""
        return cls(**_read(p, _ENGINE_SCALARS))

    @classmethod
    def from_public(cls, p: inference_pb2.SamplingParams, **given: Any) -> SamplingParams:
        """A client's omnibus.v1 SamplingParams read by the same rule (FieldError naming
        the field), `given` (what the router decides itself, as max_tokens's default)
        over it. Fields unset where the message tracks presence keep their defaults."""
        kwargs = _read(p, _PUBLIC_SCALARS)
        kwargs["speculative_off"] = p.speculative == inference_pb2.SPECULATIVE_OFF
        return cls(**(kwargs | given))

    def to_proto(self) -> engine_pb2.EngineSamplingParams:
        """The message the router sends the engine for these parameters."""
        fields = {name: getattr(self, name) for name, _ in _ENGINE_SCALARS if getattr(self, name) is not None}
        out = engine_pb2.EngineSamplingParams(**fields, stop_token_ids=list(self.stop_token_ids),
                                              logit_bias=dict(self.logit_bias))
        if self.structured_output is not None:
            out.structured_output.CopyFrom(self.structured_output.to_proto())
        return out

    # Cached: the engine asks both for every sampled row of every step.
    @functools.cached_property
    def greedy(self) -> bool:
        """True when the request takes the argmax instead of sampling."""
        return self.temperature < _GREEDY_TEMPERATURE

    @functools.cached_property
    def has_penalties(self) -> bool:
        """True when any repetition / presence / frequency penalty changes the logits."""
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )


def _scalars(message: Any) -> tuple[tuple[str, bool], ...]:
    """(name, tracks presence) of each singular scalar field of the proto `message` that
    is also a SamplingParams field: what the conversions copy as they are, derived from
    the descriptor so a new field needs no line here."""
    names = {f.name for f in dataclasses.fields(SamplingParams)}
    return tuple((f.name, f.has_presence) for f in message.DESCRIPTOR.fields
                 if f.name in names and not f.is_repeated and f.message_type is None)


def _read(p: Any, scalars: tuple[tuple[str, bool], ...]) -> dict[str, Any]:
    """The keyword arguments of SamplingParams in a proto message: its scalars (those it
    tracks presence of, when set) and the fields that are not scalars."""
    kwargs: dict[str, Any] = {name: getattr(p, name) for name, presence in scalars
                              if not presence or p.HasField(name)}
    kwargs["stop_token_ids"] = tuple(p.stop_token_ids)
    kwargs["logit_bias"] = dict(p.logit_bias)
    if p.HasField("structured_output"):
        kwargs["structured_output"] = StructuredOutput.from_proto(p.structured_output)
    return kwargs


_ENGINE_SCALARS = _scalars(engine_pb2.EngineSamplingParams)
_PUBLIC_SCALARS = _scalars(inference_pb2.SamplingParams)


MAX_LOGIT_BIAS = 1024  # token ids one request may bias
_MAX_BIAS = 100.0  # OpenAI's range: [-100, 100]


def _logit_bias(value: object) -> tuple[tuple[int, float], ...]:
    """logit_bias as sorted (token id, bias) pairs; FieldError naming what is wrong."""
    if isinstance(value, Mapping):
        items: list[object] = list(value.items())
    elif isinstance(value, (list, tuple)):
        items = list(value)
    else:
        raise FieldError("logit_bias", f"logit_bias must map token ids to biases, got {value!r}")
    pairs: dict[int, float] = {}
    for item in items:
        if not isinstance(item, (list, tuple)) or len(item) != 2:
            raise FieldError("logit_bias", f"logit_bias entries must be (token id, bias) pairs, got {item!r}")
        token, bias = item
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise FieldError("logit_bias", f"logit_bias token ids must be integers >= 0, got {token!r}")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -_MAX_BIAS <= bias <= _MAX_BIAS:
            raise FieldError("logit_bias", f"logit_bias of token {token} must be a number in [-100, 100], "
                             f"got {bias!r}")
        if token in pairs:
            raise FieldError("logit_bias", f"logit_bias names token {token} twice")
        pairs[int(token)] = float(bias)
    if len(pairs) > MAX_LOGIT_BIAS:
        raise FieldError("logit_bias", f"logit_bias names {len(pairs)} tokens; at most {MAX_LOGIT_BIAS} are allowed")
    return tuple(sorted(pairs.items()))


def _stop_ids(value: object) -> tuple[int, ...]:
    allowed = "a list or tuple of token ids >= 0"
    if not isinstance(value, (list, tuple)):
        raise FieldError("stop_token_ids", f"stop_token_ids must be {allowed}, got {value!r}")
    for t in value:
        if isinstance(t, bool) or not isinstance(t, numbers.Integral) or t < 0:
            raise FieldError("stop_token_ids", f"stop_token_ids must be {allowed}, got element {t!r}")
    return tuple(int(t) for t in value)


def check_seed(seed: object) -> int:
    """A seed as an int in [0, 2**64 - 1] (what torch.Generator.manual_seed takes)."""
    return _int_field("seed", seed, "in [0, 2**64 - 1]", 0, MAX_SEED)


def check_token_ids(ids: Sequence[int], vocab_size: int, what: str) -> None:
    """ValueError unless `ids` is a non-empty list of token ids in [0, vocab_size)."""
    if not ids:
        raise ValueError(f"{what} is empty: send at least one token")
    bad = next((t for t in ids if not isinstance(t, int) or not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(f"{what}: token id {bad!r} is outside the vocabulary [0, {vocab_size})")


def kv_tokens(blocks: int, block_size: int) -> int:
    """The most tokens (prompt + max_tokens) one request may span in `blocks` KV blocks:
    every token but the last sampled one, which no step computes, needs KV. The engine
    refuses past it and the router routes by it (one rule for both processes)."""
    return blocks * block_size + 1


def check_context(prompt_tokens: int, max_tokens: int, context: int) -> None:
    """ValueError unless the prompt plus max_tokens fits the model's context."""
    if prompt_tokens + max_tokens > context:
        raise ValueError(
            f"the prompt ({prompt_tokens} tokens) + max_tokens ({max_tokens}) exceeds the "
            f"model's context of {context} tokens; shorten the prompt or lower max_tokens"
        )
