"""The router's OpenAI-compatible HTTP front over real processes, driven by the official
`openai` client (and httpx for the raw SSE bytes and headers): token-exact with the gRPC
API on the same router (one pipeline), chat prompts as transformers renders the
template, adapters by `model` and by header equal to PEFT, every error status, client
disconnects freeing every KV block, and 100 concurrent streams.

Tenants share cached prefixes only within their cache group, on both APIs.

Three routers share one engine: `main` (keys file, chat template, adapters), `plain`
(the checkpoint as is: no chat template; one request in flight and a 0.5 s queue limit,
for 504) and `orphan` (its engine address has nothing listening, for 503).
"""

from __future__ import annotations

import asyncio
import base64
import codecs
import json
import os
import random
import struct
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import openai
import pytest
import transformers
from omnibus.v1 import engine_pb2, engine_pb2_grpc, inference_pb2_grpc
from omnibus.v1 import inference_pb2 as pb
from tokenizers import Tokenizer

from omnibus.common.sampling import SamplingParams
from tests.checkpoints import hf_greedy
from tests.grpc_helpers import (
    ServerProcess,
    engine_process,
    engine_stats,
    free_port,
    router_process,
    tiny_checkpoint,
    wait_until,
)
from tests.oracle.test_lora import ADAPTERS, make_adapter

MODEL = "tiny-llama"
NUM_KV_BLOCKS = 256
ENGINE_FLAGS = ("--block-size", "8", "--num-kv-blocks", str(NUM_KV_BLOCKS), "--max-num-seqs", "16",
                "--max-loras", "2")  # fmt: skip
TENANTS = {
    "acme": {"keys": ["key-acme"], "adapters": ["a-r2"]},
    "initech": {"keys": ["key-initech"]},  # any adapter
    "tight": {"keys": ["key-tight"], "tokens_per_minute": 60, "max_concurrent": 1},
    # prefix-cache groups: team-a and team-c share one, loner has its own (its name's)
    "team-a": {"keys": ["key-team-a"], "cache_group": "team"},
    "team-c": {"keys": ["key-team-c"], "cache_group": "team"},
    "loner": {"keys": ["key-loner"]},
}
# A ChatML-like template, with the special tokens and raise_exception HF templates use.
CHAT_TEMPLATE = (
    "{% if messages[0]['role'] == 'assistant' %}"
    "{{ raise_exception('a conversation must not start with the assistant') }}{% endif %}"
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
PROMPT = "Once upon a time"
PROMPT_IDS = [5, 6, 7, 8, 9, 10]
MESSAGES = [
    {"role": "system", "content": "You are a fox."},
    {"role": "user", "content": [{"type": "text", "text": "Every day the fox "}, {"type": "text", "text": "ran"}]},
]  # fmt: skip


@dataclass
class Cluster:
    model: Path
    chat_model: Path
    engine: ServerProcess
    main: ServerProcess
    plain: ServerProcess
    orphan: ServerProcess
    http: dict[str, int]  # router name -> HTTP port
    peft: dict[str, object]  # adapter -> PEFT model

    def url(self, router: str = "main") -> str:
        return f"http://127.0.0.1:{self.http[router]}/v1"

    def client(self, key: str = "key-initech", router: str = "main", **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url(router), api_key=key, max_retries=0, **kw)

    def grpc(self, request: pb.GenerateRequest, key: str = "key-initech", adapter: str = ""):
        stub = inference_pb2_grpc.InferenceStub(grpc.insecure_channel(self.main.address))
        metadata = [("authorization", f"Bearer {key}"), ("x-adapter-id", adapter)]
        return list(stub.Generate(request, metadata=metadata, timeout=60))


def serving_http(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=1) as reply:
            return reply.status == 200
    except OSError:
        return False


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[Cluster]:
    model = tiny_checkpoint(tmp_path_factory)
    root = tmp_path_factory.mktemp("openai-http")
    chat_model = root / MODEL  # what the router reads, plus a chat template
    chat_model.mkdir()
    for name in ("config.json", "tokenizer.json"):
        os.symlink(model / name, chat_model / name)
    config = json.loads((model / "tokenizer_config.json").read_text())
    (chat_model / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": CHAT_TEMPLATE}))
    peft = {name: make_adapter(model, root / "adapters" / name, *ADAPTERS[name], seed=i)
            for i, name in enumerate(("a-r2", "b-r8"))}  # fmt: skip
    keys = root / "keys.json"
    keys.write_text(json.dumps({"tenants": TENANTS}))
    logs = tmp_path_factory.mktemp("logs")
    engine = engine_process(model, logs, "engine", *ENGINE_FLAGS, "--adapter-dir", str(root / "adapters"))
    http = {name: free_port() for name in ("main", "plain", "orphan")}
    name_flag = f"--model-name={MODEL}"
    main = router_process(chat_model, [engine.address], logs, "router-main", name_flag,
                          f"--keys-file={keys}", f"--http-port={http['main']}", "--max-n=4")
    plain = router_process(model, [engine.address], logs, "router-plain", name_flag,
                           f"--http-port={http['plain']}", "--max-inflight-per-engine=1",
                           "--max-queue-seconds=0.5")
    orphan = router_process(model, [f"127.0.0.1:{free_port()}"], logs, "router-orphan",
                            name_flag, f"--http-port={http['orphan']}")  # fmt: skip
    procs = [engine, main, plain, orphan]
    try:
        for proc in (engine, main, plain):
            proc.wait_serving()
        wait_until(lambda: serving_http(http["orphan"]), 60, "the orphan router's HTTP port")
        yield Cluster(model, chat_model, engine, main, plain, orphan, http, peft)
    finally:
        for proc in reversed(procs):
            proc.stop()


def greedy_grpc(prompt: str | list[int], max_tokens: int, **sampling) -> pb.GenerateRequest:
    params = pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, **sampling)
    if isinstance(prompt, str):
        return pb.GenerateRequest(text=prompt, sampling=params)
    return pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling=params)


