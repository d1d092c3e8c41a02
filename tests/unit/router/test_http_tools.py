"""Tool calling and the regex / choice / grammar formats on the router, in process
(tests/unit/router/inprocess.py: a scripted engine). What reaches the engine: the
template sees the tools; a named function or `required` becomes the structured_output
schema (vLLM's for required); `auto` and `none` constrain nothing. What comes back: a
scripted hermes output parsed into content and tool_calls, streamed as OpenAI's deltas
that add up to the non-streamed message whatever the steps. Bad tools, tool_choice and
tool turns are 400s naming the field, from the router or (a schema its grammar compiler
refuses) from the engine."""

from __future__ import annotations

import json

import grpc
import pytest
from omnibus.v1 import engine_pb2, inference_pb2
from tokenizers import Tokenizer, models, pre_tokenizers

from omnibus.router.http import bodies, v1_requests
from omnibus.router.http.chat_template import ChatTemplate
from tests.unit.router import inprocess
from tests.unit.router.inprocess import refusal
from tests.unit.router.test_http_vllm_surface import AUTH, TENANTS, serve

# The prompt starts with TOOLS' word when the template is given tools.
TEMPLATE = ("{% if tools %}TOOLS {{ tools | length }} {% endif %}"
            "{% for m in messages %}{{ m.content }} {% endfor %}")
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time"}}]  # no parameters
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 40, "tools": TOOLS}
# What the scripted engine says (one word a token; the tokenizer joins words with spaces).
WORDS = ["Sure.", "<tool_call>", '{"name":', '"get_time",', '"arguments":', "{}}", "</tool_call>",
         "<tool_call>", '{"name":', '"get_weather",', '"arguments":', '{"city":', '"Oslo"}}',
         "</tool_call>", "<tool_call>", "{broken", "</tool_call>"]  # fmt: skip
NAMED = ['{"city":', '"Oslo"}']  # get_weather's arguments
REQUIRED = ['[{"name":', '"get_weather",', '"parameters":', '{"city":', '"Oslo"}},', '{"name":',
            '"get_time",', '"parameters":', "{}}]"]  # fmt: skip


