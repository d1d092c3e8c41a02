"""Structured output beyond JSON is token-exact too: greedy output under a regex, a choice of
strings, an EBNF grammar and the same grammar in Lark (the engine converts it; the oracle
compiles the hand-written EBNF) equals transformers' `generate` with xgrammar's Hugging
Face logits processor, token for token, alone and batched with free requests. A choice's
options reach the grammar as their exact text (quotes, backslashes, newlines, non-ASCII);
the oracle builds its choice grammar by another spelling (every character a \\U escape).
A regex or grammar xgrammar cannot compile, Lark outside the subset the engine converts
(tests/unit/test_lark.py), or a format no output can start, is a ValueError
naming structured_output (INVALID_ARGUMENT on gRPC: tests/e2e/test_structured_grpc.py);
one that dead-ends mid-output ends the request there."""

from __future__ import annotations

import re

import pytest

from omnibus.common.sampling import StructuredOutput
from omnibus.engine.worker.sampling import SamplingParams
from tests.checkpoints import make_checkpoint
from tests.oracle.test_structured import EOS, MAX_TOKENS, PROMPTS, VOCAB, Oracle, make_engine

xgr = pytest.importorskip("xgrammar")

REGEX = r"[a-z]{2,6}(-[0-9]{1,3})?@(foo|bar)\.(com|org)"
GRAMMAR = "\n".join([
    'root ::= "let " name " = " value ";"',
    "name ::= [a-z] [a-z0-9_]{0,5}",
    'value ::= number | "\\"" [a-z ]{0,8} "\\"" | "[" number ("," number){0,2} "]"',
    'number ::= "-"? [0-9]{1,3}',
])
# GRAMMAR in Lark (regex terminals, an import, [ ] for {0,2}, modifiers and an alias): the
# engine converts it, the oracle compiles GRAMMAR as written.
LARK = "\n".join([
    "// a let statement",
    '?start: "let " NAME " = " value ";"',
    "NAME: /[a-z][a-z0-9_]{0,5}/",
    'value: number | "\\"" /[a-z ]{0,8}/ "\\""',
    '     | "[" number ["," number ["," number]] "]"  -> array',
    '!number: ["-"] DIGIT (DIGIT DIGIT?)?',
    "%import common.DIGIT",
    "%ignore \" \"",
])
# What GRAMMAR accepts, as a Python regex (to check the outputs by another engine).
GRAMMAR_AS_REGEX = r'let [a-z][a-z0-9_]{0,5} = (-?[0-9]{1,3}|"[a-z ]{0,8}"|\[-?[0-9]{1,3}(,-?[0-9]{1,3}){0,2}\]);'
# Options that need escaping in an EBNF literal, one a prefix of another, non-ASCII.
TRICKY = ('say "hi"', "back\\slash", "two\nlines\ttab", "café ☕ 日本", "\\n", '"', "a", "ab")
FORMATS = {
    "regex": StructuredOutput("regex", REGEX),
    "grammar": StructuredOutput("grammar", GRAMMAR),
    "lark": StructuredOutput("grammar", LARK),
    "choice": StructuredOutput("choice", options=TRICKY),
    **{f"only{i}": StructuredOutput("choice", options=(o,)) for i, o in enumerate(TRICKY)},
}


def escaped_choice(options: tuple[str, ...]) -> str:
    """The oracle's choice grammar: each character a \\U escape (no other escaping to get wrong)."""
    return "root ::= " + " | ".join('"' + "".join(f"\\U{ord(c):08x}" for c in o) + '"' for o in options)


@pytest.fixture(scope="module")
def oracle(tmp_path_factory):
    from transformers import PreTrainedTokenizerFast

    oracle = Oracle(make_checkpoint(tmp_path_factory.mktemp("formats"), "llama", vocab_size=VOCAB))
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(oracle.path / "tokenizer.json"))
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=VOCAB,
                                                                      stop_token_ids=[EOS]))
    oracle.grammars.update({"regex": compiler.compile_regex(REGEX),
                            "grammar": compiler.compile_grammar(GRAMMAR),
                            "lark": compiler.compile_grammar(GRAMMAR)})  # the EBNF LARK converts to
    for name, fmt in FORMATS.items():
        if fmt.kind == "choice":
            oracle.grammars[name] = compiler.compile_grammar(escaped_choice(fmt.options))
    return oracle


@pytest.fixture(scope="module")
def engine(oracle):
    """An engine for the tests that run no batch (refusals, the compiler itself)."""
    return make_engine(oracle)


def params(fmt: str | None) -> SamplingParams:
    if fmt is None:
        return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, structured_output=FORMATS[fmt])


def run(oracle: Oracle, requests: list[tuple[list[int], str | None]]) -> list[list[int]]:
    """Runs `requests` (prompt, format) in one batch and checks each against transformers."""
    engine = make_engine(oracle)
    outputs = engine.generate([p for p, _ in requests], [params(fmt) for _, fmt in requests])
    for i, ((prompt, fmt), got) in enumerate(zip(requests, outputs)):
        assert got == oracle.expected(prompt, fmt), f"request {i} ({fmt}) diverged"
    assert engine.check_integrity().referenced == 0
    return outputs