def grpc_result(responses: list[pb.GenerateResponse]) -> tuple[str, list[int], str]:
    finish = pb.FinishReason.Name(responses[-1].finish_reason).lower()
    return "".join(r.text for r in responses), [t for r in responses for t in r.token_ids], finish


def chat_prompt_ids(cluster: Cluster) -> list[int]:
    """The chat prompt as transformers renders and tokenizes it (the reference)."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(cluster.chat_model)
    flat = [{"role": m["role"], "content": m["content"] if isinstance(m["content"], str)
             else "\n".join(p["text"] for p in m["content"])} for m in MESSAGES]  # fmt: skip
    ids = tokenizer.apply_chat_template(flat, add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if not isinstance(ids, list) else ids
    return list(ids)


def is_idle(address: str) -> bool:
    s = engine_stats(address)
    return s.num_active_streams == 0 and s.load.num_running == 0 and s.load.num_waiting == 0


def wait_all_blocks_free(cluster: Cluster) -> None:
    wait_until(lambda: is_idle(cluster.engine.address), 30, "the engine to be idle")
    load = engine_stats(cluster.engine.address).load
    assert (load.num_free_blocks, load.num_total_blocks) == (NUM_KV_BLOCKS - 1, NUM_KV_BLOCKS - 1)


# ---- completions and chat, token-exact with gRPC -------------------------------------


@pytest.mark.parametrize("prompt", [PROMPT, PROMPT_IDS], ids=["text", "token-ids"])
def test_completion_equals_grpc_streamed_and_not(cluster, prompt):
    text, ids, finish = grpc_result(cluster.grpc(greedy_grpc(prompt, 12)))
    client = cluster.client()
    extra = {"return_token_ids": True}
    reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                      extra_body=extra)  # fmt: skip
    (choice,) = reply.choices
    assert (choice.text, choice.token_ids, choice.finish_reason) == (text, ids, finish)
    assert reply.object == "text_completion" and reply.model == MODEL
    assert reply.usage.completion_tokens == len(ids) and reply.usage.total_tokens == (
        reply.usage.prompt_tokens + len(ids))
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=12,
                                            temperature=0, stream=True, extra_body=extra))  # fmt: skip
    assert "".join(c.choices[0].text for c in chunks) == text
    assert [t for c in chunks for t in c.choices[0].token_ids] == ids
    assert [c.choices[0].finish_reason for c in chunks] == [None] * (len(chunks) - 1) + [finish]


def test_chat_uses_the_models_template_and_equals_grpc(cluster):
    expected = grpc_result(cluster.grpc(greedy_grpc(chat_prompt_ids(cluster), 10)))
    client = cluster.client()
    kw = dict(model=MODEL, messages=MESSAGES, max_tokens=10, temperature=0,
              extra_body={"return_token_ids": True})  # fmt: skip
    reply = client.chat.completions.create(**kw)
    (choice,) = reply.choices
    assert (choice.message.content, choice.token_ids, choice.finish_reason) == expected
    assert choice.message.role == "assistant" and reply.object == "chat.completion"
    assert reply.usage.prompt_tokens == len(chat_prompt_ids(cluster))
    chunks = list(client.chat.completions.create(**kw, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(expected[1])
    assert chunks[-2].choices[0].finish_reason == expected[2]
    assert "".join(c.choices[0].delta.content or "" for c in chunks[:-1]) == expected[0]
    assert all(c.usage is None for c in chunks[:-1])


STRUCTURED_SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 5},
                                                    "n": {"type": "integer", "maximum": 9}},
                     "required": ["name", "n"]}


def test_structured_output_equals_grpc_and_a_bad_schema_is_400(cluster):
    """response_format through the official client is gRPC's structured_output (token-exact
    on one pipeline); a schema the engine's grammar compiler refuses is 400 naming it."""
    schema_text = json.dumps(STRUCTURED_SCHEMA)
    client = cluster.client()
    for fmt, response_format in (
        (pb.StructuredOutput(json_schema=schema_text),
         {"type": "json_schema", "json_schema": {"name": "thing", "schema": STRUCTURED_SCHEMA, "strict": True}}),
        (pb.StructuredOutput(json_object=True), {"type": "json_object"}),
    ):
        expected = grpc_result(cluster.grpc(greedy_grpc(PROMPT_IDS, 40, structured_output=fmt)))
        reply = client.completions.create(model=MODEL, prompt=PROMPT_IDS, max_tokens=40, temperature=0,
                                          extra_body={"return_token_ids": True, "response_format": response_format})
        (choice,) = reply.choices
        assert (choice.text, choice.token_ids, choice.finish_reason) == expected
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(choice.text), dict)
    reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=40, temperature=0,
                                           response_format={"type": "json_object"})
    if reply.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(reply.choices[0].message.content), dict)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, response_format={
            "type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "nonsense"}}})
    assert err.value.body["param"] == "response_format"
    assert err.value.body["message"].startswith("response_format: the JSON schema does not compile")


def test_logit_bias_is_grpcs_and_a_bad_one_is_400_naming_it(cluster):
    """OpenAI's logit_bias (token ids as strings) is gRPC's logit_bias map: +100 on a token
    makes greedy take it every step; bad keys, biases and ids are 400 with param logit_bias."""
    client = cluster.client()
    expected = grpc_result(cluster.grpc(greedy_grpc(PROMPT_IDS, 6, logit_bias={123: 100.0})))
    reply = client.completions.create(model=MODEL, prompt=PROMPT_IDS, max_tokens=6, temperature=0,
                                      logit_bias={"123": 100}, extra_body={"return_token_ids": True})
    (choice,) = reply.choices
    assert (choice.text, choice.token_ids, choice.finish_reason) == expected
    assert choice.token_ids == [123] * 6
    for bias, message in (
        ({"x": 1}, "logit_bias keys must be token ids (integers >= 0 as strings), got 'x'"),
        ({"123": 101}, "logit_bias of token 123 must be a number in [-100, 100], got 101"),
        ({"99999": 1}, "logit_bias: token id 99999 is outside the vocabulary"),
    ):
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model=MODEL, prompt=PROMPT_IDS, max_tokens=2, logit_bias=bias)
        assert err.value.body["param"] == "logit_bias"
        assert message in err.value.body["message"]


