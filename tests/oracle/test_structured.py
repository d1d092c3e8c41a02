"""Structured output is token-exact: greedy output under a JSON schema (and under
json_object) equals transformers' `generate` with xgrammar's own Hugging Face logits
processor for the grammar the engine compiles (xgrammar's conversion of the schema, with
its string classes made strict JSON: engine/omnibus/engine/worker/json_schema.py), token
for token, on a test checkpoint (byte-level BPE), alone and batched with
free requests (which stay exact), with overlapped steps, chunked prefill, preemption and a
speculating engine (structured requests are never speculated). Outputs parse as JSON and
follow the schema; a schema xgrammar cannot compile is a ValueError naming
structured_output (INVALID_ARGUMENT on gRPC)."""

from __future__ import annotations

import json

import pytest

from omnibus.common.sampling import StructuredOutput
from omnibus.engine.config import EngineConfig
from omnibus.engine.engine import Engine
from omnibus.engine.worker.json_schema import json_schema_ebnf
from omnibus.engine.worker.sampling import SamplingParams
from tests.checkpoints import hf_greedy, load_hf, make_checkpoint
from tests.oracle.test_speculative import KnowingProposer

xgr = pytest.importorskip("xgrammar")

VOCAB = 384
EOS = 2
SCHEMA = {"type": "object", "properties": {
    "name": {"enum": ["fox", "dog", "owl"]},
    "age": {"type": "integer", "minimum": 0, "maximum": 99},
    "ok": {"type": "boolean"}}, "required": ["name", "age", "ok"]}
FORMATS = {"schema": StructuredOutput("json_schema", json.dumps(SCHEMA)),
           "object": StructuredOutput("json_object")}
PROMPTS = [[5, 17, 33, 101], [200, 7], [9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 40]]
MAX_TOKENS = 80
WHITESPACE = 4  # at most, between JSON elements: the random model pads with whitespace otherwise


class Oracle:
    def __init__(self, path) -> None:
        from transformers import PreTrainedTokenizerFast

        self.path = path
        self.hf = load_hf(path)
        tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer.json"))
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=VOCAB, stop_token_ids=[EOS])
        assert info.vocab_type == xgr.VocabType.BYTE_LEVEL  # the checkpoint's byte-level BPE
        compiler = xgr.GrammarCompiler(info)
        # (not compile_json_schema's: in json_object's strings the random model spells
        # surrogates, which are not UTF-8; xgrammar's grammar takes them, the engine's not)
        self.grammars = {
            "schema": compiler.compile_grammar(json_schema_ebnf(json.dumps(SCHEMA), WHITESPACE)),
            "object": compiler.compile_grammar(json_schema_ebnf('{"type": "object"}', WHITESPACE, strict=False))}
        self.decoded = info.decoded_vocab
        self._memo: dict[tuple, list[int]] = {}

    def expected(self, prompt: list[int], fmt: str | None) -> list[int]:
        """transformers' greedy output (to EOS or MAX_TOKENS), with xgrammar's logits
        processor for `fmt`; without, ignoring EOS (as `ignore_eos`)."""
        key = (tuple(prompt), fmt)
        if key not in self._memo:
            grammar = None if fmt is None else self.grammars[fmt]
            self._memo[key] = hf_greedy(self.hf, prompt, MAX_TOKENS, grammar, EOS)
        return self._memo[key]

    def text(self, tokens: list[int]) -> str:
        return b"".join(self.decoded[t] for t in tokens if t != EOS).decode()


@pytest.fixture(scope="module")
def oracle(tmp_path_factory):
    return Oracle(make_checkpoint(tmp_path_factory.mktemp("structured"), "llama", vocab_size=VOCAB))


def make_engine(oracle: Oracle, **kw) -> Engine:
    return Engine(EngineConfig(model=str(oracle.path), dtype="float32", structured_max_whitespace=WHITESPACE, **kw))


def params(fmt: str | None) -> SamplingParams:
    if fmt is None:
        return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, structured_output=FORMATS[fmt])


def run(oracle: Oracle, requests: list[tuple[list[int], str | None]], **kw) -> Engine:
    """Runs `requests` (prompt, format) in one batch and checks each against transformers."""
    engine = make_engine(oracle, **kw)
    if engine.speculator is not None:  # guesses right for the free requests
        engine.speculator.proposer = KnowingProposer(
            {tuple(p): oracle.expected(p, None) for p, fmt in requests if fmt is None})
    outputs = engine.generate([p for p, _ in requests], [params(fmt) for _, fmt in requests])
    for i, ((prompt, fmt), got) in enumerate(zip(requests, outputs)):
        assert got == oracle.expected(prompt, fmt), f"request {i} ({fmt}) diverged"
    assert engine.check_integrity().referenced == 0
    return engine