def script_tokenizer() -> Tokenizer:
    words = dict.fromkeys(WORDS + NAMED + REQUIRED)
    vocab = {"w0": 0, "TOOLS": 1, **{w: i + 2 for i, w in enumerate(words)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return tokenizer


@pytest.fixture
async def setup(tmp_path, monkeypatch):
    monkeypatch.setattr(inprocess, "word_tokenizer", script_tokenizer)
    router = await inprocess.Router(tmp_path, TENANTS).start()
    front, client = await serve(router, ChatTemplate(TEMPLATE, {}))
    yield router, client
    await client.close()
    await router.close()


def script(router, words: list[str], per_step: int) -> None:
    """The engine answers every request with `words`, `per_step` tokens a message, then
    stops (a last token, w0, for the stop token, which the text leaves out)."""
    vocab = script_tokenizer().get_vocab()
    ids = [vocab[w] for w in words] + [0]

    async def generate(request, timeout=None):
        router.engine.requests.append(request)
        for at in range(0, len(ids), per_step):
            last = at + per_step >= len(ids)
            yield engine_pb2.EngineGenerateResponse(
                token_ids=ids[at:at + per_step], num_output_tokens=min(at + per_step, len(ids)),
                finish_reason=inference_pb2.STOP if last else inference_pb2.FINISH_REASON_UNSPECIFIED,
                num_prompt_tokens=len(request.prompt_token_ids))

    router.engine.generate = generate


async def post(client, body: dict) -> dict:
    reply = await client.post("/v1/chat/completions", headers=AUTH, json=body)
    assert reply.status == 200, await reply.text()
    return await reply.json()


async def stream(client, body: dict) -> list[dict]:
    reply = await client.post("/v1/chat/completions", headers=AUTH, json={**body, "stream": True})
    assert reply.status == 200, await reply.text()
    events = [line[6:] for line in (await reply.text()).split("\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def added_up(chunks: list[dict]) -> dict:
    """A stream's deltas as a client adds them up into a message (calls by index)."""
    content, calls, finish = "", {}, None
    for chunk in chunks:
        (choice,) = chunk["choices"]
        content += choice["delta"].get("content") or ""
        for delta in choice["delta"].get("tool_calls", []):
            if "id" in delta:  # a call's first delta names it; its arguments follow
                assert delta["type"] == "function" and delta["function"]["arguments"] == ""
                calls[delta["index"]] = {"name": delta["function"]["name"], "arguments": ""}
            else:
                assert set(delta) == {"index", "function"}
                calls[delta["index"]]["arguments"] += delta["function"]["arguments"]
        finish = choice["finish_reason"] or finish
    return {"content": content or None, "calls": [calls[i] for i in sorted(calls)], "finish": finish}


@pytest.mark.parametrize("per_step", [1, 2, 3, 5, 100])
async def test_auto_parses_hermes_calls_and_the_stream_adds_up_to_the_message(setup, per_step):
    router, client = setup
    script(router, WORDS, per_step)
    reply = await post(client, CHAT)
    (choice,) = reply["choices"]
    message = choice["message"]
    calls = [{"name": "get_time", "arguments": "{}"}, {"name": "get_weather", "arguments": '{"city": "Oslo"}'}]
    # the malformed block after the calls is content, as is the text before them (the
    # tokenizer puts a space before each word)
    assert message["content"] == " Sure.  <tool_call> {broken </tool_call>"
    assert [c["function"] for c in message["tool_calls"]] == calls
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in message["tool_calls"])
    assert len({c["id"] for c in message["tool_calls"]}) == 2
    assert choice["finish_reason"] == "tool_calls"
    assert not router.engine.requests[-1].sampling.HasField("structured_output")
    assert added_up(await stream(client, CHAT)) == {
        "content": message["content"], "calls": calls, "finish": "tool_calls"}


async def test_each_choice_has_its_own_calls(setup):
    router, client = setup
    script(router, WORDS, 2)
    body = {**CHAT, "n": 2}
    reply = await post(client, body)
    assert [len(c["message"]["tool_calls"]) for c in reply["choices"]] == [2, 2]
    chunks = await stream(client, body)
    for index in (0, 1):
        mine = [{**c, "choices": [ch]} for c in chunks for ch in c["choices"] if ch["index"] == index]
        assert added_up(mine)["calls"] == [c["function"] for c in reply["choices"][index]["message"]["tool_calls"]]
        assert added_up(mine)["content"] == reply["choices"][index]["message"]["content"]


async def test_auto_without_calls_is_plain_chat_and_parallel_false_keeps_one_call(setup):
    router, client = setup
    script(router, ["Sure.", "<tool_call>"], 1)  # a block that never closes nor parses: text
    (choice,) = (await post(client, CHAT))["choices"]
    assert choice["message"] == {"role": "assistant", "content": " Sure. <tool_call>", "refusal": None}
    assert choice["finish_reason"] == "stop"
    script(router, WORDS[:14], 2)
    body = {**CHAT, "parallel_tool_calls": False}
    (choice,) = (await post(client, body))["choices"]
    assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == ["get_time"]
    assert added_up(await stream(client, body))["calls"] == [{"name": "get_time", "arguments": "{}"}]


async def test_tool_choice_none_renders_the_tools_and_parses_nothing(setup):
    router, client = setup
    script(router, WORDS[:7], 1)
    (choice,) = (await post(client, {**CHAT, "tool_choice": "none"}))["choices"]
    assert choice["message"]["content"] == ' Sure. <tool_call> {"name": "get_time", "arguments": {}} </tool_call>'
    assert "tool_calls" not in choice["message"] and choice["finish_reason"] == "stop"
    assert router.engine.requests[-1].prompt_token_ids[0] == 1  # TOOLS: the template saw them
    await post(client, {**CHAT, "tools": None})
    assert router.engine.requests[-1].prompt_token_ids[0] == 0


async def test_tokenize_renders_the_tools_as_chat_does(setup):
    router, client = setup
    script(router, ["w0"], 1)
    await post(client, CHAT)
    reply = await client.post("/tokenize", headers=AUTH, json={
        "messages": CHAT["messages"], "tools": TOOLS})
    assert (await reply.json())["tokens"] == list(router.engine.requests[-1].prompt_token_ids)
    assert (await reply.json())["tokens"][0] == 1  # TOOLS
    reply = await client.post("/tokenize", headers=AUTH, json={"prompt": "hi", "tools": TOOLS})
    assert (reply.status, (await reply.json())["error"]["param"]) == (400, "tools")
    reply = await client.post("/tokenize", headers=AUTH, json={
        "messages": CHAT["messages"], "tools": [{"type": "function", "function": {"name": ""}}]})
    assert (reply.status, (await reply.json())["error"]["param"]) == (400, "tools.0.function.name")


def required_schema(parallel: bool) -> dict:
    """vLLM's schema for tool_choice required."""
    out = {"type": "array", "minItems": 1}
    if not parallel:
        out["maxItems"] = 1
    out["items"] = {"type": "object", "anyOf": [
        {"properties": {"name": {"type": "string", "enum": ["get_weather"]}, "parameters": WEATHER},
         "required": ["name", "parameters"]},
        {"properties": {"name": {"type": "string", "enum": ["get_time"]},
                        "parameters": {"type": "object", "properties": {}}},
         "required": ["name", "parameters"]}]}
    return out


@pytest.mark.parametrize(("fields", "schema"), [
    ({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, WEATHER),
    ({"tool_choice": {"type": "function", "function": {"name": "get_time"}}},
     {"type": "object", "properties": {}}),
    ({"tool_choice": "required"}, required_schema(True)),
    ({"tool_choice": "required", "parallel_tool_calls": False}, required_schema(False)),
])  # fmt: skip
async def test_forced_tool_choice_is_the_engines_structured_output(setup, fields, schema):
    router, client = setup
    script(router, ["w0"], 1)
    await post(client, {**CHAT, **fields})
    sampling = router.engine.requests[-1].sampling
    assert json.loads(sampling.structured_output.json_schema) == schema
    assert sampling.structured_output.json_schema == json.dumps(schema)  # key order kept


async def test_a_named_function_streams_its_arguments_as_they_come(setup):
    router, client = setup
    script(router, NAMED, 1)
    body = {**CHAT, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    (choice,) = (await post(client, body))["choices"]
    assert choice["message"]["content"] is None and choice["finish_reason"] == "tool_calls"
    arguments = ' {"city": "Oslo"}'  # the output itself (this tokenizer's words start with a space)
    assert [c["function"] for c in choice["message"]["tool_calls"]] == [
        {"name": "get_weather", "arguments": arguments}]
    chunks = await stream(client, body)
    assert [c["choices"][0]["delta"].get("tool_calls", [{}])[0].get("function") for c in chunks] == [
        None, {"name": "get_weather", "arguments": ""}, {"arguments": ' {"city":'},
        {"arguments": ' "Oslo"}'}, None]
    assert added_up(chunks)["calls"] == [{"name": "get_weather", "arguments": arguments}]


async def test_the_required_array_becomes_calls_and_cut_short_is_content(setup):
    router, client = setup
    script(router, REQUIRED, 2)
    body = {**CHAT, "tool_choice": "required"}
    (choice,) = (await post(client, body))["choices"]
    calls = [{"name": "get_weather", "arguments": '{"city": "Oslo"}'}, {"name": "get_time", "arguments": "{}"}]
    assert [c["function"] for c in choice["message"]["tool_calls"]] == calls
    assert (choice["message"]["content"], choice["finish_reason"]) == (None, "tool_calls")
    assert added_up(await stream(client, body)) == {"content": None, "calls": calls, "finish": "tool_calls"}
    script(router, REQUIRED[:-1], 2)  # (max_tokens cuts a real one so)
    (choice,) = (await post(client, body))["choices"]
    text = ' [{"name": "get_weather", "parameters": {"city": "Oslo"}}, {"name": "get_time", "parameters":'
    assert (choice["message"], choice["finish_reason"]) == (
        {"role": "assistant", "content": text, "refusal": None}, "stop")
    assert added_up(await stream(client, body)) == {"content": text, "calls": [], "finish": "stop"}


@pytest.mark.parametrize(("fields", "param", "message"), [
    ({"tool_choice": "auto", "tools": None}, "tool_choice", "tool_choice auto needs tools"),
    ({"tool_choice": {"type": "function", "function": {"name": "f"}}, "tools": []}, "tool_choice",
     "tool_choice 'f' needs tools"),
    ({"tool_choice": "always"}, "tool_choice", "tool_choice must be none, auto, required or"),
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name",
     "tool_choice names function 'nope', which tools does not define (it has get_weather, get_time)"),
    ({"tool_choice": {"type": "function", "function": {"name": "f", "x": 1}}},
     "tool_choice.function.x", "unknown field 'tool_choice.function.x'"),
    ({"tool_choice": {"type": "tool", "function": {"name": "f"}}}, "tool_choice.type",
     "tool_choice.type must be \"function\", got 'tool'"),
    ({"tools": [{"type": "function"}]}, "tools.0.function",
     "tools.0.function must be an object with name"),
    ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools.0.type",
     "tools.0.type must be \"function\", got 'retrieval'"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools.0.function.name",
     "tools.0.function.name must be 1 to 64 letters, digits, _ or -, got 'a b'"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools.1.function.name",
     "tools.1.function.name: 'get_weather' is also tools.0's name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "{}"}}]},
     "tools.0.function.parameters", "tools.0.function.parameters must be a JSON Schema object, got str"),
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": 1}}]},
     "tools.0.function.strict", "tools.0.function.strict must be a bool, got int"),
    ({"tools": ["f"]}, "tools.0", "tools.0: Input should be a valid dictionary"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format",
     "tool_choice and response_format both set the output's format; set one"),
    ({"tool_choice": "required", "tools": [
        {"type": "function", "function": {"name": "a", "parameters": {"$defs": {"x": {"type": "integer"}}}}},
        {"type": "function", "function": {"name": "b", "parameters": {"$defs": {"x": {"type": "string"}}}}}]},
     "tools.1.function.parameters", "tools.1.function.parameters.$defs.x differs from another tool's"),
    ({"messages": [{"role": "tool", "content": "Sunny"}]}, "messages.0.tool_call_id",
     "messages.0.tool_call_id is required for a tool message"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {
        "name": "f", "arguments": "{nope"}}]}]}, "messages.0.tool_calls.0.function.arguments",
     "messages.0.tool_calls.0.function.arguments is not JSON"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f",
                                                                                 "arguments": "[1]"}}]}]},
     "messages.0.tool_calls.0.function.arguments",
     "messages.0.tool_calls.0.function.arguments must be a JSON object"),
    ({"messages": [{"role": "assistant", "tool_calls": {"id": "c"}}]}, "messages.0.tool_calls",
     "messages.0.tool_calls must be a list of tool calls"),
])  # fmt: skip
async def test_bad_tools_are_400_naming_the_field(setup, fields, param, message):
    router, client = setup
    body = {k: v for k, v in {**CHAT, **fields}.items() if v is not None}
    reply = await client.post("/v1/chat/completions", headers=AUTH, json=body)
    error = (await reply.json())["error"]
    assert (reply.status, error["param"]) == (400, param), error
    assert error["message"].startswith(message), error
    assert router.engine.requests == []


