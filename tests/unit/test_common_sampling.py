"""omnibus.common.sampling: the one definition of sampling parameters both processes use,
and its mapping to the router→engine message."""

import dataclasses
import re

import pytest
from omnibus.v1 import engine_pb2, inference_pb2

from omnibus.common.sampling import FieldError, SamplingParams, StructuredOutput

CASES = [
    SamplingParams(),
    SamplingParams(max_tokens=7, temperature=0.0, seed=0, stop_token_ids=(3, 9), logprobs=5),
    # float32 on the wire (as in inference.proto): values exact in float32 round-trip exactly
    SamplingParams(temperature=0.75, top_p=0.875, top_k=40, min_p=0.0625, seed=2**64 - 1,
                   ignore_eos=True, repetition_penalty=1.25, presence_penalty=-2.0,
                   frequency_penalty=2.0),  # fmt: skip
    SamplingParams(structured_output=StructuredOutput("json_schema", '{"type": "object"}')),
    SamplingParams(structured_output=StructuredOutput("json_object")),
    SamplingParams(structured_output=StructuredOutput("regex", r"[a-z]+@(foo|bar)\.com")),
    SamplingParams(structured_output=StructuredOutput("choice", options=("yes", 'say "no"\n', "日本", "yes"))),
    SamplingParams(structured_output=StructuredOutput("grammar", 'root ::= "a" | "b" root')),
    SamplingParams(logit_bias={17: 100.0, 3: -0.5, 0: -100.0}),  # float32-exact biases
]


@pytest.mark.parametrize("params", CASES)
def test_round_trip_through_the_engine_message(params):
    message = params.to_proto()
    wire = engine_pb2.EngineSamplingParams.FromString(message.SerializeToString())
    assert SamplingParams.from_proto(wire) == params


def test_every_field_crosses_to_the_engine():
    names = {f.name for f in dataclasses.fields(SamplingParams)}
    proto_names = set(engine_pb2.EngineSamplingParams.DESCRIPTOR.fields_by_name)
    assert names == proto_names
    unset_seed = SamplingParams(seed=None).to_proto()
    assert not unset_seed.HasField("seed")


@pytest.mark.parametrize(("bias", "message"), [
    ({5: 100.5}, "logit_bias of token 5 must be a number in [-100, 100], got 100.5"),
    ({5: float("nan")}, "logit_bias of token 5 must be a number in [-100, 100], got nan"),
    ({-1: 1.0}, "logit_bias token ids must be integers >= 0, got -1"),
    ({True: 1.0}, "logit_bias token ids must be integers >= 0, got True"),
    ([(1, 2.0), (1, 3.0)], "logit_bias names token 1 twice"),
    ({i: 1.0 for i in range(1025)}, "logit_bias names 1025 tokens; at most 1024 are allowed"),
    ("17", "logit_bias must map token ids to biases, got '17'"),
])
def test_a_bad_logit_bias_is_refused_naming_it(bias, message):
    with pytest.raises(ValueError, match=re.escape(message)) as err:
        SamplingParams(logit_bias=bias)
    assert err.value.field == "logit_bias"


def test_a_logit_bias_is_kept_as_sorted_pairs():
    assert SamplingParams(logit_bias={9: 1, 2: -3.5}).logit_bias == ((2, -3.5), (9, 1.0))


def test_out_of_range_messages_are_refused_as_the_router_would():
    bad = engine_pb2.EngineSamplingParams(max_tokens=4, top_p=0.0, temperature=1.0)
    with pytest.raises(ValueError, match=r"top_p must be a finite number in \(0, 1\], got 0.0"):
        SamplingParams.from_proto(bad)


def test_structured_output_turns_speculation_off():
    fmt = StructuredOutput("json_schema", '{"type": "integer"}')
    assert SamplingParams(structured_output=fmt).speculative_off
    assert SamplingParams(structured_output=fmt).to_proto().structured_output.json_schema == '{"type": "integer"}'
    assert not SamplingParams().to_proto().HasField("structured_output")