@pytest.mark.parametrize("fmt", ["schema", "object"])
def test_greedy_structured_output_matches_xgrammar_in_transformers(oracle, fmt):
    run(oracle, [(p, fmt) for p in PROMPTS])
    for prompt in PROMPTS:
        tokens = oracle.expected(prompt, fmt)
        if tokens[-1] != EOS:
            continue  # cut at max_tokens: not a whole value
        value = json.loads(oracle.text(tokens))
        assert isinstance(value, dict)
        if fmt == "schema":
            assert list(value) == ["name", "age", "ok"]
            assert value["name"] in ("fox", "dog", "owl")
            assert type(value["age"]) is int and 0 <= value["age"] <= 99 and type(value["ok"]) is bool
    # the random model finishes the schema for some prompt (else the parse above checks nothing)
    assert any(oracle.expected(p, fmt)[-1] == EOS for p in PROMPTS)


@pytest.mark.parametrize("kw", [
    dict(),
    dict(overlap_scheduling=True),  # the step after a structured one waits for its pick
    dict(max_num_batched_tokens=5),  # chunked prefill
    dict(num_kv_blocks=32, block_size=4, max_num_seqs=4),  # preemption: recomputed, not re-emitted
    dict(speculative="ngram"),  # free requests speculate in the same steps; structured ones never
], ids=["continuous", "overlap", "chunked", "preempting", "speculating"])
def test_mixed_batches_stay_exact_for_structured_and_free_requests(oracle, kw):
    requests = [(PROMPTS[0], "schema"), (PROMPTS[1], None), (PROMPTS[2], "object"), ([44, 45, 46], None)]
    engine = run(oracle, requests, **kw)
    if "num_kv_blocks" in kw:
        assert engine.scheduler.num_preemptions > 0
    if "speculative" in kw:
        assert engine.speculator.stats.snapshot().proposed > 0


def test_a_structured_request_ends_when_its_grammar_does_even_ignoring_eos(oracle):
    prompt = next(p for p in PROMPTS if oracle.expected(p, "schema")[-1] == EOS)
    engine = make_engine(oracle)
    engine.add_request("r", prompt, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True,
                                                   structured_output=FORMATS["schema"]))
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert [t for o in outs for t in o.new_token_ids] == oracle.expected(prompt, "schema")
    assert outs[-1].finish_reason == "stop"


def test_a_continuation_resumes_the_grammar_after_its_output(oracle):
    prompt = PROMPTS[0]
    full = oracle.expected(prompt, "schema")
    engine = make_engine(oracle)
    cut = 5
    resumed = SamplingParams(max_tokens=MAX_TOKENS - cut, temperature=0.0, output_offset=cut,
                             structured_output=FORMATS["schema"])
    assert engine.generate([prompt + full[:cut]], resumed) == [full[cut:]]
    with pytest.raises(ValueError, match="structured_output: output token 0 of the continuation"):
        engine.add_request("bad", prompt + [EOS, 7], SamplingParams(
            max_tokens=4, output_offset=2, structured_output=FORMATS["schema"]))


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}},
    {"type": "nonsense"},
])
def test_a_schema_xgrammar_cannot_compile_is_a_value_error_naming_structured_output(oracle, schema):
    engine = make_engine(oracle)
    fmt = StructuredOutput("json_schema", json.dumps(schema))
    with pytest.raises(ValueError, match="^structured_output: the JSON schema does not compile"):
        engine.add_request("r", [5, 6], SamplingParams(max_tokens=4, structured_output=fmt))
    assert not engine.has_unfinished()


def test_sampled_structured_output_parses(oracle):
    engine = make_engine(oracle)
    sampled = [SamplingParams(max_tokens=60, temperature=1.0, top_p=0.9, seed=s,
                              structured_output=FORMATS["schema"]) for s in range(4)]
    for tokens in engine.generate([PROMPTS[0]] * 4, sampled):
        if tokens[-1] == EOS:
            value = json.loads(oracle.text(tokens))
            assert set(value) == {"name", "age", "ok"}


def test_free_requests_build_no_grammar_compiler(oracle):
    engine = make_engine(oracle)
    assert engine.generate([PROMPTS[1]], params(None)) == [oracle.expected(PROMPTS[1], None)]
    assert engine.runner.grammars is None  # xgrammar is not even imported for them