@pytest.mark.parametrize(("fmt", "pattern"), [
    ("regex", REGEX), ("grammar", GRAMMAR_AS_REGEX), ("lark", GRAMMAR_AS_REGEX),
    ("choice", "|".join(map(re.escape, TRICKY)))])
def test_greedy_output_matches_xgrammar_in_transformers_and_follows_the_format(oracle, fmt, pattern):
    for tokens in run(oracle, [(p, fmt) for p in PROMPTS]):
        assert tokens[-1] == EOS  # each format is bounded: every output ends well before MAX_TOKENS
        assert re.fullmatch(pattern, oracle.text(tokens)), oracle.text(tokens)


def test_a_mixed_batch_stays_exact_and_each_choice_is_its_exact_text(oracle):
    # (the scheduling paths, overlap and preemption among them, are the JSON formats':
    # tests/oracle/test_structured.py; only the grammar differs here)
    singles = [f"only{i}" for i in range(len(TRICKY))]
    requests = [(PROMPTS[0], "regex"), (PROMPTS[1], None), (PROMPTS[2], "grammar"),
                *(([60 + i, 61], name) for i, name in enumerate(singles))]
    outputs = run(oracle, requests)
    assert [oracle.text(t) for t in outputs[3:]] == list(TRICKY)


def test_choice_grammar_accepts_exactly_its_options(engine):
    engine.runner.grammar(FORMATS["choice"])  # builds the compiler
    compiled = engine.runner.grammars.compile(FORMATS["choice"])

    def accepts(text: str) -> bool:
        matcher = xgr.GrammarMatcher(compiled)
        return matcher.accept_string(text) and matcher.is_completed()

    assert all(accepts(o) for o in TRICKY)
    for near in ("say hi", 'say \\"hi\\"', "back\\\\slash", "two\\nlines\\ttab", "café", "", "abc", "b"):
        assert not accepts(near), near


@pytest.mark.parametrize(("fmt", "message"), [
    (StructuredOutput("regex", "(a"), "structured_output: the regular expression does not compile: "
     "Regex parsing error at position 3: The parenthesis is not closed."),
    (StructuredOutput("regex", "(?<=a)b"), "structured_output: the regular expression does not compile: "
     "Regex parsing error at position 3: Lookbehind is not supported yet."),
    (StructuredOutput("grammar", 'start ::= "a"'), "structured_output: the EBNF grammar does not compile: "
     'EBNF parser error at line 1, column 1: The root rule with name "root" is not found'),
    (StructuredOutput("grammar", "root ::= word\n"), "structured_output: the EBNF grammar does not compile: "
     'EBNF parser error at line 1, column 10: Rule "word" is not defined'),
    (StructuredOutput("grammar", "root ::= root"), "structured_output: no token can start the output under "
     "this EBNF grammar (does every rule it needs reach a string?)"),
    (StructuredOutput("grammar", "start: /a(?=b)/"), "structured_output: the Lark grammar cannot be used: line 1, "
     "in start: /a(?=b)/ has a (? group (lookaround, flags or a named group) at position 2; only characters, "
     "classes, groups, | and the quantifiers ? * + {n,m} convert to EBNF"),
    (StructuredOutput("grammar", "start: start"), "structured_output: no token can start the output under "
     "this Lark grammar (does every rule it needs reach a string?)"),
])  # fmt: skip
def test_a_format_xgrammar_cannot_use_is_a_value_error_naming_structured_output(engine, fmt, message):
    with pytest.raises(ValueError) as err:
        engine.add_request("r", [5, 6], SamplingParams(max_tokens=4, structured_output=fmt))
    assert str(err.value) == message
    assert not engine.has_unfinished()


def test_each_format_compiles_once_and_a_regex_is_not_a_grammar_of_the_same_text(engine):
    engine.runner.grammar(FORMATS["regex"])
    grammars = engine.runner.grammars
    size = grammars._compiler.get_cache_size_bytes()
    for _ in range(3):
        engine.runner.grammar(FORMATS["regex"])
    assert grammars._compiler.get_cache_size_bytes() == size
    engine.runner.grammar(StructuredOutput("grammar", 'root ::= "x"'))
    grown = grammars._compiler.get_cache_size_bytes()
    assert grown > size
    engine.runner.grammar(StructuredOutput("regex", 'root ::= "x"'))  # the same text, another kind
    assert grammars._compiler.get_cache_size_bytes() > grown


def test_a_grammar_that_dead_ends_mid_output_ends_the_request_instead_of_breaking_it(oracle):
    # x has no sentence: after "a" no token fits, and every logit would be masked
    fmt = StructuredOutput("grammar", 'root ::= "a" x\nx ::= x')
    engine = make_engine(oracle)
    for i, temperature in enumerate((0.0, 1.0)):  # r1 ignores EOS: its matcher ends it
        engine.add_request(f"r{i}", [5, 6, 7], SamplingParams(max_tokens=8, temperature=temperature, seed=i,
                                                              ignore_eos=i == 1, structured_output=fmt))
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    for rid in ("r0", "r1"):
        mine = [o for o in outs if o.request_id == rid]
        tokens = [t for o in mine for t in o.new_token_ids]
        assert (oracle.text(tokens), tokens[-1], mine[-1].finish_reason) == ("a", EOS, "stop")
    assert engine.check_integrity().referenced == 0
