"""What a client sees, and what is counted, when the engines behind the router fail
(outside probe, fleet): a stream whose adapter no other engine has ends UNAVAILABLE at
once rather than waiting out the queue limit; a new request for an adapter whose engines
are down is UNAVAILABLE (clients retry), one no engine has NOT_FOUND; a deadline ending
is always a miss, and a refusal only when no engine worked on the request."""

from __future__ import annotations

import asyncio
import re
import time

import aiohttp
import grpc
import pytest
from aiohttp.test_utils import TestServer
from omnibus.v1 import engine_pb2, inference_pb2
from structlog.testing import capture_logs

from omnibus.router.cli import build_parser, config_from_args, main
from omnibus.router.http.app import OpenAIFront
from omnibus.router.service.errors import RequestError
from omnibus.router.service.pipeline import Caller
from tests.unit.router.inprocess import Router, prompt, refusal

TENANTS = {"t": {"keys": ["sk-t"]}}


def token(n: int) -> engine_pb2.EngineGenerateResponse:
    """The engine's output carrying its `n`th token."""
    return engine_pb2.EngineGenerateResponse(token_ids=[5], num_output_tokens=n)


async def served(router: Router, caller: Caller, request=None) -> tuple[list, RequestError | None]:
    """The responses of one call, and the error that ended it (None: it finished)."""
    responses = []
    try:
        async for response in router.pipeline.generate(request or prompt(5, 10), caller):
            responses.append(response)
    except RequestError as err:
        return responses, err
    return responses, None


def caller(router: Router, adapter: str = "", deadline: float | None = None) -> Caller:
    tenant = router.pipeline.authenticate([("authorization", "Bearer sk-t")])
    return Caller(tenant, adapter=adapter, deadline=deadline)


def counter(router: Router, name: str, label: str) -> float:
    return getattr(router.pipeline.metrics, name).labels(label)._value.get()


@pytest.mark.parametrize("how", ["dies", "drains"])
async def test_a_stream_whose_adapter_no_other_engine_has_ends_unavailable_at_once(tmp_path, how):
    """The engine with the adapter dies (its call fails UNAVAILABLE) or its drain runs out
    (ABORTED) after a token; the other engine takes requests but lacks the adapter. With a
    1 s queue limit, waiting for an engine would end DEADLINE_EXCEEDED instead."""
    router = await Router(tmp_path, TENANTS, max_queue_seconds=1).start()
    try:
        router.engine.report_load(available_adapters=["ad"])
        other = router.add_engine("127.0.0.1:2")  # the base model only

        async def lost(request, timeout=None):
            yield token(1)
            if how == "dies":
                raise refusal(grpc.StatusCode.UNAVAILABLE, "connection reset")
            router.engine.report_load(available_adapters=["ad"], draining=True)
            yield engine_pb2.EngineGenerateResponse(num_output_tokens=1, finish_reason=inference_pb2.ABORTED)

        router.engine.generate = lost
        responses, err = await served(router, caller(router, "ad"))
        assert [list(r.token_ids) for r in responses] == [[5]]
        assert err is not None and err.code == grpc.StatusCode.UNAVAILABLE, err
        assert "after 1 tokens and no other engine could continue the stream" in err.message
        assert other.requests == [] and len(router.queue) == 0
    finally:
        await router.close()


async def test_a_base_model_stream_still_moves_to_another_engine(tmp_path):
    router = await Router(tmp_path, TENANTS).start()
    try:
        other = router.add_engine("127.0.0.1:2")

        async def dies(request, timeout=None):
            yield token(1)
            raise refusal(grpc.StatusCode.UNAVAILABLE, "connection reset")

        router.engine.generate = dies
        responses, err = await served(router, caller(router), prompt(5, 3))
        assert err is None
        assert [list(r.token_ids) for r in responses] == [[5], [5], [5]]
        assert len(other.requests) == 1 and other.requests[0].sampling.output_offset == 1
    finally:
        await router.close()


