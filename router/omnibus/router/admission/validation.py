"""Request validation: every refusal of the request is INVALID_ARGUMENT with a message
that says what to change (a tokenizer that does not belong to the model is the server's
FAILED_PRECONDITION). Produces the token ids and fully resolved sampling parameters the
engine gets."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, replace
from pathlib import Path

import grpc
from google.protobuf.message import Message
from omnibus.v1 import engine_pb2, inference_pb2
import structlog
from tokenizers import Tokenizer

from omnibus.common.checkpoint import context_length
from omnibus.common.model_files import open_model
from omnibus.common.sampling import (
    FieldError, SamplingParams, check_context, check_token_ids)
from omnibus.router.config import RouterConfig
from omnibus.router.service.errors import TOO_LARGE, RequestError, invalid

log = structlog.get_logger("router.validation")

MAX_REQUEST_ID_CHARS = 128
DEFAULT_MAX_TOKENS = 16  # inference.proto's default for an unset max_tokens
# proto3 `optional` sampling fields: unset means SamplingParams' default, not 0.


def load_tokenizer(model: str) -> Tokenizer:
    """The tokenizer of the model directory or GGUF file `model`; ValueError when there
    is none to read."""
    files = open_model(model)
    text = files.tokenizer_json()  # ValueError naming the file
    try:
        return Tokenizer.from_str(text)
    except Exception as exc:  # tokenizers raises a bare Exception for parse errors
        raise ValueError(f"cannot load the tokenizer {files.file_for('tokenizer.json')}: {exc}") from exc


@dataclass(frozen=True)
class ModelLimits:
    """What the served model allows, from its config (config.json, or a GGUF file's
    metadata) and the router's flags."""

    model_id: str
    context: int  # prompt + max_tokens
    vocab_size: int
    max_prompt_tokens: int
    max_tokens: int

    @classmethod
    def load(cls, config: RouterConfig) -> ModelLimits:
        files = open_model(config.model)
        path = files.file_for("config.json")
        try:
            raw = files.config()
            # The engines' own rule (defaults, sliding-window cap), so what is advertised is served.
            model_len, vocab = context_length(raw), int(raw["vocab_size"])
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"cannot read the model's limits from {path}: {exc!r}") from exc
        context = min(model_len, config.max_model_len or model_len)
        max_prompt = min(config.max_prompt_tokens or context - 1, context - 1)
        return cls(
            model_id=config.model_name or Path(config.model).resolve().name,
            context=context,
            vocab_size=vocab,
            max_prompt_tokens=max_prompt,
            max_tokens=min(config.max_tokens_limit, context - 1),
        )

    def within(self, context: int) -> ModelLimits:
        """These limits with the context at most `context` (what the engines serve)."""
        if context >= self.context:
            return self
        return replace(self, context=context, max_prompt_tokens=min(self.max_prompt_tokens, context - 1),
                       max_tokens=min(self.max_tokens, context - 1))


@dataclass(frozen=True)
class ValidRequest:
    """A request that passed validation, ready for admission and an engine."""

    request_id: str  # the client's, or one the router made
    prompt_ids: list[int]
    sampling: engine_pb2.EngineSamplingParams
    stop: tuple[str, ...]
    priority: int

    @property
    def cost(self) -> int:
        """Tokens the request may span: what budgets and queue caps count."""
        return len(self.prompt_ids) + self.sampling.max_tokens


