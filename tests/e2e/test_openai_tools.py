"""Tool calling on /v1/chat/completions over real processes (one engine, one router with a
Hermes-style chat template that renders `tools` and tool-call turns), driven by the
official `openai` client. Greedy and token-exact against transformers: the prompt is
transformers' apply_chat_template with the same tools and messages (an assistant's
tool_calls and a tool's answer included); a named function's arguments, and tool_choice
required's calls, are `generate` with xgrammar's Hugging Face logits processor for the
schema the router builds (vLLM's for required); `auto` is plain greedy output, and with
a regex that makes the model write hermes blocks, those blocks parsed into calls.
Streamed deltas add up to the non-streamed message; bad tools and tool_choice are 400s
naming the field. vLLM's regex, choice and grammar fields on /v1/completions are
token-exact with xgrammar's processor for the same language."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import jsonschema
import openai
import pytest
import transformers

from omnibus.router.http.chat_template import ChatTemplate
from tests.checkpoints import hf_greedy, load_hf
from tests.grpc_helpers import ServerProcess, engine_process, free_port, router_process, tiny_checkpoint

xgr = pytest.importorskip("xgrammar")

MODEL = "tiny-tools"
EOS = 2
WHITESPACE = 1  # the engine's --structured-max-whitespace (the random model pads otherwise)
MAX_TOKENS = 48
TOOL_TEMPLATE = (
    "{{ bos_token }}{% if tools %}<|system|>Tools:{% for t in tools %}\n{{ t | tojson }}{% endfor %}"
    "{{ eos_token }}{% endif %}{% for m in messages %}"
    "{% if m.role == 'assistant' and m.tool_calls %}<|assistant|>{% for c in m.tool_calls %}"
    '<tool_call>{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}'
    "</tool_call>{% endfor %}"
    "{% elif m.role == 'tool' %}<|tool|>{{ m.tool_call_id }}: {{ m.content }}"
    "{% else %}<|{{ m.role }}|>{{ m.content }}{% endif %}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 9}},
           "required": ["city", "days"]}
TIME = {"type": "object", "properties": {"zone": {"enum": ["CET", "UTC"]}}, "required": ["zone"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The forecast",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]  # fmt: skip
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]
# A conversation with an earlier call and its answer (the template renders both).
HISTORY = MESSAGES + [
    {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "Sunny"},
]  # fmt: skip


@dataclass
class Served:
    model: Path
    chat_model: Path
    http: int
    hf: object
    tokenizer: object  # transformers', with the template
    compiler: object  # xgrammar's, for the tokenizer

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"http://127.0.0.1:{self.http}/v1", api_key="none", max_retries=0)

    def prompt(self, messages: list[dict], tools: list[dict] | None = TOOLS) -> list[int]:
        """The prompt as transformers renders and tokenizes it: an assistant's arguments as
        the object they hold, as transformers documents them."""
        flat = [{**m, "tool_calls": [{**c, "function": {**c["function"], "arguments": json.loads(
            c["function"]["arguments"])}} for c in m["tool_calls"]]} if m.get("tool_calls") else m
            for m in messages]  # fmt: skip
        text = self.tokenizer.apply_chat_template(flat, tools=tools, add_generation_prompt=True,
                                                  tokenize=False)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def generate(self, prompt: list[int], schema: dict | object | None,
                 max_tokens: int = MAX_TOKENS) -> list[int]:
        """transformers' greedy output: under xgrammar's processor for `schema` (a JSON
        schema or a compiled grammar; to EOS), or free (ignoring EOS, as max_tokens cuts
        the router's)."""
        grammar = schema if not isinstance(schema, dict) else self.compiler.compile_json_schema(
            json.dumps(schema, ensure_ascii=False), max_whitespace_cnt=WHITESPACE)
        return hf_greedy(self.hf, prompt, max_tokens, grammar, EOS)

    def text(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)  # as the router's text


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Iterator[Served]:
    model = tiny_checkpoint(tmp_path_factory)
    chat_model = tmp_path_factory.mktemp("tools") / MODEL
    chat_model.mkdir()
    for name in ("config.json", "tokenizer.json"):
        os.symlink(model / name, chat_model / name)
    config = json.loads((model / "tokenizer_config.json").read_text())
    (chat_model / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TOOL_TEMPLATE}))
    logs = tmp_path_factory.mktemp("logs")
    http = free_port()
    engine = engine_process(model, logs, "engine", "--block-size", "8", "--num-kv-blocks", "128",
                            "--structured-max-whitespace", str(WHITESPACE))
    router = router_process(chat_model, [engine.address], logs, "router", f"--model-name={MODEL}",
                            f"--http-port={http}", "--tool-call-parser=hermes")
    procs: list[ServerProcess] = [engine, router]
    try:
        for proc in procs:
            proc.wait_serving()
        tokenizer = transformers.AutoTokenizer.from_pretrained(chat_model)
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=384, stop_token_ids=[EOS])
        yield Served(model, chat_model, http, load_hf(model), tokenizer, xgr.GrammarCompiler(info))
    finally:
        for proc in reversed(procs):
            proc.stop()


