"""omnibus.common.sampling: the one definition of sampling parameters both processes use,
and its mapping to the router→engine message."""

import dataclasses

import pytest
from omnibus.v1 import engine_pb2

from omnibus.common.sampling import SamplingParams

CASES = [
    SamplingParams(),
    SamplingParams(max_tokens=7, temperature=0.0, seed=0, stop_token_ids=(3, 9), logprobs=5),
    # float32 on the wire (as in inference.proto): values exact in float32 round-trip exactly
    SamplingParams(temperature=0.75, top_p=0.875, top_k=40, min_p=0.0625, seed=2**64 - 1,
                   ignore_eos=True, repetition_penalty=1.25, presence_penalty=-2.0,
                   frequency_penalty=2.0),  # fmt: skip
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
