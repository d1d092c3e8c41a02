"""Lark grammars for structured output's `grammar` kind, converted to the EBNF (GBNF
dialect) xgrammar compiles, as vLLM does: a grammar with no `::=` is taken for Lark.

The subset is what people send for constrained decoding:
- rules `name: a | b` (continuation lines start with `|`), `?name` / `!name` modifiers
  (dropped: they shape Lark's tree, not its language), `-> alias` (dropped likewise);
  terminals `NAME: ...`; the start rule `start` becomes `root`;
- "string" and 'string' literals (Python escapes), "text"i (each letter either case),
  "a".."z" character ranges;
- /regex/ terminals made of characters, classes, `.`, \\d \\w \\s (their ASCII classes),
  groups, `|` and the quantifiers ? * + {n} {n,} {n,m}; flags, anchors, lookarounds and
  backreferences are refused;
- ( ) groups, [ ] and ? optional, * and + repetition;
- `%import common.X` (or `-> Y`, or `common (X, Y)`) for the terminals of Lark's
  common.lark in `COMMON`;
- `%ignore X` is dropped: Lark would skip X between any two tokens, which a token mask
  cannot express; without it the output is one of the texts Lark parses with no ignored
  text between tokens: whatever is generated is still a sentence of the user's grammar.
- // comments.
Anything else is a ValueError naming structured_output, the line and what to change.
"""

from __future__ import annotations

import ast
import re
import warnings
from dataclasses import dataclass
from functools import lru_cache
from typing import NoReturn

# Lark's common.lark terminals as self-contained EBNF bodies (same languages, except
# \\d and \\w style Unicode classes, which these spell in ASCII).
_INT = "[0-9]+"
_DECIMAL = '[0-9]+ "." [0-9]* | "." [0-9]+'
_EXP = "[eE] [+\\-]? [0-9]+"
_NUMBER = f"({_INT} | {_DECIMAL}) ({_EXP})?"  # FLOAT | INT
COMMON = {
    "DIGIT": "[0-9]", "HEXDIGIT": "[0-9a-fA-F]", "INT": _INT, "SIGNED_INT": f"[+\\-]? {_INT}",
    "DECIMAL": _DECIMAL, "FLOAT": f"({_INT} | {_DECIMAL}) {_EXP} | {_DECIMAL}",
    "SIGNED_FLOAT": f"[+\\-]? (({_INT} | {_DECIMAL}) {_EXP} | {_DECIMAL})",
    "NUMBER": _NUMBER, "SIGNED_NUMBER": f"[+\\-]? {_NUMBER}",
    "LCASE_LETTER": "[a-z]", "UCASE_LETTER": "[A-Z]", "LETTER": "[a-zA-Z]", "WORD": "[a-zA-Z]+",
    "CNAME": "[_a-zA-Z] [_a-zA-Z0-9]*",
    "ESCAPED_STRING": '"\\"" ([^"\\\\\\n] | "\\\\" [^\\n])* "\\""',  # .*? with \\-escapes, no newline
    "WS_INLINE": "[ \\t]+", "WS": "[ \\t\\f\\r\\n]+", "CR": '"\\r"', "LF": '"\\n"', "NEWLINE": '("\\r"? "\\n")+',
}

_TOKEN = re.compile(r"""
    (?P<skip>[ \t\f\r]+|//[^\n]*|\\\n)
  | (?P<nl>\n)
  | (?P<string>"(?:\\.|[^"\\\n])*"i?|'(?:\\.|[^'\\\n])*'i?)
  | (?P<regex>/(?:\\.|[^/\\\n])+/[imslux]*)
  | (?P<directive>%[a-z]+)
  | (?P<name>[_a-zA-Z][_a-zA-Z0-9]*)
  | (?P<number>[0-9]+)
  | (?P<op>->|\.\.|[:|()\[\]?*+!~.,{}])
""", re.VERBOSE)


class LarkError(ValueError):
    """A grammar outside the subset; the message says where and what."""


@dataclass(frozen=True)
class Token:
    kind: str  # nl, string, regex, directive, name, number, op
    text: str
    line: int


def is_lark(grammar: str) -> bool:
    """Whether a `grammar` format is Lark: EBNF rules are written `name ::= ...`."""
    return "::=" not in grammar


@lru_cache(maxsize=64)
def lark_to_ebnf(grammar: str) -> str:
    """The EBNF grammar (rule `root`) with the language of Lark `grammar`'s `start`.
    ValueError "structured_output: the Lark grammar ..." for what is outside the subset."""
    try:
        return _Converter(_statements(_tokens(grammar))).ebnf()
    except LarkError as exc:
        raise ValueError(f"structured_output: the Lark grammar cannot be used: {exc}") from None