def test_the_router_renders_tools_and_tool_turns_as_transformers(served):
    ours = ChatTemplate(TOOL_TEMPLATE, {"bos_token": "<s>", "eos_token": "</s>"})
    from omnibus.router.http import bodies
    body = bodies.parse(bodies.ChatBody, json.dumps({"model": MODEL, "messages": HISTORY, "tools": TOOLS}).encode())
    text = ours.render([m.for_template(i) for i, m in enumerate(body.messages)], True, TOOLS)
    assert served.tokenizer(text, add_special_tokens=False)["input_ids"] == served.prompt(HISTORY)
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}</tool_call>' in text


def calls_of(message) -> list[tuple[str, str]]:
    return [(c.function.name, c.function.arguments) for c in message.tool_calls or []]


def streamed(client: openai.OpenAI, **kw) -> tuple[str, list[tuple[str, str]], str, list[str]]:
    """A stream's content, calls (name, arguments), finish reason and call ids, from its
    deltas as a client adds them up (by index)."""
    content, calls, ids, finish = "", {}, {}, None
    for chunk in client.chat.completions.create(**kw, stream=True):
        (choice,) = chunk.choices
        content += choice.delta.content or ""
        for delta in choice.delta.tool_calls or []:
            if delta.id is not None:  # a call's first delta: id, type, name
                assert delta.index not in calls and delta.type == "function"
                ids[delta.index] = delta.id
                calls[delta.index] = [delta.function.name, delta.function.arguments]
                assert delta.function.arguments == ""
            else:
                calls[delta.index][1] += delta.function.arguments
        finish = choice.finish_reason or finish
    return content, [tuple(calls[i]) for i in sorted(calls)], finish, [ids[i] for i in sorted(ids)]


def test_a_named_function_is_xgrammar_in_transformers_and_streams_the_same(served):
    client, messages = served.client(), HISTORY
    kw = dict(model=MODEL, messages=messages, tools=TOOLS, max_tokens=MAX_TOKENS, temperature=0,
              tool_choice={"type": "function", "function": {"name": "get_weather"}})
    expected = served.generate(served.prompt(messages), WEATHER)
    assert expected[-1] == EOS  # a whole value (else the comparison below checks a cut one)
    reply = client.chat.completions.create(**kw, extra_body={"return_token_ids": True})
    (choice,) = reply.choices
    assert choice.token_ids == expected
    assert choice.message.content is None and choice.finish_reason == "tool_calls"
    assert calls_of(choice.message) == [("get_weather", served.text(expected))]
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert set(json.loads(call.function.arguments)) == {"city", "days"}
    assert reply.usage.prompt_tokens == len(served.prompt(messages))
    content, calls, finish, ids = streamed(client, **kw)
    assert (content, calls, finish) == ("", calls_of(choice.message), "tool_calls")
    assert ids[0].startswith("call_") and ids[0] != call.id