async def test_tool_turns_reach_the_template_with_their_arguments_as_objects(setup):
    router, client = setup
    template = ChatTemplate("{% for m in messages %}{% for c in m.tool_calls or [] %}"
                            "{{ c.function.arguments.city }} {% endfor %}{{ m.tool_call_id }} {% endfor %}", {})
    body = bodies.parse(bodies.ChatBody, json.dumps({**CHAT, "messages": [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "Sunny"}]}).encode())  # fmt: skip
    assert template.render([m.for_template(i) for i, m in enumerate(body.messages)]) == "Oslo  c1 "


@pytest.mark.parametrize("tool_choice", [{"type": "function", "function": {"name": "get_weather"}},
                                         "required"])
async def test_a_schema_the_engine_cannot_compile_is_400_naming_the_tool(setup, tool_choice):
    router, client = setup
    router.engine.error = refusal(grpc.StatusCode.INVALID_ARGUMENT,
                                  "structured_output: the JSON schema does not compile: bad $ref")
    reply = await client.post("/v1/chat/completions", headers=AUTH, json={**CHAT, "tool_choice": tool_choice})
    error = (await reply.json())["error"]
    field = "tools" if tool_choice == "required" else "tools.0.function.parameters"
    assert (reply.status, error["param"], error["message"]) == (
        400, field, f"{field}: the JSON schema does not compile: bad $ref")


