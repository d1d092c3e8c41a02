"""Property-based fuzzing of every public RPC and of the engine's internal ones.

Hypothesis builds requests from random field values (huge strings and repeated fields
near --max-request-bytes, NaN and infinite floats, extreme integers, unknown fields,
invalid UTF-8 in string fields), random and truncated bytes, and every metadata form
(missing, empty and garbage authorization, odd x-adapter-id values, x-priority junk,
binary -bin headers). Every call is sent as raw bytes through `channel.unary_*(path)`,
so the server sees exactly the bytes drawn. Each call must end with a status from the
RPC's allowed set (never UNKNOWN or INTERNAL); afterwards the router and the engine are
still SERVING and every KV block of the engine is free.

`make test` replays a fixed set of examples (derandomized); `make fuzz` sets
OMNIBUS_FUZZ_EXAMPLES to explore many more, drawn afresh each run.
"""

from __future__ import annotations

import http.client
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from omnibus.v1 import admin_pb2, engine_pb2, inference_pb2

from tests.e2e.conftest import NUM_KV_BLOCKS, Served
from tests.grpc_helpers import (
    ServerProcess,
    engine_stats,
    free_port,
    router_process,
    wait_until,
)

MAX_REQUEST_BYTES = 32 * 1024  # the fuzz router's --max-request-bytes
KEY, ADMIN_KEY = "key-fuzz", "admin-fuzz"
CALL_TIMEOUT_S = 2.0  # a generation the fuzzer made long ends DEADLINE_EXCEEDED
EXAMPLES = int(os.environ.get("OMNIBUS_FUZZ_EXAMPLES", "0"))  # 0: the fixed `make test` set

Code = grpc.StatusCode
OK = Code.OK
# What each call may end with. UNKNOWN and INTERNAL are never allowed: they mean the
# server failed to classify an input.
PUBLIC = {OK, Code.INVALID_ARGUMENT, Code.UNAUTHENTICATED, Code.PERMISSION_DENIED,
          Code.NOT_FOUND, Code.RESOURCE_EXHAUSTED, Code.DEADLINE_EXCEEDED}
# RESOURCE_EXHAUSTED: a message over the server's gRPC receive cap (2 x --max-request-bytes).
ADMIN = {OK, Code.INVALID_ARGUMENT, Code.UNAUTHENTICATED, Code.PERMISSION_DENIED,
         Code.NOT_FOUND, Code.RESOURCE_EXHAUSTED}
ENGINE = {OK, Code.INVALID_ARGUMENT, Code.NOT_FOUND, Code.ALREADY_EXISTS,
          Code.RESOURCE_EXHAUSTED, Code.DEADLINE_EXCEEDED, Code.FAILED_PRECONDITION}
INFERENCE, ADMIN_SVC, ENGINE_SVC = "/omnibus.v1.Inference/", "/omnibus.v1.Admin/", "/omnibus.v1.Engine/"


def fuzz_settings(examples: int):  # noqa: ANN201 (hypothesis' settings decorator)
    return settings(
        max_examples=EXAMPLES or examples,
        derandomize=not EXAMPLES,
        deadline=None,
        database=None,
        print_blob=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                               HealthCheck.large_base_example],
    )


# ---- the processes ------------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    router: ServerProcess  # keys file, admin key, small --max-request-bytes
    engine: Served  # the shared engine behind it (no credentials)
    http_port: int  # the router's OpenAI HTTP front


@pytest.fixture(scope="module")
def target(tiny_model, shared_engine: Served, tmp_path_factory) -> Iterator[Target]:
    logs = tmp_path_factory.mktemp("fuzz")
    keys = logs / "keys.json"
    keys.write_text(json.dumps({"tenants": {
        "fuzz": {"keys": [KEY], "max_concurrent": 2},
        "limited": {"keys": ["key-limited"], "adapters": ["only-this"]},
    }}))
    (logs / "admin.key").write_text(ADMIN_KEY)
    http_port = free_port()
    router = router_process(
        tiny_model, [shared_engine.address], logs, "fuzz-router",
        f"--keys-file={keys}", f"--admin-key-file={logs / 'admin.key'}",
        f"--max-request-bytes={MAX_REQUEST_BYTES}", "--max-queued-requests=4",
        f"--http-port={http_port}",
    )
    try:
        yield Target(router.wait_serving(), shared_engine, http_port)
        for address in (router.address, shared_engine.address):
            assert serving(address), f"{address} is no longer SERVING after the fuzzing"
        wait_until(lambda: kv_all_free(shared_engine.address), 60, "every KV block free")
    finally:
        router.stop()


