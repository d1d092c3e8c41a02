"""One job's stream, across engines: queued until the dispatcher assigns an engine,
streamed from it, and continued on another one when it is lost.

Nothing lost: when the engine serving a stream dies, drains, or is marked unhealthy
(stalled), the stream continues on another engine as the prompt + the tokens already
sent (output_offset: penalties and seeded draws go on as if uninterrupted), with the
rest of max_tokens; the client sees one stream. A draining engine that moves KV hands
each running stream's KV on (its last output names it: kv_handle), and the next engine
reads it instead of recomputing it.

Disaggregated serving: with engines of --role prefill in the fleet, a request's prompt
is computed on one of them first (max_tokens 1, its KV held: the first token streams to
the client), then a decode engine goes on with it, reading that KV. The holder is told
to let go of held KV once the reader's first output arrives, or the stream ends. A prefill
engine that overlaps the transfer (--kv-transfer-overlap) hands the stream on as soon as
it is seated, before its first token, and the decode engine samples that token itself. A client that stops reading for
--client-stall-seconds has its engine work aborted and its seat freed (client_stalled).
A router drain that runs out of time ends each stream with ABORTED, usage included.
"""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from collections.abc import AsyncGenerator, Sequence
from contextlib import aclosing
from typing import Any, TypeVar

import grpc
import structlog
from omnibus.v1 import engine_pb2, inference_pb2

from omnibus.common import finish_reasons
from omnibus.router.config import RouterConfig
from omnibus.router.dispatch.dispatcher import Dispatcher, Ticket
from omnibus.router.dispatch.engines import EngineClient
from omnibus.router.dispatch.fleet import Fleet
from omnibus.router.service.accounting import ENGINE_REFUSAL_CODES, Accounts, unserved, used_tokens
from omnibus.router.service.errors import RequestError
from omnibus.router.service.job import Job, StreamWatch
from omnibus.router.service.metrics import RouterMetrics
from omnibus.router.service.shaping import Shaper

log = structlog.get_logger("router")

STOP, UNSPECIFIED = inference_pb2.STOP, inference_pb2.FINISH_REASON_UNSPECIFIED
ABORTED, LENGTH = inference_pb2.ABORTED, inference_pb2.LENGTH
PREFILL = frozenset({"prefill"})  # engine roles (--role) a prefill hop goes to
SERVING = frozenset({"both", "decode"})  # ... and the rest, whenever prefill engines exist
T = TypeVar("T")
# A cancel this close to the deadline is the deadline: the client's own timer started
# before its call reached the router (a new connection's handshake), so its cancel can
# come a moment before the router's clock reaches the deadline it was sent.
DEADLINE_CANCEL_SLACK_S = 0.1
# The engine's request ids: this process's random prefix and a count, unique across the
# routers sharing an engine as uuid4s are, without a getrandom call per request.
_engine_request_ids = map(f"{uuid.uuid4().hex[:16]}-{{}}".format, itertools.count())


class _EngineLost(Exception):
    """The engine can no longer serve the stream: it may go on on another one."""

    def __init__(self, error: RequestError, why: str = "engine_unavailable", what: str = "") -> None:
        super().__init__(error.message)
        self.error = error  # what the client gets when no other engine goes on with it
        self.why = why  # engine_unavailable, engine_unhealthy, engine_drained, engine_refused
        self.what = what or error.message  # what happened to the engine (the log's)


class _Handoff(Exception):
    """The prefill engine is done with the stream: a decode engine goes on with it."""


class _Drained(Exception):
    """The router's drain ran out of time while the stream was being served."""


