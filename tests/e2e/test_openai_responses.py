"""POST /v1/responses over real processes, driven by the official `openai` client: the
text is the chat path's for the same messages (token-exact, and so transformers'), the
stream is the Responses API's event sequence, text.format is chat's structured output,
and what the server cannot do (store, previous_response_id, images, tools, unknown
fields) is a 400 naming the field. The events after a stream failed are checked
in-process, on the event generator.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import jsonschema
import openai
import pytest
import transformers
from omnibus.bench.processes import engine_and_router
from omnibus.v1 import inference_pb2 as pb
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from omnibus.router.http import responses as rs
from omnibus.router.service.errors import RequestError
from tests.checkpoints import hf_greedy
from tests.grpc_helpers import engine_stats, free_port, tiny_checkpoint, wait_until

MODEL = "tiny-llama"
# A ChatML-like template, as tests/e2e/test_openai_http.py's.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
INSTRUCTIONS = "You are a fox."
INPUT = [{"role": "user", "content": [{"type": "input_text", "text": "Every day the fox "},
                                      {"type": "input_text", "text": "ran"}]}]  # fmt: skip
# The same conversation as chat messages.
MESSAGES = [{"role": "system", "content": INSTRUCTIONS},
            {"role": "user", "content": [{"type": "text", "text": "Every day the fox "},
                                         {"type": "text", "text": "ran"}]}]  # fmt: skip
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 5},
                                           "n": {"type": "integer", "maximum": 9}},
          "required": ["name", "n"], "additionalProperties": False}  # fmt: skip
EVENTS = TypeAdapter(ResponseStreamEvent)


@dataclass
class Server:
    model: Path  # the checkpoint with the chat template
    port: int
    engine: str  # the engine's address

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key="any",
                             max_retries=0)

    def post(self, body: dict) -> httpx.Response:
        return httpx.post(f"http://127.0.0.1:{self.port}/v1/responses", json=body, timeout=30)


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[Server]:
    checkpoint = tiny_checkpoint(tmp_path_factory)
    model = tmp_path_factory.mktemp("responses") / MODEL
    model.mkdir()
    for path in checkpoint.iterdir():
        if path.name != "tokenizer_config.json":
            os.symlink(path, model / path.name)
    config = json.loads((checkpoint / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": CHAT_TEMPLATE}))
    port = free_port()
    logs = tmp_path_factory.mktemp("responses-logs")
    flags = (f"--model-name={MODEL}", f"--http-port={port}")
    with engine_and_router(model, logs, ("--block-size", "8", "--num-kv-blocks", "128"), flags) as (
        engine, _,
    ):
        wait_until(lambda: _serving(port), 60, "the router's HTTP port")
        yield Server(model, port, engine.address)


def _serving(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def _prompt_ids(model: Path) -> list[int]:
    """The conversation as transformers renders and tokenizes it."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(model)
    flat = [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": "Every day the fox \nran"}]
    ids = tokenizer.apply_chat_template(flat, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if not isinstance(ids, list) else ids)


def test_create_is_the_chat_completion_and_transformers(server):
    """Greedy, 8 tokens: the chat path's tokens (transformers' continuation of the
    template's prompt), ended by the length limit: status incomplete."""
    client = server.client()
    reply = client.responses.create(model=MODEL, instructions=INSTRUCTIONS, input=INPUT,
                                    max_output_tokens=8, temperature=0)  # fmt: skip
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_completion_tokens=8,
                                          temperature=0, extra_body={"return_token_ids": True})
    prompt = _prompt_ids(server.model)
    hf = transformers.AutoModelForCausalLM.from_pretrained(server.model)
    assert chat.choices[0].token_ids == hf_greedy(hf, prompt, 8)
    assert chat.choices[0].finish_reason == "length"
    assert reply.output_text == chat.choices[0].message.content
    assert (reply.status, reply.incomplete_details.reason) == ("incomplete", "max_output_tokens")
    usage = reply.usage
    assert (usage.input_tokens, usage.output_tokens, usage.total_tokens) == (len(prompt), 8, len(prompt) + 8)
    assert (usage.output_tokens_details.reasoning_tokens, usage.input_tokens_details.cached_tokens >= 0) == (0, True)
    assert reply.id.startswith("resp_") and reply.object == "response" and reply.model == MODEL
    (item,) = reply.output
    assert (item.type, item.role, item.status, item.id[:4]) == ("message", "assistant", "incomplete", "msg_")
    assert [(p.type, p.annotations) for p in item.content] == [("output_text", [])]
    # the raw body is a Response as the SDK's model defines it (every required field)
    raw = server.post({"model": MODEL, "instructions": INSTRUCTIONS, "input": INPUT,
                       "max_output_tokens": 8, "temperature": 0})  # fmt: skip
    assert Response.model_validate(raw.json()).output_text == reply.output_text
    assert raw.json()["instructions"] == INSTRUCTIONS and raw.json()["max_output_tokens"] == 8


