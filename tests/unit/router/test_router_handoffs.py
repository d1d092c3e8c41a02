"""Disaggregated serving in the router (service/stream.py): a stream's prompt goes to a
prefill engine once, and its decode to a decode engine that reads the KV the prefill
engine names. A prefill engine hands the KV on either with the first token (the
default) or before it (--kv-transfer-overlap: an early handle, no token). An early
handoff sent the stream back to a prefill engine, hop after hop, each adding the whole
time since arrival to the time queued, until the queue limit ended it: a drain test
stalled on it. In process over scripted engines (tests/unit/router/inprocess.py)."""

from __future__ import annotations

import asyncio

import pytest
from omnibus.v1 import engine_pb2, inference_pb2

from tests.unit.router.inprocess import Router, ScriptedEngine, prompt
from tests.unit.router.test_fleet_faults import TENANTS, caller, counter, served

LAYOUT = "2x(4,8):float32"


class PrefillEngine(ScriptedEngine):
    """A prefill engine: a request held for a transfer (kv_hold) ends at once with the
    handle of its KV, before its first token (`early`) or with it; it takes `seconds`."""

    early = True
    seconds = 0.0
    handle = True  # False: it names no KV (a hold that found no room, a faulty engine)

    async def generate(self, request, timeout=None):  # type: ignore[override]
        self.requests.append(request)
        assert request.kv_hold and request.sampling.max_tokens == 1
        await asyncio.sleep(self.seconds)
        n = len(request.prompt_token_ids)
        handle = engine_pb2.KvHandle(peer="127.0.0.1:9", request_id=request.request_id,
                                     num_tokens=n - 1, layout=LAYOUT)
        yield engine_pb2.EngineGenerateResponse(
            token_ids=[] if self.early else [7], num_output_tokens=0 if self.early else 1,
            finish_reason=inference_pb2.LENGTH, num_prompt_tokens=n, kv_handle=handle if self.handle else None)


async def disaggregated(tmp_path, early: bool, seconds: float = 0.0, **flags):
    router = await Router(tmp_path, TENANTS, **flags).start()
    decode = router.engine
    decode.report_load(role="decode", kv_transfer=True, kv_layout=LAYOUT)
    prefill = PrefillEngine(router.config, router.fleet.changed, address="127.0.0.1:2")
    prefill.early, prefill.seconds = early, seconds
    prefill.report_load(role="prefill", kv_transfer=True, kv_layout=LAYOUT)
    router.fleet.add(prefill)
    released: list[str] = []
    prefill.release = released.append  # type: ignore[method-assign]
    return router, prefill, decode, released


@pytest.mark.parametrize("early", [True, False], ids=["early-handle", "with-first-token"])
async def test_a_stream_is_prefilled_once_and_decoded_where_its_kv_is_read(tmp_path, early):
    router, prefill, decode, released = await disaggregated(tmp_path, early)
    try:
        for i in range(3):
            responses, err = await served(router, caller(router), prompt(6, 4))
            assert err is None, err
            tokens = [t for r in responses for t in r.token_ids]
            # early: the decode engine samples every token; else the prefill's first one
            assert tokens == ([5, 5, 5] if early else [7, 5, 5, 5])
            assert responses[-1].finish_reason == inference_pb2.LENGTH
            assert len(prefill.requests) == i + 1, "a stream went to a prefill engine twice"
            hold, read = prefill.requests[-1], decode.requests[-1]
            assert len(decode.requests) == i + 1 and not read.kv_hold
            assert read.kv_source.request_id == hold.request_id  # it reads what the prefill holds
            want = list(hold.prompt_token_ids) + ([] if early else [7])
            assert list(read.prompt_token_ids) == want
            assert read.sampling.max_tokens == (4 if early else 3)
            assert released == [r.request_id for r in prefill.requests]  # let go once read
        assert counter(router, "handoffs", "transfer") == 3
    finally:
        await router.close()


async def test_the_prefill_hops_time_is_not_queue_time(tmp_path):
    """A prefill that takes 0.4 s of a router whose queue limit is 0.3 s: the decode hop
    still has the limit less the (near zero) time the request was queued."""
    router, prefill, decode, _ = await disaggregated(tmp_path, early=True, seconds=0.4, max_queue_seconds=0.3)
    try:
        responses, err = await served(router, caller(router), prompt(6, 2))
        assert err is None, err
        assert [t for r in responses for t in r.token_ids] == [5, 5]
        assert len(prefill.requests) == len(decode.requests) == 1
    finally:
        await router.close()


async def test_a_prefill_hop_that_names_no_kv_is_not_taken_again(tmp_path):
    """A prefill engine that ends the hop with no token and no handle: the stream is not
    sent to a prefill engine again (one prefill hop a stream), the decode engine computes it."""
    router, prefill, decode, released = await disaggregated(tmp_path, early=True)
    prefill.handle = False
    try:
        responses, err = await served(router, caller(router), prompt(6, 3))
        assert err is None, err
        assert [t for r in responses for t in r.token_ids] == [5, 5, 5]
        assert len(prefill.requests) == len(decode.requests) == 1
        assert not decode.requests[0].HasField("kv_source") and released == []
        assert counter(router, "handoffs", "recompute") == 1
    finally:
        await router.close()