def test_sampled_arguments_with_a_length_bounded_string_are_strict_json(served):
    """(xgrammar 0.2.8 let a string with maxLength take raw control characters, which the
    engine works around: engine/omnibus/engine/worker/json_schema.py)"""
    note = {"type": "object", "properties": {"text": {"type": "string", "maxLength": 12}},
            "required": ["text"]}
    tools = [{"type": "function", "function": {"name": "note", "parameters": note}}]
    reply = served.client().chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=tools, max_tokens=MAX_TOKENS, temperature=1.5,
        seed=1, n=8, tool_choice={"type": "function", "function": {"name": "note"}})
    for choice in reply.choices:
        assert choice.finish_reason == "tool_calls"
        (call,) = choice.message.tool_calls
        jsonschema.validate(json.loads(call.function.arguments), note)  # strict: no raw controls


def test_required_is_vllms_array_schema_and_streams_the_same(served):
    """(parallel_tool_calls false: its maxItems 1 is the one difference; the schema with
    parallel calls is checked in tests/unit/router/test_http_tools.py)"""
    client, parallel = served.client(), False
    kw = dict(model=MODEL, messages=HISTORY, tools=TOOLS, max_tokens=2 * MAX_TOKENS, temperature=0,
              tool_choice="required", parallel_tool_calls=parallel)
    # vLLM's schema for required (one call at most without parallel calls)
    schema = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": [
        {"properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},
                        "parameters": t["function"]["parameters"]},
         "required": ["name", "parameters"]} for t in TOOLS]}}  # fmt: skip
    if not parallel:
        schema = {"type": "array", "minItems": 1, "maxItems": 1, "items": schema["items"]}
    expected = served.generate(served.prompt(HISTORY), schema, 2 * MAX_TOKENS)
    assert expected[-1] == EOS
    items = json.loads(served.text(expected))
    reply = client.chat.completions.create(**kw, extra_body={"return_token_ids": True})
    (choice,) = reply.choices
    assert choice.token_ids == expected
    assert calls_of(choice.message) == [(i["name"], json.dumps(i["parameters"])) for i in items]
    assert len(items) >= 1 and choice.message.content is None and choice.finish_reason == "tool_calls"
    content, calls, finish, _ = streamed(client, **kw)
    assert (content, calls, finish) == ("", calls_of(choice.message), "tool_calls")


def test_auto_is_free_greedy_output_with_the_tools_in_the_prompt(served):
    """The random model writes no <tool_call>: its text is the content, as without tools,
    token for token with transformers on the prompt that shows the tools."""
    client = served.client()
    prompt = served.prompt(HISTORY)
    assert prompt != served.prompt(HISTORY, tools=None)  # the tools are in it
    expected = served.generate(prompt, None)[:12]
    kw = dict(model=MODEL, messages=HISTORY, tools=TOOLS, max_tokens=12, temperature=0)
    reply = client.chat.completions.create(**kw, extra_body={"return_token_ids": True, "ignore_eos": True})
    (choice,) = reply.choices
    assert "<tool_call>" not in choice.message.content
    assert (choice.token_ids, choice.message.content, choice.finish_reason) == (
        expected, served.text(expected), "length")
    assert not choice.message.tool_calls
    content, calls, finish, _ = streamed(client, **kw, extra_body={"ignore_eos": True})
    assert (content, calls, finish) == (choice.message.content, [], "length")


