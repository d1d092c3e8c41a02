"""Speculative decoding through real processes: an engine with `--speculative ngram`
serving a model whose greedy output repeats (tests/checkpoints.py's echo checkpoint), so
most guesses are kept and steps emit several tokens. The router streams them with the
same text, stop strings and usage as one token per step, on both APIs."""

from __future__ import annotations

import json
import time
import urllib.request

import grpc
import pytest
from omnibus.v1 import inference_pb2 as pb
from omnibus.v1 import inference_pb2_grpc
from tokenizers import Tokenizer

from tests.checkpoints import hf_greedy, load_hf, make_checkpoint
from tests.grpc_helpers import engine_process, free_port, metric, router_process, scrape

PROMPT = "Every day the fox ran to the river."


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec")
    model = make_checkpoint(root / "echo", echo=True)
    metrics, http = free_port(), free_port()
    engine = engine_process(model, root, "engine", "--speculative", "ngram", "--num-speculative-tokens", "4",
                            f"--metrics-port={metrics}", "--num-kv-blocks", "64", "--block-size", "8")
    procs = [engine]
    try:
        engine.wait_serving()
        router = router_process(model, [engine.address], root, "router", f"--http-port={http}")
        procs.append(router)
        router.wait_serving()
        yield model, router, metrics, http
    finally:
        for p in reversed(procs):
            p.stop()


def test_streams_of_several_tokens_a_step_equal_transformers_with_stop_strings(served):
    model, router, metrics, _ = served
    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    prompt = tok.encode(PROMPT).ids
    expected = hf_greedy(load_hf(model), prompt, 30)
    stub = inference_pb2_grpc.InferenceStub(grpc.insecure_channel(router.address))
    replies = list(stub.Generate(pb.GenerateRequest(
        text=PROMPT, sampling=pb.SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)), timeout=60))
    ids = [t for r in replies for t in r.token_ids]
    assert ids == expected and "".join(r.text for r in replies) == tok.decode(ids)
    assert replies[-1].usage.completion_tokens == 30
    assert settled(metrics, "omnibus_engine_spec_accepted_tokens_total") > 0
    assert 0 < settled(metrics, "omnibus_engine_spec_steps_total") < 30
    # a stop string inside a step's tokens: nothing after it is sent
    stop = tok.decode(expected[:7])[-3:]
    full = tok.decode(expected)
    replies = list(stub.Generate(pb.GenerateRequest(text=PROMPT, sampling=pb.SamplingParams(
        max_tokens=30, temperature=0.0, ignore_eos=True, stop=[stop])), timeout=60))
    assert "".join(r.text for r in replies) == full[:full.index(stop)]
    assert replies[-1].finish_reason == pb.STOP
    # per request off: the same tokens, one a step
    before = settled(metrics, "omnibus_engine_spec_steps_total")
    replies = list(stub.Generate(pb.GenerateRequest(text=PROMPT, sampling=pb.SamplingParams(
        max_tokens=30, temperature=0.0, ignore_eos=True, speculative=pb.SPECULATIVE_OFF)), timeout=60))
    assert [t for r in replies for t in r.token_ids] == expected
    assert settled(metrics, "omnibus_engine_spec_steps_total") == before


def settled(port: int, name: str) -> float:
    """The counter once the engine's stats (published after its steps) stop moving."""
    last = None
    for _ in range(100):
        value = metric(scrape(port), name, proposer="ngram")
        if value == last:
            return value
        last = value
        time.sleep(0.2)
    raise AssertionError(f"{name} kept changing")


def test_http_completions_speculate_and_refuse_an_unknown_setting(served):
    model, _, _, http = served

    def post(body: dict) -> tuple[int, dict]:
        req = urllib.request.Request(f"http://127.0.0.1:{http}/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=60) as reply:
                return reply.status, json.loads(reply.read())
        except urllib.error.HTTPError as err:
            return err.code, json.loads(err.read())

    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    expected = tok.decode(hf_greedy(load_hf(model), tok.encode(PROMPT).ids, 20))
    for setting in ("auto", "off"):
        status, body = post({"model": model.name, "prompt": PROMPT, "max_tokens": 20, "temperature": 0,
                             "ignore_eos": True, "speculative": setting})
        assert status == 200 and body["choices"][0]["text"] == expected
    status, body = post({"model": model.name, "prompt": PROMPT, "speculative": "always"})
    assert status == 400 and body["error"]["param"] == "speculative"