def test_raw_sse_is_what_the_openai_api_sends(cluster):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 5, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True}  # fmt: skip
    with httpx.stream("POST", cluster.url() + "/completions", json=body, timeout=30,
                      headers={"Authorization": "Bearer key-initech"}) as reply:  # fmt: skip
        assert reply.status_code == 200
        assert reply.headers["content-type"].startswith("text/event-stream")
        raw = reply.read().decode()
    events = raw.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert all(e.startswith("data: {") for e in events[:-2])
    assert {c["object"] for c in chunks} == {"text_completion"} and len({c["id"] for c in chunks}) == 1
    assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]][-1] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 5


def test_n_choices_draw_from_seeds_of_their_own(cluster):
    """Choice i had seed + i, the single choice of seed + i: adjacent seeds shared samples."""
    from omnibus.router.http.v1_requests import choice_seed

    def grpc_text(seed: int) -> str:
        request = pb.GenerateRequest(text=PROMPT, sampling=pb.SamplingParams(
            max_tokens=8, temperature=1.0, seed=seed, ignore_eos=True))
        return grpc_result(cluster.grpc(request))[0]

    reply = cluster.client().completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=8, temperature=1.0, seed=40, n=3,
        extra_body={"ignore_eos": True})  # fmt: skip
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert [c.text for c in reply.choices] == [grpc_text(choice_seed(40, i)) for i in range(3)]
    assert reply.choices[0].text == grpc_text(40) and reply.choices[1].text != grpc_text(41)
    assert reply.usage.completion_tokens == 24


def test_what_vllm_clients_probe_and_send(cluster):
    """lm-evaluation-harness and guidellm: /health, /tokenizer_info, /tokenize,
    /detokenize, /metrics, /version, batched prompts (token-exact with gRPC, prompt-major
    with n) and streams with continuous_usage_stats."""
    url, auth = cluster.url().removesuffix("/v1"), {"Authorization": "Bearer key-initech"}
    assert httpx.get(url + "/health").status_code == 200  # no key: as gRPC health
    orphan = httpx.get(f"http://127.0.0.1:{cluster.http['orphan']}/health")
    assert orphan.status_code == 503
    assert httpx.get(url + "/version").json()["version"]
    info = httpx.get(url + "/tokenizer_info", headers=auth).json()
    assert info["eos_token"] == "</s>" and info["chat_template"] == CHAT_TEMPLATE, info
    tokenized = httpx.post(url + "/tokenize", headers=auth, json={"prompt": PROMPT}).json()
    reference = Tokenizer.from_file(str(cluster.model / "tokenizer.json"))
    assert tokenized["tokens"] == reference.encode(PROMPT).ids
    chat = httpx.post(url + "/tokenize", headers=auth, json={"messages": MESSAGES}).json()
    assert chat["tokens"] == chat_prompt_ids(cluster)
    text = httpx.post(url + "/detokenize", headers=auth, json={"tokens": tokenized["tokens"]}).json()
    assert text["prompt"].endswith(PROMPT), text
    # Batched prompts: each choice as gRPC serves its prompt alone.
    prompts = [PROMPT, PROMPT_IDS]
    expected = [grpc_result(cluster.grpc(greedy_grpc(p, 6, ignore_eos=True)))[0] for p in prompts]
    reply = cluster.client().completions.create(model=MODEL, prompt=prompts, max_tokens=6, n=2,
                                                temperature=0, extra_body={"ignore_eos": True})
    assert [(c.index, c.text) for c in reply.choices] == [
        (0, expected[0]), (1, expected[0]), (2, expected[1]), (3, expected[1])]
    assert reply.usage.prompt_tokens == tokenized["count"] + len(PROMPT_IDS)
    # guidellm's stream: usage on every chunk.
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 5, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with httpx.stream("POST", cluster.url() + "/completions", json=body, headers=auth, timeout=30) as sse:
        events = [json.loads(e.removeprefix("data: ")) for e in sse.read().decode().split("\n\n")[:-2]]
    counts = [e["usage"]["completion_tokens"] for e in events]
    assert counts == sorted(counts) and counts[-1] == 5 and events[-1]["choices"] == [], counts
    assert {e["usage"]["prompt_tokens"] for e in events} == {tokenized["count"]}
    metrics = httpx.get(url + "/metrics", headers=auth).text
    assert 'omnibus_router_requests_total{model_name="tiny-llama",outcome="length"}' in metrics


