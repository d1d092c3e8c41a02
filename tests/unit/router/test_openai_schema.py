"""OpenAI bodies that are valid JSON but not Unicode text, and handler failures, come back
as OpenAI JSON errors a client can act on, never as aiohttp's plain-text 500."""

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from omnibus.router.http import openai_schema as oa
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
        oa.parse(oa.CompletionBody, raw)
    assert err.value.message.startswith(f"{where}: the string holds a lone UTF-16 surrogate")


def test_a_lone_surrogate_in_a_chat_message_is_refused():
    with pytest.raises(RequestError) as err:
        oa.parse(oa.ChatBody, rb'{"model": "m", "messages": [{"role": "user", "content": "\udc00"}]}')
    assert err.value.message.startswith("messages.0.content: the string holds a lone UTF-16")


def test_a_surrogate_pair_and_an_escaped_backslash_are_text():
    body = oa.parse(oa.CompletionBody, rb'{"model": "m", "prompt": "ok \ud83d\ude00 \\ud800"}')
    assert body.prompt == "ok \U0001f600 \\ud800"


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