async def test_a_new_request_for_an_adapter_whose_engines_are_down_is_unavailable(tmp_path):
    """NOT_FOUND is for an adapter no engine has (clients do not retry a 404); while the
    engines that have it are down or draining it is UNAVAILABLE (503, retried)."""
    router = await Router(tmp_path, TENANTS).start()
    try:
        router.engine.report_load(available_adapters=["ad"])
        router.add_engine("127.0.0.1:2")  # up, the base model only
        router.engine.link.mark_failed("connection refused")  # restarting: its last report stays
        _, err = await served(router, caller(router, "ad"))
        assert err is not None and (err.code, err.reason) == (grpc.StatusCode.UNAVAILABLE,
                                                              "adapter_unavailable")
        assert err.message == ("no engine with adapter 'ad' is taking requests now (down, "
                               "restarting or draining); retry later")
        assert router.fleet.serves_adapter("ad")  # so the HTTP front's 404 check passes it on
        tenant = router.pipeline.authenticate([("authorization", "Bearer sk-t")])
        assert [a.id for a in router.pipeline.list_models(tenant).adapters] == ["ad"]  # listed, as served
        _, err = await served(router, caller(router, "zz"))
        assert err is not None and err.code == grpc.StatusCode.NOT_FOUND

        router.engine.report_load(available_adapters=["ad"], draining=True)  # back, then a SIGTERM
        _, err = await served(router, caller(router, "ad"))
        assert err is not None and err.code == grpc.StatusCode.UNAVAILABLE

        router.engine.seats.retiring = True  # gone from DNS: it will not come back
        _, err = await served(router, caller(router, "ad"))
        assert err is not None and err.code == grpc.StatusCode.NOT_FOUND
        assert not router.pipeline.list_models(tenant).adapters
        assert counter(router, "rejected", "adapter_unavailable") == 2
    finally:
        await router.close()


async def test_over_http_an_adapter_whose_engines_are_down_is_503_an_unknown_one_404(tmp_path):
    router = await Router(tmp_path, TENANTS).start()
    server = TestServer(OpenAIFront(router.pipeline, router.config, None).app())
    await server.start_server()
    try:
        router.engine.report_load(available_adapters=["ad"])
        router.add_engine("127.0.0.1:2")
        router.engine.link.mark_failed("connection refused")
        async with aiohttp.ClientSession(headers={"Authorization": "Bearer sk-t"}) as session:
            statuses = []
            for model in ("ad", "zz"):
                body = {"model": model, "prompt": "w1 w2", "max_tokens": 2}
                async with session.post(server.make_url("/v1/completions"), json=body) as reply:
                    statuses.append(reply.status)
        assert statuses == [503, 404]
    finally:
        await server.close()
        await router.close()


async def test_an_adapter_while_an_engine_has_not_reported_is_unavailable_not_not_found(tmp_path):
    """Outside probe: the engine with the adapter was down when the router started (both
    restarted together); a request for it got NOT_FOUND, which clients do not retry."""
    router = await Router(tmp_path, TENANTS).start()
    server = TestServer(OpenAIFront(router.pipeline, router.config, None).app())
    await server.start_server()
    try:
        silent = router.add_engine("127.0.0.1:2", reported=False)  # none since the router started
        _, err = await served(router, caller(router, "ad"))
        assert err is not None and (err.code, err.reason) == (grpc.StatusCode.UNAVAILABLE,
                                                              "adapter_unavailable")
        assert "1 engine(s) have not reported since this router started" in err.message
        async with aiohttp.ClientSession(headers={"Authorization": "Bearer sk-t"}) as session:
            body = {"model": "ad", "prompt": "w1 w2", "max_tokens": 2}
            async with session.post(server.make_url("/v1/completions"), json=body) as reply:
                assert reply.status == 503, await reply.text()

        silent.report_load(available_adapters=["ad"])  # it reports: served there
        responses, err = await served(router, caller(router, "ad"))
        assert err is None and len(silent.requests) == 1
        _, err = await served(router, caller(router, "zz"))  # every engine has reported
        assert err is not None and err.code == grpc.StatusCode.NOT_FOUND
    finally:
        await server.close()
        await router.close()