def test_a_string_input_is_one_user_message(server):
    client = server.client()
    reply = client.responses.create(model=MODEL, input="Once upon a time", max_output_tokens=5,
                                    temperature=0)  # fmt: skip
    chat = client.chat.completions.create(model=MODEL, max_tokens=5, temperature=0,
                                          messages=[{"role": "user", "content": "Once upon a time"}])
    assert reply.output_text == chat.choices[0].message.content
    assert reply.usage.input_tokens == chat.usage.prompt_tokens


def test_stream_sends_the_documented_event_sequence(server):
    client = server.client()
    kw = dict(model=MODEL, instructions=INSTRUCTIONS, input=INPUT, max_output_tokens=8, temperature=0)
    whole = client.responses.create(**kw)
    events = list(client.responses.create(**kw, stream=True))
    kinds = [e.type for e in events]
    deltas = kinds.count("response.output_text.delta")
    assert deltas >= 1 and kinds == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", *["response.output_text.delta"] * deltas,
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.incomplete",
    ]  # fmt: skip
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == events[-4].text == events[-3].part.text == whole.output_text
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    final = events[-1].response
    assert (final.status, final.output_text, final.id) == ("incomplete", text, events[0].response.id)
    assert final.usage.output_tokens == 8 and final.usage.input_tokens == whole.usage.input_tokens
    assert events[-2].item.content[0].text == text and events[2].item.content == []


def test_raw_stream_frames_each_event_with_its_type(server):
    body = {"model": MODEL, "input": "Once upon a time", "max_output_tokens": 3, "stream": True}
    with httpx.stream("POST", f"http://127.0.0.1:{server.port}/v1/responses", json=body,
                      timeout=30) as reply:  # fmt: skip
        assert reply.status_code == 200
        assert reply.headers["content-type"].startswith("text/event-stream")
        raw = reply.read().decode()
    frames = raw.split("\n\n")
    assert frames[-1] == ""  # no [DONE]: the Responses API ends with the terminal event
    for frame in frames[:-1]:
        kind, data = frame.split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert kind == f"event: {event['type']}"
        EVENTS.validate_python(event)  # the SDK's own event types, every required field


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_json_schema_format_is_chats_structured_output(server, stream):
    """text.format json_schema holds the output to the schema, token-exact with chat's
    response_format; the grammar ends the output, so the response is completed."""
    client = server.client()
    fmt = {"type": "json_schema", "name": "thing", "schema": SCHEMA, "strict": True}
    kw = dict(model=MODEL, input=INPUT, instructions=INSTRUCTIONS, max_output_tokens=60,
              temperature=0, text={"format": fmt})  # fmt: skip
    if stream:
        final = list(client.responses.create(**kw, stream=True))[-1]
        assert final.type == "response.completed"
        reply = final.response
    else:
        reply = client.responses.create(**kw)
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=60, temperature=0,
                                          response_format={"type": "json_schema", "json_schema": {
                                              "name": "thing", "schema": SCHEMA, "strict": True}})
    assert (reply.status, chat.choices[0].finish_reason) == ("completed", "stop")
    assert reply.incomplete_details is None and reply.output[0].status == "completed"
    assert reply.output_text == chat.choices[0].message.content
    jsonschema.validate(json.loads(reply.output_text), SCHEMA)
    assert reply.text.format.type == "json_schema" and reply.text.format.name == "thing"


def test_json_object_format(server):
    reply = server.client().responses.create(model=MODEL, input="Once upon a time", temperature=0,
                                             max_output_tokens=60, text={"format": {"type": "json_object"}})
    assert reply.status == "completed"
    assert isinstance(json.loads(reply.output_text), dict)


REFUSALS = {  # body fields -> (param, the message's start)
    "store": ({"store": True}, "store",
              "store: true is not supported: this server stores no responses"),
    "previous_response_id": ({"previous_response_id": "resp_1"}, "previous_response_id",
                             "previous_response_id is not supported: this server stores no responses"),
    "image": ({"input": [{"role": "user", "content": [
        {"type": "input_text", "text": "what is this?"},
        {"type": "input_image", "image_url": "https://example.com/a.png"}]}]},
              "input.0.content.1", "input.0.content.1: input_image parts are not supported"),
    "tools": ({"tools": [{"type": "function", "name": "f", "parameters": {}}]}, "tools",
              "tools and tool_choice are not supported on /v1/responses"),
    "unknown-field": ({"frequency_penalty": 1.0}, "frequency_penalty",
                      "unknown field 'frequency_penalty'"),
    "function-call-output": ({"input": [{"type": "function_call_output", "call_id": "c",
                                         "output": "1"}]},
                             "input.0.type", "input.0: input items of type 'function_call_output'"),
    "tool-role": ({"input": [{"role": "tool", "content": "1"}]}, "input.0.role",
                  "input.0.role must be one of user, system, developer, assistant, got 'tool'"),
    "empty-input": ({"input": []}, "input", "input must be a non-empty string"),
    "truncation": ({"truncation": "auto"}, "truncation", "truncation: auto"),
    "max_output_tokens": ({"max_output_tokens": 0}, "max_output_tokens", "max_output_tokens must be in [1, "),
    "context": ({"max_output_tokens": 1020}, "max_output_tokens",
                "the prompt (25 tokens) + max_output_tokens (1020) exceeds the model's context of 1024"),
    "format-name": ({"text": {"format": {"type": "json_schema", "schema": SCHEMA}}}, "text.format.name",
                    "text.format.name must be a non-empty string"),
    "format-field": ({"text": {"format": {"type": "json_object", "schema": SCHEMA}}}, "text.format.schema",
                     "unknown field 'text.format.schema'"),
    "format-type": ({"text": {"format": {"type": "yaml"}}}, "text.format.type",
                    "text.format.type must be text, json_object or json_schema, got 'yaml'"),
    "schema": ({"text": {"format": {"type": "json_schema", "name": "bad", "schema": {"type": "nonsense"}}}},
               "text.format", "text.format: the JSON schema does not compile"),
}  # fmt: skip