# ---- regex / choice / grammar (vLLM's spellings) -------------------------------------

GRAMMAR = 'root ::= "yes" | "no"'


@pytest.mark.parametrize(("fields", "expected", "field"), [
    ({"structured_outputs": {"regex": "[a-z]+"}}, {"regex": "[a-z]+"}, "structured_outputs"),
    ({"guided_regex": "[a-z]+"}, {"regex": "[a-z]+"}, "guided_regex"),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, {"choice": ["yes", "no"]}, "structured_outputs"),
    ({"guided_choice": ["yes", "no"]}, {"choice": ["yes", "no"]}, "guided_choice"),
    ({"structured_outputs": {"grammar": GRAMMAR}}, {"grammar": GRAMMAR}, "structured_outputs"),
    ({"guided_grammar": GRAMMAR}, {"grammar": GRAMMAR}, "guided_grammar"),
    ({"structured_outputs": {"json_object": False, "regex": "a"}}, {"regex": "a"}, "structured_outputs"),
])  # fmt: skip
@pytest.mark.parametrize("kind", [bodies.ChatBody, bodies.CompletionBody])
def test_regex_choice_and_grammar_become_the_proto_fields(kind, fields, expected, field):
    base = {"model": "m", "messages": [{"role": "user", "content": "x"}]} if kind is bodies.ChatBody else {
        "model": "m", "prompt": "x"}
    body = bodies.parse(kind, json.dumps({**base, **fields}).encode())
    fmt, named = v1_requests.structured_output(body)
    which = fmt.WhichOneof("format")
    value = list(fmt.choice.options) if which == "choice" else getattr(fmt, which)
    assert ({which: value}, named) == (expected, field)
    params = v1_requests.sampling(body, 4, None)
    assert params.structured_output == fmt