def _tokens(text: str) -> list[Token]:
    out: list[Token] = []
    line, pos = 1, 0
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if m is None:
            raise LarkError(f"line {line}: unexpected {text[pos]!r}")
        kind = m.lastgroup or ""
        if kind != "skip" and not (kind == "nl" and (not out or out[-1].kind == "nl")):
            out.append(Token(kind, m.group(), line))
        line += m.group().count("\n")
        pos = m.end()
    return out


def _statements(tokens: list[Token]) -> list[list[Token]]:
    """Tokens split at line ends, except one before `|` (an alternative on its own line)."""
    statements: list[list[Token]] = [[]]
    for i, tok in enumerate(tokens):
        if tok.kind != "nl":
            statements[-1].append(tok)
        elif i + 1 < len(tokens) and tokens[i + 1].text != "|":
            statements.append([])
    return [s for s in statements if s]


class _Converter:
    """One grammar's definitions and imports, written out as EBNF rules."""

    def __init__(self, statements: list[list[Token]]) -> None:
        self.rules: dict[str, str] = {}  # Lark name: EBNF body
        self.lines: dict[str, int] = {}  # Lark name: the line defining it
        self.used: dict[str, int] = {}  # Lark name: the first line using it
        for statement in statements:
            self._statement(statement)

    def ebnf(self) -> str:
        if "start" not in self.rules:
            raise LarkError("no rule start (Lark's start rule, the whole output)")
        for name, line in self.used.items():
            if name not in self.rules:
                raise LarkError(f"line {line}: {name} is used but not defined (or imported from common)")
        return "\n".join(f"{_ebnf_name(n)} ::= {body}" for n, body in self.rules.items())

    def _statement(self, tokens: list[Token]) -> None:
        head = tokens[0]
        if head.kind == "directive":
            return self._directive(head, tokens[1:])
        rest = tokens[1:] if head.text in ("?", "!") else tokens
        if len(rest) > 1 and rest[1].text == ".":
            raise LarkError(f"line {head.line}: priorities ({rest[0].text}.N) are not supported; drop the .N")
        if len(rest) < 2 or rest[0].kind != "name" or rest[1].text != ":":
            raise LarkError(f"line {head.line}: expected a definition `name: ...` or a %directive, "
                            f"got {' '.join(t.text for t in tokens[:4])!r}")
        self._define(rest[0], _Expansions(rest[2:], rest[0], self.used).parse())

    def _define(self, name: Token, body: str) -> None:
        if name.text == "root":
            raise LarkError(f"line {name.line}: a rule named root (the EBNF's name for start); rename it")
        if name.text in self.rules:
            raise LarkError(f"line {name.line}: {name.text} is defined twice (first on line {self.lines[name.text]})")
        self.rules[name.text], self.lines[name.text] = body, name.line

    def _directive(self, head: Token, args: list[Token]) -> None:
        if head.text == "%ignore":
            return  # dropped: see the module's docstring
        if head.text != "%import":
            raise LarkError(f"line {head.line}: {head.text} is not supported (only %import common and %ignore)")
        spelled = "".join(t.text for t in args)
        one = re.fullmatch(r"common\.(\w+)(?:->(\w+))?", spelled)
        many = re.fullmatch(r"common\((\w+(?:,\w+)*)\)", spelled)
        if one:
            self._import(head, one.group(1), one.group(2) or one.group(1))
        elif many:
            for name in many.group(1).split(","):
                self._import(head, name, name)
        else:
            raise LarkError(f"line {head.line}: only %import common.NAME (-> ALIAS) or common (A, B) "
                            f"is supported, not %import {spelled}")

    def _import(self, head: Token, name: str, alias: str) -> None:
        if name not in COMMON:
            raise LarkError(f"line {head.line}: common.{name} is not one of the supported imports "
                            f"({', '.join(COMMON)})")
        self._define(Token("name", alias, head.line), COMMON[name])


