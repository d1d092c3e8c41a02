"""Random JSON schemas (a Hypothesis strategy) hold sampled output to them: every output
of a batch of random schemas, sampled at temperature 1.5 with no top-k from a
random-weight model (which tries whatever the grammar lets through, byte by byte: the
checkpoint's byte-level vocabulary has a token for each byte), ends because its grammar
ended, parses as strict JSON and validates against its schema; json_object's outputs
parse too. The grammars refuse, byte by byte, what strict JSON refuses in a string (raw
control characters, surrogates' 3-byte forms); a schema the grammar engine would serve
wrongly is refused with a message naming the place and the fix, and what it can serve
right (a NUL in a literal, bounds beyond int32) is served right.

The strategy nests objects (required and optional properties, no others), arrays with
bounds, enums, bounded integers, booleans, null and strings bounded by minLength and
maxLength or by a pattern, so every output is bounded. xgrammar 0.2.8 let a string with
minLength or maxLength take raw control characters (engine/omnibus/engine/worker/json_schema.py
works around it). The patterns' classes reach only ASCII, or one non-ASCII character:
xgrammar's regex automaton spells a class wider than that (`.`, `\\S`, `[^a]`) with
overlong UTF-8 forms a byte-level model can pick (docs/engine.md)."""

from __future__ import annotations

import itertools
import json

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from omnibus.common.sampling import StructuredOutput
from omnibus.engine.config import EngineConfig
from omnibus.engine.engine import Engine
from omnibus.engine.worker.sampling import SamplingParams
from tests.checkpoints import make_checkpoint

xgr = pytest.importorskip("xgrammar")

IDS = itertools.count()  # request ids, unique across the module's one engine
NAMES = st.text(alphabet="abcdefgh", min_size=1, max_size=5)
# Pattern classes: quotes, backslashes and control characters in them are xgrammar's to
# leave out (its JSON-safe path), é is written as an escape before it compiles.
CLASSES = ["[a-z0-9 ]", "[ -~]", "[\\x00-\\x7f]", "é|[a-z]"]
STRINGS = st.one_of(
    st.integers(0, 8).map(lambda n: {"type": "string", "maxLength": n}),
    st.tuples(st.integers(0, 4), st.integers(0, 4)).map(
        lambda t: {"type": "string", "minLength": t[0], "maxLength": t[0] + t[1]}),
    st.tuples(st.sampled_from(CLASSES), st.integers(0, 6)).map(
        lambda t: {"type": "string", "pattern": f"^({t[0]}){{0,{t[1]}}}$"}),
)
LEAVES = st.one_of(
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    st.builds(lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
              st.integers(-99, 99), st.integers(0, 200)),
    STRINGS,
    STRINGS,
    st.lists(st.one_of(NAMES, st.integers(-9, 9), st.booleans()), min_size=1, max_size=3,
             unique=True).map(lambda values: {"enum": values}),
)


def _object(properties: dict) -> st.SearchStrategy[dict]:
    return st.lists(st.sampled_from(sorted(properties)), unique=True).map(
        lambda required: {"type": "object", "properties": properties, "required": required,
                          "additionalProperties": False})


SCHEMAS = st.recursive(LEAVES, lambda inner: st.one_of(
    st.builds(lambda items, lo, extra: {"type": "array", "items": items, "minItems": lo,
                                        "maxItems": lo + extra},
              inner, st.integers(0, 2), st.integers(0, 2)),
    st.dictionaries(NAMES, inner, min_size=1, max_size=3).flatmap(_object),
), max_leaves=6)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = make_checkpoint(tmp_path_factory.mktemp("random-schemas"), "llama")
    return Engine(EngineConfig(model=str(path), dtype="float32", structured_max_whitespace=1,
                               num_kv_blocks=256))


@pytest.fixture(scope="module")
def tokenizer(engine):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(engine.config.model) + "/tokenizer.json")


def sample(engine, fmts: list[StructuredOutput], seed: int,
           max_tokens: int = 400) -> list[tuple[list[int], str | None]]:
    """Each format's output (token ids) and finish reason, sampled in one batch."""
    tokens: dict[str, list[int]] = {}
    ends: dict[str, str | None] = {}
    for i, fmt in enumerate(fmts):
        params = SamplingParams(max_tokens=max_tokens, temperature=1.5, top_k=0, seed=seed + i,
                                structured_output=fmt)
        rid = f"r{next(IDS)}"
        engine.add_request(rid, [5 + i, 17, 33], params)
        tokens[rid] = []
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
            if out.finished:
                ends[out.request_id] = out.finish_reason
    assert engine.check_integrity().referenced == 0
    return [(ids, ends[rid]) for rid, ids in tokens.items()]