@pytest.mark.parametrize(("kind", "schema", "message"), [
    ("xml", "a+", "structured_output must be one of json_schema, json_object, regex, choice, grammar, "
     "got 'xml'"),
    ("json_object", "{}", "json_object takes no schema"),
    ("json_schema", "", "structured_output: the JSON schema is empty; send the one the whole output must follow"),
    ("regex", "", "structured_output: the regular expression is empty; send the one the whole output must follow"),
    ("grammar", "", "structured_output: the grammar is empty; send the one the whole output must follow"),
    ("grammar", b"root ::= x", "structured_output: the grammar must be text, got bytes"),
    ("regex", "a\ud800", "structured_output: the regular expression is not valid Unicode text "
     "(surrogates not allowed at character 1)"),
    ("choice", "a|b", "structured_output: choice takes options, not a schema"),
    ("regex", "x" * 65537, "structured_output: the regular expression is 65537 characters long, more than 65536"),
    ("grammar", "x" * 65537, "structured_output: the grammar is 65537 characters long, more than 65536"),
    ("json_schema", "{nope", "structured_output: the JSON schema is not valid JSON"),
    ("json_schema", "[1]", "structured_output: a JSON schema must be a JSON object (or true), got list"),
    ("json_schema", "false", "structured_output: a JSON schema must be a JSON object (or true), got bool"),
    ("json_schema", "[" * 100000, "structured_output: the JSON schema is not valid JSON"),
])  # fmt: skip
def test_bad_formats_are_refused_naming_structured_output(kind, schema, message):
    with pytest.raises(FieldError, match=re.escape(message)) as err:
        StructuredOutput(kind, schema)
    assert err.value.field == "structured_output"


@pytest.mark.parametrize(("fmt", "message"), [
    (dict(), "structured_output: choice needs at least one option"),
    (dict(options="yes"), "structured_output: choice options must be a list of strings, got str"),
    (dict(options=("yes", "")), "structured_output: choice option 1 is empty"),
    (dict(options=("yes", 3)), "structured_output: choice option 1 must be text, got int"),
    (dict(options=("\udcff",)), "structured_output: choice option 0 is not valid Unicode text"),
    (dict(options=("x",) * 1025), "structured_output: choice takes at most 1024 options, got 1025 "
     "(use a regex or a grammar for larger sets)"),
    (dict(options=("ok", "x" * 65535)), "structured_output: the choice options hold 65537 characters in all, "
     "more than 65536"),
])  # fmt: skip
def test_bad_choices_are_refused_naming_structured_output(fmt, message):
    with pytest.raises(FieldError, match=re.escape(message)) as err:
        StructuredOutput("choice", **fmt)
    assert err.value.field == "structured_output"


def test_choice_options_are_kept_as_a_tuple_up_to_the_bounds_and_only_choice_takes_them():
    with pytest.raises(FieldError, match=re.escape("structured_output: regex takes no options (only choice does)")):
        StructuredOutput("regex", "a+", options=("a",))
    assert StructuredOutput("choice", options=["a", "b"]).options == ("a", "b")
    assert StructuredOutput("choice", options=("x",) * 1024).options == ("x",) * 1024  # the bounds themselves
    assert StructuredOutput("choice", options=("x" * 65535, "y")).options[1] == "y"
    assert StructuredOutput("regex", "x" * 65536).schema == "x" * 65536


@pytest.mark.parametrize(("message", "expected"), [
    (dict(regex="a+"), StructuredOutput("regex", "a+")),
    (dict(grammar='root ::= "a"'), StructuredOutput("grammar", 'root ::= "a"')),
    (dict(choice=inference_pb2.Choices(options=["a", "b"])), StructuredOutput("choice", options=("a", "b"))),
    (dict(json_object=False), None),
])  # fmt: skip
def test_the_new_formats_read_from_their_oneof_members(message, expected):
    assert StructuredOutput.from_proto(inference_pb2.StructuredOutput(**message)) == expected


def test_an_empty_choice_message_is_refused_not_read_as_no_format():
    with pytest.raises(FieldError, match="structured_output: choice needs at least one option"):
        StructuredOutput.from_proto(inference_pb2.StructuredOutput(choice=inference_pb2.Choices()))