def token_bytes(tokenizer: Tokenizer, token_id: int) -> bytes:
    """A byte-level BPE token's bytes, by transformers' own table (the oracle)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_of = {c: b for b, c in bytes_to_unicode().items()}
    return bytes(byte_of[c] for c in tokenizer.id_to_token(token_id))


def openai_name(data: bytes) -> str:
    try:
        return data.decode()
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in data)


def test_completion_logprobs_equal_grpc(cluster):
    responses = cluster.grpc(greedy_grpc(PROMPT, 8, logprobs=2, ignore_eos=True))
    expected = [lp for r in responses for lp in r.logprobs]
    reply = cluster.client().completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=2,
        extra_body={"ignore_eos": True})  # fmt: skip
    logprobs = reply.choices[0].logprobs
    assert logprobs.token_logprobs == pytest.approx([lp.logprob for lp in expected])
    tokenizer = Tokenizer.from_file(str(cluster.model / "tokenizer.json"))
    for got, want in zip(logprobs.top_logprobs, expected, strict=True):
        tops = {openai_name(token_bytes(tokenizer, t.token_id)): t.logprob for t in want.top}
        assert got == pytest.approx(tops) and len(want.top) == 2
    chosen = [token_bytes(tokenizer, lp.token_id) for lp in expected]
    assert logprobs.tokens == [openai_name(b) for b in chosen]
    assert b"".join(chosen).decode(errors="replace") == reply.choices[0].text
    # a token starts after the characters that the tokens before it completed
    def completed(prefix: list[bytes]) -> int:
        utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        return len("".join(utf8.decode(b) for b in prefix))

    offsets = [completed(chosen[:i]) for i in range(8)]
    assert logprobs.text_offset == offsets


def test_echo_logprobs_score_the_prompt_as_transformers(cluster):
    """lm-evaluation-harness's loglikelihood request (a prompt list with --batch_size): each
    prompt echoed with its tokens' logprobs (the first null) and the one greedy token after
    them, to 1e-4 of transformers' log-softmax."""
    import torch

    from tests.checkpoints import load_hf

    tokenizer = Tokenizer.from_file(str(cluster.model / "tokenizer.json"))
    prompts = [PROMPT_IDS * 4, PROMPT]  # 24 tokens: three KV blocks, cached by earlier requests
    reply = httpx.post(cluster.url() + "/completions", headers={"Authorization": "Bearer key-initech"},
                       json={"model": MODEL, "prompt": prompts, "max_tokens": 1, "logprobs": 1,
                             "echo": True, "temperature": 0}, timeout=60).json()
    hf = load_hf(cluster.model)
    name = lambda t: openai_name(token_bytes(tokenizer, t))  # noqa: E731
    for choice, ids in zip(reply["choices"], [PROMPT_IDS * 4, tokenizer.encode(PROMPT).ids], strict=True):
        with torch.no_grad():
            lp = hf(torch.tensor([ids])).logits[0].log_softmax(-1)  # row i scores token i + 1
        picked = int(lp[-1].argmax())
        scored = [*ids[1:], picked]
        logprobs = choice["logprobs"]
        assert logprobs["tokens"] == [name(t) for t in [*ids, picked]]
        assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
        assert logprobs["token_logprobs"][1:] == pytest.approx(
            [lp[i, t].item() for i, t in enumerate(scored)], abs=1e-4)
        for i, (top, t) in enumerate(zip(logprobs["top_logprobs"][1:], scored, strict=True)):
            best = int(lp[i].argmax())
            assert top == pytest.approx({name(best): lp[i, best].item(), name(t): lp[i, t].item()}, abs=1e-4)
        text = choice["text"]
        assert text.startswith(tokenizer.decode(ids)) and text.endswith(tokenizer.decode([picked]))
        ends = [len(tokenizer.decode(ids[:i])) for i in range(len(ids) + 1)]
        assert logprobs["text_offset"] == ends  # ASCII text: each token where the ones before end
    assert reply["choices"][1]["text"].startswith(PROMPT)
    assert reply["usage"]["completion_tokens"] == 2


