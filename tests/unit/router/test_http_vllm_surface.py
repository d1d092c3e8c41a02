"""What vLLM-class clients (lm-evaluation-harness, guidellm) send and probe beside the
OpenAI endpoints, in process (tests/unit/router/inprocess.py: scripted engines, a
one-token-per-word tokenizer): /health, /version, /metrics, /tokenize, /detokenize,
/tokenizer_info, stream_options.continuous_usage_stats, batched completion prompts,
the seeds of n choices, and echo with prompt logprobs."""

from __future__ import annotations

import dataclasses
import json

import pytest
from aiohttp.test_utils import TestClient, TestServer
from omnibus.v1 import inference_pb2

from omnibus.router.http import v1_requests
from omnibus.router.http.app import OpenAIFront
from omnibus.router.http.chat_template import ChatTemplate
from omnibus.router.service.errors import RequestError
from omnibus.router.service.pipeline import Caller
from tests.unit.router.inprocess import Router

TENANTS = {"t": {"keys": ["sk-t"]}, "tight": {"keys": ["sk-tight"], "tokens_per_minute": 60},
           "two": {"keys": ["sk-two"], "max_concurrent": 2}}
AUTH = {"Authorization": "Bearer sk-t"}
TEMPLATE = "{% for m in messages %}{{ m.content }} {% endfor %}{% if add_generation_prompt %}w9{% endif %}"


async def serve(router: Router, chat: ChatTemplate | None = None) -> tuple[OpenAIFront, TestClient]:
    front = OpenAIFront(router.pipeline, router.config, chat)
    client = TestClient(TestServer(front.app()))
    await client.start_server()
    return front, client


@pytest.fixture
async def setup(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "w1", "eos_token": {"content": "w2", "special": True}, "chat_template": TEMPLATE,
        "added_tokens_decoder": {"1": {"content": "w1"}}, "model_max_length": 10**30}))
    router = await Router(tmp_path, TENANTS, max_embed_inputs=3).start()
    front, client = await serve(router, ChatTemplate(TEMPLATE, {}))
    yield router, front, client
    await client.close()
    await router.close()


async def test_health_follows_the_engines_and_the_drain_and_needs_no_key(setup):
    router, front, client = setup
    reply = await client.get("/health")
    assert (reply.status, await reply.read()) == (200, b"")
    router.engine.link.mark_failed("connection refused")  # no engine takes requests
    reply = await client.get("/health")
    assert reply.status == 503
    assert (await reply.json())["error"]["message"] == "no engine worker is taking requests"
    router.engine.report_load()  # back
    assert (await client.get("/health")).status == 200
    await front.stop()  # the router's drain
    reply = await client.get("/health")
    assert (reply.status, (await reply.json())["error"]["message"]) == (
        503, "the router is draining (shutting down)")


async def test_version_and_metrics_on_the_http_port(setup):
    _, _, client = setup
    version = await (await client.get("/version")).json()
    assert isinstance(version["version"], str) and version["version"]
    assert (await client.get("/metrics")).status == 401  # series name tenants: a key is needed
    reply = await client.post("/v1/completions", headers=AUTH,
                              json={"model": "m", "prompt": "w1 w2", "max_tokens": 2})
    assert reply.status == 200
    reply = await client.get("/metrics", headers=AUTH)
    assert reply.status == 200 and reply.headers["Content-Type"].startswith("text/plain; version=")
    text = await reply.text()
    assert 'omnibus_router_requests_total{model_name="m",outcome="length"} 1.0' in text
    assert "process_cpu_seconds_total" in text or "omnibus_router_queue_length" in text


async def test_tokenize_is_the_prompt_the_completion_gets(setup):
    router, _, client = setup
    reply = await client.post("/tokenize", headers=AUTH, json={"prompt": "w1 w2 w3"})
    assert await reply.json() == {"count": 3, "max_model_len": 1024, "tokens": [1, 2, 3], "token_strs": None}
    reply = await client.post("/tokenize", headers=AUTH, json={
        "model": "m", "prompt": "w4 w5", "add_special_tokens": False, "return_token_strs": True})
    assert (await reply.json())["token_strs"] == ["w4", "w5"]
    # messages: the chat completion's prompt
    messages = [{"role": "user", "content": "w3 w4"}]
    reply = await client.post("/v1/chat/completions", headers=AUTH,
                              json={"model": "m", "messages": messages, "max_tokens": 1})
    assert reply.status == 200
    chat_ids = list(router.engine.requests[-1].prompt_token_ids)
    reply = await client.post("/tokenize", headers=AUTH, json={"messages": messages})
    assert (await reply.json())["tokens"] == chat_ids == [3, 4, 9]
    reply = await client.post("/tokenize", headers=AUTH,
                              json={"messages": messages, "add_generation_prompt": False})
    assert (await reply.json())["tokens"] == [3, 4]


