"""A rule the gRPC path and the HTTP front both apply is decided once, in the pipeline
(issue 32): the same refusal, with the same words, whichever transport carries it (the
HTTP one adds where its listing is)."""

from __future__ import annotations

import aiohttp
import grpc
import pytest
from aiohttp.test_utils import TestServer

from omnibus.router.http.app import OpenAIFront
from omnibus.router.service.errors import RequestError
from omnibus.router.service.pipeline import Caller
from tests.unit.router.inprocess import Router, prompt

TENANTS = {"t": {"keys": ["sk-t"], "adapters": ["ad", "gone"]}}


@pytest.fixture
async def router(tmp_path):
    """One engine with adapter `ad` on its disk (`gone` is in the tenant's list only, and
    `other` on no list), and the HTTP front over the same pipeline."""
    router = await Router(tmp_path, TENANTS).start()
    router.engine.report_load(available_adapters=["ad", "other"])
    server = TestServer(OpenAIFront(router.pipeline, router.config, None).app())
    await server.start_server()
    router.http = server
    yield router
    await server.close()
    await router.close()


async def grpc_refusal(router: Router, adapter: str = "", request=None) -> RequestError:
    tenant = router.pipeline.authenticate([("authorization", "Bearer sk-t")])
    with pytest.raises(RequestError) as err:
        [r async for r in router.pipeline.generate(request or prompt(3, 2), Caller(tenant, adapter))]
    return err.value


async def http_refusal(router: Router, path: str, body: dict, headers: dict | None = None) -> tuple[int, dict]:
    async with aiohttp.ClientSession(headers={"Authorization": "Bearer sk-t", **(headers or {})}) as s:
        async with s.post(router.http.make_url(path), json=body) as reply:
            return reply.status, (await reply.json())["error"]


@pytest.mark.parametrize("adapter, code, status, reason", [
    ("other", grpc.StatusCode.PERMISSION_DENIED, 403, "adapter_denied"),
    ("gone", grpc.StatusCode.NOT_FOUND, 404, "unknown_adapter"),
])
async def test_an_adapter_refusal_is_one_rule_with_the_listing_named_over_http(router, adapter, code,
                                                                               status, reason):
    err = await grpc_refusal(router, adapter)
    assert (err.code, err.reason) == (code, reason)
    assert err.message.endswith("ListModels lists the adapters " + ("it" if status == 403 else "you")
                                + " may use")
    got, error = await http_refusal(router, "/v1/completions", {"model": "m", "prompt": "w1 w2",
                                                                 "max_tokens": 2}, {"x-adapter-id": adapter})
    assert (got, error["code"], error["message"]) == (status, reason,
                                                      err.message + " (GET /v1/models over HTTP)")


async def test_embeddings_come_from_the_base_model_on_both_paths(router):
    from omnibus.v1 import inference_pb2

    tenant = router.pipeline.authenticate([("authorization", "Bearer sk-t")])
    request = inference_pb2.EmbedRequest(inputs=[inference_pb2.EmbedInput(text="w1")])
    with pytest.raises(RequestError) as err:
        await router.pipeline.embed(request, Caller(tenant, "ad"))
    assert (err.value.code, err.value.message) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "embeddings come from the base model 'm', not adapter 'ad': leave x-adapter-id empty")
    status, error = await http_refusal(router, "/v1/embeddings", {"model": "ad", "input": "w1"})
    assert (status, error["param"], error["message"]) == (
        400, "model", "embeddings come from the base model 'm', not adapter 'ad': set model to the base model")


async def test_the_priority_bound_is_one_rule(router):
    bound = router.config.max_abs_priority
    err = await grpc_refusal(router, request=prompt(3, 2, priority=bound + 1))
    assert (err.code, err.message) == (grpc.StatusCode.INVALID_ARGUMENT,
                                       f"priority must be in [-{bound}, {bound}], got {bound + 1}")
    status, error = await http_refusal(router, "/v1/completions", {"model": "m", "prompt": "w1", "max_tokens": 1},
                                       {"x-priority": str(bound + 1)})
    assert (status, error["param"], error["message"]) == (
        400, "priority", f"x-priority must be in [-{bound}, {bound}], got {bound + 1}")
    status, error = await http_refusal(router, "/v1/completions",
                                       {"model": "m", "prompt": "w1", "max_tokens": 1, "priority": bound + 1})
    assert (status, error["message"]) == (400, f"priority must be in [-{bound}, {bound}], got {bound + 1}")


async def test_the_default_max_tokens_fills_what_an_engine_takes(router):
    """A chat request without max_tokens gets the rest of the context of an engine taking
    it (the pipeline's rule; the HTTP chat path asks it)."""
    context = router.pipeline.limits.context
    assert router.pipeline.default_max_tokens(10) == min(router.pipeline.limits.max_tokens, context - 10)
    router.engine.report_load(max_model_len=48)
    assert router.pipeline.default_max_tokens(10) == 38
    assert router.pipeline.default_max_tokens(60) == 1  # at least one: the context check refuses it