class _Expansions:
    """A definition's right side (Lark's expansions), read by recursive descent."""

    def __init__(self, tokens: list[Token], name: Token, used: dict[str, int]) -> None:
        self.tokens, self.pos, self.name, self.used = tokens, 0, name, used

    def parse(self) -> str:
        body = self._alternatives()
        if self.pos < len(self.tokens):
            self._fail(f"unexpected {self.tokens[self.pos].text!r}")
        return body

    def _peek(self) -> str | None:
        return self.tokens[self.pos].text if self.pos < len(self.tokens) else None

    def _next(self) -> Token:
        tok = self.tokens[self.pos]
        self.pos += 1
        return tok

    def _fail(self, what: str) -> NoReturn:
        line = self.tokens[min(self.pos, len(self.tokens) - 1)].line if self.tokens else self.name.line
        raise LarkError(f"line {line}, in {self.name.text}: {what}")

    def _alternatives(self) -> str:
        options = [self._sequence()]
        while self._peek() == "|":
            self._next()
            options.append(self._sequence())
        return " | ".join(options)

    def _sequence(self) -> str:
        items = []
        while self._peek() not in (None, "|", ")", "]", "->"):
            items.append(self._item())
        if self._peek() == "->":  # an alias names the tree node; the language is the same
            self._next()
            if self.pos >= len(self.tokens) or self._next().kind != "name":
                self._fail("-> needs an alias name")
        return " ".join(items) or '""'

    def _item(self) -> str:
        atom = self._atom()
        op = self._peek()
        if op in ("?", "*", "+"):
            self._next()
            return f"{atom}{op}"
        if op == "~":
            self._fail("~ repetition (x ~ n) is not supported; write the copies out, [ ] around optional ones")
        return atom

    def _atom(self) -> str:
        tok = self._next()
        if tok.text in ("(", "["):
            inner = self._alternatives()
            close = ")" if tok.text == "(" else "]"
            if self._peek() != close:
                self._fail(f"{tok.text} is not closed by {close}")
            self._next()
            return f"({inner})" + ("?" if close == "]" else "")
        if tok.kind == "string":
            return self._string(tok)
        if tok.kind == "regex":
            return "(" + regex_to_ebnf(tok.text, f"line {tok.line}, in {self.name.text}") + ")"
        if tok.kind == "name":
            self.used.setdefault(tok.text, tok.line)
            return _ebnf_name(tok.text)
        self._fail(f"unexpected {tok.text!r}")

    def _string(self, tok: Token) -> str:
        text = self._decode(tok)
        if self._peek() == "..":  # "a".."z": one character of a range
            self._next()
            end = self._decode(self._next()) if self.pos < len(self.tokens) else ""
            if len(text) != 1 or len(end) != 1:
                self._fail('a range needs one character on each side of .., as "a".."z"')
            if text > end:
                self._fail(f"the range {text!r}..{end!r} runs backwards")
            return f"[{_class_char(text)}-{_class_char(end)}]"
        if tok.text.endswith("i"):
            return _any_case(text)
        return ebnf_literal(text) if text else '""'

    def _decode(self, tok: Token) -> str:
        if tok.kind != "string":
            self._fail(f"expected a string literal, got {tok.text!r}")
        quoted = tok.text[:-1] if tok.text.endswith("i") else tok.text
        try:
            with warnings.catch_warnings():  # "\d" stays a backslash and d, as in Lark
                warnings.simplefilter("ignore")
                return str(ast.literal_eval(quoted))
        except (SyntaxError, ValueError) as exc:
            self._fail(f"the string {tok.text} has a bad escape ({exc})")


def regex_to_ebnf(token: str, where: str) -> str:
    """The EBNF of a Lark /regex/ token (`where` names its place in a refusal)."""
    body, flags = token[1:].rsplit("/", 1)
    if flags:
        raise LarkError(f"{where}: {token} has flags ({flags}), which are not supported; "
                        "spell the cases out in the regex")
    return _Regex(body.replace("\\/", "/"), f"{where}: {token}").parse()


_CLASSES = {"d": "0-9", "w": "a-zA-Z0-9_", "s": " \\t\\n\\r\\f\\v"}
_QUANTIFIER = re.compile(r"[?*+]|\{(\d+)(,(\d*))?\}")
_HEX_DIGITS = {"x": 2, "u": 4, "U": 8}
_CHARS = {"n": "\n", "t": "\t", "r": "\r", "f": "\f", "v": "\v", "0": "\0"}