@pytest.mark.parametrize(("body", "headers", "status", "param", "message"), [
    ({"prompt": "w1"}, {}, 401, None, "missing 'authorization: Bearer <key>' header"),
    ({"prompt": "w1", "model": "gpt-4o"}, AUTH, 404, "model", "model 'gpt-4o' does not exist"),
    ({"prompt": "w1", "messages": []}, AUTH, 400, "prompt", "send either prompt (text) or messages"),
    ({}, AUTH, 400, "prompt", "send either prompt (text) or messages"),
    ({"prompt": "w1", "add_generation_prompt": True}, AUTH, 400, "add_generation_prompt",
     "add_generation_prompt is for messages"),
    ({"prompt": "w1", "nope": 1}, AUTH, 400, "nope", "unknown field 'nope'"),
    ({"prompt": 5}, AUTH, 400, "prompt", "prompt: Input should be a valid string"),
])  # fmt: skip
async def test_tokenize_refusals_name_the_field(setup, body, headers, status, param, message):
    _, _, client = setup
    reply = await client.post("/tokenize", headers=headers, json=body)
    error = (await reply.json())["error"]
    assert (reply.status, error["param"]) == (status, param), error
    assert error["message"].startswith(message), error


async def test_detokenize_checks_the_ids_as_a_prompts(setup):
    _, _, client = setup
    reply = await client.post("/detokenize", headers=AUTH, json={"tokens": [1, 2, 3]})
    assert await reply.json() == {"prompt": "w1 w2 w3"}
    assert await (await client.post("/detokenize", headers=AUTH, json={"tokens": []})).json() == {"prompt": ""}
    for tokens, message in (([1, 64], "tokens: token id 64 is outside the vocabulary [0, 64)"),
                            ([1, -1], "tokens: token id -1 is outside the vocabulary [0, 64)"),
                            ([1, 2**31], "tokens.1: Input should be less than or equal to 2147483647")):
        reply = await client.post("/detokenize", headers=AUTH, json={"tokens": tokens})
        error = (await reply.json())["error"]
        assert (reply.status, error["message"]) == (400, message)
    assert (await client.post("/detokenize", json={"tokens": [1]})).status == 401


async def test_tokenizer_info_shows_the_special_tokens_and_template(setup):
    _, _, client = setup
    assert (await client.get("/tokenizer_info")).status == 401
    info = await (await client.get("/tokenizer_info", headers=AUTH)).json()
    assert {k: info[k] for k in ("bos_token", "eos_token", "chat_template", "model_max_length",
                                 "tokenizer_class")} == {
        "bos_token": "w1", "eos_token": "w2", "chat_template": TEMPLATE, "model_max_length": 1024,
        "tokenizer_class": "PreTrainedTokenizerFast"}
    assert "added_tokens_decoder" not in info


# ---- continuous usage -------------------------------------------------------------------


async def stream(client: TestClient, body: dict, path: str = "/v1/completions") -> list[dict]:
    reply = await client.post(path, headers=AUTH, json={"model": "m", "stream": True, **body})
    assert reply.status == 200, await reply.text()
    events = (await reply.text()).split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    return [json.loads(e.removeprefix("data: ")) for e in events[:-2]]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk(setup, path):
    _, _, client = setup
    body = {"prompt": "w1 w2"} if path == "/v1/completions" else {
        "messages": [{"role": "user", "content": "w1"}]}  # "w1 w9": 2 tokens
    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = await stream(client, {**body, "max_tokens": 3, "n": 2, "stream_options": options}, path)
    *running, last = chunks
    assert last["choices"] == [] and last["usage"] | {"prompt_tokens_details": None} == {
        "prompt_tokens": 2, "completion_tokens": 6, "total_tokens": 8, "prompt_tokens_details": None}
    completions = [c["usage"]["completion_tokens"] for c in running]
    assert all(c["usage"]["prompt_tokens"] == 2 for c in running)
    assert completions == sorted(completions) and completions[-1] == 6
    assert all(c["usage"]["total_tokens"] == 2 + c["usage"]["completion_tokens"] for c in running)
    # Without include_usage: usage on every chunk, and no usage-only chunk at the end.
    chunks = await stream(client, {**body, "max_tokens": 3, "stream_options": {"continuous_usage_stats": True}},
                          path)
    assert all(c["choices"] for c in chunks) and chunks[-1]["usage"]["completion_tokens"] == 3
    # Off: as before, null on each chunk with include_usage.
    chunks = await stream(client, {**body, "max_tokens": 3, "stream_options": {"include_usage": True}}, path)
    assert all(c["usage"] is None for c in chunks[:-1])


