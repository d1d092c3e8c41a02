"""One router's Session stream to one engine (omnibus.v1.Engine.Session).

Every request this router runs on the engine goes in as an add on the one stream, and
the engine answers with one update per step carrying every new token of this router's
requests, so the cost of a token is a few field copies, not a gRPC message: a plain token
(no logprobs, not a request's first or last) is a packed (handle, token) pair. The session
owns the registry of its open requests (handle -> slot); each request's consumer
(`EngineSession.generate`) reads its slot, where outputs it has not taken yet are
merged into one (a slow client gets fewer, larger messages, never a queue per token).

Errors reach a request as grpc.aio.AioRpcError, with the codes a per-request Generate
call would end with: the engine's per-request status, DEADLINE_EXCEEDED when the
request's timeout passes (the engine is told to abort it), or the stream's own status
when the session breaks (every open request ends with it; the engine aborts the
sequences of a session whose stream ended, so a reconnect leaks nothing).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncGenerator

import grpc
from omnibus.v1 import engine_pb2, engine_pb2_grpc

EngineOutput = engine_pb2.EngineGenerateResponse
_CODES = {code.value[0]: code for code in grpc.StatusCode}
_HANDLES = 1 << 32  # handles are uint32
_MAX_DEADLINE_MS = (1 << 32) - 1  # EngineGenerateRequest.deadline_ms is a uint32


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


class _Slot:
    """One open request's outputs between the session reader and its consumer: at most
    one pending output (later entries are merged into it), the packed tokens that came
    after it, and then, perhaps, an error. The consumer takes them, as one output, once
    they hold `interval` tokens, its first token or its finish. Every output it hands
    over carries the request's counts as of its last token."""

    __slots__ = ("request_id", "interval", "started", "pending", "tokens", "held", "error",
                 "waiter", "num_prompt", "num_cached", "num_output")

    def __init__(self, request_id: str, interval: int = 1) -> None:
        self.request_id = request_id
        self.interval = interval
        self.started = False  # a token has been taken
        self.pending: EngineOutput | None = None
        self.tokens: list[int] = []  # packed tokens not taken yet, after `pending`'s
        self.held = 0  # tokens not taken yet
        self.error: grpc.aio.AioRpcError | None = None
        self.waiter: asyncio.Future[None] | None = None
        self.num_prompt = self.num_cached = self.num_output = 0

    def push(self, out: EngineOutput) -> None:
        """An entry of SessionUpdate.outputs."""
        self.num_prompt, self.num_cached = out.num_prompt_tokens, out.num_cached_tokens
        self.num_output = out.num_output_tokens
        self.held += len(out.token_ids)
        if self.pending is None and not self.tokens:
            self.pending = out
        else:  # not taken yet: token ids and logprobs append, counts and finish update
            self._merged().MergeFrom(out)
        if self._ready():
            self._wake()

    def push_token(self, token: int) -> None:
        """A packed token (SessionUpdate.tokens): one more output token, nothing else."""
        self.tokens.append(token)
        self.num_output += 1
        self.held += 1
        if self.held >= self.interval or not self.started:
            self._wake()

    def _merged(self) -> EngineOutput:
        """The pending output with the packed tokens moved into it, and the counts."""
        out = self.pending
        if out is None:
            out = self.pending = EngineOutput()
        if self.tokens:
            out.token_ids.extend(self.tokens)
            self.tokens = []
        out.num_prompt_tokens, out.num_cached_tokens = self.num_prompt, self.num_cached
        out.num_output_tokens = self.num_output
        return out

    def _ready(self) -> bool:
        pending = self.pending
        if pending is None and not self.held:
            return False
        return (not self.started or self.held >= self.interval
                or (pending is not None and pending.finish_reason != 0))

    def fail(self, error: grpc.aio.AioRpcError) -> None:
        if self.error is None:
            self.error = error
            self._wake()

    def expire(self) -> None:
        """The request's deadline passed (its error is made only then: most never do)."""
        self.fail(rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"))

    def _wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    async def next(self) -> EngineOutput:
        while not self._ready():
            if self.error is not None:
                if self.pending is not None or self.held:
                    break  # the tokens it has first (a continuation resumes after them)
                raise self.error
            self.waiter = asyncio.get_running_loop().create_future()
            await self.waiter
        out = self._merged()
        self.pending, self.held = None, 0
        self.started = self.started or bool(out.token_ids)
        return out


class EngineSession:
    """The stream and its registry; `closed` once the stream has ended (a new request
    then needs a new session)."""

    def __init__(self, stub: engine_pb2_grpc.EngineStub, address: str) -> None:
        self._address = address
        self._slots: dict[int, _Slot] = {}  # handle -> the open request
        self._next_handle = 0
        self._outbox = engine_pb2.SessionRequest(packed_tokens=True)
        self._wake = asyncio.Event()  # the outbox has something to send
        self.closed = False
        self._call = stub.Session(self._requests())
        self._reader = asyncio.create_task(self._read(), name=f"session-{address}")

    def __len__(self) -> int:
        return len(self._slots)

    async def generate(
        self, request: engine_pb2.EngineGenerateRequest, timeout: float | None = None,
        interval: int = 1,
    ) -> AsyncGenerator[EngineOutput, None]:
        """Runs `request` (its request_id unique on the engine) and yields its outputs;
        the last has finish_reason set. `timeout`: seconds left of its deadline;
        `interval`: after the first token, outputs are held until they carry this many
        tokens (or the finish). Closing the generator early aborts the request."""
        if self.closed:
            raise rpc_error(grpc.StatusCode.UNAVAILABLE, f"the session to {self._address} has ended")
        if timeout is not None and timeout <= 0:
            raise rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
        handle = self._handle()
        slot = _Slot(request.request_id, interval)
        request.handle = handle
        timer = None
        if timeout is not None:
            # deadline_ms is a uint32: a deadline beyond ~49 days is none the engine must keep
            deadline_ms = min(max(1, math.ceil(timeout * 1000)), _MAX_DEADLINE_MS)
            request.deadline_ms = min(request.deadline_ms or deadline_ms, deadline_ms)
            timer = asyncio.get_running_loop().call_later(timeout, slot.expire)
        self._slots[handle] = slot
        self._outbox.add.append(request)
        self._wake.set()
        try:
            while True:
                out = await slot.next()
                yield out
                if out.finish_reason:
                    return
        finally:
            if timer is not None:
                timer.cancel()
            if self._slots.get(handle) is slot:  # still open on the engine: abort it
                del self._slots[handle]
                if not self.closed:
                    self._outbox.abort.append(slot.request_id)
                    self._wake.set()

    def release(self, request_id: str) -> None:
        """Lets the engine give back what an ended request still holds (its KV kept for a
        transfer): an abort of that id."""
        if not self.closed:
            self._outbox.abort.append(request_id)
            self._wake.set()

    async def close(self) -> None:
        self._call.cancel()
        self._reader.cancel()
        await asyncio.gather(self._reader, return_exceptions=True)

    def _handle(self) -> int:
        handle = self._next_handle
        while handle in self._slots:
            handle = (handle + 1) % _HANDLES
        self._next_handle = (handle + 1) % _HANDLES
        return handle

    async def _requests(self) -> AsyncGenerator[engine_pb2.SessionRequest, None]:
        """What the stream sends: everything queued since the last message, in one."""
        while not self.closed:
            await self._wake.wait()
            self._wake.clear()
            request, self._outbox = self._outbox, engine_pb2.SessionRequest(packed_tokens=True)
            if request.add or request.abort:
                yield request

    async def _read(self) -> None:
        error = rpc_error(grpc.StatusCode.UNAVAILABLE, f"engine {self._address} ended the session")
        slots = self._slots
        try:
            while True:
                update = await self._call.read()
                if update is grpc.aio.EOF:
                    break
                for handle, token in zip(update.token_handles, update.tokens):
                    slot = slots.get(handle)
                    if slot is not None:  # else aborted here already
                        slot.push_token(token)
                for out in update.outputs:
                    slot = slots.get(out.handle)
                    if slot is None:
                        continue  # aborted here already
                    if out.status_code:
                        del slots[out.handle]
                        slot.fail(rpc_error(_CODES.get(out.status_code, grpc.StatusCode.UNKNOWN),
                                            out.status_message))
                        continue
                    if out.finish_reason:
                        del slots[out.handle]
                    slot.push(out)
        except grpc.aio.AioRpcError as exc:
            error = exc
        finally:
            self.closed = True
            self._wake.set()  # ends the request stream
            for slot in slots.values():
                slot.fail(error)
            slots.clear()
