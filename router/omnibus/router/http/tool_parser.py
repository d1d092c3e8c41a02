"""Tool calls out of generated text (vLLM's `--tool-call-parser`), for chat requests whose
`tool_choice` is `auto`. Pure text in, content and calls out: no HTTP here.

`hermes` (Hermes 2 Pro, Qwen 2.5/3 and the many templates that copied them): a call is
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` anywhere in the output.

A parser is fed the output as it comes (`push`, any split) and told when it ends
(`finish`); what it returns over a whole output is the same however the output was split,
so a stream's deltas add up to the non-streamed message (the tests split at every
position). Rules, as vLLM's hermes parser where it has one:
- text outside call blocks is content; after the first call, whitespace is sent only
  once more text follows it (the newlines models put between and after calls are
  dropped);
- a block whose body is not a JSON object with a string `name` and an object
  `arguments` is content, tags and all (vLLM returns malformed calls as text);
- an unclosed block at the end of the output is a call if its body parses (vLLM's
  regex takes `<tool_call>` to the end), else content;
- with `max_calls`, calls beyond it are dropped (`parallel_tool_calls: false`: vLLM keeps
  the first).
A call goes out whole when its block closes: until then it could still be malformed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

# The --tool-call-parser names (router.config checks the flag against the same tuple).
TOOL_CALL_PARSERS = ("hermes",)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text of an object, as OpenAI's function.arguments


@dataclass
class Parsed:
    """What a piece of output turned out to hold: content text and whole calls."""

    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)

    def __iadd__(self, other: Parsed) -> Parsed:
        self.content += other.content
        self.calls += other.calls
        return self


class HermesParser:
    """Incremental `<tool_call>...</tool_call>` parser for one choice's output."""

    START, END = "<tool_call>", "</tool_call>"

    def __init__(self, max_calls: int | None = None) -> None:
        self._max_calls = max_calls
        self._buffer = ""  # text not yet decided
        self._in_call = False  # the buffer is the body of an open block
        self._calls = 0  # well-formed calls so far, kept or dropped
        self._held = ""  # whitespace after a call, sent only if more text follows

    def push(self, text: str) -> Parsed:
        self._buffer += text
        out = Parsed()
        while True:
            if self._in_call:
                end = self._buffer.find(self.END)
                if end < 0:
                    return out
                body, self._buffer = self._buffer[:end], self._buffer[end + len(self.END):]
                self._in_call = False
                out += self._block(body, closed=True)
            else:
                start = self._buffer.find(self.START)
                if start < 0:
                    keep = _partial_suffix(self._buffer, self.START)
                    cut = len(self._buffer) - keep
                    out += self._text(self._buffer[:cut])
                    self._buffer = self._buffer[cut:]
                    return out
                out += self._text(self._buffer[:start])
                self._buffer = self._buffer[start + len(self.START):]
                self._in_call = True

    def finish(self) -> Parsed:
        """The rest, once the output has ended."""
        rest, self._buffer = self._buffer, ""
        if self._in_call:
            self._in_call = False
            return self._block(rest, closed=False)
        out = self._text(rest)
        self._held = ""  # whitespace after the last call
        return out

    def _block(self, body: str, closed: bool) -> Parsed:
        call = _hermes_call(body)
        if call is None:
            return self._text(self.START + body + (self.END if closed else ""))
        self._calls += 1
        self._held = ""  # whitespace between two calls
        if self._max_calls is not None and self._calls > self._max_calls:
            return Parsed()
        return Parsed(calls=[call])

    def _text(self, text: str) -> Parsed:
        if not text:
            return Parsed()
        if not self._calls:
            return Parsed(content=text)
        text = self._held + text
        sent = text.rstrip()  # the whitespace at its end waits for more text
        self._held = text[len(sent):]
        return Parsed(content=sent)


def _hermes_call(body: str) -> ToolCall | None:
    """The call a block's body holds, or None when it is malformed."""
    try:
        value = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if not (isinstance(value, dict) and isinstance(value.get("name"), str) and value["name"]
            and isinstance(value.get("arguments"), dict)):
        return None
    return ToolCall(value["name"], json.dumps(value["arguments"], ensure_ascii=False))


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (held back: the tag may
    be arriving)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


PARSERS = {"hermes": HermesParser}