# ---- batched prompts ----------------------------------------------------------------------


async def complete(client: TestClient, body: dict, headers: dict = AUTH) -> tuple[int, dict]:
    reply = await client.post("/v1/completions", headers=headers, json={"model": "m", **body})
    return reply.status, await reply.json()


@pytest.mark.parametrize("prompt", [["w1", "w1 w2 w3"], [[1], [1, 2, 3]], ["w1", [1, 2, 3]]])
async def test_batched_prompts_are_indexed_prompt_major_and_usage_is_summed(setup, prompt):
    router, _, client = setup
    router.engine.tokens = 2
    status, reply = await complete(client, {"prompt": prompt, "n": 2, "max_tokens": 5, "return_token_ids": True})
    assert status == 200, reply
    assert [c["index"] for c in reply["choices"]] == [0, 1, 2, 3]
    assert reply["usage"]["prompt_tokens"] == 1 + 3  # each prompt once
    assert reply["usage"]["completion_tokens"] == 4 * 2
    sent = sorted(list(r.prompt_token_ids) for r in router.engine.requests)
    assert sent == [[1], [1], [1, 2, 3], [1, 2, 3]]


async def test_batched_prompts_stream_each_choice_under_its_index(setup):
    router, _, client = setup
    chunks = await stream(client, {"prompt": ["w1", "w2 w3", "w4"], "max_tokens": 2,
                                   "stream_options": {"include_usage": True}})
    finished = sorted(c["choices"][0]["index"] for c in chunks[:-1] if c["choices"][0]["finish_reason"])
    assert finished == [0, 1, 2]
    assert chunks[-1]["usage"]["prompt_tokens"] == 4 and chunks[-1]["usage"]["completion_tokens"] == 6


@pytest.mark.parametrize(("prompt", "param", "message"), [
    (["w1"] * 4, "prompt", "prompt holds 4 prompts; at most 3 per request"),
    ([], "prompt", "prompt must be a non-empty string or a non-empty list of token ids, or a list"),
    (["w1", []], "prompt.1", "prompt.1 must be a non-empty string or a non-empty list of token ids"),
    (["w1", 5], "prompt.1", "prompt.1 must be a non-empty string"),
    (["w1", [1, 2**31]], "prompt.1", "prompt.1: token id 2147483648 is outside the vocabulary"),
    (["w1", ""], "prompt.1", "prompt 1: the prompt text is empty"),
    (["w1", [1, 99]], "prompt.1", "prompt 1: prompt token_ids: token id 99 is outside the vocabulary"),
    ([[1], [2], [3]], None, None),
])  # fmt: skip
async def test_batched_prompt_refusals_name_the_prompt(setup, prompt, param, message):
    router, _, client = setup
    status, reply = await complete(client, {"prompt": prompt, "max_tokens": 2})
    if message is None:
        assert status == 200 and len(reply["choices"]) == 3
        return
    assert (status, reply["error"]["param"]) == (400, param), reply
    assert reply["error"]["message"].startswith(message), reply
    assert router.engine.requests == []  # all or none


async def test_a_batch_is_admitted_whole_and_charged_what_it_used(setup):
    router, _, client = setup
    tight = {"Authorization": "Bearer sk-tight"}
    # 2 choices charged as the longest prompt (5) + max_tokens 20 each: 50 of 60; each used
    # its prompt + 3 tokens, so 1 + 3 + 5 + 3 = 12 is spent and 48 are left.
    status, reply = await complete(client, {"prompt": ["w1", "w1 w2 w3 w4 w5"], "max_tokens": 20}, tight)
    assert status == 200, reply
    status, reply = await complete(client, {"prompt": ["w1", "w1"], "max_tokens": 24}, tight)  # 50
    assert status == 429
    assert "(this request needs 50 for its 2 choices, 4" in reply["error"]["message"], reply
    # Over the whole budget: never admitted, and nothing reached an engine.
    before = len(router.engine.requests)
    status, reply = await complete(client, {"prompt": ["w1", "w1 w2"], "max_tokens": 40}, tight)
    assert (status, reply["error"]["code"], reply["error"]["param"]) == (400, "tenant_budget", "max_tokens")
    assert reply["error"]["message"].endswith(
        "lower max_tokens to at most 28 or lower n (the 2 prompts of n=1 choices each run 2 "
        "choices: send fewer prompts per request)"), reply
    assert len(router.engine.requests) == before
    # A batch over the tenant's concurrency: every prompt's choices count.
    status, reply = await complete(client, {"prompt": ["w1", "w2", "w3"], "max_tokens": 1},
                                   {"Authorization": "Bearer sk-two"})
    assert (status, reply["error"]["param"]) == (400, "prompt"), reply
    assert reply["error"]["message"] == (
        "n=3 choices run side by side but tenant 'two' may run 2 requests at once; lower n (the 3 "
        "prompts of n=1 choices each run 3 choices: send fewer prompts per request)")