def test_chat_logprobs_carry_each_tokens_real_bytes(cluster):
    reply = cluster.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=8, temperature=0,
        logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})  # fmt: skip
    tokenizer = Tokenizer.from_file(str(cluster.model / "tokenizer.json"))
    content = reply.choices[0].logprobs.content
    ids = [tokenizer.token_to_id(t.token) if not t.token.startswith("bytes:") else None for t in content]
    assert len(content) == 8
    joined = b"".join(bytes(t.bytes) for t in content)
    assert joined.decode(errors="replace") == reply.choices[0].message.content
    for item, token_id in zip(content, ids):
        assert item.token == openai_name(bytes(item.bytes))
        assert len(item.top_logprobs) == 2
        if token_id is not None and item.token in tokenizer.get_vocab():
            assert bytes(item.bytes) == token_bytes(tokenizer, token_id)


# ---- LoRA adapters --------------------------------------------------------------------


def test_adapter_by_model_and_by_header_equals_peft(cluster):
    client = cluster.client("key-acme")
    kw = dict(prompt=PROMPT_IDS, max_tokens=6, temperature=0,
              extra_body={"ignore_eos": True, "return_token_ids": True})  # fmt: skip
    by_model = client.completions.create(model="a-r2", **kw).choices[0].token_ids
    by_header = client.completions.create(model=MODEL, extra_headers={"x-adapter-id": "a-r2"},
                                          **kw).choices[0].token_ids  # fmt: skip
    base = client.completions.create(model=MODEL, **kw).choices[0].token_ids
    assert by_model == by_header == hf_greedy(cluster.peft["a-r2"], PROMPT_IDS, 6)
    assert by_model != base


def test_models_lists_the_base_model_and_the_tenants_adapters(cluster):
    def ids(key: str) -> list[str]:
        return [m.id for m in cluster.client(key).models.list()]

    assert ids("key-acme") == [MODEL, "a-r2"]
    assert ids("key-initech") == [MODEL, "a-r2", "b-r8"]
    (adapter,) = [m for m in cluster.client("key-acme").models.list().data if m.id == "a-r2"]
    assert adapter.parent == MODEL
    # models.retrieve: one entry, under the same tenant's list
    assert cluster.client("key-acme").models.retrieve("a-r2").parent == MODEL
    assert cluster.client("key-acme").models.retrieve(MODEL).id == MODEL
    for key, model in (("key-acme", "b-r8"), ("key-acme", "nope")):
        err = status_of(lambda: cluster.client(key).models.retrieve(model))  # noqa: B023
        assert (err.status_code, err.body["param"]) == (404, "model")
        assert err.body["message"].startswith(f"model {model!r} does not exist")


# ---- embeddings -----------------------------------------------------------------------


def test_embeddings_equal_grpc_embed_in_both_encodings(cluster):
    stub = inference_pb2_grpc.InferenceStub(grpc.insecure_channel(cluster.main.address))
    request = pb.EmbedRequest(inputs=[pb.EmbedInput(text=PROMPT), pb.EmbedInput(text="fox")],
                              normalize=True)  # fmt: skip
    expected = stub.Embed(request, metadata=[("authorization", "Bearer key-initech")], timeout=30)
    client = cluster.client()
    reply = client.embeddings.create(model=MODEL, input=[PROMPT, "fox"])  # base64 on the wire
    for got, want in zip(reply.data, expected.embeddings, strict=True):
        assert got.embedding == pytest.approx(list(want.values), abs=1e-6)
    assert reply.usage.prompt_tokens == expected.total_tokens
    raw = httpx.post(cluster.url() + "/embeddings", timeout=30, headers={"Authorization": "Bearer key-acme"},
                     json={"model": MODEL, "input": "fox", "encoding_format": "base64"}).json()  # fmt: skip
    packed = base64.b64decode(raw["data"][0]["embedding"])
    values = struct.unpack(f"<{len(packed) // 4}f", packed)
    assert values == pytest.approx(list(expected.embeddings[1].values), abs=1e-6)


def test_embeddings_name_the_model_that_is_wrong(cluster):
    client = cluster.client()
    unknown = status_of(lambda: client.embeddings.create(model="nope", input="fox"))
    assert (unknown.status_code, unknown.body["param"]) == (404, "model")
    assert unknown.body["message"].startswith("model 'nope' does not exist")
    adapter = status_of(lambda: client.embeddings.create(model="a-r2", input="fox"))
    assert (adapter.status_code, adapter.body["param"]) == (400, "model")
    assert "embeddings come from the base model 'tiny-llama', not adapter 'a-r2'" in adapter.body["message"]


# ---- errors ---------------------------------------------------------------------------


def status_of(call) -> openai.APIStatusError:
    with pytest.raises(openai.APIStatusError) as err:
        call()
    return err.value