@pytest.mark.parametrize(("fields", "param", "message"), [
    ({"structured_outputs": {"regex": ""}}, "structured_outputs.regex",
     "structured_outputs.regex must be a regular expression, as a non-empty string"),
    ({"guided_regex": 5}, "guided_regex", "guided_regex: Input should be a valid string"),
    ({"guided_choice": []}, "guided_choice", "guided_choice must be a non-empty list of strings"),
    ({"guided_choice": ["a", ""]}, "guided_choice.1", "guided_choice.1 must be a non-empty string"),
    ({"structured_outputs": {"choice": "a"}}, "structured_outputs.choice",
     "structured_outputs.choice must be a non-empty list of strings"),
    ({"structured_outputs": {"grammar": ["root"]}}, "structured_outputs.grammar",
     "structured_outputs.grammar must be a grammar (EBNF with rule root, or Lark with rule start), as a non-empty string"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs",
     "structured_outputs sets both regex and choice; set one"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice",
     "guided_regex and guided_choice both set the output's format; set one"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag",
     "structured_outputs.structural_tag is not supported; use one of json, json_object, regex, "
     "choice, grammar"),
])  # fmt: skip
def test_bad_regex_choice_and_grammar_are_refused_naming_the_field(fields, param, message):
    from omnibus.router.service.errors import RequestError
    with pytest.raises(RequestError) as err:
        body = bodies.parse(bodies.CompletionBody, json.dumps({"model": "m", "prompt": "x", **fields}).encode())
        v1_requests.structured_output(body)
    assert err.value.param == param
    assert err.value.message.startswith(message), err.value.message