@settings(max_examples=20, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(schemas=st.lists(SCHEMAS, min_size=12, max_size=12), seed=st.integers(0, 2**32))
def test_sampled_outputs_of_random_schemas_parse_and_validate(engine, tokenizer, schemas, seed):
    fmts = [StructuredOutput("json_schema", json.dumps(s)) for s in schemas]
    for schema, (ids, end) in zip(schemas, sample(engine, fmts, seed)):
        assert end == "stop", (schema, ids)  # the grammar ended it, not the length
        value = json.loads(tokenizer.decode(ids))  # strict: no raw control characters
        jsonschema.validate(value, schema)


def test_sampled_json_objects_parse(engine, tokenizer):
    outputs = sample(engine, [StructuredOutput("json_object")] * 8, seed=7, max_tokens=64)
    assert sum(end == "stop" for _, end in outputs) >= 4  # (the others ran to max_tokens)
    for ids, end in outputs:
        if end == "stop":
            assert isinstance(json.loads(tokenizer.decode(ids)), dict)


@pytest.mark.parametrize("schema, prefix, utf8", [
    ({"type": "string", "maxLength": 4}, b"", True),
    ({"type": "string", "minLength": 1, "maxLength": 1}, b"", True),
    ({"type": "string", "minLength": 2}, b"a", True),
    ({"type": "string"}, b"", True),
    ({"type": "object"}, b'{"a": "', True),  # json_object's (strict mode off)
    ({"type": "string", "format": "json-pointer"}, b"/", False),
    ({"type": "string", "format": "email"}, b"", False),  # xgrammar's quoted local part: "\\"\\a
    ({"type": "string", "pattern": "^é.{0,3}$"}, "é".encode(), False),
], ids=["maxLength", "length-1", "minLength", "string", "json_object", "json-pointer", "email",
        "non-ascii-pattern"])
def test_a_string_grammar_refuses_byte_by_byte_what_json_refuses(engine, schema, prefix, utf8):
    """After `"` and `prefix`: a raw control character, a bad escape, and (`utf8`: where the
    string's characters are an EBNF class, not xgrammar's regex automaton) a surrogate's
    3-byte form or a cut character."""
    fmt = (StructuredOutput("json_object") if schema == {"type": "object"}
           else StructuredOutput("json_schema", json.dumps(schema)))
    engine.runner.compile_format(fmt)
    compiled = engine.runner.grammars.compile(fmt)
    byte_token = {b[0]: t for t, b in enumerate(compiled.tokenizer_info.decoded_vocab) if len(b) == 1}

    def takes(text: bytes) -> bool:
        matcher = xgr.GrammarMatcher(compiled)
        return all(matcher.accept_token(byte_token[b]) for b in text)

    start = (b"" if prefix.startswith(b"{") else b'"') + prefix
    assert takes(start)
    for bad in [b"\x00", b"\t", b"\n", b"\x1f", b"\\a", b'\\"\\a'] + [b"\xed\xa0\x80", b'\xc3"'] * utf8:
        assert not takes(start + bad), bad
    if "Length" in fmt.schema:  # an escape is a character too
        assert takes(start + b'\\n"') and takes(start + b'\\""')


@pytest.mark.parametrize("schema, match", [
    ({"type": "object", "properties": {"s": {"type": "string", "minLength": 2**31}}},
     r" at /properties/s: minLength 2147483648 asks for more than any output can hold .*; lower it"),
    ({"type": "array", "items": {"type": "string", "pattern": "^[a-z]+$", "maxLength": 8}},
     r" at /items: a pattern with maxLength: the grammar engine would enforce only the pattern; "
     r"write the length into the pattern \(e.g. \^\[a-z\]\{1,8\}\$\) and drop maxLength"),
    ({"type": "string", "pattern": "^(?=.*[0-9]).{8}$"}, r": pattern .* has a lookahead or lookbehind"),
    ({"type": "string", "pattern": '^a"b$'}, r": the grammar engine cannot hold pattern .* to JSON's string rules"),
    ({"type": "string", "pattern": "^a\\u0000b$"}, r": the grammar engine cannot hold pattern .* to JSON's string rules"),
    ({"type": "string", "pattern": "^\\n$"}, r": the grammar engine cannot hold pattern .* to JSON's string rules"),
], ids=["min-beyond-int32", "pattern-and-length", "lookahead", "quote", "nul", "newline"])
def test_a_schema_the_grammar_engine_would_serve_wrongly_is_refused(engine, schema, match):
    fmt = StructuredOutput("json_schema", json.dumps(schema))
    with pytest.raises(ValueError, match=f"^structured_output: the JSON schema{match}"):
        engine.add_request("refused", [5, 6], SamplingParams(max_tokens=4, structured_output=fmt))
    assert not engine.has_unfinished()


@pytest.mark.parametrize("schema, value", [
    ({"const": "a\u0000b"}, "a\u0000b"),
    ({"type": "array", "items": {"enum": ["\u0000"]}, "minItems": 2, "maxItems": 2}, ["\u0000"] * 2),
])
def test_a_nul_in_a_literal_is_written_escaped(engine, tokenizer, schema, value):
    fmt = StructuredOutput("json_schema", json.dumps(schema))
    for ids, end in sample(engine, [fmt] * 2, seed=3):
        assert end == "stop" and json.loads(tokenizer.decode(ids)) == value


@pytest.mark.parametrize("schema, takes, refuses", [
    ({"type": "string", "minLength": 1, "maxLength": 2**32 + 1}, ['"abcdefghij"'], ['""']),
    ({"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 2**31},
     ["[1,2,3]"], ["[]"]),
    ({"type": "object", "additionalProperties": {"type": "boolean"}, "maxProperties": 2**32 + 1},
     ['{"a":true,"b":false}'], ['{"a":1}']),
    ({"type": "string", "format": "date", "maxLength": 3}, ['"abc"'], ['"abcd"']),
    ({"type": "string", "format": "email"}, ['"a.b@c.de"'], ['"\\"q\\"@c.de"']),
], ids=["maxLength-2**32+1", "maxItems-2**31", "maxProperties-2**32+1", "format-and-length", "email"])
def test_bounds_beyond_int32_and_formats_are_served_right(engine, schema, takes, refuses):
    """An upper bound beyond int32 holds for any output (xgrammar wraps maxProperties
    2**32 + 1 to 1); a length beside a format is enforced (xgrammar drops it)."""
    fmt = StructuredOutput("json_schema", json.dumps(schema))
    engine.runner.compile_format(fmt)
    compiled = engine.runner.grammars.compile(fmt)
    for text, ok in [(t, True) for t in takes] + [(t, False) for t in refuses]:
        matcher = xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)
        assert (matcher.accept_string(text) and matcher.is_terminated()) == ok, text