async def test_the_queue_limit_holds_for_the_time_a_request_is_queued_in_all(tmp_path):
    """Issue 31: a request ended DEADLINE_EXCEEDED after 182 s in a router whose queue limit
    is 60 s: a stream continued on another engine re-entered the queue with the limit's
    clock restarted, so each engine tried added a full limit. The limit is on the total
    time queued: the first wait (0.7 s of 1 s) leaves the continuation 0.3 s, and the slot
    that frees 0.65 s after the loss comes too late for it."""
    router = await Router(tmp_path, TENANTS, max_queue_seconds=1).start()
    first, other = router.engine, router.add_engine("127.0.0.1:2")
    for engine in (first, other):  # both full
        for _ in range(engine.seats.capacity):
            engine.seats.acquire(tenant="t")  # its own: no fair over-admission
    lost = asyncio.Event()

    async def dies(request, timeout=None):
        yield token(1)
        lost.set()
        raise refusal(grpc.StatusCode.UNAVAILABLE, "connection reset")

    async def frees() -> None:
        await asyncio.sleep(0.7)
        first.seats.release(tenant="t")
        await lost.wait()
        await asyncio.sleep(0.65)
        other.seats.release(tenant="t")

    first.generate = dies
    freeing = asyncio.create_task(frees())
    try:
        start = time.monotonic()
        responses, err = await served(router, caller(router), prompt(5, 3))
        assert [list(r.token_ids) for r in responses] == [[5]]
        assert err is not None and (err.code, err.reason) == (grpc.StatusCode.DEADLINE_EXCEEDED,
                                                              "queue_timeout"), err
        # the continuation's wait is what the first 0.7 s left of the 1 s limit (the first
        # wait's timer may overshoot on a loaded host, so the rest is 0.3 s or a little less)
        rest = re.match(r"the stream's engine was lost after 1 tokens and the rest waited (0\.\d+) s "
                        r"for another engine to continue it \(1\.0\d s queued in all\): the router's "
                        r"queue limit is 1 s; the completion is ", err.message)
        assert rest is not None and 0.2 <= float(rest.group(1)) <= 0.31, err.message
        assert 0.95 <= time.monotonic() - start < 1.3
        assert other.requests == [] and len(router.queue) == 0
    finally:
        freeing.cancel()
        await asyncio.gather(freeing, return_exceptions=True)
        await router.close()


# ---- engines with different KV pools --------------------------------------------------


async def test_a_request_goes_only_to_engines_whose_kv_pool_can_hold_it(tmp_path):
    """Outside probe: engines whose KV pools differ (mixed GPUs). A request too large for
    one engine's pool was sent there and refused INVALID_ARGUMENT ("lower max_tokens")
    although another engine could hold it."""
    router = await Router(tmp_path, TENANTS).start()
    try:
        small = router.engine  # 4 blocks of 4: 17 tokens (KV for all but the last)
        small.report_load(block_size=4, num_total_blocks=4, num_free_blocks=4, max_num_seqs=16)
        big = router.add_engine("127.0.0.1:2")
        big.report_load(block_size=4, num_total_blocks=64, num_free_blocks=64)  # 257 tokens
        assert small.load.fits(17) and not small.load.fits(18) and big.load.fits(257) and not big.load.fits(258)
        for _ in range(3):  # 18 tokens; `small` has the more room
            _, err = await served(router, caller(router), prompt(10, 8))
            assert err is None, err
        assert small.requests == [] and len(big.requests) == 3

        _, err = await served(router, caller(router), prompt(10, 248))  # 258 tokens
        assert err is not None and (err.code, err.param) == (grpc.StatusCode.INVALID_ARGUMENT,
                                                             "max_tokens")
        assert err.message == ("prompt + max_tokens = 258 tokens, but the most one request may "
                               "span on an engine is 257 tokens (its context and KV cache); lower "
                               "max_tokens to at most 247 or shorten the prompt")
        _, err = await served(router, caller(router), prompt(10, 247))
        assert err is None, err
        long_prompt = inference_pb2.GenerateRequest(
            token_ids=inference_pb2.TokenIds(ids=[7] * 257),
            sampling=inference_pb2.SamplingParams(max_tokens=1))
        _, err = await served(router, caller(router), long_prompt)  # no room for an output
        assert err is not None and (err.code, err.param) == (grpc.StatusCode.INVALID_ARGUMENT, "prompt")
        assert err.message.startswith("the prompt has 257 tokens, but the most one request may span")
        assert err.message.endswith("; shorten the prompt")

        silent = router.add_engine("127.0.0.1:3", reported=False)  # not reported yet (a restart)
        _, err = await served(router, caller(router), prompt(10, 248))
        assert err is not None and err.code == grpc.StatusCode.UNAVAILABLE, err
        silent.seats.retiring = True

        big.link.mark_failed("connection refused")  # restarting: only `small` takes requests
        _, err = await served(router, caller(router), prompt(10, 8))
        assert err is not None and (err.code, err.reason) == (grpc.StatusCode.UNAVAILABLE, "no_engine")
        assert err.message == ("no engine that can hold this request (prompt + max_tokens = 18 "
                               "tokens) is taking requests now (down, restarting, draining or not "
                               "yet reported); retry later")
        _, err = await served(router, caller(router), prompt(10, 7))  # fits `small`
        assert err is None and len(small.requests) == 1
    finally:
        await router.close()


