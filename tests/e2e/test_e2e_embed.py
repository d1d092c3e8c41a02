"""Embed over real processes: router + engine, checked against transformers' hidden states.
The router and engine are the session's shared ones (tests/e2e/conftest.py: EMBED_FLAGS,
--max-embed-inputs 5)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch
from omnibus.v1 import inference_pb2 as pb
from omnibus.v1 import inference_pb2_grpc
from tokenizers import Tokenizer

from tests.checkpoints import load_hf
from tests.grpc_helpers import engine_process, router_process


@pytest.fixture(scope="module")
def cluster(tiny_model, shared_router):
    return tiny_model, shared_router.process


def embed(router, request, metadata=()):
    with grpc.insecure_channel(router.address) as channel:
        return inference_pb2_grpc.InferenceStub(channel).Embed(request, metadata=metadata, timeout=60)


def test_embeddings_equal_transformers_hidden_states(cluster):
    model, router = cluster
    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    hf = load_hf(model)
    texts = ["Once upon a time", "the fox ran to the river"]
    reply = embed(router, pb.EmbedRequest(
        inputs=[pb.EmbedInput(text=texts[0]), pb.EmbedInput(token_ids=pb.TokenIds(ids=[5, 6, 7, 8]))],
        pooling=pb.LAST, normalize=True, request_id="e1"))
    assert reply.request_id == "e1" and len(reply.embeddings) == 2
    ids = [tok.encode(texts[0]).ids, [5, 6, 7, 8]]
    assert [e.num_tokens for e in reply.embeddings] == [len(x) for x in ids]
    assert reply.total_tokens == sum(map(len, ids))
    for e, x in zip(reply.embeddings, ids):
        with torch.no_grad():
            h = hf(torch.tensor([x]), output_hidden_states=True).hidden_states[-1][0, -1]
        torch.testing.assert_close(torch.tensor(list(e.values)), torch.nn.functional.normalize(h, dim=-1),
                                   rtol=1e-4, atol=1e-5)


def test_embedding_is_the_same_alone_or_batched(cluster):
    _, router = cluster
    req = pb.EmbedRequest(inputs=[pb.EmbedInput(text="the fox ran")], pooling=pb.MEAN)
    alone = list(embed(router, req).embeddings[0].values)
    with ThreadPoolExecutor(4) as pool:  # four concurrent requests fill a preferred batch of 4
        others = [pool.submit(embed, router, pb.EmbedRequest(inputs=[pb.EmbedInput(text=t)]))
                  for t in ("a", "bb cc", "once upon")]
        batched = list(pool.submit(embed, router, req).result().embeddings[0].values)
        for f in others:
            f.result()
    torch.testing.assert_close(torch.tensor(batched), torch.tensor(alone), rtol=1e-5, atol=1e-5)


def test_the_engine_refuses_an_unknown_pooling(shared_engine):
    """The engine's own API (tools, another router) as the router's: it was served as MEAN."""
    from omnibus.v1 import engine_pb2, engine_pb2_grpc

    with grpc.insecure_channel(shared_engine.process.address) as channel:
        with pytest.raises(grpc.RpcError) as err:
            engine_pb2_grpc.EngineStub(channel).Embed(engine_pb2.EngineEmbedRequest(
                inputs=[pb.TokenIds(ids=[5, 6])], pooling=3), timeout=60)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details() == "pooling must be MEAN (1) or LAST (2), or unset for MEAN; got 3"


@pytest.mark.parametrize("request_,metadata,code,message", [
    (pb.EmbedRequest(), (), grpc.StatusCode.INVALID_ARGUMENT, "send 1 to 5 inputs per Embed request, got 0"),
    (pb.EmbedRequest(inputs=[pb.EmbedInput(text="a")] * 6), (), grpc.StatusCode.INVALID_ARGUMENT,
     "send 1 to 5 inputs"),
    (pb.EmbedRequest(inputs=[pb.EmbedInput(text="")]), (), grpc.StatusCode.INVALID_ARGUMENT,
     "the input 0 text is empty"),
    (pb.EmbedRequest(inputs=[pb.EmbedInput(text="a"), pb.EmbedInput(token_ids=pb.TokenIds(ids=[10**6]))]), (),
     grpc.StatusCode.INVALID_ARGUMENT, "input 1 token_ids: token id 1000000 is outside the vocabulary"),
    (pb.EmbedRequest(inputs=[pb.EmbedInput(text="a")]), (("x-adapter-id", "a1"),),
     grpc.StatusCode.INVALID_ARGUMENT, "embeddings come from the base model"),
    (pb.EmbedRequest(inputs=[pb.EmbedInput(text="a")], pooling=9), (), grpc.StatusCode.INVALID_ARGUMENT,
     "pooling must be MEAN (1) or LAST (2), or unset for MEAN; got 9"),  # was served as MEAN
])
def test_bad_embed_requests(cluster, request_, metadata, code, message):
    _, router = cluster
    with pytest.raises(grpc.RpcError) as err:
        embed(router, request_, metadata)
    assert err.value.code() == code
    assert message in err.value.details()


def test_full_embed_queue_is_resource_exhausted(cluster, tmp_path):
    """An engine whose embed queue holds 2 requests for up to 5 s: a third is refused."""
    import time

    model, _ = cluster
    engine = engine_process(model, tmp_path, "capped", "--num-kv-blocks", "64", "--embed-max-queue-size", "2",
                            "--embed-max-queue-delay-ms", "5000").wait_serving()
    router = router_process(model, [engine.address], tmp_path, "capped-router").wait_serving()
    try:
        with ThreadPoolExecutor(2) as pool:
            queued = [pool.submit(embed, router, pb.EmbedRequest(inputs=[pb.EmbedInput(text=f"w{i}")]))
                      for i in range(2)]
            time.sleep(1.0)  # setup, not a measurement: let both reach the engine's queue
            with pytest.raises(grpc.RpcError) as err:
                embed(router, pb.EmbedRequest(inputs=[pb.EmbedInput(text="late")]))
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "embed queue full (2 requests waiting)" in err.value.details()
            assert all(len(f.result().embeddings) == 1 for f in queued)  # served when the window ends
    finally:
        router.stop()
        engine.stop()
