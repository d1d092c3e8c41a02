"""One router's Session stream: its adds and aborts in, one update per step with every
new token of its requests out. A Generate call is served by a stream of its own with one
request (`one`), whose updates it sends entry by entry: the same admission, deadline,
delivery, failure and end as a router's request."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator
from typing import TYPE_CHECKING

import grpc
from omnibus.v1 import engine_pb2

from omnibus.engine.request import EngineRequest
from omnibus.engine.serving.async_engine import Delivery, Refused
from omnibus.engine.serving.registry import Live
from omnibus.engine.serving.replies import Refusal, error_status, fill, output_error

if TYPE_CHECKING:
    from omnibus.engine.serving.service import EngineService


class SessionStream:
    """`deliver` (handed each step's outputs by the step loop, run on this server's event
    loop) adds its requests' outputs to the pending update; the stream's writer sends
    whatever is pending when it can, so steps the router has not read yet are merged. A
    started request's plain token (no logprobs, no finish) costs two list appends, sent as
    the update's packed (handle, token) pairs when the router reads them (`packed`); the
    rest become entries, one per request and update. With `merges` off (a Generate call:
    one message per step) every output is an entry of its own."""

    def __init__(self, service: EngineService, loop: asyncio.AbstractEventLoop,
                 merges: bool = True) -> None:
        self.loop = loop
        self._service = service
        self._requests = service.requests
        self.packed = False  # the router said it reads SessionUpdate.tokens
        self.pending = engine_pb2.SessionUpdate()
        self._merges = merges
        # request -> its entry in `pending`: steps the writer has not sent yet (the router
        # reads slower than steps come) are merged into one entry per request
        self._entries: dict[Live, engine_pb2.EngineGenerateResponse] = {}
        self._handles: list[int] = []  # the pending packed tokens, pair by pair
        self._tokens: list[int] = []
        self.ready = asyncio.Event()  # something is pending, or the router has left
        self.closed = False  # the router's side of the stream has ended

    # ---- the stream ------------------------------------------------------------

    async def run(
        self, requests: AsyncIterator[engine_pb2.SessionRequest]
    ) -> AsyncGenerator[engine_pb2.SessionUpdate, None]:
        """The stream's updates, until the router's side ends or `close`; on the way out
        the requests still running are aborted (the router is gone: free their KV)."""
        reader = asyncio.create_task(self._read(requests))
        try:
            while True:
                await self.ready.wait()
                update = self.take()
                if update is not None:
                    yield update
                if self.closed:
                    return
        finally:
            reader.cancel()
            for live in self._requests.of(self):
                self._cancel(live)

    async def one(
        self, msg: engine_pb2.EngineGenerateRequest
    ) -> AsyncGenerator[engine_pb2.EngineGenerateResponse, None]:
        """A Generate call's stream: `msg`'s entries, one per output (a refusal or failure:
        an entry with its status), until it ends. Leaving early aborts it (the caller has
        gone: free its KV)."""
        live = self.add(msg)
        try:
            while True:
                await self.ready.wait()
                # Ended before this take, its last entry is in it (outputs come while the
                # entries below are written: an end seen after them may have more).
                ended = live is None or self._requests.get(live.request_id) is not live
                update = self.take()
                if update is not None:
                    for entry in update.outputs:
                        yield entry
                if ended:
                    return
        finally:
            if live is not None and self._requests.get(live.request_id) is live:
                self._cancel(live)

    def close(self) -> None:
        """Ends the stream once what is pending has gone out."""
        self.closed = True
        self.ready.set()

    async def _read(self, requests: AsyncIterator[engine_pb2.SessionRequest]) -> None:
        try:
            async for request in requests:
                self.packed = request.packed_tokens
                for add in request.add:
                    self.add(add)
                for request_id in request.abort:
                    live = self._requests.get(request_id)
                    if live is not None and live.session is self:
                        self._cancel(live)
                    elif live is None:  # ended: KV it still holds for a transfer is let go
                        self._service.aengine.abort(request_id)
        except grpc.aio.AioRpcError:  # the call broke: the writer's finally aborts what is left
            pass
        finally:
            self.close()

    def add(self, msg: engine_pb2.EngineGenerateRequest) -> Live | None:
        """Admits `msg`'s request, whose deadline (deadline_ms) aborts it when it passes; None
        when it was refused (the pending update says why)."""
        try:
            live = self._service.admit(msg, self)
        except Refusal as refusal:
            self.refuse(msg.handle, refusal.code, refusal.message)
            return None
        deadline = None
        if msg.deadline_ms:
            remaining = msg.deadline_ms / 1000
            deadline = live.arrival + remaining
            live.timer = self.loop.call_later(remaining, self._expire, live)
        try:
            self._service.aengine.add(EngineRequest.from_proto(msg, deadline), self)
        except (ValueError, RuntimeError) as exc:
            self.fail(live, exc)
        return live

    def _cancel(self, live: Live) -> None:
        self._service.aengine.abort(live.request_id)
        self._requests.end(live, "cancelled")

    def _expire(self, live: Live) -> None:
        if self._requests.get(live.request_id) is live:
            self._service.aengine.abort(live.request_id)
            self.fail(live, TimeoutError())

    # ---- outputs ---------------------------------------------------------------

    def deliver(self, items: list[Delivery]) -> None:
        requests = self._requests
        outputs = self.pending.outputs
        for item in items:
            live = requests.get(item.request_id)
            if live is None or live.session is not self:
                continue  # ended here already (aborted, deadline): nothing more to say
            if isinstance(item, Refused):
                self.fail(live, item.error)
                continue
            error = output_error(item)
            if error is not None:
                self.fail(live, error)
                continue
            entry = self._entries.get(live)
            if entry is None:
                if (self.packed and live.first is not None and not item.finished
                        and not item.new_logprobs):
                    for token in item.new_token_ids:  # one per step
                        self._handles.append(live.handle)
                        self._tokens.append(token)
                    live.tokens = item.num_output_tokens
                    continue
                entry = outputs.add(handle=live.handle)
                if self._merges:
                    self._entries[live] = entry
            fill(entry, item)  # tokens and logprobs append; counts and finish are the latest
            live.saw(item)
            if item.finished:
                requests.end(live, item.finish_reason or "stop")
        self.ready.set()

    def fail(self, live: Live, error: BaseException) -> None:
        """Ends `live` with `error`, which the router hears as its status."""
        code, message = error_status(error)
        self.refuse(live.handle, code, message)
        self._requests.end(live, code)

    def refuse(self, handle: int, code: grpc.StatusCode, message: str) -> None:
        self.pending.outputs.add(handle=handle, status_code=code.value[0], status_message=message)
        self.ready.set()

    def take(self) -> engine_pb2.SessionUpdate | None:
        """The pending update (None when there is nothing to send), and a fresh one."""
        update, self.pending = self.pending, engine_pb2.SessionUpdate()
        self._entries.clear()
        self.ready.clear()
        if self._tokens:
            update.token_handles.extend(self._handles)
            update.tokens.extend(self._tokens)
            self._handles, self._tokens = [], []
        elif not update.outputs:
            return None
        return update
