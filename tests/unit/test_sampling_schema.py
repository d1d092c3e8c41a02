"""A sampling field is defined once and every layer carries it (issue 38): the public
SamplingParams (inference.proto), the engine's message (engine.proto), the dataclass both
processes check it with (omnibus.common.sampling), the router's Validator, the HTTP body
(v1_requests.sampling) and the client agree field by field. A field added to the proto
and not carried somewhere fails here, naming the layer that drops it."""

from __future__ import annotations

import dataclasses

from tokenizers import Tokenizer, models
from omnibus.v1 import engine_pb2
from omnibus.v1 import inference_pb2 as pb

from omnibus.common.sampling import SamplingParams
from omnibus.router import client
from omnibus.router.admission.validation import ModelLimits, Validator
from omnibus.router.config import RouterConfig
from omnibus.router.http import v1_requests
from omnibus.router.http.bodies import CompletionBody

PUBLIC = set(pb.SamplingParams.DESCRIPTOR.fields_by_name)
ENGINE = set(engine_pb2.EngineSamplingParams.DESCRIPTOR.fields_by_name)
# The router's own: stop strings are matched on text by the router; `speculative` (an
# enum) reaches the engine as speculative_off; output_offset is the router's
# continuation state, never a client's.
ROUTER_ONLY, ENGINE_ONLY = {"stop", "speculative"}, {"speculative_off", "output_offset"}

# One non-default value of every public field, and the engine field it must arrive as.
VALUES = {
    "max_tokens": 7, "temperature": 0.5, "top_p": 0.75, "top_k": 5, "min_p": 0.25, "seed": 11,
    "stop_token_ids": [3, 4], "ignore_eos": True, "repetition_penalty": 1.5, "presence_penalty": 0.5,
    "frequency_penalty": -0.5, "logprobs": 3, "prompt_logprobs": 2, "logit_bias": {9: 2.5},
    "speculative": pb.SPECULATIVE_OFF, "stop": ["x"],
    "structured_output": pb.StructuredOutput(json_object=True),
}
# The OpenAI body's key (and value) for each public field (vLLM's names for extensions).
HTTP = {
    "max_tokens": ("max_tokens", 7), "temperature": ("temperature", 0.5), "top_p": ("top_p", 0.75),
    "top_k": ("top_k", 5), "min_p": ("min_p", 0.25), "stop_token_ids": ("stop_token_ids", [3, 4]),
    "ignore_eos": ("ignore_eos", True), "repetition_penalty": ("repetition_penalty", 1.5),
    "presence_penalty": ("presence_penalty", 0.5), "frequency_penalty": ("frequency_penalty", -0.5),
    "logprobs": ("logprobs", 3), "logit_bias": ("logit_bias", {"9": 2.5}), "speculative": ("speculative", "off"),
    "stop": ("stop", ["x"]), "structured_output": ("response_format", {"type": "json_object"}),
}
# Public fields an OpenAI completion body sets elsewhere: the seed per choice (fan_out),
# prompt logprobs only through echo with logprobs.
HTTP_ELSEWHERE = {"seed", "prompt_logprobs"}


def test_the_messages_and_the_dataclass_have_the_same_fields():
    assert {f.name for f in dataclasses.fields(SamplingParams)} == ENGINE
    assert PUBLIC - ROUTER_ONLY == ENGINE - ENGINE_ONLY
    assert set(VALUES) == PUBLIC  # every public field has a test value below


def test_the_validator_carries_every_public_field_to_the_engine():
    config = RouterConfig(model="m", engines=("127.0.0.1:1",))
    limits = ModelLimits(model_id="m", context=1024, vocab_size=64, max_prompt_tokens=1000, max_tokens=1000)
    validator = Validator(config, limits, Tokenizer(models.WordLevel({"a": 0}, unk_token="a")))
    public = pb.SamplingParams(**VALUES)
    engine = validator._sampling(public)
    for name in PUBLIC - ROUTER_ONLY:
        got, sent = getattr(engine, name), getattr(public, name)
        assert got == sent, f"Validator._sampling drops or changes {name}: sent {sent!r}, engine gets {got!r}"
    assert engine.speculative_off


def test_the_http_body_reaches_every_public_field():
    assert set(HTTP) | HTTP_ELSEWHERE == PUBLIC
    body = CompletionBody(model="m", prompt="p", **{key: value for key, value in HTTP.values()})
    params = v1_requests.sampling(body, body.max_tokens, body.logprobs)
    for name, (key, _) in HTTP.items():
        default = getattr(pb.SamplingParams(), name)
        assert getattr(params, name) != default, f"the HTTP body's {key} does not reach SamplingParams.{name}"


def test_the_clients_sampling_flags_set_public_fields():
    args = client.build_parser().parse_args(["p", "--max-tokens", "7", "--temperature", "0.5", "--top-p", "0.75",
                                             "--top-k", "5", "--seed", "11", "--stop", "x", "--logit-bias", "9=2.5"])
    request = client.make_request(args)
    set_fields = {field.name for field, _ in request.sampling.ListFields()}
    assert set_fields == {"max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "logit_bias"} <= PUBLIC
    assert dict(request.sampling.logit_bias) == {9: 2.5}
