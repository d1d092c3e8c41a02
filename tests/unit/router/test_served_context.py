"""The context the router advertises and admits is what its engines serve: an engine's
--max-model-len (or any cap config.json does not show) reaches the router in the load
report, and requests that fit config.json but not the engine are refused by the router,
naming the engine's limit, instead of by the engine after admission."""

from __future__ import annotations

import grpc
import pytest
from omnibus.v1 import engine_pb2

from omnibus.router.service.errors import RequestError
from omnibus.router.service.pipeline import Caller
from tests.unit.router.inprocess import Router, prompt

TENANTS = {"t": {"keys": ["sk-t"]}}


def report(max_model_len: int) -> engine_pb2.LoadReport:
    return engine_pb2.LoadReport(max_num_seqs=4, num_total_blocks=64, num_free_blocks=64,
                                 max_model_len=max_model_len)


async def test_the_engines_context_caps_what_the_router_advertises_and_admits(tmp_path):
    router = await Router(tmp_path, TENANTS).start()
    try:
        pipeline = router.pipeline
        tenant = pipeline.authenticate([("authorization", "Bearer sk-t")])
        assert pipeline.list_models(tenant).base_model.max_context_length == 1024  # config.json
        router.engine.take_report(report(48))
        model = pipeline.list_models(tenant).base_model
        assert (model.max_context_length, model.max_tokens_limit) == (48, 47)
        with pytest.raises(RequestError) as err:
            [r async for r in pipeline.generate(prompt(40, 10), Caller(tenant))]
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and "48" in err.value.message
        assert not router.engine.requests  # refused before any engine saw it
        out = [r async for r in pipeline.generate(prompt(40, 8), Caller(tenant))]
        assert out[-1].usage.completion_tokens == 3
        router.engine.take_report(report(4096))  # more than config.json: config.json's stands
        assert pipeline.list_models(tenant).base_model.max_context_length == 1024
    finally:
        await router.close()


async def test_text_that_tokenizes_past_the_models_vocabulary_is_the_servers_error(tmp_path):
    """A tokenizer.json with more ids than config.json's vocabulary (another model's) used
    to reach the engine, which blamed the client's prompt."""
    from dataclasses import replace

    from omnibus.v1 import inference_pb2

    router = Router(tmp_path, TENANTS)
    router.limits = replace(router.limits, vocab_size=32)  # the word tokenizer has 64 ids
    await router.start()
    try:
        tenant = router.pipeline.authenticate([("authorization", "Bearer sk-t")])

        def text(words: str) -> inference_pb2.GenerateRequest:
            return inference_pb2.GenerateRequest(text=words, sampling=inference_pb2.SamplingParams(max_tokens=2))

        with pytest.raises(RequestError) as err:
            [r async for r in router.pipeline.generate(text("w5 w40"), Caller(tenant))]
        assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert "tokenized to id 40, outside the model's vocabulary [0, 32)" in err.value.message
        assert "does not belong to its model" in err.value.message and not router.engine.requests
        out = [r async for r in router.pipeline.generate(text("w5 w31"), Caller(tenant))]
        assert out[-1].usage.prompt_tokens == 2
    finally:
        await router.close()


async def test_engines_with_different_contexts_serve_up_to_the_longest(tmp_path):
    """Outside probe: the router admitted only the shortest context any engine had ever
    reported, even after that engine died, though another engine served 4x more. Now
    it advertises the longest and sends a request only where its context fits."""
    router = await Router(tmp_path, TENANTS).start()
    try:
        pipeline = router.pipeline
        tenant = pipeline.authenticate([("authorization", "Bearer sk-t")])
        short = router.engine
        short.take_report(report(48))
        long_ = router.add_engine("127.0.0.1:2")
        long_.take_report(report(512))
        assert pipeline.list_models(tenant).base_model.max_context_length == 512
        for _ in range(2):
            out = [r async for r in pipeline.generate(prompt(40, 60), Caller(tenant))]
            assert out[-1].usage.completion_tokens == 3
        assert not short.requests and len(long_.requests) == 2
        [r async for r in pipeline.generate(prompt(40, 8), Caller(tenant))]  # fits both
        assert len(short.requests) + len(long_.requests) == 3

        long_.link.mark_failed("connection refused")  # restarting: its context still counts
        with pytest.raises(RequestError) as err:
            [r async for r in pipeline.generate(prompt(40, 60), Caller(tenant))]
        assert err.value.code == grpc.StatusCode.UNAVAILABLE
        long_.seats.retiring = True  # gone for good: the short engine's context is the limit
        with pytest.raises(RequestError) as err:
            [r async for r in pipeline.generate(prompt(40, 60), Caller(tenant))]
        assert err.value.message == "max_tokens must be in [1, 47], got 60"
        assert pipeline.list_models(tenant).base_model.max_context_length == 48
    finally:
        await router.close()


async def test_an_embed_input_goes_to_an_engine_whose_context_holds_it(tmp_path):
    from types import SimpleNamespace

    from omnibus.v1 import inference_pb2

    calls: list[str] = []

    def embedder(name: str):
        async def embed(request, timeout=None):
            calls.append(name)
            return engine_pb2.EngineEmbedResponse(
                embeddings=[inference_pb2.Embedding(values=[0.5]) for _ in request.inputs])
        return SimpleNamespace(Embed=embed)

    router = await Router(tmp_path, TENANTS, stub=embedder("short")).start()
    try:

        short = router.engine
        short.take_report(report(48))
        long_ = router.add_engine("127.0.0.1:2", stub=embedder("long"))
        long_.take_report(report(512))
        long_.seats.inflight = 3  # busier: the short engine would be picked by load alone
        tenant = router.pipeline.authenticate([("authorization", "Bearer sk-t")])

        def request(tokens: int) -> inference_pb2.EmbedRequest:
            return inference_pb2.EmbedRequest(inputs=[inference_pb2.EmbedInput(
                token_ids=inference_pb2.TokenIds(ids=[7] * tokens))])

        await router.pipeline.embed(request(10), Caller(tenant))
        await router.pipeline.embed(request(100), Caller(tenant))
        assert calls == ["short", "long"]
        long_.link.mark_failed("connection refused")
        with pytest.raises(RequestError) as err:
            await router.pipeline.embed(request(100), Caller(tenant))
        assert err.value.code == grpc.StatusCode.UNAVAILABLE, err.value
        assert "whose context holds a 100-token input are down" in err.value.message
    finally:
        await router.close()
