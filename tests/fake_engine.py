"""A fake engine worker for router tests: `python -m tests.fake_engine --port N ...`.

It speaks omnibus.v1.Engine like the real one but runs no model: every step, each
running sequence "generates" the next token of its own prompt, cycled (an echo), so a
test knows the exact text a request produces. It keeps the real engine's limits
(max_num_seqs running, the rest waiting) and counts KV blocks like it, so routers see
realistic load reports. Steps are paced by --step-ms; --unavailable makes it refuse
every request (as a draining engine does) while still reporting room. Routers reach it
through Session, as they do a real engine; Generate serves one request per call.
"""

from __future__ import annotations

import argparse
import asyncio
import math
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health, health_pb2_grpc
from omnibus.v1 import engine_pb2, engine_pb2_grpc, inference_pb2


@dataclass(eq=False)
class _Seq:
    prompt: list[int]
    params: engine_pb2.EngineSamplingParams
    out: asyncio.Queue[engine_pb2.EngineGenerateResponse] = field(default_factory=asyncio.Queue)
    generated: int = 0
    handle: int = 0  # on a session: the router's number for it


class FakeEngine(engine_pb2_grpc.EngineServicer):
    def __init__(self, args: argparse.Namespace) -> None:
        self._args = args
        self._waiting: deque[_Seq] = deque()
        self._running: list[_Seq] = []
        self._steps = 0
        self._requests = 0
        self._wake = asyncio.Event()

    def _blocks(self, seq: _Seq) -> int:
        return math.ceil((len(seq.prompt) + seq.generated) / self._args.block_size)

    def _free_blocks(self) -> int:
        return self._args.num_blocks - sum(self._blocks(s) for s in self._running)

    async def run(self) -> None:
        while True:
            if not (self._waiting or self._running):
                await self._wake.wait()
                self._wake.clear()
            await asyncio.sleep(self._args.step_ms / 1000)
            self._step()

    def _step(self) -> None:
        while self._waiting and len(self._running) < self._args.max_num_seqs:
            self._running.append(self._waiting.popleft())
        self._steps += 1
        for seq in list(self._running):
            tokens, finish = [], inference_pb2.FINISH_REASON_UNSPECIFIED
            while not finish and len(tokens) < self._args.tokens_per_step:
                token = seq.prompt[seq.generated % len(seq.prompt)]
                tokens.append(token)
                seq.generated += 1
                if token in seq.params.stop_token_ids:
                    finish = inference_pb2.STOP
                elif seq.generated >= seq.params.max_tokens:
                    finish = inference_pb2.LENGTH
            seq.out.put_nowait(
                engine_pb2.EngineGenerateResponse(
                    handle=seq.handle,
                    token_ids=tokens,
                    logprobs=[inference_pb2.TokenLogprob(token_id=t, logprob=-1.0)
                              for t in tokens if seq.params.logprobs],
                    finish_reason=finish,
                    num_prompt_tokens=len(seq.prompt),
                    num_output_tokens=seq.generated,
                )
            )
            if finish:
                self._running.remove(seq)

    def _drop(self, seq: _Seq) -> None:
        if seq in self._running:
            self._running.remove(seq)
        elif seq in self._waiting:
            self._waiting.remove(seq)

    async def Generate(
        self, request: engine_pb2.EngineGenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[engine_pb2.EngineGenerateResponse]:
        self._requests += 1
        if self._args.unavailable:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "fake engine refuses every request")
        seq = _Seq(list(request.prompt_token_ids), request.sampling)
        self._waiting.append(seq)
        self._wake.set()
        try:
            while True:
                response = await seq.out.get()
                yield response
                if response.finish_reason:
                    return
        finally:
            self._drop(seq)  # a cancelled call frees its "blocks" at once

    async def Session(
        self, requests: AsyncIterator[engine_pb2.SessionRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[engine_pb2.SessionUpdate]:
        out: asyncio.Queue[engine_pb2.EngineGenerateResponse] = asyncio.Queue()  # the session's
        seqs: dict[str, _Seq] = {}

        async def read() -> None:
            async for request in requests:
                for add in request.add:
                    self._requests += 1
                    if self._args.unavailable:
                        out.put_nowait(engine_pb2.EngineGenerateResponse(
                            handle=add.handle, status_code=grpc.StatusCode.UNAVAILABLE.value[0],
                            status_message="fake engine refuses every request"))
                        continue
                    seq = _Seq(list(add.prompt_token_ids), add.sampling, out, handle=add.handle)
                    seqs[add.request_id] = seq
                    self._waiting.append(seq)
                    self._wake.set()
                for request_id in request.abort:
                    if request_id in seqs:
                        self._drop(seqs.pop(request_id))

        reader = asyncio.create_task(read())
        try:
            while True:
                update = engine_pb2.SessionUpdate(outputs=[await out.get()])
                while not out.empty():  # one message for all that is ready
                    update.outputs.append(out.get_nowait())
                yield update
        finally:
            reader.cancel()
            for seq in seqs.values():
                self._drop(seq)  # the router is gone: its sequences end

    def _report(self) -> engine_pb2.LoadReport:
        return engine_pb2.LoadReport(
            num_waiting=len(self._waiting),
            num_running=len(self._running),
            num_free_blocks=self._free_blocks(),
            num_total_blocks=self._args.num_blocks,
            max_num_seqs=self._args.max_num_seqs,
            block_size=self._args.block_size,
            max_model_len=1024,
        )

    async def WatchLoad(
        self, request: engine_pb2.WatchLoadRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[engine_pb2.LoadReport]:
        interval = max(request.interval_ms, 10) / 1000
        while True:
            yield self._report()
            await asyncio.sleep(interval)

    async def Stats(
        self, request: engine_pb2.StatsRequest, context: grpc.aio.ServicerContext
    ) -> engine_pb2.StatsResponse:
        return engine_pb2.StatsResponse(
            load=self._report(),
            num_steps=self._steps,
            num_requests=self._requests,
            num_active_streams=len(self._running) + len(self._waiting),
        )


async def main(args: argparse.Namespace) -> None:
    fake = FakeEngine(args)
    server = grpc.aio.server()
    engine_pb2_grpc.add_EngineServicer_to_server(fake, server)
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    server.add_insecure_port(f"{args.host}:{args.port}")
    await server.start()
    await fake.run()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--host", default="127.0.0.1", help="e.g. 127.0.0.2: one of several")
    parser.add_argument("--max-num-seqs", type=int, default=4)
    parser.add_argument("--step-ms", type=float, default=5.0)
    parser.add_argument("--tokens-per-step", type=int, default=1,
                        help="tokens per sequence per output, as a router gets them when it reads late")
    parser.add_argument("--num-blocks", type=int, default=256)
    parser.add_argument("--block-size", type=int, default=4)
    parser.add_argument(
        "--unavailable", action="store_true", help="answer every Generate with UNAVAILABLE"
    )
    asyncio.run(main(parser.parse_args()))
