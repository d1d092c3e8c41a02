"""The hermes tool-call parser on crafted outputs: content and calls exactly, and the same
result however the output is split (at every position into two pieces, and one
character at a time), as a stream's deltas must add up to the non-streamed message."""

from __future__ import annotations

import pytest

from omnibus.router.config import TOOL_CALL_PARSERS
from omnibus.router.http.tool_parser import PARSERS, HermesParser, Parsed, ToolCall

WEATHER = ToolCall("get_weather", '{"city": "Paris", "unit": "c"}')
TIME = ToolCall("get_time", '{"zone": "CET"}')
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city":"Paris", "unit": "c"}}\n</tool_call>'
CALL2 = '<tool_call>{"name": "get_time", "arguments": {"zone": "CET"}}</tool_call>'

CASES = {
    "plain text": ("Hello <tool there", "Hello <tool there", []),
    "one call": (CALL, "", [WEATHER]),
    "text before": ("Let me look.\n" + CALL, "Let me look.\n", [WEATHER]),
    "two calls, newlines between and after dropped": (CALL + "\n" + CALL2 + "\n\n", "", [WEATHER, TIME]),
    "text after a call is content, its end whitespace dropped": (CALL + "\nDone. \n", "\nDone.", [WEATHER]),
    "malformed JSON is content": ("a<tool_call>{nope}</tool_call>b", "a<tool_call>{nope}</tool_call>b", []),
    "arguments not an object": ('<tool_call>{"name": "f", "arguments": "x"}</tool_call>',
                                '<tool_call>{"name": "f", "arguments": "x"}</tool_call>', []),
    "missing name": ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),
    "a malformed block after a call": (CALL + "\n<tool_call>[1]</tool_call>", "\n<tool_call>[1]</tool_call>", [WEATHER]),
    "unclosed block that parses is a call": ('x<tool_call>{"name": "get_time", "arguments": {"zone": "CET"}}',
                                             "x", [TIME]),
    "unclosed block that does not parse": ('<tool_call>{"name": "get_ti', '<tool_call>{"name": "get_ti', []),
    "a tag's beginning at the end": ("ok <tool_ca", "ok <tool_ca", []),
    "unicode arguments kept as text": ('<tool_call>{"name": "f", "arguments": {"s": "café ☕"}}</tool_call>',
                                       "", [ToolCall("f", '{"s": "café ☕"}')]),
}  # fmt: skip


def run(pieces: list[str], max_calls: int | None = None) -> Parsed:
    parser, out = HermesParser(max_calls), Parsed()
    for piece in pieces:
        out += parser.push(piece)
    out += parser.finish()
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_content_and_calls_are_the_same_however_the_text_is_split(name):
    text, content, calls = CASES[name]
    assert run([text]) == Parsed(content, calls)
    for at in range(len(text) + 1):
        assert run([text[:at], text[at:]]) == Parsed(content, calls), f"split at {at}"
    assert run(list(text)) == Parsed(content, calls)


def test_content_goes_out_as_soon_as_it_cannot_begin_a_tag():
    parser = HermesParser()
    assert parser.push("Hi <") == Parsed("Hi ")  # "<" may begin <tool_call>
    assert parser.push("b>") == Parsed("<b>")
    assert parser.push("<tool_call>{") == Parsed()  # the block is checked whole
    assert parser.push('"name": "get_time", "arguments": {"zone": "CET"}}</tool_call>') == Parsed(calls=[TIME])


def test_parallel_tool_calls_false_keeps_the_first_call():
    assert run([CALL + "\n" + CALL2]) == Parsed("", [WEATHER, TIME])
    assert run([CALL + "\n" + CALL2], max_calls=1) == Parsed("", [WEATHER])


def test_the_flag_names_every_parser():
    assert set(PARSERS) == set(TOOL_CALL_PARSERS)
