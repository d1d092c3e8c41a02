"""JSON schemas made into grammars whose every sentence is strict JSON that the schema
accepts, around the places where xgrammar 0.2.8's converter is wrong (the fixes belong
upstream; until then this module keeps the engine's outputs parseable and valid).

`json_schema_ebnf` reads the schema, rewrites or refuses what xgrammar would get wrong,
converts the rest with xgrammar's own converter (`Grammar.from_json_schema`), and patches
two character classes in the EBNF it prints before the engine compiles that text:

- A string with minLength or maxLength gets the class "anything but a quote, a
  backslash, CR or LF": raw tabs, NULs and the other control characters pass, and strict
  JSON parsers refuse them ("Invalid control character"). It becomes JSON's string
  character: anything but U+0000-U+001F, the quote and the backslash, or a two-character
  escape (`\\n`, `\\"`, ...). Each alternative decodes to exactly one character, so the
  bounds still count what a JSON parser (and jsonschema) counts; `\\uXXXX` is left out
  because a surrogate pair is two escapes for one character. Patching the printed EBNF,
  rather than rewriting such strings as a `pattern`, keeps xgrammar's repetition rule,
  which compiles maxLength 2**31 - 1 in milliseconds where a regular expression's
  automaton would need a state per character (and refuses thousands).
- Both that class and the one of every other string take the surrogates U+D800-U+DFFF,
  whose 3-byte forms are not UTF-8 (a byte-level vocabulary can spell them byte by
  byte); they are taken out.
- A bound above 2**31 - 1 (xgrammar counts in int32, and wraps or refuses them): an
  upper bound is dropped, since no output of the engine holds 2**31 characters, items or
  properties (its context is far shorter); a lower bound is refused, since none reaches it.
- `format` is an annotation in JSON Schema, `pattern`, `minLength` and `maxLength` are
  assertions; xgrammar honours a known format and ignores the others beside it, so next
  to them the format is dropped. Three formats' built-in grammars write text that is not
  JSON (an email's quoted local part writes `\\a`; a JSON pointer takes raw quotes and
  control characters): each becomes the same expression as a `pattern`, whose characters
  xgrammar keeps JSON-safe.
- A `pattern` (or a `patternProperties` key) goes through xgrammar's JSON-safe path only
  when it is printable ASCII and that path's automaton takes it; otherwise xgrammar
  expands it with no such care (raw quotes, backslashes and control characters, and a
  NUL that prints as nothing). Other characters are written as `\\u{...}` escapes; a
  pattern that still misses that path (every match needs a character JSON escapes, or a
  repetition of thousands), one beside minLength/maxLength (xgrammar would drop the
  lengths) or with a lookaround (xgrammar ignores lookaheads) is refused.

Refusals are `UnservableSchema` (a ValueError), each saying where in the schema, what is
wrong and what to write instead; the engine answers them with INVALID_ARGUMENT.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from functools import lru_cache
from typing import Any

INT32_MAX = 2**31 - 1
_UPPER = ("maxLength", "maxItems", "maxProperties", "maxContains")
_LOWER = ("minLength", "minItems", "minProperties", "minContains")
_LENGTHS = ("minLength", "maxLength")
# Where subschemas sit: maps of them, lists of them, one of them.
_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
_ONES = ("items", "additionalItems", "additionalProperties", "unevaluatedItems",
         "unevaluatedProperties", "contains", "propertyNames", "not", "if", "then", "else")

# xgrammar's own expressions for the formats its built-in grammars write as broken JSON
# (json_schema_converter.cc), as patterns; the email's quoted local part is dropped there
# (it needs escapes a pattern's JSON-safe path cannot write).
_ATEXT = r"[\w!#$%&'*+/=?^`{|}~-]"
_DOMAIN = r"([A-Za-z0-9]([\-A-Za-z0-9]*[A-Za-z0-9])?)((\.[A-Za-z0-9][\-A-Za-z0-9]*[A-Za-z0-9])*)"
_POINTER = r"(/([\x00-\x2E]|[\x30-\x7D]|[\x7F-\u{10FFFF}]|~[01])*)*"
_FORMAT_PATTERNS = {
    "email": rf"^({_ATEXT}+(\.{_ATEXT}+)*)@{_DOMAIN}$",
    "json-pointer": rf"^{_POINTER}$",
    "relative-json-pointer": rf"^(0|[1-9][0-9]*)(#|{_POINTER})$",
}

# The classes xgrammar prints for one character of a length-bounded string and of any
# other string, and JSON's (no surrogates: their 3-byte forms are not UTF-8).
_PATCHES = (
    (r'[^\"\\\r\n]', r'([^\0-\x1f\"\\\ud800-\udfff] | "\\" [\"\\/bfnrt])'),
    (r'[^\0-\x1f\"\\\r\n]', r'[^\0-\x1f\"\\\ud800-\udfff]'),
)
_LOOKAROUND = ("(?=", "(?!", "(?<=", "(?<!")


class UnservableSchema(ValueError):
    """A JSON schema the grammar engine would hold outputs to wrongly."""


@lru_cache(maxsize=64)
def json_schema_ebnf(schema: str, max_whitespace: int, strict: bool = True) -> str:
    """The EBNF grammar (rule `root`) of the JSON text `schema`, at most `max_whitespace`
    whitespace characters between elements; `strict`: xgrammar's strict mode (no
    properties or items the schema does not name). UnservableSchema for what it would
    serve wrongly; RuntimeError (xgrammar's) for what it refuses."""
    import xgrammar as xgr

    try:
        value = json.loads(schema)
    except json.JSONDecodeError as exc:
        raise UnservableSchema(f"the JSON schema is not JSON: {exc}") from None
    _walk(value, "")
    ebnf = str(xgr.Grammar.from_json_schema(json.dumps(value), strict_mode=strict,
                                             max_whitespace_cnt=max_whitespace))
    # Plain text: the classes' text cannot occur inside the EBNF's string literals (they
    # hold JSON text or printable-ASCII patterns, never a raw CR or LF).
    for loose, strict_class in _PATCHES:
        ebnf = ebnf.replace(loose, strict_class)
    return ebnf


def _walk(schema: Any, at: str) -> None:
    """Rewrites `schema` (at JSON pointer `at`) and its subschemas in place, or refuses."""
    if not isinstance(schema, dict):
        return  # true / false
    _bounds(schema, at)
    _string(schema, at)
    for sub, where in list(_subschemas(schema, at)):
        _walk(sub, where)
    if isinstance(schema.get("patternProperties"), dict):
        schema["patternProperties"] = {_pattern(p, f"{at}/patternProperties"): s
                                       for p, s in schema["patternProperties"].items()}


def _subschemas(schema: dict, at: str) -> Iterator[tuple[Any, str]]:
    """Each subschema of `schema` with its JSON pointer."""
    for key, value in schema.items():
        if key in _MAPS and isinstance(value, dict):
            yield from ((v, f"{at}/{key}/{_escape(k)}") for k, v in value.items())
        elif key in _LISTS and isinstance(value, list):
            yield from ((v, f"{at}/{key}/{i}") for i, v in enumerate(value))
        elif key in _ONES:
            yield value, f"{at}/{key}"


def _bounds(schema: dict, at: str) -> None:
    for key in _UPPER:
        if _count(schema.get(key)) > INT32_MAX:
            del schema[key]  # no output is that long: the bound holds for every one
    for key in _LOWER:
        if (n := _count(schema.get(key))) > INT32_MAX:
            raise UnservableSchema(
                f"{_where(at)}: {key} {n} asks for more than any output can hold (the grammar "
                f"engine counts to {INT32_MAX}); lower it")


def _string(schema: dict, at: str) -> None:
    lengths = [k for k in _LENGTHS if k in schema]
    if "format" in schema and ("pattern" in schema or lengths):
        del schema["format"]  # an annotation: xgrammar would keep it and drop the assertions
    elif isinstance(fmt := schema.get("format"), str) and fmt in _FORMAT_PATTERNS:
        schema["pattern"] = _FORMAT_PATTERNS[schema.pop("format")]
    if not isinstance(schema.get("pattern"), str):
        return
    if lengths:
        raise UnservableSchema(
            f"{_where(at)}: a pattern with {' and '.join(lengths)}: the grammar engine would "
            "enforce only the pattern; write the length into the pattern (e.g. ^[a-z]{1,8}$) "
            f"and drop {' and '.join(lengths)}")
    schema["pattern"] = _pattern(schema["pattern"], at)


def _pattern(pattern: str, at: str) -> str:
    """`pattern` in printable ASCII, once xgrammar's JSON-safe path is known to take it."""
    if _has_lookaround(pattern):
        raise UnservableSchema(
            f"{_where(at)}: pattern {pattern!r} has a lookahead or lookbehind, which the grammar "
            "engine cannot enforce; write it without one")
    ascii_pattern = _ascii(pattern)
    if not _json_safe(ascii_pattern):
        raise UnservableSchema(
            f"{_where(at)}: the grammar engine cannot hold pattern {pattern!r} to JSON's string "
            "rules: every match needs a quote, a backslash or a control character (which JSON "
            "writes escaped and the engine's patterns cannot), or a repetition is too long for "
            "its automaton (thousands); change the pattern")
    return ascii_pattern


def _json_safe(pattern: str) -> bool:
    """Whether xgrammar compiles `pattern` through its JSON-safe automaton (a Regex rule in
    its EBNF) rather than expanding it into rules that write any character."""
    import xgrammar as xgr

    probe = xgr.Grammar.from_json_schema(json.dumps({"type": "string", "pattern": pattern}))
    return re.search(r"^\w+ ::= Regex\(", str(probe), re.MULTILINE) is not None


def _ascii(pattern: str) -> str:
    """`pattern` with every character outside printable ASCII as a `\\u{...}` escape (an
    escaped one, `\\é`, is the character itself)."""
    out, i = [], 0
    while i < len(pattern):
        c = pattern[i]
        if c == "\\" and i + 1 < len(pattern) and not " " <= pattern[i + 1] <= "~":
            c, i = pattern[i + 1], i + 1
        elif c == "\\":
            out.append(pattern[i:i + 2])
            i += 2
            continue
        out.append(c if " " <= c <= "~" else f"\\u{{{ord(c):x}}}")
        i += 1
    return "".join(out)


def _has_lookaround(pattern: str) -> bool:
    """Whether `pattern` opens a lookahead or lookbehind group (outside a class)."""
    i, in_class = 0, False
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            i += 2
            continue
        if in_class:
            in_class = c != "]"
        elif c == "[":
            in_class = True
        elif pattern.startswith(_LOOKAROUND, i):
            return True
        i += 1
    return False


def _count(value: object) -> int:
    """A count keyword's value, or -1 when it is no integer (xgrammar judges those)."""
    return value if isinstance(value, int) and not isinstance(value, bool) else -1


def _escape(key: str) -> str:
    return key.replace("~", "~0").replace("/", "~1")  # a JSON pointer's reference token


def _where(at: str) -> str:
    return f"the JSON schema at {at}" if at else "the JSON schema"