@pytest.mark.parametrize("name", REFUSALS)
def test_what_is_not_served_is_a_400_naming_the_field(server, name):
    fields, param, message = REFUSALS[name]
    reply = server.post({"model": MODEL, "input": "Once upon a time", "max_output_tokens": 4, **fields})
    error = reply.json()["error"]
    assert (reply.status_code, error["type"], error["param"]) == (400, "invalid_request_error", param), error
    assert error["message"].startswith(message), error["message"]


def test_the_client_sees_a_refusal_as_bad_request(server):
    with pytest.raises(openai.BadRequestError) as err:
        server.client().responses.create(model=MODEL, input="hi", store=True)
    assert err.value.body["param"] == "store"


def test_a_client_that_leaves_mid_stream_frees_every_kv_block(server):
    # 300 integers at least, so the output cannot end within hundreds of tokens
    long = {"type": "json_schema", "name": "many", "schema": {"type": "array", "items": {"type": "integer"},
                                                              "minItems": 300}}  # fmt: skip
    body = {"model": MODEL, "input": "The", "max_output_tokens": 900, "stream": True, "text": {"format": long}}
    with httpx.stream("POST", f"http://127.0.0.1:{server.port}/v1/responses", json=body,
                      timeout=30) as reply:  # fmt: skip
        lines = (line for line in reply.iter_lines() if line.startswith("event: "))
        assert next(line for line in lines if line.endswith(".delta")) == "event: response.output_text.delta"
        assert engine_stats(server.engine).num_active_streams == 1  # still generating
    # the connection is closed: the router cancels the engine call within a step
    wait_until(lambda: _idle(server.engine), 30, "the engine to be idle")
    load = engine_stats(server.engine).load
    assert (load.num_free_blocks, load.num_total_blocks) == (127, 127)  # 128, less the null block


def _idle(address: str) -> bool:
    stats = engine_stats(address)
    return (stats.num_active_streams, stats.load.num_running, stats.load.num_waiting) == (0, 0, 0)


# ---- a failure after the stream began (in-process, on the event generator) -------------


def _reply() -> rs.Reply:
    return rs.Reply(rs.ResponsesBody(model=MODEL, input="hi", stream=True), "r1")


async def _collect(first: list, rest) -> list[dict]:
    return [event async for event in rs.events(_reply(), first, rest)]


async def _failing(error: RequestError):
    yield 0, pb.GenerateResponse(text=" more", token_ids=[5])
    raise error


async def test_an_error_mid_stream_is_an_error_event_then_response_failed():
    first = [(0, pb.GenerateResponse(text="Once", token_ids=[4]))]
    error = RequestError(grpc.StatusCode.UNAVAILABLE, "engine 1 went away", "engine_lost")
    events = await _collect(first, _failing(error))
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", "response.output_text.delta", "response.output_text.delta",
        "error", "response.failed",
    ]  # fmt: skip
    assert [e["sequence_number"] for e in events] == list(range(8))
    assert {k: events[-2][k] for k in ("code", "message", "param")} == {
        "code": "engine_lost", "message": "engine 1 went away", "param": None}
    failed = events[-1]["response"]
    assert (failed["status"], failed["error"], failed["output"]) == (
        "failed", {"code": "server_error", "message": "engine 1 went away"}, [])
    for event in events:
        EVENTS.validate_python(event)


async def test_an_aborted_request_ends_as_response_failed():
    async def nothing():
        return
        yield

    last = pb.GenerateResponse(text="x", token_ids=[4], finish_reason=pb.ABORTED,
                               usage=pb.Usage(prompt_tokens=3, completion_tokens=1))
    events = await _collect([(0, last)], nothing())
    assert [e["type"] for e in events][-3:] == ["response.output_text.delta", "error", "response.failed"]
    assert events[-1]["response"]["error"]["code"] == "server_error"
    assert "shutting down" in events[-2]["message"] and events[-2]["code"] == "aborted"