ERRORS = {
    "malformed-key": ("main", "", {}, 401, "authentication_error",
                      "the authorization header must be 'Bearer <key>'"),
    "bad-key": ("main", "key-nobody", {}, 401, "authentication_error", "invalid API key"),
    "adapter-outside-list": ("main", "key-acme", {"model": "b-r8"}, 403, "permission_error",
                             "tenant 'acme' may not use adapter 'b-r8'"),
    "unknown-adapter": ("main", "key-initech", {"model": "pirate"}, 404, "not_found_error",
                        "model 'pirate' does not exist"),
    "unknown-model": ("main", "key-initech", {"model": "org/other-model"}, 404, "not_found_error",
                      "model 'org/other-model' does not exist: this server serves 'tiny-llama'"),
    "temperature": ("main", "key-initech", {"temperature": -1}, 400, "invalid_request_error",
                    "temperature must be"),
    "n-over-flag": ("main", "key-initech", {"n": 5}, 400, "invalid_request_error",
                    "n must be in [1, 4], got 5"),
    "unknown-field": ("main", "key-initech", {"extra_body": {"best_guess": 1}}, 400,
                      "invalid_request_error", "unknown field 'best_guess'"),
    "empty-prompt-in-a-batch": ("main", "key-initech", {"prompt": ["a", ""]}, 400,
                                "invalid_request_error", "prompt 1: the prompt text is empty"),
    "context": ("main", "key-initech", {"max_tokens": 1020}, 400, "invalid_request_error",
                "the model's context"),
    # Over the tenant's limits even with nothing else running: retrying cannot help.
    "never-fits-budget": ("main", "key-tight", {"max_tokens": 200}, 400, "invalid_request_error",
                          "budget of 60 tokens per minute, so it can never be admitted"),
    "n-over-concurrency": ("main", "key-tight", {"n": 2}, 400, "invalid_request_error",
                           "n=2 choices run side by side but tenant 'tight' may run 1 requests"),
    "no-engine": ("orphan", "any", {}, 503, "service_unavailable_error",
                  "no engine worker is available; retry later"),
}  # fmt: skip


@pytest.mark.parametrize("name", ERRORS)
def test_errors_have_the_http_status_of_their_grpc_status(cluster, name):
    router, key, overrides, status, kind, message = ERRORS[name]
    client = cluster.client(key or "unused", router)
    kw = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, **overrides}
    headers = {"Authorization": ""} if key == "" else {}
    err = status_of(lambda: client.completions.create(**kw, extra_headers=headers))
    assert err.status_code == status
    assert err.body["type"] == kind, err.body
    assert message in err.body["message"], err.body
    assert "Retry-After" not in err.response.headers or status == 429


PARAMS = {  # the field to blame, as OpenAI's error `param`
    "temperature": ({"temperature": -1}, "temperature"),
    "n": ({"n": 5}, "n"),
    "unknown-field": ({"extra_body": {"best_guess": 1}}, "best_guess"),
    "wrong-type": ({"extra_body": {"top_k": "5"}}, "top_k"),
    "prompt": ({"prompt": ["a", []]}, "prompt.1"),
    "max_tokens": ({"max_tokens": 0}, "max_tokens"),
    "stop": ({"stop": [""]}, "stop"),
    "budget": ({"max_tokens": 200}, "max_tokens"),
}


@pytest.mark.parametrize("name", PARAMS)
def test_errors_name_the_field_to_blame(cluster, name):
    overrides, param = PARAMS[name]
    client = cluster.client("key-tight" if name == "budget" else "key-initech")
    kw = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, **overrides}
    err = status_of(lambda: client.completions.create(**kw))
    assert (err.status_code, err.body["param"]) == (400, param), err.body


def test_fields_sent_as_null_take_their_defaults(cluster):
    url, auth = cluster.url(), {"Authorization": "Bearer key-initech"}
    nulls = {"n": None, "echo": None, "stream": None, "presence_penalty": None,
             "frequency_penalty": None, "logprobs": None, "stream_options": None}  # fmt: skip
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "temperature": 0, **nulls}
    reply = httpx.post(url + "/completions", json=body, headers=auth, timeout=30)
    assert reply.status_code == 200, reply.text
    plain = httpx.post(url + "/completions", headers=auth, timeout=30,
                       json={"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "temperature": 0})
    assert reply.json()["choices"][0]["text"] == plain.json()["choices"][0]["text"]
    chat = {"model": MODEL, "messages": MESSAGES, "max_tokens": 3, "n": None, "logprobs": None,
            "stream": None, "presence_penalty": None}  # fmt: skip
    assert httpx.post(url + "/chat/completions", json=chat, headers=auth, timeout=30).status_code == 200


def test_max_completion_tokens_is_checked_under_its_own_name(cluster):
    client = cluster.client()
    for value in (0, -1):
        err = status_of(lambda: client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_completion_tokens=value))  # noqa: B023
        assert err.status_code == 400 and err.body["param"] == "max_completion_tokens"
        assert err.body["message"].startswith("max_completion_tokens must be in [1, ") and \
            err.body["message"].endswith(f"got {value}")
    # a context overflow it sets names it too (it was blamed on max_tokens, which was not sent)
    err = status_of(lambda: client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_completion_tokens=1020))
    assert err.status_code == 400 and err.body["param"] == "max_completion_tokens"
    assert "+ max_completion_tokens (1020) exceeds the model's context" in err.body["message"], err.body
    reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_completion_tokens=2,
                                           temperature=0, extra_body={"ignore_eos": True})
    assert reply.usage.completion_tokens == 2


