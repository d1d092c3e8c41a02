"""omnibus.v1 responses in, OpenAI JSON out: each choice's output so far (Choice), the
usage, and the objects and stream chunks of /v1/completions (CompletionShape, with
echo and text offsets) and /v1/chat/completions (ChatShape; ToolChatShape when the
model may call tools, whose output becomes `tool_calls`)."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from omnibus.v1 import inference_pb2 as pb

from omnibus.common import finish_reasons
from omnibus.router.http.tool_parser import ToolCall
from omnibus.router.http.tools import Tools
from omnibus.router.text.detokenizer import IncrementalDetokenizer
from omnibus.router.text.token_bytes import TokenBytes



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
            self.finish = finish_reasons.OPENAI[response.finish_reason]
            self.usage = response.usage


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


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