async def test_max_prompt_tokens_names_the_prompt_of_a_batch_over_it(tmp_path):
    router = Router(tmp_path, TENANTS)
    router.limits = dataclasses.replace(router.limits, max_prompt_tokens=5)
    await router.start()
    _, client = await serve(router)
    try:
        status, reply = await complete(client, {"prompt": ["w1", "w1 " * 6], "max_tokens": 2})
        assert (status, reply["error"]["param"]) == (400, "prompt.1"), reply
        assert reply["error"]["message"] == "prompt 1: the prompt has 6 tokens; the limit is 5"
    finally:
        await client.close()
        await router.close()


# ---- seeds of n choices -------------------------------------------------------------------


def test_choice_seeds_are_not_the_next_seeds_and_never_collide():
    """Choice i of seed S had seed S + i: the single choice of seed S + i, so requests with
    adjacent seeds shared samples."""
    seeds = {v1_requests.choice_seed(s % 2**64, j) for s in range(-100, 1000) for j in range(8)}
    assert len(seeds) == 1100 * 8  # no two (seed, choice) pairs share a seed
    assert v1_requests.choice_seed(40, 0) == 40  # choice 0 is the request's seed, as with n=1
    assert v1_requests.choice_seed(40, 1) not in range(-100, 2000)
    assert v1_requests.choice_seed(2**64 - 1, 3) == v1_requests.choice_seed(2**64 - 1, 3) < 2**64  # reproducible, a uint64


async def test_n_choices_get_seeds_derived_from_the_request_seed(setup):
    router, _, client = setup
    status, _ = await complete(client, {"prompt": ["w1", "w2"], "n": 3, "seed": 7, "max_tokens": 1})
    assert status == 200
    by_prompt = {}
    for r in router.engine.requests:
        by_prompt.setdefault(tuple(r.prompt_token_ids), set()).add(r.sampling.seed)
    expected = {7, v1_requests.choice_seed(7, 1), v1_requests.choice_seed(7, 2)}
    assert by_prompt == {(1,): expected, (2,): expected}  # each prompt as a request of its own


# ---- echo and prompt logprobs (lm-evaluation-harness's loglikelihood requests) ----------

# The scripted engine's logprobs (inprocess.scripted_logprob): prompt token at position p
# -p/10 - 0.5, a generated token -0.5; alternatives w60, w61... at -0.1, -0.2...
def lp(p: int) -> float:
    return pytest.approx(-p / 10 - 0.5)


async def test_echo_with_logprobs_is_openais_shape_for_each_prompt_of_a_batch(setup):
    """What lm-eval sends for loglikelihood with --batch_size: the prompts echoed, their
    tokens scored (null first), the one generated token after them."""
    router, _, client = setup
    status, reply = await complete(client, {"prompt": ["w1 w2 w3", [4, 7]], "max_tokens": 1,
                                            "logprobs": 1, "echo": True, "temperature": 0})
    assert status == 200, reply
    first, second = reply["choices"]
    assert (first["index"], first["text"], second["text"]) == (0, "w1 w2 w3 w5", "w4 w7 w5")
    assert first["logprobs"]["tokens"] == ["w1", "w2", "w3", "w5"]
    assert first["logprobs"]["token_logprobs"] == [None, lp(1), lp(2), lp(0)]
    assert first["logprobs"]["top_logprobs"] == [
        None, {"w60": pytest.approx(-0.1), "w2": lp(1)}, {"w60": pytest.approx(-0.1), "w3": lp(2)},
        {"w60": pytest.approx(-0.1), "w5": lp(0)}]
    assert first["logprobs"]["text_offset"] == [0, 3, 6, 9]  # into the echoed text
    assert second["logprobs"]["tokens"] == ["w4", "w7", "w5"]
    assert second["logprobs"]["token_logprobs"] == [None, lp(1), lp(0)]
    assert second["logprobs"]["text_offset"] == [0, 3, 6]
    assert reply["usage"]["prompt_tokens"] == 5 and reply["usage"]["completion_tokens"] == 2
    assert [(r.sampling.logprobs, r.sampling.prompt_logprobs) for r in router.engine.requests] == [(1, 1)] * 2


