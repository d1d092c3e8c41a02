"""The OpenAI HTTP front in process (tests/unit/router/inprocess.py: one scripted
engine): headers it cannot use are the client's error (400 naming the header, 401 for
a key), never a server error, whatever their bytes; the n choices of a request are
admitted all or none; budget refusals name the field to change."""

from __future__ import annotations

import asyncio
import json
import re

import pytest
from aiohttp.test_utils import TestServer

from omnibus.router.http.app import OpenAIFront
from tests.unit.router.inprocess import Router

TENANTS = {"t": {"keys": ["sk-t"], "tokens_per_minute": 60}}
AUTH = b"Authorization: Bearer sk-t\r\n"


@pytest.fixture
async def http(tmp_path):
    router = await Router(tmp_path, TENANTS).start()
    server = TestServer(OpenAIFront(router.pipeline, router.config, None).app())
    await server.start_server()
    yield server.port
    await server.close()
    await router.close()


async def call(port: int, headers: bytes, body: dict | None = None,
               path: bytes = b"/v1/completions") -> tuple[int, dict, dict]:
    """Status, headers and JSON body of a request sent as these raw bytes."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    data = json.dumps(body or {"model": "m", "prompt": "w1 w2", "max_tokens": 2}).encode()
    method = b"POST " if body is not None or path == b"/v1/completions" else b"GET "
    writer.write(method + path + b" HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                 b"Content-Type: application/json\r\n" + headers
                 + b"Content-Length: %d\r\n\r\n" % len(data) + data)
    reply = await reader.read()
    writer.close()
    head, _, payload = reply.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    fields = dict(line.split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), fields, json.loads(payload)


@pytest.mark.parametrize("value", [b"--5", b"+-5", b"5-", b"\xfc", "\u00b2".encode()])
async def test_a_priority_header_that_is_no_integer_is_400(http, value):
    status, _, body = await call(http, AUTH + b"x-priority: " + value + b"\r\n")
    assert status == 400, body
    assert body["error"]["message"].startswith("x-priority must be an integer, got ")


async def test_a_priority_header_beyond_int32_is_400(http):
    status, _, body = await call(http, AUTH + b"x-priority: 2147483648\r\n")
    assert (status, body["error"]["message"]) == (400, "x-priority must be in [-100, 100], got 2147483648"), body


@pytest.mark.parametrize("path", [b"/v1/completions", b"/v1/models"])
@pytest.mark.parametrize("key", [b"sk-\xfc", "sk-\u00fc".encode()])
async def test_a_key_whose_bytes_are_not_utf8_is_just_a_wrong_key(http, path, key):
    status, _, body = await call(http, b"Authorization: Bearer " + key + b"\r\n", path=path)
    assert (status, body["error"]["message"]) == (401, "invalid API key")


@pytest.mark.parametrize("value", [b"\xfcni", "\u00fcn\u00ef".encode()])
async def test_a_request_id_header_that_is_no_request_id_is_400_naming_it(http, value):
    for path, body in ((b"/v1/completions", None),
                       (b"/v1/embeddings", {"model": "m", "input": "w1"})):
        status, _, reply = await call(http, AUTH + b"x-request-id: " + value + b"\r\n", body, path)
        assert status == 400, reply
        assert reply["error"]["message"] == (
            "x-request-id must be at most 128 printable ASCII characters without spaces")


async def test_an_adapter_header_that_is_not_utf8_is_400(http):
    status, _, body = await call(http, AUTH + b"x-adapter-id: \xfc\r\n")
    assert status == 400 and "x-adapter-id" in body["error"]["message"], body


async def test_n_choices_are_refused_together_with_the_whole_requests_cost(http):
    spend = {"model": "m", "prompt": "w1 w2 w3 w4 w5", "max_tokens": 40}
    status, _, body = await call(http, AUTH, spend)
    assert status == 200, body  # 5 + 3 used of 45 charged: 52 left
    status, headers, body = await call(http, AUTH, {**spend, "max_tokens": 5, "n": 6})  # 6 x 10
    assert status == 429, body
    message = body["error"]["message"]
    match = re.fullmatch(r"tenant 't' is over its budget of 60 tokens per minute \(this request "
                         r"needs 60 for its 6 choices, 5[23] are left\); retry in ([78]) s", message)
    assert match and headers["Retry-After"] == match[1], message
    # Nothing was taken: the 52 tokens left still admit 5 choices of 10.
    status, _, body = await call(http, AUTH, {**spend, "max_tokens": 5, "n": 5})
    assert status == 200, body
    assert len(body["choices"]) == 5


@pytest.mark.parametrize("path, body, param, advice", [
    (b"/v1/embeddings", {"model": "m", "input": " ".join(["w1"] * 61)}, "input",
     "send fewer or shorter inputs"),
    (b"/v1/completions", {"model": "m", "prompt": " ".join(["w1"] * 60), "max_tokens": 1},
     "prompt", "shorten the prompt"),
    (b"/v1/completions", {"model": "m", "prompt": "w1 w2", "max_tokens": 59}, "max_tokens",
     "lower max_tokens to at most 58"),
    (b"/v1/completions", {"model": "m", "prompt": "w1 w2", "max_tokens": 29, "n": 2},
     "max_tokens", "lower max_tokens to at most 28 or lower n"),
])  # fmt: skip
async def test_a_request_over_the_whole_budget_is_told_what_to_change(
    http, path, body, param, advice
):
    status, _, reply = await call(http, AUTH, body, path)
    error = reply["error"]
    assert (status, error["param"], error["code"]) == (400, param, "tenant_budget"), reply
    assert error["message"].endswith("budget of 60 tokens per minute, so it can never be "
                                     f"admitted; {advice}")


BIG = 2**31


@pytest.mark.parametrize(("path", "body", "field"), [
    (b"/v1/completions", {"max_tokens": BIG}, "max_tokens"),
    (b"/v1/completions", {"logprobs": BIG}, "logprobs"),
    (b"/v1/completions", {"top_k": BIG}, "top_k"),
    (b"/v1/completions", {"top_k": -BIG - 1}, "top_k"),
    (b"/v1/completions", {"stop_token_ids": [BIG]}, "stop_token_ids.0"),
    (b"/v1/completions", {"prompt": [5, BIG]}, "prompt"),
    (b"/v1/chat/completions", {"messages": [{"role": "user", "content": "w1"}], "max_completion_tokens": BIG},
     "max_completion_tokens"),
    (b"/v1/chat/completions", {"messages": [{"role": "user", "content": "w1"}], "logprobs": True,
                               "top_logprobs": BIG}, "top_logprobs"),
    (b"/v1/embeddings", {"input": [[5, BIG]]}, "input.0"),
    (b"/v1/completions", {"priority": BIG}, "priority"),
    (b"/v1/embeddings", {"input": "w1", "priority": -BIG - 1}, "priority"),
])  # fmt: skip
async def test_an_integer_too_large_for_its_field_is_400_naming_it(http, path, body, field):
    """They were 500s (protobuf's ValueError building the request), retried by clients."""
    base = {"model": "m", "prompt": "w1 w2", "max_tokens": 2} if path == b"/v1/completions" else {"model": "m"}
    status, _, reply = await call(http, AUTH, base | body, path)
    assert (status, reply["error"]["param"]) == (400, field), reply


@pytest.mark.parametrize("logprobs", [-1, -5, 21])
async def test_completion_logprobs_out_of_range_are_400(http, logprobs):
    status, _, reply = await call(http, AUTH, {"model": "m", "prompt": "w1", "max_tokens": 2, "logprobs": logprobs})
    assert status == 400 and reply["error"]["message"] == f"logprobs must be in [0, 20], got {logprobs}"


async def test_errors_echo_the_request_id_and_name_their_code(http):
    status, headers, _ = await call(http, b"Authorization: Bearer nope\r\nx-request-id: abc-1\r\n")
    assert (status, headers.get("x-request-id")) == (401, "abc-1")
    status, headers, reply = await call(http, AUTH, {"model": "m", "prompt": "w1 " * 1_200_000})
    assert (status, reply["error"]["code"]) == (413, "request_too_large")
    assert "x-request-id" in headers  # one was made for it


async def test_a_model_that_is_neither_the_base_nor_an_adapter_is_404_naming_model(http):
    status, _, reply = await call(http, AUTH, {"model": "gpt-4o", "prompt": "w1", "max_tokens": 2})
    assert (status, reply["error"]["param"], reply["error"]["code"]) == (404, "model", "unknown_model")
    assert reply["error"]["message"].startswith("model 'gpt-4o' does not exist")


async def test_an_empty_embeddings_input_says_so(http):
    status, _, reply = await call(http, AUTH, {"model": "m", "input": []}, b"/v1/embeddings")
    assert (status, reply["error"]["param"]) == (400, "input")
    assert reply["error"]["message"].startswith("input is empty")


def test_harmless_openai_fields_are_accepted_and_a_negative_seed_is_int64():
    from omnibus.v1 import inference_pb2 as pb

    from omnibus.router.http import bodies, v1_requests
    from omnibus.router.service.errors import RequestError

    body = bodies.parse(bodies.ChatBody, json.dumps({
        "model": "m", "messages": [{"role": "user", "content": "hi"}], "store": False,
        "metadata": {"k": "v"}, "service_tier": "auto", "prompt_cache_key": "x",
        "safety_identifier": "u1", "stream": True,
        "stream_options": {"include_usage": True, "include_obfuscation": False},
        "seed": -1}).encode())
    (one,) = v1_requests.fan_out(body, [pb.GenerateRequest()], 8, "r", 0)
    assert one.sampling.seed == 2**64 - 1
    body.n, body.seed = 2, -(2**63) - 1
    with pytest.raises(RequestError, match=r"seed must be in \[-9223372036854775808, 18446744073709551615\]"):
        v1_requests.fan_out(body, [pb.GenerateRequest()], 8, "r", 0)
    body.top_logprobs, body.logprobs = 21, True
    with pytest.raises(RequestError) as err:
        body.logprob_count
    assert (err.value.param, err.value.message) == ("top_logprobs", "top_logprobs must be in [0, 20], got 21")


async def test_a_model_the_tenant_may_not_use_is_403_naming_model(tmp_path):
    tenants = {"t": {"keys": ["sk-t"], "adapters": ["allowed"]}}
    router = await Router(tmp_path, tenants).start()
    server = TestServer(OpenAIFront(router.pipeline, router.config, None).app())
    await server.start_server()
    try:
        status, _, reply = await call(server.port, AUTH, {"model": "other", "prompt": "w1", "max_tokens": 2})
        error = reply["error"]
        assert (status, error["param"], error["code"]) == (403, "model", "adapter_denied"), reply
    finally:
        await server.close()
        await router.close()


async def test_max_prompt_tokens_bounds_an_embedding_input_as_it_bounds_a_prompt(tmp_path):
    router = await Router(tmp_path, TENANTS, max_prompt_tokens=5).start()
    server = TestServer(OpenAIFront(router.pipeline, router.config, None).app())
    await server.start_server()
    try:
        body = {"model": "m", "input": ["w1", " ".join(["w1"] * 6)]}
        status, _, reply = await call(server.port, AUTH, body, b"/v1/embeddings")
        error = reply["error"]
        assert (status, error["param"]) == (400, "input.1"), reply
        assert error["message"] == "input 1 has 6 tokens; the limit (--max-prompt-tokens) is 5"
    finally:
        await server.close()
        await router.close()


async def test_an_adapter_named_as_the_base_model_is_not_listed_twice(tmp_path):
    router = await Router(tmp_path, TENANTS).start()
    router.add_engine("127.0.0.1:2", adapters=("m", "a1"))  # "m": the base model's name
    server = TestServer(OpenAIFront(router.pipeline, router.config, None).app())
    await server.start_server()
    try:
        status, _, reply = await call(server.port, AUTH, None, b"/v1/models")
        assert status == 200 and [m["id"] for m in reply["data"]] == ["m", "a1"], reply
    finally:
        await server.close()
        await router.close()


async def test_a_chat_without_max_tokens_fills_what_an_engine_can_hold(tmp_path):
    """Regression probe: a chat request without max_tokens took "up to the context" from
    the longest context any engine advertised, and was refused (400 "lower max_tokens",
    a field the client never set) by a fleet whose KV pools hold less than that, or 503
    while only the engine with the longest context was down."""
    from omnibus.router.http.chat_template import ChatTemplate

    router = await Router(tmp_path, {"t": {"keys": ["sk-t"]}}).start()
    chat = ChatTemplate("{% for m in messages %}{{ m.content }} {% endfor %}", {})
    server = TestServer(OpenAIFront(router.pipeline, router.config, chat).app())
    await server.start_server()
    try:
        router.engine.report_load(block_size=4, num_total_blocks=8, num_free_blocks=8)  # 33 tokens
        body = {"model": "m", "messages": [{"role": "user", "content": "w1 w2"}]}
        status, _, reply = await call(server.port, AUTH, body, b"/v1/chat/completions")
        assert status == 200, reply
        assert router.engine.requests[-1].sampling.max_tokens == 33 - 2
        big = router.add_engine("127.0.0.1:2")
        big.report_load(block_size=4, num_total_blocks=64, num_free_blocks=64, max_model_len=600)
        big.link.mark_failed("connection refused")  # the longest context is down: the small one serves
        status, _, reply = await call(server.port, AUTH, body, b"/v1/chat/completions")
        assert status == 200 and router.engine.requests[-1].sampling.max_tokens == 31, reply
        # a max_completion_tokens no engine holds is refused under that name (openai probe)
        status, _, reply = await call(server.port, AUTH, body | {"max_completion_tokens": 300},
                                      b"/v1/chat/completions")
        assert (status, reply["error"]["param"]) == (400, "max_completion_tokens"), reply
        assert "lower max_completion_tokens to at most 255" in reply["error"]["message"]
    finally:
        await server.close()
        await router.close()


async def test_an_http_refusal_is_counted_and_logged_once(tmp_path):
    """Outside probe: a bad key over HTTP counted 2 unauthenticated refusals and logged
    request_refused twice (the pipeline's authenticate counted it, then the front again)."""
    from structlog.testing import capture_logs

    router = await Router(tmp_path, TENANTS).start()
    server = TestServer(OpenAIFront(router.pipeline, router.config, None).app())
    await server.start_server()
    try:
        with capture_logs() as logs:
            status, _, _ = await call(server.port, b"Authorization: Bearer nope\r\nx-request-id: r-1\r\n")
            await call(server.port, b"Authorization: Bearer nope\r\nx-request-id: r-2\r\n",
                       {"model": "m", "input": "w1"}, b"/v1/embeddings")
        assert status == 401
        assert router.pipeline.metrics.rejected.labels("unauthenticated")._value.get() == 2
        # once each, under the client's request id (regression probe: it was "")
        assert [e["request_id"] for e in logs if e["event"] == "request_refused"] == ["r-1", "r-2"]
    finally:
        await server.close()
        await router.close()


def test_library_logs_are_json_lines_and_malformed_http_is_one_info_line():
    """Outside probe: a malformed request (an over-long header, a garbage request line)
    made aiohttp print a dozen plain-text traceback lines, breaking JSON-lines logs and
    letting any client flood them."""
    import subprocess
    import sys

    script = """
import asyncio, logging
from aiohttp import web
from omnibus.common.logs import configure_logging
from omnibus.router.http.app import _bad_http_request
configure_logging("info")
logging.getLogger("aiohttp.server").addFilter(_bad_http_request)
logging.getLogger("some.library").error("boom", exc_info=ValueError("why"))
async def main():
    runner = web.AppRunner(web.Application(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    for payload in (b"GARBAGE\\r\\n\\r\\n", b"GET / HTTP/1.1\\r\\nX: " + b"a" * 9000 + b"\\r\\n\\r\\n"):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(payload)
        assert (await reader.read(20)).startswith(b"HTTP/1.0 400")
        writer.close()
    await asyncio.sleep(0.2)
    await runner.cleanup()
asyncio.run(main())
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = [json.loads(line) for line in out.stderr.splitlines()]  # every line is JSON
    assert (lines[0]["logger"], lines[0]["level"]) == ("some.library", "error")
    assert "ValueError: why" in lines[0]["exception"]
    assert len(lines) >= 2  # aiohttp logs the over-long header (a garbage line only at debug)
    for e in lines[1:]:
        assert (e["logger"], e["level"], e["event"].split(":")[0]) == (
            "aiohttp.server", "info", "bad_http_request") and "exception" not in e, e