def serving(address: str) -> bool:
    with grpc.insecure_channel(address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=10
        )
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def kv_all_free(address: str) -> bool:
    s = engine_stats(address)
    idle = s.num_active_streams == 0 and s.load.num_running == 0 and s.load.num_waiting == 0
    return idle and s.load.num_free_blocks == s.load.num_total_blocks == NUM_KV_BLOCKS - 1


def call(address: str, path: str, raw: bytes, metadata=(), streaming: bool = False) -> Code:
    """Sends `raw` as the request of `path`; the call's final status (a stream is read to
    its end)."""
    with grpc.insecure_channel(address) as channel:
        try:
            if streaming:
                for _ in channel.unary_stream(path)(raw, metadata=metadata,
                                                    timeout=CALL_TIMEOUT_S):
                    pass
            else:
                channel.unary_unary(path)(raw, metadata=metadata, timeout=CALL_TIMEOUT_S)
        except grpc.RpcError as err:
            return err.code()
    return OK


def check(code: Code, allowed: set[Code], what: str) -> None:
    assert code in allowed, f"{what} ended {code.name}, not one of {sorted(c.name for c in allowed)}"


# ---- strategies ---------------------------------------------------------------------

INT32 = st.one_of(st.integers(-3, 8), st.sampled_from([-(2**31), 2**31 - 1, 4096, 4097, 1024]),
                  st.integers(-(2**31), 2**31 - 1))
UINT32 = st.one_of(st.integers(0, 5), st.sampled_from([2**32 - 1]), st.integers(0, 2**32 - 1))
UINT64 = st.one_of(st.integers(0, 10), st.integers(0, 2**64 - 1))
FLOAT = st.one_of(st.floats(-2, 2, width=32), st.floats(width=32),
                  st.sampled_from([float("nan"), float("inf"), float("-inf"), -0.0]))