class Validator:
    def __init__(self, config: RouterConfig, limits: ModelLimits, tokenizer: Tokenizer) -> None:
        self._config = config
        self.limits = limits  # the Pipeline keeps it to what the engines serve
        self._tokenizer = tokenizer
        # A tokenizer with ids past the model's vocabulary belongs to another model (a
        # deployment error): text that tokenizes to such an id is refused saying so.
        self._tokenizer_ids = tokenizer.get_vocab_size(with_added_tokens=True)
        if self._tokenizer_ids > limits.vocab_size:
            log.warning("tokenizer_exceeds_vocabulary", tokenizer_ids=self._tokenizer_ids,
                        vocab_size=limits.vocab_size)

    async def validate(
        self, request: inference_pb2.GenerateRequest, request_id: str
    ) -> ValidRequest:
        """Checks `request` and tokenizes its prompt. Raises RequestError(INVALID_ARGUMENT)."""
        self._check_envelope(request)
        sampling = self._sampling(request.sampling)
        stop = self._stop_strings(request.sampling)
        prompt = await self._prompt_ids(request)
        self._check_length(len(prompt), sampling.max_tokens)
        return ValidRequest(request_id, prompt, sampling, stop, request.priority)

    def _check_envelope(self, request: inference_pb2.GenerateRequest | inference_pb2.EmbedRequest) -> None:
        """What every request carries: its size, request_id and priority."""
        size = request.ByteSize()
        if size > self._config.max_request_bytes:
            raise RequestError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"the request is {size} bytes; the limit is {self._config.max_request_bytes} bytes",
                TOO_LARGE,
            )
        check_request_id(request.request_id)
        self._check_priority(request.priority)

    async def embed_inputs(self, request: inference_pb2.EmbedRequest) -> list[list[int]]:
        """Checks an Embed request and tokenizes its text inputs. Raises
        RequestError(INVALID_ARGUMENT)."""
        self._check_envelope(request)
        count, cap = len(request.inputs), self._config.max_embed_inputs
        if not 1 <= count <= cap:
            raise invalid(f"send 1 to {cap} inputs per Embed request, got {count}", "input")
        inputs = []
        # --max-prompt-tokens bounds an input as it bounds a prompt (all of the context
        # otherwise: an input needs no room for output)
        limit = min(self._config.max_prompt_tokens or self.limits.context, self.limits.context)
        for i, item in enumerate(request.inputs):
            ids = await self._ids(item, "input", f"input {i}")
            if len(ids) > limit:
                what = ("the model's context is" if limit == self.limits.context
                        else "the limit (--max-prompt-tokens) is")
                raise invalid(f"input {i} has {len(ids)} tokens; {what} {limit}", f"input.{i}")
            inputs.append(ids)
        return inputs

    async def _prompt_ids(self, request: inference_pb2.GenerateRequest) -> list[int]:
        return await self._ids(request, "prompt", "prompt")

    async def _ids(self, message: Message, oneof: str, subject: str) -> list[int]:
        """Token ids of a `text` / `token_ids` oneof (`subject`: "prompt", "input 3"),
        tokenizing text off the event loop."""
        kind = message.WhichOneof(oneof)
        if kind is None:
            raise invalid(f"the {subject} is missing: set either text or token_ids")
        if kind == "token_ids":
            ids = list(message.token_ids.ids)
            try:
                check_token_ids(ids, self.limits.vocab_size, f"{subject} token_ids")
            except ValueError as exc:
                raise invalid(str(exc), oneof) from None
            return ids
        if not message.text:
            raise invalid(f"the {subject} text is empty", oneof)
        # Tokenizing a long text takes milliseconds; keep the event loop free meanwhile.
        ids = (await asyncio.to_thread(self._tokenizer.encode, message.text)).ids
        if not ids:
            raise invalid(f"the {subject} text produced no tokens", oneof)
        if self._tokenizer_ids > self.limits.vocab_size and max(ids) >= self.limits.vocab_size:
            raise RequestError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"the {subject} text tokenized to id {max(ids)}, outside the model's vocabulary "
                f"[0, {self.limits.vocab_size}): this server's tokenizer.json has "
                f"{self._tokenizer_ids} ids and does not belong to its model (a deployment error)",
                "tokenizer_mismatch")
        return ids

    def _check_length(self, prompt_tokens: int, max_tokens: int) -> None:
        limits = self.limits
        if prompt_tokens > limits.max_prompt_tokens:
            raise invalid(
                f"the prompt has {prompt_tokens} tokens; the limit is {limits.max_prompt_tokens}",
                "prompt",
            )
        try:
            check_context(prompt_tokens, max_tokens, limits.context)
        except ValueError as exc:
            raise invalid(str(exc), "max_tokens") from None

    def _check_priority(self, priority: int) -> None:
        check_priority(priority, self._config.max_abs_priority)

    def _sampling(self, p: inference_pb2.SamplingParams) -> engine_pb2.EngineSamplingParams:
        """The request's sampling parameters, checked by the rule the engine runs them by
        (omnibus.common.sampling), plus this router's max_tokens cap and the vocabulary."""
        max_tokens = p.max_tokens if p.HasField("max_tokens") else DEFAULT_MAX_TOKENS
        if not 1 <= max_tokens <= self.limits.max_tokens:
            raise invalid(f"max_tokens must be in [1, {self.limits.max_tokens}], got {max_tokens}",
                          "max_tokens")
        if p.speculative not in (inference_pb2.SPECULATIVE_AUTO, inference_pb2.SPECULATIVE_OFF):
            raise invalid(f"speculative must be SPECULATIVE_AUTO (0) or SPECULATIVE_OFF (1), got {p.speculative}",
                          "speculative")
        try:  # every field by the engine's rule, read as the descriptor says (common/sampling.py)
            params = SamplingParams.from_public(p, max_tokens=max_tokens)
        except FieldError as exc:
            raise invalid(str(exc), exc.field) from None
        for name, ids in (("stop_token_ids", list(params.stop_token_ids)),
                          ("logit_bias", [token for token, _ in params.logit_bias])):
            try:
                if ids:
                    check_token_ids(ids, self.limits.vocab_size, name)
            except ValueError as exc:
                raise invalid(str(exc), name) from None
        return params.to_proto()

    def _stop_strings(self, p: inference_pb2.SamplingParams) -> tuple[str, ...]:
        config = self._config
        if len(p.stop) > config.max_stop_strings:
            raise invalid(
                f"{len(p.stop)} stop strings given; at most {config.max_stop_strings} are allowed",
                "stop",
            )
        for s in p.stop:
            if not s:
                raise invalid("stop strings must not be empty", "stop")
            if len(s) > config.max_stop_string_chars:
                raise invalid(
                    f"a stop string has {len(s)} characters; "
                    f"the limit is {config.max_stop_string_chars}",
                    "stop",
                )
        return tuple(p.stop)


def check_request_id(request_id: str, name: str = "request_id") -> None:
    """A request id (`name`: where the client set it) is at most MAX_REQUEST_ID_CHARS
    printable ASCII characters without spaces. Raises RequestError(INVALID_ARGUMENT)."""
    if len(request_id) > MAX_REQUEST_ID_CHARS or not all(" " < c <= "~" for c in request_id):
        raise invalid(
            f"{name} must be at most {MAX_REQUEST_ID_CHARS} printable ASCII characters "
            "without spaces"
        )


def check_priority(priority: int, bound: int, name: str = "priority") -> None:
    """A priority in [-bound, bound] (--max-abs-priority), whether the body or a header
    (`name`) carries it: else INVALID_ARGUMENT naming it."""
    if not -bound <= priority <= bound:
        raise invalid(f"{name} must be in [-{bound}, {bound}], got {priority}", "priority")
