"""omnibus.common.sampling: the one definition of sampling parameters both processes use,
and its mapping to the router→engine message."""

import dataclasses
import re

import pytest
from omnibus.v1 import engine_pb2

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
    ("regex", "a+", "structured_output must be one of json_schema, json_object, got 'regex'"),
    ("json_object", "{}", "json_object takes no schema"),
    ("json_schema", "{nope", "structured_output: the JSON schema is not valid JSON"),
    ("json_schema", "[1]", "structured_output: a JSON schema must be a JSON object (or true), got list"),
    ("json_schema", "false", "structured_output: a JSON schema must be a JSON object (or true), got bool"),
    ("json_schema", "[" * 100000, "structured_output: the JSON schema is not valid JSON"),
])  # fmt: skip
def test_bad_formats_are_refused_naming_structured_output(kind, schema, message):
    with pytest.raises(FieldError, match=re.escape(message)) as err:
        StructuredOutput(kind, schema)
    assert err.value.field == "structured_output"