async def test_echo_with_max_tokens_0_is_the_prompt_alone(setup):
    router, _, client = setup
    status, reply = await complete(client, {"prompt": "w1 w2 w3", "max_tokens": 0, "logprobs": 0, "echo": True})
    assert status == 200, reply
    (choice,) = reply["choices"]
    assert (choice["text"], choice["finish_reason"]) == ("w1 w2 w3", "length")
    assert choice["logprobs"] == {"tokens": ["w1", "w2", "w3"], "token_logprobs": [None, lp(1), lp(2)],
                                  "top_logprobs": [None, {"w2": lp(1)}, {"w3": lp(2)}],  # logprobs 0: no alternatives
                                  "text_offset": [0, 3, 6]}
    assert reply["usage"] | {"prompt_tokens_details": None} == {
        "prompt_tokens": 3, "completion_tokens": 0, "total_tokens": 3, "prompt_tokens_details": None}
    # the engine ran one token (the prompt's logprobs come with it), which nobody gets
    assert router.engine.requests[-1].sampling.max_tokens == 1
    chunks = await stream(client, {"prompt": "w1 w2", "max_tokens": 0, "echo": True,
                                   "stream_options": {"include_usage": True}})
    assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == "w1 w2"
    assert chunks[-1]["usage"]["completion_tokens"] == 0
    # max_tokens 0 is for echo only
    status, reply = await complete(client, {"prompt": "w1", "max_tokens": 0})
    assert (status, reply["error"]["param"]) == (400, "max_tokens")
    assert reply["error"]["message"].startswith("max_tokens must be at least 1, or 0 with echo: true")


async def test_echo_without_logprobs_repeats_the_prompt_and_scores_nothing(setup):
    router, _, client = setup
    router.engine.tokens = 2
    status, reply = await complete(client, {"prompt": ["w1 w2", [3]], "max_tokens": 2, "echo": True})
    assert status == 200, reply
    assert [(c["text"], c["logprobs"]) for c in reply["choices"]] == [("w1 w2 w5 w5", None), ("w3 w5 w5", None)]
    assert [r.sampling.prompt_logprobs for r in router.engine.requests] == [0, 0]
    # streamed: the prompt with the first chunk, with its logprobs when asked
    chunks = await stream(client, {"prompt": "w1 w2", "max_tokens": 2, "echo": True, "logprobs": 1})
    texts = [c["choices"][0]["text"] for c in chunks]
    assert texts[0].startswith("w1 w2") and "".join(texts) == "w1 w2 w5 w5"
    head = chunks[0]["choices"][0]["logprobs"]
    assert head["tokens"][:2] == ["w1", "w2"] and head["token_logprobs"][:2] == [None, lp(1)]
    assert chunks[-1]["choices"][0]["logprobs"]["text_offset"] == [9]


async def test_grpc_prompt_logprobs_come_on_the_first_message_within_the_logprobs_range(setup):
    router, _, _ = setup
    tenant = router.pipeline.authenticate([("authorization", "Bearer sk-t")])
    request = inference_pb2.GenerateRequest(
        token_ids=inference_pb2.TokenIds(ids=[1, 2, 3]),
        sampling=inference_pb2.SamplingParams(max_tokens=2, prompt_logprobs=2))
    responses = [r async for r in router.pipeline.generate(request, Caller(tenant))]
    assert [len(r.prompt_logprobs) for r in responses] == [2, 0]  # the first message only
    assert [(p.token_id, [t.token_id for t in p.top]) for p in responses[0].prompt_logprobs] == [
        (2, [60, 61]), (3, [60, 61])]
    request.sampling.prompt_logprobs = 21
    with pytest.raises(RequestError) as err:
        [r async for r in router.pipeline.generate(request, Caller(tenant))]
    assert (err.value.param, err.value.message) == ("prompt_logprobs", "prompt_logprobs must be in [0, 20], got 21")