@pytest.mark.parametrize("third", [True, False])
async def test_a_continuation_an_engine_refuses_goes_on_elsewhere(tmp_path, third):
    """Outside probe: a stream whose engine died was continued on an engine that refused
    it, and the client's half-sent stream ended INVALID_ARGUMENT ("lower max_tokens"),
    as if its request were bad. A refusal of a continuation is now a lost engine: the
    stream goes on on another one (not the refusing one again), or ends UNAVAILABLE."""
    router = await Router(tmp_path, TENANTS).start()
    try:
        refusing = router.add_engine("127.0.0.1:2")
        refusing.error = refusal(grpc.StatusCode.INVALID_ARGUMENT, "too large for this pool")
        other = router.add_engine("127.0.0.1:3") if third else None

        async def dies(request, timeout=None):
            yield token(1)
            raise refusal(grpc.StatusCode.UNAVAILABLE, "connection reset")

        router.engine.generate = dies
        with capture_logs() as logs:
            responses, err = await served(router, caller(router), prompt(5, 3))
        assert len(refusing.requests) == 1  # tried once, then avoided
        moves = [e["error"] for e in logs if e["event"] == "request_continued"]
        assert moves == ["engine 127.0.0.1:1 is unavailable (connection reset)",  # what happened,
                         "engine 127.0.0.1:2 refused to continue it (INVALID_ARGUMENT: too large "
                         "for this pool)"][:len(moves)]  # not the client's "could not continue"
        assert len(moves) == 1 + third
        assert counter(router, "continued", "engine_refused") == int(third)
        if other is not None:
            assert err is None, err
            assert [list(r.token_ids) for r in responses] == [[5], [5], [5]]
            assert other.requests[0].sampling.output_offset == 1
        else:
            assert [list(r.token_ids) for r in responses] == [[5]]
            assert err is not None and err.code == grpc.StatusCode.UNAVAILABLE
            assert err.message.startswith(
                "engine 127.0.0.1:2 refused to continue it (INVALID_ARGUMENT: too large for "
                "this pool) after 1 tokens and no other engine could continue the stream")
    finally:
        await router.close()


async def test_a_request_one_engine_refuses_runs_on_another(tmp_path):
    """Regression probe doubt: engines differ (an adapter over one engine's
    --max-lora-rank), and a new request the chosen engine refused ended with that refusal
    although another engine could serve it. Now it is tried there; when every engine
    refuses, the client gets the last refusal."""
    router = await Router(tmp_path, TENANTS).start()
    try:
        router.engine.error = refusal(grpc.StatusCode.FAILED_PRECONDITION, "rank 16 > --max-lora-rank 8")
        other = router.add_engine("127.0.0.1:2")
        responses, err = await served(router, caller(router), prompt(5, 3))
        assert err is None and [list(r.token_ids) for r in responses] == [[5], [5], [5]]
        assert len(router.engine.requests) == 1 and len(other.requests) == 1
        assert counter(router, "continued", "engine_refused") == 0  # no token had been sent

        other.error = refusal(grpc.StatusCode.FAILED_PRECONDITION, "weights failed to load")
        _, err = await served(router, caller(router), prompt(5, 3))
        assert err is not None and (err.code, err.message) == (
            grpc.StatusCode.FAILED_PRECONDITION, "weights failed to load")  # the last one asked
        assert len(router.engine.requests) == 2 and len(other.requests) == 2  # each once
        assert counter(router, "rejected", "engine_failed_precondition") == 1
    finally:
        await router.close()


# ---- deadlines ------------------------------------------------------------------------


