"""omnibus.engine.worker.lark: Lark grammars (structured output's `grammar` kind without a
`::=`) written out as the EBNF xgrammar compiles. Each construct's EBNF is checked as
text, the regexes and common imports by their language (every short string over an
alphabet, against Python's re), and what is outside the subset by its exact refusal."""

from __future__ import annotations

import itertools
import re

import pytest

from omnibus.engine.worker.lark import COMMON, is_lark, lark_to_ebnf

xgr = pytest.importorskip("xgrammar")


@pytest.fixture(scope="module")
def compiler():
    return xgr.GrammarCompiler(xgr.TokenizerInfo(["a"]))  # strings are matched byte by byte


def accepts(compiler, ebnf: str, text: str) -> bool:
    return accepts_compiled(compiler.compile_grammar(ebnf), text)


def accepts_compiled(compiled, text: str) -> bool:
    matcher = xgr.GrammarMatcher(compiled)
    return matcher.accept_string(text) and matcher.is_completed()


def same_language(compiler, ebnf: str, regex: str, alphabet: str, longest: int) -> None:
    """Asserts that `ebnf` and Python's `regex` accept the same strings over `alphabet` up
    to `longest` characters."""
    compiled = compiler.compile_grammar(ebnf)
    for n in range(longest + 1):
        for chars in itertools.product(alphabet, repeat=n):
            text = "".join(chars)
            assert accepts_compiled(compiled, text) == bool(re.fullmatch(regex, text)), (regex, text)


def test_a_grammar_with_a_definition_sign_is_ebnf_and_any_other_is_lark():
    assert not is_lark('root ::= "a"')
    assert not is_lark('root::="a" // start: "b"')
    assert is_lark('start: "a"')
    assert is_lark('?start: x\nx: "::"')  # "::" is not "::="


def test_each_construct_becomes_its_ebnf():
    lark = r"""
// comments, blank lines and a %ignore go
?start: greeting ("," _item)* ["!"]   -> top
greeting: "hi"i | 'it''s'
        | "a".."f"+
        // an alternative after a comment
        | NAME? "\"\n\\"
!_item: WORD | X
NAME: /[a-z]+/
%import common.WORD
%import common.INT -> X
%import common (WS, DIGIT)
%ignore WS
"""
    assert lark_to_ebnf(lark) == "\n".join([
        'root ::= greeting ("," _item)* ("!")?',
        "greeting ::= ([hH] [iI]) | \"it\" \"s\" | [a-f]+ | NAME? \"\\\"\\u000a\\\\\"",
        "_item ::= WORD | X",
        "NAME ::= ([a-z]+)",
        f"WORD ::= {COMMON['WORD']}",
        f"X ::= {COMMON['INT']}",
        f"WS ::= {COMMON['WS']}",
        f"DIGIT ::= {COMMON['DIGIT']}",
    ])


def test_an_empty_alternative_is_the_empty_string(compiler):
    ebnf = lark_to_ebnf('start: "a" |\n  | "b" ""')
    assert ebnf == 'root ::= "a" | "" | "b" ""'
    assert [accepts(compiler, ebnf, t) for t in ("a", "", "b", "ab")] == [True, True, True, False]


@pytest.mark.parametrize(("regex", "ebnf"), [
    (r"/[a-z]+/", "[a-z]+"),
    (r"/[0-9]{1,3}/", "[0-9]{1,3}"),
    (r"/\d+/", "[0-9]+"),
    (r"/\w*\s?\S{2,}/", "[a-zA-Z0-9_]* [ \\t\\n\\r\\f\\v]? [^ \\t\\n\\r\\f\\v]{2,}"),
    (r"/[^\]\\\d-]./", '[^\\]\\\\0-9\\-] [^\\n]'),
    (r"/(?:ab|c)+?\/x{3}/", '("a" "b" | "c")+ "/" "x"{3}'),
    (r'/"\x41\u00e9\U0001F600\t/', '"\\"" "A" "é" "😀" "\\u0009"'),
])  # fmt: skip
def test_a_regex_terminal_becomes_classes_and_repetition(regex, ebnf):
    assert lark_to_ebnf(f"start: T\nT: {regex}") == f"root ::= T\nT ::= ({ebnf})"