TOKEN = st.one_of(st.integers(-2, 400), st.sampled_from([-(2**31), 2**31 - 1, 383, 384]))
TEXT = st.one_of(
    st.text(max_size=40),
    st.sampled_from(["", "\x00", "\ud7ff\ue000", "Once upon a time"]),
    # near and past --max-request-bytes (each char is 1-4 bytes)
    st.builds(lambda c, n: c * n, st.sampled_from(["a", "é", "😀"]),
              st.integers(MAX_REQUEST_BYTES // 8, MAX_REQUEST_BYTES + 64)),
)
TOKENS = st.one_of(st.lists(TOKEN, max_size=20),
                   st.builds(lambda t, n: [t] * n, TOKEN, st.integers(1000, 2 * MAX_REQUEST_BYTES // 5)))
# The fuzzer's generations stay short mostly, so that a run spends its time on inputs.
MAX_TOKENS = st.one_of(st.none(), st.integers(-2, 6), INT32)


def optional(strategy):  # noqa: ANN001, ANN201
    return st.one_of(st.none(), strategy)


@st.composite
def sampling_params(draw) -> inference_pb2.SamplingParams:  # noqa: ANN001
    fields = dict(
        max_tokens=draw(MAX_TOKENS), temperature=draw(optional(FLOAT)), top_p=draw(optional(FLOAT)),
        top_k=draw(optional(INT32)), min_p=draw(optional(FLOAT)), seed=draw(optional(UINT64)),
        stop=draw(optional(st.lists(TEXT, max_size=20))),
        stop_token_ids=draw(optional(st.lists(TOKEN, max_size=10))),
        ignore_eos=draw(optional(st.booleans())),
        repetition_penalty=draw(optional(FLOAT)), presence_penalty=draw(optional(FLOAT)),
        frequency_penalty=draw(optional(FLOAT)), logprobs=draw(optional(INT32)),
    )
    return inference_pb2.SamplingParams(**{k: v for k, v in fields.items() if v is not None})


@st.composite
def generate_requests(draw) -> inference_pb2.GenerateRequest:  # noqa: ANN001
    request = inference_pb2.GenerateRequest(priority=draw(INT32), request_id=draw(TEXT))
    prompt = draw(st.sampled_from(["text", "token_ids", "none"]))
    if prompt == "text":
        request.text = draw(TEXT)
    elif prompt == "token_ids":
        request.token_ids.ids.extend(draw(TOKENS))
    if draw(st.booleans()):
        request.sampling.CopyFrom(draw(sampling_params()))
    return request


@st.composite
def embed_requests(draw) -> inference_pb2.EmbedRequest:  # noqa: ANN001
    request = inference_pb2.EmbedRequest(
        pooling=draw(st.integers(-1, 3)), normalize=draw(st.booleans()),
        priority=draw(INT32), request_id=draw(TEXT),
    )
    for _ in range(draw(st.sampled_from([0, 1, 2, 6, 100]))):
        item = request.inputs.add()
        if draw(st.booleans()):
            item.text = draw(TEXT)
        elif draw(st.booleans()):
            item.token_ids.ids.extend(draw(TOKENS))
    return request


NOWHERE = "127.0.0.1:1"  # an engine address nothing listens on
ADAPTER_NAMES = st.one_of(
    st.sampled_from(["", "only-this", "../../etc/passwd", "..", "/abs", "a/b", "a\\b", "%2e%2e",
                     "x" * 300, " ", "ünïcödé", "CON", "a:b", ".hidden", "-dash"]),
    st.text(max_size=30),
)


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited field (wire type 2) on the wire."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


BAD_UTF8 = st.sampled_from([b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"abc\x80", b"\xf8\x88\x80\x80\x80"])


@st.composite
def mangled(draw, message) -> bytes:  # noqa: ANN001
    """`message`'s bytes, then maybe: invalid UTF-8 in a string field (as a trailing field
    the parser merges), unknown fields, or cut short."""
    raw = message.SerializeToString()
    string_fields = [f.number for f in message.DESCRIPTOR.fields if f.type == f.TYPE_STRING]
    how = draw(st.sampled_from(["as is", "bad utf-8", "unknown field", "truncated"]))
    if how == "bad utf-8" and string_fields:
        raw += _field(draw(st.sampled_from(string_fields)), draw(BAD_UTF8))
    elif how == "unknown field":
        raw += _varint(draw(st.integers(20, 2**29 - 1)) << 3) + _varint(draw(UINT64))
        raw += _field(draw(st.integers(20, 2000)), draw(st.binary(max_size=20)))
    elif how == "truncated" and raw:
        raw = raw[: draw(st.integers(0, len(raw) - 1))]
    return raw


RAW_BYTES = st.one_of(st.binary(max_size=64), st.sampled_from([b"\xff" * 10, b"\x0a\xff\xff\xff\xff\x0f"]))

AUTH = st.one_of(
    st.none(),
    st.sampled_from([f"Bearer {KEY}", f"Bearer {ADMIN_KEY}", "Bearer key-limited", "", "Bearer",
                     f"bearer {KEY}", f"Basic {KEY}", f"Bearer   {KEY}"]),
    st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=40),
)
ASCII = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=40)


def legal(value: str) -> bool:
    return value.isascii() and value.isprintable() and value == value.strip()


@st.composite
def metadata(draw) -> tuple[tuple[str, str | bytes], ...]:  # noqa: ANN001
    """gRPC metadata of every form the client library lets through: printable ASCII
    values without surrounding blanks for plain keys (it refuses others before sending),
    any bytes for -bin keys."""
    md: list[tuple[str, str | bytes]] = []
    auth = draw(AUTH)
    if auth is not None and legal(auth):
        md.append(("authorization", auth))
    adapter = draw(optional(ADAPTER_NAMES))
    if adapter is not None:
        if legal(adapter):
            md.append(("x-adapter-id", adapter))
        else:  # not legal as a plain gRPC header value: sent as -bin bytes
            md.append(("x-adapter-id-bin", adapter.encode("utf-8", "surrogatepass")))
    priority = draw(st.one_of(ASCII, st.sampled_from(["-1", "1e9", "NaN"])))
    if draw(st.booleans()) and legal(priority):
        md.append(("x-priority", priority))
    if draw(st.booleans()):
        md.append((draw(st.sampled_from(["authorization-bin", "x-junk-bin", "x-adapter-id-bin"])),
                   draw(st.binary(max_size=40))))
    return tuple(md)


# ---- the public API (the fuzz router) ----------------------------------------------


@fuzz_settings(60)
@given(request=generate_requests().flatmap(mangled), md=metadata())
def test_generate_fuzzed(target, request, md):
    code = call(target.router.address, INFERENCE + "Generate", request, md, streaming=True)
    check(code, PUBLIC, "Generate")


@fuzz_settings(40)
@given(request=embed_requests().flatmap(mangled), md=metadata())
def test_embed_fuzzed(target, request, md):
    check(call(target.router.address, INFERENCE + "Embed", request, md), PUBLIC, "Embed")


@fuzz_settings(20)
@given(request=st.builds(inference_pb2.ListModelsRequest).flatmap(mangled), md=metadata())
def test_list_models_fuzzed(target, request, md):
    check(call(target.router.address, INFERENCE + "ListModels", request, md), PUBLIC, "ListModels")


@st.composite
def admin_calls(draw) -> tuple[str, bytes]:  # noqa: ANN001
    method = draw(st.sampled_from(["LoadAdapter", "UnloadAdapter", "ListAdapters"]))
    if method == "ListAdapters":
        message = admin_pb2.AdminListAdaptersRequest()
    else:
        engines = draw(st.lists(st.one_of(TEXT, st.just(NOWHERE)), max_size=3))
        message = admin_pb2.AdminAdapterRequest(adapter=draw(ADAPTER_NAMES), engines=engines)
    return method, draw(mangled(message))


@fuzz_settings(40)
@given(admin=admin_calls(), md=metadata())
def test_admin_fuzzed(target, admin, md):
    method, raw = admin
    check(call(target.router.address, ADMIN_SVC + method, raw, md), ADMIN, f"Admin.{method}")


INFERENCE_METHODS = [("Generate", True), ("Embed", False), ("ListModels", False)]
ADMIN_METHODS = ["LoadAdapter", "UnloadAdapter", "ListAdapters"]


@fuzz_settings(30)
@given(raw=RAW_BYTES, md=metadata(),
       method=st.sampled_from([(INFERENCE + m, s) for m, s in INFERENCE_METHODS]
                              + [(ADMIN_SVC + m, False) for m in ADMIN_METHODS]))
def test_random_bytes_to_the_router(target, raw, md, method):
    path, streaming = method
    check(call(target.router.address, path, raw, md, streaming), PUBLIC | ADMIN, path)


# ---- the engine's API (the shared engine, no credentials) --------------------------


@st.composite
def engine_requests(draw) -> engine_pb2.EngineGenerateRequest:  # noqa: ANN001
    sampling = engine_pb2.EngineSamplingParams(
        max_tokens=draw(MAX_TOKENS.filter(lambda v: v is not None)), temperature=draw(FLOAT),
        top_p=draw(FLOAT), top_k=draw(INT32), min_p=draw(FLOAT), seed=draw(UINT64),
        stop_token_ids=draw(st.lists(TOKEN, max_size=5)), ignore_eos=draw(st.booleans()),
        repetition_penalty=draw(FLOAT), presence_penalty=draw(FLOAT),
        frequency_penalty=draw(FLOAT), logprobs=draw(INT32), output_offset=draw(INT32),
    )
    return engine_pb2.EngineGenerateRequest(
        request_id=draw(TEXT), prompt_token_ids=draw(TOKENS), sampling=sampling,
        priority=draw(INT32), adapter=draw(ADAPTER_NAMES), tenant=draw(TEXT),
        tenant_weight=draw(FLOAT), deadline_ms=draw(UINT32), handle=draw(UINT32),
        cache_salt=draw(st.one_of(st.just(""), TEXT)),
    )


@st.composite
def engine_calls(draw) -> tuple[str, bytes, bool]:  # noqa: ANN001
    method = draw(st.sampled_from(["Generate", "Embed", "Stats", "LoadAdapter", "UnloadAdapter",
                                   "ListAdapters", "WatchLoad", "raw"]))
    if method == "Generate":
        return method, draw(mangled(draw(engine_requests()))), True
    if method == "Embed":
        message = engine_pb2.EngineEmbedRequest(
            inputs=[inference_pb2.TokenIds(ids=draw(TOKENS)) for _ in range(draw(st.integers(0, 3)))],
            pooling=draw(st.integers(-1, 3)), normalize=draw(st.booleans()),
            priority=draw(INT32), queue_timeout_ms=draw(UINT32),
        )
        return method, draw(mangled(message)), False
    if method in ("LoadAdapter", "UnloadAdapter"):
        kind = getattr(engine_pb2, f"{method}Request")
        return method, draw(mangled(kind(adapter=draw(ADAPTER_NAMES)))), False
    if method == "WatchLoad":  # a stream without end: the call's deadline ends it
        return method, draw(mangled(engine_pb2.WatchLoadRequest(interval_ms=draw(INT32)))), True
    if method == "raw":
        name, streaming = draw(st.sampled_from([("Generate", True), ("Embed", False),
                                                ("Stats", False), ("LoadAdapter", False),
                                                ("WatchLoad", True)]))
        return name, draw(RAW_BYTES), streaming
    return method, draw(mangled(getattr(engine_pb2, f"{method}Request")())), False


@fuzz_settings(50)
@given(engine_call=engine_calls(), md=metadata())
def test_engine_rpcs_fuzzed(target, engine_call, md):
    method, raw, streaming = engine_call
    code = call(target.engine.address, ENGINE_SVC + method, raw, md, streaming)
    allowed = ENGINE | {Code.DEADLINE_EXCEEDED} if method == "WatchLoad" else ENGINE
    check(code, allowed, f"Engine.{method}")


@fuzz_settings(20)
@given(messages=st.lists(st.one_of(RAW_BYTES, st.builds(
    lambda r: engine_pb2.SessionRequest(add=[r], abort=[r.request_id]).SerializeToString(),
    engine_requests())), min_size=1, max_size=4))
def test_engine_session_fuzzed(target, messages):
    """The engine's Session stream, with random and valid-but-odd messages; the stream's
    end aborts whatever it added."""
    with grpc.insecure_channel(target.engine.address) as channel:
        stream = channel.stream_stream(ENGINE_SVC + "Session")
        try:
            for _ in stream(iter(messages), timeout=CALL_TIMEOUT_S):
                pass
            code = OK
        except grpc.RpcError as err:
            code = err.code()
    check(code, ENGINE, "Engine.Session")


# ---- the OpenAI HTTP front ----------------------------------------------------------

JSON_SCALAR = st.one_of(st.none(), st.booleans(), INT32, st.integers(), TEXT,
                        st.floats(allow_nan=False, allow_infinity=False))
JSON = st.recursive(JSON_SCALAR, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=8)
HTTP_FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens",
               "temperature", "top_p", "n", "stop", "seed", "logprobs", "top_logprobs",
               "presence_penalty", "frequency_penalty", "stream", "stream_options", "input",
               "encoding_format", "priority", "user"]


@st.composite
def http_requests(draw) -> tuple[str, bytes, list[tuple[str, bytes]]]:  # noqa: ANN001
    path = draw(st.sampled_from(["/v1/completions", "/v1/chat/completions", "/v1/embeddings"]))
    body = draw(st.dictionaries(st.sampled_from(HTTP_FIELDS), JSON, max_size=8))
    if draw(st.booleans()):
        body["model"] = "tiny-llama"
    raw = json.dumps(body).encode()
    if draw(st.integers(0, 9)) == 0:  # not JSON at all, or cut short
        raw = draw(st.one_of(st.binary(max_size=40), st.just(raw[: len(raw) // 2])))
    headers = [("Content-Type", b"application/json")]
    for name, value in draw(metadata()):
        text = value if isinstance(value, bytes) else value.encode()
        if b"\r" not in text and b"\n" not in text:  # would end the header
            headers.append((name.removesuffix("-bin"), text))  # raw bytes: HTTP takes them
    return path, raw, headers


@fuzz_settings(40)
@given(call_http=http_requests())
def test_http_front_fuzzed(target, call_http):
    """Random bodies and headers (x-priority junk, x-adapter-id as raw UTF-8 bytes) to the
    OpenAI endpoints: a client error (4xx) or success, never a server error."""
    path, raw, headers = call_http
    conn = http.client.HTTPConnection("127.0.0.1", target.http_port, timeout=30)
    try:
        conn.putrequest("POST", path)
        for name, value in headers:
            conn.putheader(name, value)
        conn.putheader("Content-Length", str(len(raw)))
        conn.endheaders(raw)
        reply = conn.getresponse()
        text = reply.read()[:300]
    finally:
        conn.close()
    assert reply.status < 500, f"{path} answered {reply.status}: {text!r}"


@pytest.mark.parametrize("header, body", [("99999999999999999999", None), ("-99999999999999999999", None),
                                          ("1_0", None), ("\u0661".encode(), None), (None, 10**20)])
def test_http_priority_that_is_no_int32_is_a_client_error(target, header, body):
    """Found by test_http_front_fuzzed: an x-priority (or body priority) past int32 was an
    HTTP 500 (building the protobuf request failed); int() also took "1_0" and non-ASCII
    digits."""
    raw = json.dumps({"model": "tiny-llama", "prompt": "hi", "max_tokens": 1}
                     | ({} if body is None else {"priority": body})).encode()
    conn = http.client.HTTPConnection("127.0.0.1", target.http_port, timeout=30)
    try:
        conn.putrequest("POST", "/v1/completions")
        conn.putheader("Authorization", f"Bearer {KEY}")
        if header is not None:
            conn.putheader("x-priority", header)
        conn.putheader("Content-Length", str(len(raw)))
        conn.endheaders(raw)
        reply = conn.getresponse()
        error = json.loads(reply.read())["error"]
    finally:
        conn.close()
    assert (reply.status, error["code"]) == (400, "invalid_argument")
    assert "priority" in error["message"]
