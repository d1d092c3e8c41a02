"""Structured output on the router, in process (tests/unit/router/inprocess.py: scripted
engines): OpenAI's response_format and vLLM's structured_outputs / guided_json become the
engine request's structured_output (speculation off), on /v1/completions and
/v1/chat/completions; bad formats are 400 naming the field as sent, whether the router
or an engine (its grammar compiler) refuses them; gRPC's SamplingParams.structured_output
is checked by the same rule."""

from __future__ import annotations

import json

import grpc
import pytest
from omnibus.v1 import inference_pb2

from omnibus.router.service.errors import RequestError
from omnibus.router.service.pipeline import Caller
from tests.unit.router.inprocess import refusal
from tests.unit.router.test_http_vllm_surface import AUTH, setup  # noqa: F401 (a fixture)

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "w3 w4"}], "max_tokens": 2}
COMPLETION = {"model": "m", "prompt": "w1 w2", "max_tokens": 2}


@pytest.mark.parametrize("body", [CHAT, COMPLETION], ids=["chat", "completion"])
@pytest.mark.parametrize(("fields", "expected"), [
    ({"response_format": {"type": "json_object"}}, {"json_object": True}),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "person", "schema": SCHEMA, "strict": True, "description": "a person"}}},
     {"json_schema": json.dumps(SCHEMA)}),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "any", "schema": True,
                                                                 "strict": None}}},
     {"json_schema": "true"}),
    ({"structured_outputs": {"json": SCHEMA}}, {"json_schema": json.dumps(SCHEMA)}),
    ({"structured_outputs": {"json": '{"type": "integer"}'}}, {"json_schema": '{"type": "integer"}'}),
    ({"structured_outputs": {"json_object": True}}, {"json_object": True}),
    ({"guided_json": SCHEMA}, {"json_schema": json.dumps(SCHEMA)}),
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": None}, None),
])  # fmt: skip
async def test_formats_reach_the_engine_as_structured_output(setup, body, fields, expected):
    router, _, client = setup
    reply = await client.post(body is CHAT and "/v1/chat/completions" or "/v1/completions",
                              headers=AUTH, json={**body, **fields})
    assert reply.status == 200, await reply.text()
    sampling = router.engine.requests[-1].sampling
    if expected is None:
        assert not sampling.HasField("structured_output") and not sampling.speculative_off
        return
    fmt = sampling.structured_output
    assert {fmt.WhichOneof("format"): getattr(fmt, fmt.WhichOneof("format"))} == expected
    assert sampling.speculative_off  # guesses are not masked by the grammar


def test_a_schemas_key_order_is_kept():
    # properties are generated in the schema's order: the text keeps it
    schema = {"type": "object", "properties": {"z": {"type": "integer"}, "a": {"type": "string"}}}
    from omnibus.router.http import bodies, v1_requests
    body = bodies.parse(bodies.ChatBody, json.dumps({**CHAT, "response_format": {
        "type": "json_schema", "json_schema": {"name": "n", "schema": schema}}}).encode())
    fmt, field = v1_requests.structured_output(body)
    assert (fmt.json_schema, field) == ('{"type": "object", "properties": {"z": {"type": "integer"}, '
                                        '"a": {"type": "string"}}}', "response_format")


@pytest.mark.parametrize(("fields", "param", "message"), [
    ({"response_format": {"type": "regex"}}, "response_format.type",
     "response_format.type must be text, json_object or json_schema, got 'regex'"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema",
     "response_format.json_schema must be an object with name and schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}},
     "response_format.json_schema.name", "response_format.json_schema.name must be a non-empty string"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n"}}},
     "response_format.json_schema.schema", "response_format.json_schema.schema is required"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": [1]}}},
     "response_format.json_schema.schema",
     "response_format.json_schema.schema must be a JSON Schema object, got list"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {}, "x": 1}}},
     "response_format.json_schema.x", "unknown field 'response_format.json_schema.x'"),
    ({"response_format": {"type": "json_object", "schema": {}}}, "response_format.schema",
     "unknown field 'response_format.schema'"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {},
                                                                 "strict": "yes"}}},
     "response_format.json_schema.strict", "response_format.json_schema.strict must be a bool"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag",
     "structured_outputs.structural_tag is not supported; use one of json, json_object, regex, "
     "choice, grammar"),
    ({"structured_outputs": {"json": SCHEMA, "json_object": True}}, "structured_outputs",
     "structured_outputs sets both json and json_object"),
    ({"response_format": {"type": "json_object"}, "guided_json": SCHEMA}, "guided_json",
     "response_format and guided_json both set the output's format; set one"),
    # the Validator's check (the schema is JSON), named as sent
    ({"guided_json": "{not json"}, "guided_json", "guided_json: the JSON schema is not valid JSON"),
    ({"structured_outputs": {"json": "[1, 2]"}}, "structured_outputs",
     "structured_outputs: a JSON schema must be a JSON object (or true), got list"),
])  # fmt: skip
async def test_bad_formats_are_400_naming_the_field(setup, fields, param, message):
    _, _, client = setup
    for path, body in (("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)):
        reply = await client.post(path, headers=AUTH, json={**body, **fields})
        error = (await reply.json())["error"]
        assert (reply.status, error["param"]) == (400, param), error
        assert error["message"].startswith(message), error


@pytest.mark.parametrize("stream", [False, True])
async def test_a_schema_the_engine_cannot_compile_is_400_naming_response_format(setup, stream):
    router, _, client = setup
    router.engine.error = refusal(grpc.StatusCode.INVALID_ARGUMENT,
                                  "structured_output: the JSON schema does not compile: bad $ref")
    reply = await client.post("/v1/chat/completions", headers=AUTH, json={
        **CHAT, "stream": stream,
        "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}}})
    error = (await reply.json())["error"]
    assert (reply.status, error["param"], error["message"]) == (
        400, "response_format", "response_format: the JSON schema does not compile: bad $ref")


async def test_grpc_structured_output_is_checked_by_the_same_rule(setup):
    router, _, _ = setup
    tenant = router.pipeline.authenticate([("authorization", "Bearer sk-t")])
    request = inference_pb2.GenerateRequest(
        token_ids=inference_pb2.TokenIds(ids=[1, 2, 3]),
        sampling=inference_pb2.SamplingParams(max_tokens=2, structured_output=inference_pb2.StructuredOutput(
            json_schema=json.dumps(SCHEMA))))
    responses = [r async for r in router.pipeline.generate(request, Caller(tenant))]
    assert responses[-1].finish_reason == inference_pb2.LENGTH
    sent = router.engine.requests[-1].sampling
    assert sent.structured_output.json_schema == json.dumps(SCHEMA) and sent.speculative_off
    request.sampling.structured_output.json_schema = '"a string"'
    with pytest.raises(RequestError) as err:
        [r async for r in router.pipeline.generate(request, Caller(tenant))]
    assert (err.value.code, err.value.param, err.value.message) == (
        grpc.StatusCode.INVALID_ARGUMENT, "structured_output",
        "structured_output: a JSON schema must be a JSON object (or true), got str")