def test_429_carries_retry_after_and_the_budget_refills(cluster):
    # 46 of 60 tokens a minute, all used (an early EOS would refund the rest: engines sample
    # unseeded requests from an OS-seeded generator)
    body = {"model": MODEL, "prompt": PROMPT_IDS, "max_tokens": 40, "ignore_eos": True}
    headers = {"Authorization": "Bearer key-tight"}
    first = httpx.post(cluster.url() + "/completions", json=body, headers=headers, timeout=30)
    assert first.status_code == 200
    second = httpx.post(cluster.url() + "/completions", json=body, headers=headers, timeout=30)
    error = second.json()["error"]
    assert (second.status_code, error["code"]) == (429, "tenant_budget")
    wait = int(second.headers["Retry-After"])  # what the message says, in whole seconds
    assert wait >= 1 and error["message"].endswith(f"retry in {wait} s")


def test_chat_errors(cluster):
    plain = cluster.client(router="plain")
    err = status_of(lambda: plain.chat.completions.create(model=MODEL, messages=MESSAGES))
    assert err.status_code == 400
    assert "has no chat template" in err.body["message"] and "/v1/completions" in err.body["message"]
    main = cluster.client()
    err = status_of(lambda: main.chat.completions.create(
        model=MODEL, messages=[{"role": "assistant", "content": "hi"}]))
    assert (err.status_code, err.body["message"]) == (
        400, "the model's chat template refused the messages: a conversation must not start "
        "with the assistant")  # fmt: skip
    err = status_of(lambda: main.chat.completions.create(model=MODEL, messages=[
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]))
    assert err.status_code == 400 and "only text parts are supported" in err.body["message"]


def test_raw_http_errors_are_openai_json(cluster):
    url, auth = cluster.url(), {"Authorization": "Bearer key-initech"}
    no_key = httpx.post(url + "/completions", json={"model": MODEL, "prompt": PROMPT})
    assert (no_key.status_code, no_key.json()["error"]["message"]) == (
        401, "missing 'authorization: Bearer <key>' header")
    bad_json = httpx.post(url + "/completions", content=b"{nope", headers=auth)
    assert bad_json.status_code == 400
    assert bad_json.json()["error"]["message"].startswith("the request body must be a JSON object")
    priority = httpx.post(url + "/completions", headers={**auth, "x-priority": "high"},
                          json={"model": MODEL, "prompt": PROMPT})  # fmt: skip
    assert priority.json()["error"]["message"] == "x-priority must be an integer, got 'high'"
    missing = httpx.get(url + "/nothing-here", headers=auth)
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"
    wrong_method = httpx.get(url + "/completions", headers=auth)
    assert wrong_method.status_code == 405 and wrong_method.headers["Allow"] == "POST"
    # Valid JSON, but a lone surrogate is no Unicode text: no tokenizer or protobuf takes it.
    lone = httpx.post(url + "/completions", headers={**auth, "Content-Type": "application/json"},
                      content=b'{"model": "%s", "prompt": "hi \\ud800", "max_tokens": 4}' % MODEL.encode())
    assert lone.status_code == 400, lone.text
    assert lone.json()["error"]["message"].startswith("prompt: the string holds a lone UTF-16 surrogate")
    deep = httpx.post(url + "/completions", headers={**auth, "Content-Type": "application/json"},
                      content=b'{"model": "m", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}")
    assert (deep.status_code, deep.json()["error"]["message"]) == (
        400, "the request body is nested too deeply to be a request")
    # Over the request size limit: 413 however far over (the router's check or aiohttp's).
    for size in (1_100_000, 3_000_000):  # the limit is 1 MiB (aiohttp's is 2 MiB + 4 KiB)
        big = httpx.post(url + "/completions", headers=auth, timeout=30,
                         json={"model": MODEL, "prompt": "x" * size})
        assert big.status_code == 413, (size, big.text)


def test_queue_timeout_is_504(cluster):
    """`plain` keeps one request on the engine: a second one waits in its queue past 0.5 s."""
    client = cluster.client(router="plain")
    with client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=600, stream=True,
                                   extra_body={"ignore_eos": True}) as hog:  # fmt: skip
        next(iter(hog))  # on the engine now
        err = status_of(lambda: client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2))
    assert err.status_code == 504 and err.body["type"] == "timeout_error"
    assert "waited" in err.body["message"] and "never scheduled" in err.body["message"]
    wait_all_blocks_free(cluster)


# ---- the prefix cache's tenant groups ------------------------------------------------


def cold_prompt(seed: str) -> list[int]:
    """99 random token ids no other test sends: 12 reusable KV blocks of 8 (a hit serves
    96 tokens; the engine computes the last one itself)."""
    rng = random.Random(seed)
    return [rng.randrange(3, 384) for _ in range(99)]


def cached_over_http(cluster: Cluster, key: str, prompt: list[int], router: str = "main") -> int:
    reply = cluster.client(key, router).completions.create(model=MODEL, prompt=prompt, max_tokens=1,
                                                           temperature=0)  # fmt: skip
    assert reply.usage.prompt_tokens == len(prompt)
    return reply.usage.prompt_tokens_details.cached_tokens


