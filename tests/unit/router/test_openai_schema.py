"""OpenAI bodies that are valid JSON but not Unicode text, and handler failures, come back
as OpenAI JSON errors a client can act on, never as aiohttp's plain-text 500."""

import json

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from omnibus.router.http import bodies, shapes, v1_requests
from omnibus.router.http.app import _json_errors
from omnibus.router.service.errors import RequestError


@pytest.mark.parametrize(("raw", "where"), [
    (rb'{"model": "m", "prompt": "hi \ud800 there"}', "prompt"),
    (rb'{"model": "m", "prompt": "x", "stop": ["a", "\uDFFF"]}', "stop.1"),
    (rb'{"model": "m", "prompt": "x", "user": "\udc00"}', "user"),
    (rb'{"model": "m", "prompt": "x", "\ud800": 1}', "body"),
])  # fmt: skip
def test_a_lone_surrogate_is_refused_naming_its_field(raw, where):
    with pytest.raises(RequestError) as err:
        bodies.parse(bodies.CompletionBody, raw)
    assert err.value.message.startswith(f"{where}: the string holds a lone UTF-16 surrogate")


def test_a_lone_surrogate_in_a_chat_message_is_refused():
    with pytest.raises(RequestError) as err:
        bodies.parse(bodies.ChatBody, rb'{"model": "m", "messages": [{"role": "user", "content": "\udc00"}]}')
    assert err.value.message.startswith("messages.0.content: the string holds a lone UTF-16")


def test_a_surrogate_pair_and_an_escaped_backslash_are_text():
    body = bodies.parse(bodies.CompletionBody, rb'{"model": "m", "prompt": "ok \ud83d\ude00 \\ud800"}')
    assert body.prompt == "ok \U0001f600 \\ud800"


@pytest.mark.parametrize(("raw", "message", "param"), [
    # a value of the wrong JSON type is refused, not converted
    (b'{"model": "m", "prompt": "x", "max_tokens": "5"}', "max_tokens: Input should be a valid integer",
     "max_tokens"),
    (b'{"model": "m", "prompt": "x", "max_tokens": 5.0}', "max_tokens: Input should be a valid integer",
     "max_tokens"),
    (b'{"model": "m", "prompt": "x", "max_tokens": true}', "max_tokens: Input should be a valid integer",
     "max_tokens"),
    (b'{"model": "m", "prompt": "x", "temperature": false}', "temperature: Input should be a valid number",
     "temperature"),
    (b'{"model": "m", "prompt": "x", "stream": "yes"}', "stream: Input should be a valid boolean", "stream"),
    (b'{"model": "m", "prompt": [["a"]]}', "prompt must be a non-empty string or a non-empty list of token ids",
     "prompt"),
    (b'{"model": "m", "prompt": "x", "max_tokens": 0}', "max_tokens must be at least 1, or 0 with echo: true",
     "max_tokens"),
    (b'{"model": null, "prompt": "x"}', "model is required", "model"),
])  # fmt: skip
def test_completion_bodies_are_typed_strictly(raw, message, param):
    with pytest.raises(RequestError) as err:
        v1_requests.completion_prompts(bodies.parse(bodies.CompletionBody, raw).prompt, 8)
    assert err.value.message.startswith(message) and err.value.param == param


def test_null_is_the_default_and_nesting_is_bounded():
    body = bodies.parse(bodies.CompletionBody, b'{"model": "m", "prompt": "x", "n": null, "echo": null, '
                    b'"stream": null, "presence_penalty": null, "frequency_penalty": null}')
    assert (body.n, body.echo, body.stream, body.presence_penalty) == (1, False, False, 0.0)
    with pytest.raises(RequestError, match="unknown field 'nope'"):  # null does not hide a typo
        bodies.parse(bodies.CompletionBody, b'{"model": "m", "prompt": "x", "nope": null}')
    for depth in (900, 5000):  # under and over the JSON parser's own limit
        raw = b'{"model": "m", "prompt": "x", "user": ' + b"[" * depth + b"]" * depth + b"}"
        with pytest.raises(RequestError) as err:
            bodies.parse(bodies.CompletionBody, raw)
        assert err.value.message in ("the request body is nested too deeply to be a request",
                                     "user: Input should be a valid string")


@pytest.mark.parametrize(("message", "error"), [
    ({"role": "foo", "content": "x"}, "messages.0.role: Input should be 'system', 'developer', 'user'"),
    ({"role": "user"}, "messages.0.content is required for a user message"),
    ({"role": "system", "content": None}, "messages.0.content is required for a system message"),
])  # fmt: skip
def test_chat_messages_need_a_known_role_and_content(message, error):
    with pytest.raises(RequestError) as err:
        body = bodies.parse(bodies.ChatBody, json.dumps({"model": "m", "messages": [message]}).encode())
        [m.for_template(i) for i, m in enumerate(body.messages)]
    assert err.value.message.startswith(error)
    assistant = bodies.parse(bodies.ChatBody, b'{"model": "m", "messages": [{"role": "assistant", "content": null}]}')
    assert assistant.messages[0].for_template(0)["content"] == ""


async def test_a_handler_s_unexpected_error_is_a_json_500():
    async def broken(request: web.Request) -> web.Response:
        raise KeyError("a bug")

    app = web.Application(middlewares=[_json_errors])
    app.router.add_post("/v1/completions", broken)
    async with TestClient(TestServer(app)) as client:
        resp = await client.post("/v1/completions", json={})
        assert resp.status == 500
        assert (await resp.json())["error"] == {
            "message": "internal error: KeyError", "type": "server_error", "param": None,
            "code": "internal"}


def test_a_request_id_leaves_room_for_the_choice_suffix():
    from omnibus.v1 import inference_pb2 as pb

    body = bodies.parse(bodies.CompletionBody, b'{"model": "m", "prompt": "x", "n": 2}')
    assert [r.request_id for r in v1_requests.fan_out(body, [pb.GenerateRequest()], 4, "a" * 126, 0)] == [
        "a" * 126 + "-0", "a" * 126 + "-1"]
    with pytest.raises(RequestError, match="with 2 choices the request id .* at most 126 characters.* it has 127"):
        v1_requests.fan_out(body, [pb.GenerateRequest()], 4, "a" * 127, 0)


def test_a_logprob_json_cannot_carry_is_sent_as_vllms_floor():
    """Outside probe: a NaN logprob went out as a bare NaN, which strict JSON parsers
    refuse; -inf would go out as -Infinity."""
    assert [shapes.json_logprob(v) for v in (-1.5, 0.0, -9999.0, -1e30, float("-inf"), float("nan"))] == [
        -1.5, 0.0, -9999.0, -9999.0, -9999.0, -9999.0]
    json.dumps([shapes.json_logprob(float("-inf"))], allow_nan=False)