class Streamer:
    """Serves admitted jobs: each one's stream, from engine to engine, to its end."""

    def __init__(
        self,
        config: RouterConfig,
        dispatcher: Dispatcher,
        fleet: Fleet,
        shaper: Shaper,
        accounts: Accounts,
        metrics: RouterMetrics,
    ) -> None:
        self._config = config
        self._dispatcher = dispatcher
        self._queue = dispatcher.queue
        self._fleet = fleet
        self._shaper = shaper
        self._accounts = accounts
        self._metrics = metrics
        self._watch = StreamWatch(config.client_stall_seconds)

    def drain(self) -> None:
        """The router's drain is out of time: every stream ends now, those being served
        with a final ABORTED message carrying usage, those still queued UNAVAILABLE."""
        self._watch.drain()

    async def served(self, job: Job) -> AsyncGenerator[inference_pb2.GenerateResponse, None]:
        """An admitted request, served; its permit is released and its outcome recorded
        when it ends."""
        outcome = "cancelled"  # what an exception other than ours means here
        self._watch.add(job)
        try:
            async with aclosing(self._serve(job)) as responses:
                async for response in responses:
                    if response.finish_reason != UNSPECIFIED:
                        outcome = finish_reasons.OUTCOME[response.finish_reason]
                    job.wait("client")
                    yield response
                    job.wait("")
                    if job.interrupted == "drain" and response.finish_reason == UNSPECIFIED:
                        yield self._shaper.final(job, ABORTED)  # the drain came during that write
                        return
        except RequestError as err:
            outcome = err.reason
            if unserved(job, outcome):  # a refusal: no engine worked on it
                raise self._accounts.refused(err, job.request.request_id) from None
            log.info("request_failed", request_id=job.request.request_id, code=err.code.name,
                     reason=err.reason, message=err.message)
            raise
        finally:
            self._watch.jobs.discard(job)
            if job.interrupted == "client_stalled":  # the write it was stuck in was cancelled
                outcome = "client_stalled"
                log.warning("client_stalled", request_id=job.request.request_id,
                            seconds=self._config.client_stall_seconds)
            elif outcome == "cancelled" and job.caller.deadline_passed(DEADLINE_CANCEL_SLACK_S):
                outcome = "deadline"  # the client's deadline ended the call (gRPC cancels it)
            job.permit.release(used_tokens(job, outcome))
            self._accounts.record(job, outcome)

    async def _serve(self, job: Job) -> AsyncGenerator[inference_pb2.GenerateResponse, None]:
        """Streams the request from an engine, moving it to another engine (prompt + the
        tokens sent so far) when one fails, drains or stalls, at most
        max_engine_attempts engines in all."""
        self._shaper.start(job)
        job.queued_at = job.arrival
        attempt = 1
        try:
            while True:
                if len(job.sent_ids) >= job.request.sampling.max_tokens:  # lost after its last
                    yield self._shaper.final(job, LENGTH)
                    return
                job.hop = "prefill" if self._disaggregated(job) else ""
                engine = await self._queued(job)
                try:
                    async with aclosing(self._stream(job, engine)) as responses:
                        async for response in responses:
                            yield response
                    return
                except _Handoff:  # a decode engine goes on, reading the prefill's KV (or recomputing)
                    job.prefilled, job.queued_at = True, time.monotonic()
                    continue
                except _EngineLost as lost:
                    # No engine left to take it (one with its adapter): fail now, as a new
                    # request would be refused, rather than wait out the queue limit.
                    if (attempt == self._config.max_engine_attempts
                            or not self._fleet.taking(job.adapter, job.request.cost, job.refused_by)):
                        raise lost.error from None
                    self._moving(job, engine, attempt, lost)
                    attempt += 1
                finally:
                    job.serving = None
                    engine.seats.release(job.adapter, job.caller.tenant.name)
        except _Drained:
            yield self._shaper.final(job, ABORTED)
        finally:
            self._release_source(job)

    def _disaggregated(self, job: Job) -> bool:
        """Whether the job's prompt goes to a prefill engine first: a new stream that will
        decode (max_tokens > 1), not prefilled already (an early handle comes before the
        first token) and whose KV no engine holds, while engines of both roles that move
        KV take requests."""
        request = job.request
        return (not job.sent_ids and not job.prefilled and job.kv_source is None
                and request.sampling.max_tokens > 1 and request.sampling.prompt_logprobs == 0
                and self._fleet.with_role(PREFILL, job.adapter, request.cost)
                and self._fleet.with_role(SERVING, job.adapter, request.cost))

    def _roles(self, job: Job) -> frozenset[str] | None:
        """The engine roles the job's next ticket may go to (None: any)."""
        if job.hop == "prefill":
            return PREFILL
        if self._fleet.with_role(PREFILL) and any(e.load.role in SERVING for e in self._fleet.accepting()):
            return SERVING  # prefill engines take prefill hops only, while others take the rest
        return None

    def _take_source(self, job: Job, handle: engine_pb2.KvHandle, engine: EngineClient) -> None:
        """The KV `engine` holds for the stream's next engine."""
        self._release_source(job)
        job.kv_source, job.kv_holder = handle, engine

    def _release_source(self, job: Job) -> None:
        """The holder of the stream's KV may let go of it (read, recomputed or unwanted)."""
        if job.kv_source is not None and job.kv_holder is not None:
            job.kv_holder.release(job.kv_source.request_id)
        job.kv_source = job.kv_holder = None

    async def _queued(self, job: Job) -> EngineClient:
        job.wait("queue")
        try:
            engine = await self._wait_for_engine(job)
        except asyncio.CancelledError:
            if job.take_interrupt() != "drain":
                raise
            raise RequestError(
                grpc.StatusCode.UNAVAILABLE,
                "the router is shutting down and the request was still queued; retry on another "
                "router",
                "router_draining",
            ) from None
        job.serving = engine
        return engine

    def _moving(self, job: Job, engine: EngineClient, attempt: int, lost: _EngineLost) -> None:
        """Logs and counts a move to another engine; the next one resumes after the
        tokens already sent, queued ahead of later arrivals."""
        if job.sent_ids:
            self._metrics.continued.labels(lost.why).inc()
        job.queued_at = time.monotonic()
        log.warning(
            "request_continued" if job.sent_ids else "request_retried",
            request_id=job.request.request_id,
            engine=engine.address,
            attempt=attempt,
            tokens_sent=len(job.sent_ids),
            error=lost.what,
        )

    def _resumed(self, job: Job) -> tuple[Sequence[int], engine_pb2.EngineSamplingParams]:
        """The prompt and sampling for the current engine: the original ones, or for a
        continuation the prompt + the tokens sent, with the rest of max_tokens."""
        request, sent = job.request, job.sent_ids
        job.offset = len(sent)
        if job.hop == "prefill":  # the prompt and the first token; a decode engine goes on
            sampling = engine_pb2.EngineSamplingParams()
            sampling.CopyFrom(request.sampling)
            sampling.max_tokens = 1
            return request.prompt_ids, sampling
        if not sent:
            return request.prompt_ids, request.sampling
        sampling = engine_pb2.EngineSamplingParams()
        sampling.CopyFrom(request.sampling)
        sampling.max_tokens -= len(sent)
        sampling.output_offset = len(sent)
        sampling.prompt_logprobs = 0  # sent with the first token already
        return [*request.prompt_ids, *sent], sampling

    async def _wait_for_engine(self, job: Job) -> EngineClient:
        """Queues the request until the dispatcher assigns it an engine with room. The
        router's queue limit holds for the time the request spends queued in all: a
        stream moved to another engine (or a request an engine refused) re-enters the queue
        with what its earlier waits left of the limit, not a fresh one (issue 31)."""
        tenant = job.caller.tenant
        ticket = Ticket(
            job.request.priority, job.request.cost, job.arrival, job.adapter,
            tenant.name, tenant.weight, job.request.prompt_ids, avoid=frozenset(job.refused_by),
            cache_salt=tenant.cache_salt, roles=self._roles(job),
            kv_layout=job.kv_source.layout if job.kv_source is not None else "",
        )
        self._dispatcher.submit(ticket)
        queue_left = (job.queued_at + self._config.max_queue_seconds - job.queued_before
                      - time.monotonic())
        client_left = job.caller.time_remaining()
        timeout = queue_left if client_left is None else min(queue_left, client_left)
        try:
            async with asyncio.timeout(max(timeout, 0.0)):
                engine = await ticket.future
        except BaseException as exc:
            self._dispatcher.withdraw(ticket)
            if isinstance(exc, TimeoutError):
                raise self._queue_timeout(
                    job, client_left is not None and client_left <= queue_left
                ) from None
            raise
        finally:
            job.queued_before += time.monotonic() - job.queued_at
        job.dispatched = job.dispatched or time.monotonic()  # a retry keeps the first
        job.engine = engine.address
        if ticket.affinity is not None:
            self._metrics.adapter_dispatches.labels(ticket.affinity.label).inc()
        return engine

    def _queue_timeout(self, job: Job, by_client: bool) -> RequestError:
        why = (
            "its deadline passed"
            if by_client
            else f"the router's queue limit is {self._config.max_queue_seconds} s"
        )
        if job.sent_ids:  # a continuation: its engine was lost and no other took it in time
            waited = time.monotonic() - job.queued_at
            total = job.queued_before + waited
            what = (f"the stream's engine was lost after {len(job.sent_ids)} tokens and the rest "
                    f"waited {waited:.2f} s for another engine to continue it ({total:.2f} s queued "
                    f"in all): {why}; the completion is incomplete, retry the request")
        else:
            waited = time.monotonic() - job.arrival
            what = f"the request waited {waited:.2f} s for an engine and was never scheduled: {why}"
        # Counted as the client's deadline when that ended it (a miss), else the queue limit.
        return RequestError(grpc.StatusCode.DEADLINE_EXCEEDED, what,
                            "deadline" if by_client else "queue_timeout")

    async def _stream(
        self, job: Job, engine: EngineClient
    ) -> AsyncGenerator[inference_pb2.GenerateResponse, None]:
        request = job.request
        prompt_ids, sampling = self._resumed(job)
        prefill = job.hop == "prefill"
        message = engine_pb2.EngineGenerateRequest(
            request_id=next(_engine_request_ids),  # unique on the engine whatever the client sent
            prompt_token_ids=prompt_ids,
            sampling=sampling,
            priority=request.priority,
            adapter=job.adapter,
            tenant=job.caller.tenant.name,
            tenant_weight=job.caller.tenant.weight,
            cache_salt=job.caller.tenant.cache_salt,  # the tenant's cache group: never the client's
            kv_hold=prefill,
        )
        if job.kv_source is not None:
            message.kv_source.CopyFrom(job.kv_source)
        outputs = engine.generate(message, timeout=job.caller.time_remaining())  # the client's deadline
        tenant = job.caller.tenant
        job.wait("engine")
        try:
            async for out in outputs:
                job.wait("")
                if job.kv_holder is not None and job.kv_holder is not engine:
                    self._release_source(job)  # its reader has its first output: the KV was read or recomputed
                # The engine gave the sequence up (it drains): go on elsewhere, with its KV
                # when it names where it holds it. A prefill hop's end by its length of 1 is
                # the decode engine's turn.
                drained = out.finish_reason == ABORTED
                handoff = prefill and out.finish_reason == LENGTH
                if drained or handoff:
                    out.finish_reason = UNSPECIFIED
                    if out.HasField("kv_handle"):
                        self._take_source(job, out.kv_handle, engine)
                self._queue.charge(tenant.name, len(out.token_ids), tenant.weight)  # fair share
                response = self._shaper.response(job, out)
                if response.token_ids or response.text or not (drained or handoff):
                    yield response  # (an early handoff names the KV before the first token: nothing to send)
                if handoff and response.finish_reason == UNSPECIFIED:
                    self._metrics.handoffs.labels("transfer" if job.kv_source is not None else "recompute").inc()
                    raise _Handoff()
                if drained and response.finish_reason == UNSPECIFIED:
                    moved = "engine_migrated" if job.kv_source is not None else "engine_drained"
                    raise self._lost(job, engine, moved, f"engine {engine.address} "
                                     + ("moved it while draining" if moved == "engine_migrated"
                                        else "aborted it while draining"))
                job.wait("engine")
                if response.finish_reason != UNSPECIFIED:
                    return  # a stop string may end it early: the finally aborts it on the engine
        except grpc.aio.AioRpcError as exc:
            raise self._engine_error(exc, engine, job) from None
        except asyncio.CancelledError:
            why = job.take_interrupt()
            if why == "engine":
                raise self._lost(job, engine, "engine_unhealthy", job.interrupt_note) from None
            if why == "drain":
                raise _Drained() from None
            raise
        finally:
            await outputs.aclose()
        raise RequestError(
            grpc.StatusCode.INTERNAL,
            f"engine {engine.address} ended the stream without a finish reason",
            "engine_error",
        )

    def _engine_error(
        self, exc: grpc.aio.AioRpcError, engine: EngineClient, job: Job
    ) -> Exception:
        code, details = exc.code(), exc.details() or ""
        if code == grpc.StatusCode.UNAVAILABLE:
            engine.link.mark_failed(details)
            return self._lost(job, engine, "engine_unavailable",
                              f"engine {engine.address} is unavailable ({details})")
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            if job.first_token is None:  # e.g. a stalled engine not yet marked unhealthy
                when = f"before engine {engine.address} produced its first token"
            else:
                when = f"during generation, after {len(job.sent_ids)} tokens"
            return RequestError(code, f"the request's deadline passed {when}", "deadline")
        if code in ENGINE_REFUSAL_CODES:
            # Engines differ (adapter ranks, lengths, what loaded): another may take it.
            job.refused_by.add(engine.address)
            if job.sent_ids:  # the request was good where it started
                return self._lost(job, engine, "engine_refused",
                                  f"engine {engine.address} refused to continue it "
                                  f"({code.name}: {details})")
            # A format the engine's grammar engine refused names the field, as the router's checks do.
            param = "structured_output" if details.startswith("structured_output") else None
            refusal = RequestError(code, details, f"engine_{code.name.lower()}", param=param)  # when none does
            return _EngineLost(refusal, "engine_refused",
                               f"engine {engine.address} refused it ({code.name}: {details})")
        return RequestError(code, f"engine {engine.address} failed: {details}", "engine_error")

    def _lost(self, job: Job, engine: EngineClient, why: str, what: str) -> _EngineLost:
        """The engine can no longer serve the stream; the error is what the client gets
        when no other engine is left to continue on."""
        if not job.sent_ids:
            message = f"{what}; retry later"
        else:
            message = (
                f"{what} after {len(job.sent_ids)} tokens and no other engine could continue "
                f"the stream (none was available, or {self._config.max_engine_attempts} engines "
                "were tried); the completion is incomplete, retry the request"
            )
        return _EngineLost(RequestError(grpc.StatusCode.UNAVAILABLE, message, why), why, what)

    def stall_error(self) -> RequestError | None:
        """When the current task's write was cancelled because its client stopped reading
        (--client-stall-seconds), the status the transport ends the call with; else None."""
        task = asyncio.current_task()
        if task is None or task not in self._watch.stalled:
            return None
        return RequestError(
            grpc.StatusCode.ABORTED,
            f"the client did not read its stream for {self._config.client_stall_seconds:g} s "
            "(the router's --client-stall-seconds), so the router ended it and freed its seat",
            "client_stalled",
        )


async def merge(streams: list[AsyncGenerator[T, None]]) -> AsyncGenerator[tuple[int, T], None]:
    """(index, item) from several streams as items arrive. The first error ends it
    (and every stream); closing it closes every stream."""
    if len(streams) == 1:
        async with aclosing(streams[0]) as only:
            async for item in only:
                yield 0, item
        return
    # Bounded: a stream waits while its items are not taken (a slow client), as a single
    # stream waits on its write, so its outputs merge upstream instead of queueing here.
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue(maxsize=len(streams))
    done = object()

    async def pump(index: int, stream: AsyncGenerator[T, None]) -> None:
        try:
            async with aclosing(stream) as items:
                async for item in items:
                    await queue.put((index, item))
            await queue.put((index, done))
        except Exception as exc:  # handed to the consumer, which raises it
            await queue.put((index, exc))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        running = len(tasks)
        while running:
            index, item = await queue.get()
            if item is done:
                running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
