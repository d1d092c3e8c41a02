"""Structured output's regex, choice and grammar (EBNF and Lark) formats over the router's
gRPC API and a real engine worker (the session's shared router and engine): the output is what
transformers with xgrammar's logits processor gives (token-exact), and a format either
side refuses is INVALID_ARGUMENT with a message saying what to fix: the router's checks
(empty texts, empty options) and the engine's grammar compiler (a regex or grammar it
cannot compile)."""

from __future__ import annotations

import grpc
import pytest
from omnibus.v1 import inference_pb2 as pb
from omnibus.v1 import inference_pb2_grpc

from tests.oracle.test_structured import Oracle
from tests.oracle.test_structured_formats import GRAMMAR, LARK, REGEX, escaped_choice

pytest.importorskip("xgrammar")

PROMPT = [5, 17, 33, 101]
OPTIONS = ('say "hi"', "two\nlines", "café ☕")
FORMATS = {
    "regex": pb.StructuredOutput(regex=REGEX),
    "choice": pb.StructuredOutput(choice=pb.Choices(options=OPTIONS)),
    "grammar": pb.StructuredOutput(grammar=GRAMMAR),
    "lark": pb.StructuredOutput(grammar=LARK),  # the oracle compiles GRAMMAR, its EBNF
}


@pytest.fixture(scope="module")
def served(tiny_model, shared_router):
    """The router's stub, and the oracle for the same checkpoint (tests/checkpoints.py:
    the shared tiny model is the oracle tests' checkpoint)."""
    import xgrammar as xgr
    from transformers import PreTrainedTokenizerFast

    oracle = Oracle(tiny_model)
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(tiny_model / "tokenizer.json"))
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(
        tokenizer, vocab_size=oracle.hf.config.vocab_size, stop_token_ids=[2]))
    oracle.grammars.update({"regex": compiler.compile_regex(REGEX), "grammar": compiler.compile_grammar(GRAMMAR),
                            "lark": compiler.compile_grammar(GRAMMAR),
                            "choice": compiler.compile_grammar(escaped_choice(OPTIONS))})
    with grpc.insecure_channel(shared_router.address) as channel:
        yield inference_pb2_grpc.InferenceStub(channel), oracle


def generate(stub, fmt: pb.StructuredOutput, max_tokens: int = 80) -> list[pb.GenerateResponse]:
    sampling = pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, structured_output=fmt)
    return list(stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=PROMPT), sampling=sampling), timeout=60))


@pytest.mark.parametrize("kind", FORMATS)
def test_each_format_is_token_exact_through_the_router(served, kind):
    stub, oracle = served
    responses = generate(stub, FORMATS[kind])
    tokens = [t for r in responses for t in r.token_ids]
    assert tokens == oracle.expected(PROMPT, kind)
    assert responses[-1].finish_reason == pb.STOP
    if kind == "choice":
        assert "".join(r.text for r in responses) in OPTIONS


@pytest.mark.parametrize(("fmt", "message"), [
    (pb.StructuredOutput(regex=""),
     "structured_output: the regular expression is empty; send the one the whole output must follow"),
    (pb.StructuredOutput(choice=pb.Choices()), "structured_output: choice needs at least one option"),
    (pb.StructuredOutput(choice=pb.Choices(options=["yes", ""])), "structured_output: choice option 1 is empty"),
    (pb.StructuredOutput(regex="[0-9]+(a"), "structured_output: the regular expression does not compile: "
     "Regex parsing error at position 9: The parenthesis is not closed."),
    (pb.StructuredOutput(grammar='root ::= "a" tail'), "structured_output: the EBNF grammar does not compile: "
     'EBNF parser error at line 1, column 14: Rule "tail" is not defined'),
    (pb.StructuredOutput(grammar="root ::= root"), "structured_output: no token can start the output under "
     "this EBNF grammar (does every rule it needs reach a string?)"),
    (pb.StructuredOutput(grammar='start: "a" tail'), "structured_output: the Lark grammar cannot be used: "
     "line 1: tail is used but not defined (or imported from common)"),
])  # fmt: skip
def test_a_bad_format_is_invalid_argument_saying_what_to_fix(served, fmt, message):
    stub, _ = served
    with pytest.raises(grpc.RpcError) as err:
        generate(stub, fmt, max_tokens=4)
    assert (err.value.code(), err.value.details()) == (grpc.StatusCode.INVALID_ARGUMENT, message)