async def test_a_deadline_ending_is_a_miss_and_not_a_refusal_once_an_engine_worked_on_it(tmp_path):
    """The engine call's deadline (a timer that may fire a moment before the router's
    clock reaches the deadline) ends a request before and one after its first token."""
    router = await Router(tmp_path, TENANTS).start()
    try:
        async def stalled(request, timeout=None):
            raise refusal(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
            yield

        async def slow(request, timeout=None):
            yield token(1)
            yield token(2)
            raise refusal(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")

        later = time.monotonic() + 30  # not reached when the engine call ends
        router.engine.generate = stalled
        _, err = await served(router, caller(router, deadline=later))
        assert err is not None and err.code == grpc.StatusCode.DEADLINE_EXCEEDED
        assert err.message == "the request's deadline passed before engine 127.0.0.1:1 produced its first token"
        router.engine.generate = slow
        responses, err = await served(router, caller(router, deadline=later))
        assert len(responses) == 2 and err is not None
        assert err.message == "the request's deadline passed during generation, after 2 tokens"

        assert counter(router, "requests", "deadline") == 2
        assert counter(router, "deadline_misses", "t") == 2
        assert counter(router, "rejected", "deadline") == 0  # both were served, not refused
    finally:
        await router.close()


async def test_a_deadline_that_passes_in_the_queue_is_a_refusal_and_a_miss(tmp_path):
    router = await Router(tmp_path, TENANTS).start()
    try:
        for _ in range(router.engine.seats.capacity):  # the only engine is full
            router.engine.seats.acquire(tenant="t")
        _, err = await served(router, caller(router, deadline=time.monotonic() + 0.05))
        assert err is not None and err.code == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "was never scheduled: its deadline passed" in err.message
        assert counter(router, "requests", "deadline") == 1
        assert counter(router, "rejected", "deadline") == 1  # never served
        assert counter(router, "deadline_misses", "t") == 1
        assert counter(router, "rejected", "queue_timeout") == 0  # the router's own limit
    finally:
        await router.close()


async def test_a_cancel_just_before_the_deadline_is_the_deadline(tmp_path):
    """The client's timer starts before its call reaches the router, so the client cancels
    a moment before the router's clock reaches the deadline; earlier, a cancel is a cancel."""
    router = await Router(tmp_path, TENANTS).start()
    try:
        async def stalled(request, timeout=None):
            await asyncio.Event().wait()
            yield

        router.engine.generate = stalled

        async def cancelled_with(deadline: float) -> None:
            task = asyncio.create_task(served(router, caller(router, deadline=deadline)))
            await asyncio.sleep(0.01)
            task.cancel()  # what gRPC does to the handler when the client cancels
            await asyncio.gather(task, return_exceptions=True)

        await cancelled_with(time.monotonic() + 0.06)  # 0.05 s to go: the client's deadline
        await cancelled_with(time.monotonic() + 30)
        assert (counter(router, "requests", "deadline"), counter(router, "requests", "cancelled")) == (1, 1)
        assert counter(router, "deadline_misses", "t") == 1
    finally:
        await router.close()


# ---- the command line -----------------------------------------------------------------


def test_a_repeated_engine_is_refused_at_startup(tmp_path, capsys):
    """Two --engine flags for one engine would make two clients, each filling it to its cap."""
    argv = ["serve", "--model", str(tmp_path), "--engine", "h:1", "--engine", "dns:///n:2",
            "--engine", "h:1", "--engine", "dns:n:2", "--engine", "h:3"]
    with pytest.raises(ValueError, match=r"^engines must each be given once; repeated: dns:///n:2, h:1$"):
        config_from_args(build_parser().parse_args(argv))
    assert main(argv) == 2
    assert "error: engines must each be given once" in capsys.readouterr().err
    config = config_from_args(build_parser().parse_args(argv[:7]))
    assert config.engines == ("h:1", "dns:///n:2")



async def test_a_silent_engines_load_gauges_are_absent_not_stale(tmp_path):
    """Outside probe: a dead engine kept its last running_sequences and kv_blocks_free
    forever, so a sum over engines counted it."""
    from prometheus_client import generate_latest

    router = await Router(tmp_path, TENANTS).start()
    try:
        router.engine.report_load(num_running=4, num_free_blocks=10)
        registry = router.pipeline.metrics.registry

        def gauges() -> str:
            text = generate_latest(registry).decode()
            return "\n".join(line for line in text.splitlines() if line.startswith(
                ("omnibus_router_engine_running_sequences{", "omnibus_router_engine_kv_blocks_free{",
                 "omnibus_router_engine_healthy{")))

        assert gauges() == ('omnibus_router_engine_healthy{engine="127.0.0.1:1"} 1.0\n'
                            'omnibus_router_engine_running_sequences{engine="127.0.0.1:1"} 4.0\n'
                            'omnibus_router_engine_kv_blocks_free{engine="127.0.0.1:1"} 10.0')
        router.engine.link.mark_failed("connection refused")
        assert gauges() == 'omnibus_router_engine_healthy{engine="127.0.0.1:1"} 0.0'
    finally:
        await router.close()