def test_auto_parses_the_calls_a_real_model_writes(served):
    """A regex makes the random model write hermes blocks (the zone and the text after
    are its choice): the router's auto parse of real BPE tokens, streamed and not."""
    client = served.client()
    regex = (r'Ok\.\n<tool_call>\{"name": "get_time", "arguments": \{"zone": "(CET|UTC)"\}\}'
             r"</tool_call>\n<tool_call>\{(fox|dog)</tool_call>")
    expected = served.generate(served.prompt(MESSAGES), served.compiler.compile_regex(regex), 200)
    assert expected[-1] == EOS
    text = served.text(expected)
    zone = re.search(r'"zone": "(\w+)"', text)[1]
    kw = dict(model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=200, temperature=0,
              extra_body={"guided_regex": regex, "return_token_ids": True})
    (choice,) = client.chat.completions.create(**kw).choices
    assert choice.token_ids == expected
    assert calls_of(choice.message) == [("get_time", json.dumps({"zone": zone}))]
    # the text before the call, and the malformed block after it, are content
    assert choice.message.content == "Ok.\n" + text[text.rindex("\n"):]
    assert choice.finish_reason == "tool_calls"
    content, calls, finish, _ = streamed(client, **kw)
    assert (content, calls, finish) == (choice.message.content, calls_of(choice.message), "tool_calls")


@pytest.mark.parametrize(("fields", "param", "message"), [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name",
     "tool_choice names function 'nope', which tools does not define (it has get_weather, get_time)"),
    ({"tools": None, "tool_choice": "required"}, "tool_choice",
     "tool_choice required needs tools: send the functions in tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}]},
     "tools.0.function.parameters", "tools.0.function.parameters must be a JSON Schema object, got list"),
    # a schema the engine's grammar compiler refuses, named as the tool's parameters
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}],
      "tool_choice": {"type": "function", "function": {"name": "f"}}}, "tools.0.function.parameters",
     "tools.0.function.parameters: the JSON schema does not compile"),
])  # fmt: skip
def test_bad_tools_are_400_naming_the_field(served, fields, param, message):
    kw = {"model": MODEL, "messages": MESSAGES, "tools": TOOLS, "max_tokens": 4, **fields}
    kw = {k: v for k, v in kw.items() if v is not None}
    with pytest.raises(openai.BadRequestError) as err:
        served.client().chat.completions.create(**kw)
    assert err.value.body["param"] == param
    assert err.value.body["message"].startswith(message), err.value.body["message"]


# ---- regex / choice / grammar (vLLM's fields) -----------------------------------------

REGEX = "(Paris|Oslo), [1-9] days"
CHOICES = ["fox", "dog", "owl"]
GRAMMAR = 'root ::= "The " animal " ran " [0-9] [0-9]? " miles"\nanimal ::= "fox" | "dog"'


@pytest.mark.parametrize(("fields", "grammar"), [
    ({"guided_regex": REGEX}, lambda c: c.compile_regex(REGEX)),
    ({"structured_outputs": {"choice": CHOICES}}, lambda c: c.compile_grammar(
        "root ::= " + " | ".join(json.dumps(o) for o in CHOICES))),
    ({"structured_outputs": {"grammar": GRAMMAR}}, lambda c: c.compile_grammar(GRAMMAR)),
], ids=["regex", "choice", "grammar"])  # fmt: skip
def test_regex_choice_and_grammar_are_xgrammar_in_transformers(served, fields, grammar):
    """Over HTTP as vLLM's clients send them, on /v1/completions: token-exact with
    transformers under xgrammar's processor for the same language."""
    prompt = [5, 17, 33, 101]
    expected = served.generate(prompt, grammar(served.compiler))
    assert expected[-1] == EOS
    reply = served.client().completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                               extra_body={"return_token_ids": True, **fields})
    (choice,) = reply.choices
    assert (choice.token_ids, choice.text, choice.finish_reason) == (expected, served.text(expected), "stop")
    if "guided_regex" in fields:
        assert re.fullmatch(REGEX, choice.text)
    elif "choice" in fields["structured_outputs"]:
        assert choice.text in CHOICES


def test_a_regex_the_engine_cannot_compile_is_400_naming_the_field(served):
    with pytest.raises(openai.BadRequestError) as err:
        served.client().completions.create(model=MODEL, prompt=[5, 6], max_tokens=4,
                                           extra_body={"structured_outputs": {"regex": "(unclosed"}})
    assert err.value.body["param"] == "structured_outputs"
    assert err.value.body["message"].startswith(
        "structured_outputs: the regular expression does not compile"), err.value.body["message"]