@pytest.mark.parametrize(("regex", "alphabet"), [
    (r"[a-c]{1,2}(x|yz)?", "abcxyz1"),
    (r"\d+(\.\d*)?|\.\d+", "01.a"),
    (r"[^a\-\"]b*", "ab-c\""),
    (r"(ab|a)*c?", "abc"),
])
def test_a_converted_regex_accepts_exactly_what_python_does(compiler, regex, alphabet):
    same_language(compiler, lark_to_ebnf(f"start: /{regex}/"), regex, alphabet, 4)


# Lark's common.lark terminals, as Python regexes (their ASCII reading).
_FLOAT = r"([0-9]+[eE][+-]?[0-9]+|([0-9]+\.[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?)"
COMMON_AS_REGEX = {
    "DIGIT": r"[0-9]", "HEXDIGIT": r"[0-9a-fA-F]", "LCASE_LETTER": r"[a-z]", "UCASE_LETTER": r"[A-Z]",
    "LETTER": r"[a-zA-Z]", "SIGNED_FLOAT": r"[+-]?" + _FLOAT, "WS_INLINE": r"[ \t]+", "CR": r"\r", "LF": r"\n",
    "INT": r"[0-9]+", "SIGNED_INT": r"[+-]?[0-9]+", "DECIMAL": r"[0-9]+\.[0-9]*|\.[0-9]+",
    "FLOAT": _FLOAT,
    "NUMBER": r"([0-9]+|[0-9]+\.[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?",
    "SIGNED_NUMBER": r"[+-]?([0-9]+|[0-9]+\.[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?",
    "CNAME": r"[_a-zA-Z][_a-zA-Z0-9]*", "WORD": r"[a-zA-Z]+", "WS": r"[ \t\f\r\n]+",
    "ESCAPED_STRING": r'"([^"\\\n]|\\[^\n])*"', "NEWLINE": r"(\r?\n)+",
}


@pytest.mark.parametrize(("name", "alphabet"), [
    ("DIGIT", "09a"), ("HEXDIGIT", "0fFg"), ("LCASE_LETTER", "azA"), ("UCASE_LETTER", "AZa"), ("LETTER", "aZ1"),
    ("SIGNED_FLOAT", "1.e-"), ("WS_INLINE", " \ta\n"), ("CR", "\r\n"), ("LF", "\r\n"),
    ("INT", "1a."), ("SIGNED_INT", "1+-"), ("DECIMAL", "1.e"), ("FLOAT", "1.e-"), ("NUMBER", "1.e-"),
    ("SIGNED_NUMBER", "1.-E"), ("CNAME", "a_1Z-"), ("WORD", "aZ1"), ("WS", " \t\n\fa"),
    ("ESCAPED_STRING", '"\\a\n'), ("NEWLINE", "\r\na"),
])  # fmt: skip
def test_each_common_import_accepts_what_lark_does(compiler, name, alphabet):
    same_language(compiler, lark_to_ebnf(f"start: {name}\n%import common.{name}"), COMMON_AS_REGEX[name],
                  alphabet, 5)


def test_every_common_terminal_is_checked():
    assert set(COMMON_AS_REGEX) == set(COMMON)


PREFIX = "structured_output: the Lark grammar cannot be used: "
REGEX_TAIL = "; only characters, classes, groups, | and the quantifiers ? * + {n,m} convert to EBNF"