class _Regex:
    """A Python regular expression of characters, classes, groups, | and quantifiers."""

    def __init__(self, text: str, where: str) -> None:
        self.text, self.pos, self.where = text, 0, where

    def parse(self) -> str:
        out = self._alternatives()
        if self.pos < len(self.text):
            self._fail(f"an unmatched {self.text[self.pos]!r}")
        return out

    def _fail(self, what: str) -> NoReturn:
        raise LarkError(f"{self.where} has {what} at position {self.pos}; only characters, classes, groups, | "
                        "and the quantifiers ? * + {n,m} convert to EBNF")

    def _peek(self) -> str:
        return self.text[self.pos] if self.pos < len(self.text) else ""

    def _alternatives(self) -> str:
        options = [self._sequence()]
        while self._peek() == "|":
            self.pos += 1
            options.append(self._sequence())
        return " | ".join(options)

    def _sequence(self) -> str:
        items = []
        while self._peek() not in ("", "|", ")"):
            items.append(self._atom() + self._quantifier())
        return " ".join(items) or '""'

    def _quantifier(self) -> str:
        m = _QUANTIFIER.match(self.text, self.pos)
        if m is None:
            return ""
        self.pos = m.end()
        if self._peek() == "?":
            self.pos += 1  # lazy: the same language
        if m.group(1) is None:
            return m.group()
        lo, hi = m.group(1), m.group(3)
        if hi and int(hi) < int(lo):
            self._fail(f"{{{lo},{hi}}}, a repetition whose least is above its most")
        return f"{{{lo}}}" if m.group(2) is None else f"{{{lo},{hi}}}"

    def _atom(self) -> str:
        c = self._peek()
        self.pos += 1
        if c == "(":
            if self.text.startswith("?:", self.pos):
                self.pos += 2
            elif self._peek() == "?":
                self._fail("a (? group (lookaround, flags or a named group)")
            inner = self._alternatives()
            if self._peek() != ")":
                self._fail("a ( with no )")
            self.pos += 1
            return f"({inner})"
        if c == "[":
            return self._class()
        if c == ".":
            return "[^\\n]"
        if c == "\\":
            char, letter = self._escape()
            if char is not None:
                return ebnf_literal(char)
            return f"[{'^' if letter.isupper() else ''}{_CLASSES[letter.lower()]}]"
        if c in "^$*+?{}]":
            self.pos -= 1
            self._fail(f"{c!r}")
        return ebnf_literal(c)

    def _escape(self) -> tuple[str | None, str]:
        """After a backslash: (the character, "") or (None, a class escape's letter)."""
        c = self._peek()
        self.pos += 1
        if c.lower() in _CLASSES:
            return None, c
        if c in _HEX_DIGITS:
            digits = self.text[self.pos:self.pos + _HEX_DIGITS[c]]
            if not re.fullmatch(f"[0-9a-fA-F]{{{_HEX_DIGITS[c]}}}", digits) or int(digits, 16) > 0x10FFFF:
                self._fail(f"a bad \\{c} escape")
            self.pos += len(digits)
            return chr(int(digits, 16)), ""
        if c in _CHARS:
            return _CHARS[c], ""
        if c and not c.isalnum():
            return c, ""
        self.pos -= 1
        self._fail(f"\\{c} (an anchor, backreference or unknown escape)")

    def _class(self) -> str:
        negated = self._peek() == "^"
        self.pos += negated
        parts: list[str] = []
        while not parts or self._peek() != "]":  # a ] first is itself
            lo = self._class_atom()
            if self._peek() == "-" and self.text[self.pos + 1:self.pos + 2] not in ("]", ""):
                self.pos += 1
                hi = self._class_atom()
                if len(lo) != 1 or len(hi) != 1 or lo > hi:
                    self._fail(f"a bad range {lo}-{hi}")
                parts.append(f"{_class_char(lo)}-{_class_char(hi)}")
            else:
                parts.append(_class_char(lo) if len(lo) == 1 else lo)
        self.pos += 1
        return ("[^" if negated else "[") + "".join(parts) + "]"

    def _class_atom(self) -> str:
        """One character in a class, or the EBNF class body of \\d, \\w or \\s."""
        c = self._peek()
        if not c:
            self._fail("a [ with no ]")
        self.pos += 1
        if c != "\\":
            return c
        char, letter = self._escape()
        if char is not None:
            return char
        if letter.isupper():
            self._fail(f"\\{letter} inside a class")
        return _CLASSES[letter]


def _any_case(text: str) -> str:
    """"text"i: each letter in either case (one character each way), the rest as written."""
    parts = []
    for c in text:
        lo, up = c.lower(), c.upper()
        cased = len(lo) == 1 and len(up) == 1 and lo != up
        parts.append(f"[{lo}{up}]" if cased else ebnf_literal(c))
    return "(" + " ".join(parts) + ")" if parts else '""'


def _ebnf_name(name: str) -> str:
    return "root" if name == "start" else name


def _class_char(c: str) -> str:
    """One character inside an EBNF [...] class."""
    if c in "\\]-^":
        return "\\" + c
    return ebnf_literal(c)[1:-1]


def ebnf_literal(text: str) -> str:
    """`text` as an EBNF string literal: quote and backslash escaped, and every character
    that is not printable (controls, line and paragraph separators, format characters) as
    a \\u or \\U escape, so no raw control character reaches the grammar's lexer."""
    out = []
    for c in text:
        if c in '"\\':
            out.append("\\" + c)
        elif c.isprintable():
            out.append(c)
        else:
            out.append(f"\\u{ord(c):04x}" if ord(c) <= 0xFFFF else f"\\U{ord(c):08x}")
    return '"' + "".join(out) + '"'