def cached_over_grpc(cluster: Cluster, key: str, prompt: list[int]) -> int:
    usage = cluster.grpc(greedy_grpc(prompt, 1), key=key)[-1].usage
    assert usage.prompt_tokens == len(prompt)
    return usage.cached_prompt_tokens


@pytest.mark.parametrize("api", ["http", "grpc"])
def test_a_tenant_hits_only_its_cache_groups_prefixes(cluster, api):
    """The issue's report: tenant B's identical prompt after tenant A's was served 624 of
    631 tokens from A's cached blocks (its time to first token tells B what A sent). The
    router salts each tenant's blocks with its cache group: B gets none of A's, A's repeat
    and C (A's group) hit them, B's own repeat hits B's, and a router without a keys file
    (unsalted) shares with none of them."""
    cached = cached_over_http if api == "http" else cached_over_grpc
    prompt = cold_prompt(f"cache-groups-{api}")
    assert cached(cluster, "key-team-a", prompt) == 0
    assert cached(cluster, "key-loner", prompt) == 0  # was 96: A's blocks
    assert [cached(cluster, key, prompt) for key in ("key-team-a", "key-team-c", "key-loner")] == [96] * 3
    assert cached(cluster, "key-initech", prompt) == 0  # no group: its own name's
    if api == "http":
        assert cached_over_http(cluster, "any", prompt, "plain") == 0


def test_clients_cannot_set_a_cache_salt(cluster):
    """Only the router salts (vLLM takes a body's cache_salt; here it is an unknown field):
    the HTTP body's is refused by name, and the gRPC API has no such field."""
    err = status_of(lambda: cluster.client().completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=1, extra_body={"cache_salt": "team"}))
    assert (err.status_code, err.body["param"]) == (400, "cache_salt"), err.body
    assert not {f.name for f in pb.GenerateRequest.DESCRIPTOR.fields} & {"cache_salt", "salt", "cache_group"}


@pytest.mark.parametrize("salt, message", [
    ("", None), ("s" * 64, None), ("s" * 65, "cache_salt must be at most 64 printable ASCII"),
    ("a\x00b", "cache_salt must be at most 64 printable ASCII"),
])  # fmt: skip
def test_the_engine_takes_an_empty_or_printable_cache_salt(cluster, salt, message):
    stub = engine_pb2_grpc.EngineStub(grpc.insecure_channel(cluster.engine.address))
    request = engine_pb2.EngineGenerateRequest(
        request_id=f"salt-{len(salt)}-{time.monotonic_ns()}", prompt_token_ids=PROMPT_IDS, cache_salt=salt,
        sampling=SamplingParams(max_tokens=1, temperature=0.0).to_proto())
    if message is None:
        out = list(stub.Generate(request, timeout=30))[-1]
        assert (out.num_prompt_tokens, out.num_output_tokens) == (len(PROMPT_IDS), 1)
        return
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(request, timeout=30))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in err.value.details()


# ---- disconnects and load ---------------------------------------------------------------


def test_disconnect_mid_stream_frees_every_kv_block(cluster):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 900, "stream": True, "ignore_eos": True}
    before = engine_stats(cluster.engine.address).num_requests
    with httpx.stream("POST", cluster.url() + "/completions", json=body, timeout=30,
                      headers={"Authorization": "Bearer key-initech"}) as reply:  # fmt: skip
        events = (line for line in reply.iter_lines() if line)
        first = [next(events) for _ in range(3)]
        assert all(e.startswith('data: {"id"') for e in first), first
    # the connection is closed: the router cancels the engine call within a step
    wait_all_blocks_free(cluster)
    stats = engine_stats(cluster.engine.address)
    assert stats.num_requests == before + 1


def test_disconnect_while_waiting_for_a_whole_completion_frees_every_kv_block(cluster):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 900, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(cluster.url() + "/completions", json=body, timeout=1.0,
                   headers={"Authorization": "Bearer key-initech"})  # fmt: skip
    wait_all_blocks_free(cluster)


async def test_100_concurrent_streams(cluster):
    client = openai.AsyncOpenAI(base_url=cluster.url(), api_key="key-initech", max_retries=0,
                                http_client=openai.DefaultAsyncHttpxClient(
                                    limits=httpx.Limits(max_connections=200)))  # fmt: skip

    async def one(i: int) -> tuple[str, str | None, int]:
        stream = await client.completions.create(
            model=MODEL, prompt=f"{PROMPT} {i}", max_tokens=8, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})  # fmt: skip
        text, finish, tokens = "", None, 0
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
                finish = chunk.choices[0].finish_reason or finish
            else:
                tokens = chunk.usage.completion_tokens
        return text, finish, tokens

    start = time.monotonic()
    results = await asyncio.gather(*(one(i) for i in range(100)))
    seconds = time.monotonic() - start
    await client.close()
    assert [(finish, tokens) for _, finish, tokens in results] == [("length", 8)] * 100
    print(f"100 concurrent streams of 8 tokens: {seconds:.2f} s")
    wait_all_blocks_free(cluster)