@pytest.mark.parametrize(("lark", "message"), [
    ('a: "x"', "no rule start (Lark's start rule, the whole output)"),
    ("start: x", "line 1: x is used but not defined (or imported from common)"),
    ('start: "a"\n\nstart: "b"', "line 3: start is defined twice (first on line 1)"),
    ('start: root\nroot: "a"', "line 2: a rule named root (the EBNF's name for start); rename it"),
    ('start: "a" ~ 3', "line 1, in start: ~ repetition (x ~ n) is not supported; "
     "write the copies out, [ ] around optional ones"),
    ('start.2: "a"', "line 1: priorities (start.N) are not supported; drop the .N"),
    ('start: _sep{x}', "line 1, in start: unexpected '{'"),
    ('start: "a" @', "line 1: unexpected '@'"),
    ('start: ("a" | "b"', "line 1, in start: ( is not closed by )"),
    ('start: "a" ]', "line 1, in start: unexpected ']'"),
    ('start: "a"\n  "b"', "line 2: expected a definition `name: ...` or a %directive, got '\"b\"'"),
    ('start: "a" ->', "line 1, in start: -> needs an alias name"),
    ('start: "ab".."z"', 'line 1, in start: a range needs one character on each side of .., as "a".."z"'),
    ('start: "z".."a"', "line 1, in start: the range 'z'..'a' runs backwards"),
    ('start: "\\xZZ"', "line 1, in start: the string \"\\xZZ\" has a bad escape ((unicode error) 'unicodeescape' "
     "codec can't decode bytes in position 0-1: truncated \\xXX escape (<unknown>, line 1))"),
    ('start: "a"\n%declare X', "line 2: %declare is not supported (only %import common and %ignore)"),
    ('start: "a"\n%import foo.BAR', "line 2: only %import common.NAME (-> ALIAS) or common (A, B) is "
     "supported, not %import foo.BAR"),
    ('start: FOO\n%import common.FOO', f"line 2: common.FOO is not one of the supported imports ({', '.join(COMMON)})"),
    ("start: N\nN: /\\d+/i", "line 2, in N: /\\d+/i has flags (i), which are not supported; "
     "spell the cases out in the regex"),
    ("start: /^a/", "line 1, in start: /^a/ has '^' at position 0" + REGEX_TAIL),
    ("start: /a(?=b)/", "line 1, in start: /a(?=b)/ has a (? group (lookaround, flags or a named group) "
     "at position 2" + REGEX_TAIL),
    ("start: /(a)\\1/", "line 1, in start: /(a)\\1/ has \\1 (an anchor, backreference or unknown escape) "
     "at position 4" + REGEX_TAIL),
    ("start: /\\p{L}/", "line 1, in start: /\\p{L}/ has \\p (an anchor, backreference or unknown escape) "
     "at position 1" + REGEX_TAIL),
    ("start: /[\\D]/", "line 1, in start: /[\\D]/ has \\D inside a class at position 3" + REGEX_TAIL),
    ("start: /[a-/", "line 1, in start: /[a-/ has a [ with no ] at position 3" + REGEX_TAIL),
    ("start: /[z-a]/", "line 1, in start: /[z-a]/ has a bad range z-a at position 4" + REGEX_TAIL),
    ("start: /[\\w-z]/", "line 1, in start: /[\\w-z]/ has a bad range a-zA-Z0-9_-z at position 5" + REGEX_TAIL),
    ("start: /a{3,1}/", "line 1, in start: /a{3,1}/ has {3,1}, a repetition whose least is above its most "
     "at position 6" + REGEX_TAIL),
    ("start: /\\U00110000/", "line 1, in start: /\\U00110000/ has a bad \\U escape at position 2" + REGEX_TAIL),
    ("start: /a{2/", "line 1, in start: /a{2/ has '{' at position 1" + REGEX_TAIL),
    ("start: /(a/", "line 1, in start: /(a/ has a ( with no ) at position 2" + REGEX_TAIL),
])  # fmt: skip
def test_what_is_outside_the_subset_is_refused_saying_where(lark, message):
    with pytest.raises(ValueError) as err:
        lark_to_ebnf(lark)
    assert str(err.value) == PREFIX + message
