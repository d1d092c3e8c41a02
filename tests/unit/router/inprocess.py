"""A router Pipeline (and its OpenAI HTTP front) in this process, over one scripted
engine: an EngineClient handed its load reports (EngineClient.take_report), whose
requests get scripted tokens or a scripted error, with no engine process behind it. For tests of admission, budgets
and the HTTP front that need no model."""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator
from pathlib import Path

import grpc
from omnibus.v1 import engine_pb2, inference_pb2
from tokenizers import Tokenizer, models, pre_tokenizers

from omnibus.router.admission.auth import KeyStore
from omnibus.router.admission.validation import ModelLimits
from omnibus.router.config import RouterConfig
from omnibus.router.dispatch.dispatcher import Dispatcher, Ticket
from omnibus.router.dispatch.engines import EngineClient
from omnibus.router.dispatch.fleet import Fleet
from omnibus.router.dispatch.queue import RequestQueue
from omnibus.router.dispatch.session import rpc_error
from omnibus.router.service.metrics import RouterMetrics
from omnibus.router.service.pipeline import Pipeline

VOCAB = 64


def word_tokenizer() -> Tokenizer:
    """One token per whitespace-separated word w0..w63."""
    vocab = {f"w{i}": i for i in range(1, VOCAB)} | {"w0": 0}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return tokenizer


class ScriptedEngine(EngineClient):
    """Each request gets `tokens` tokens (at most its max_tokens) and then the finish,
    or raises `error`. Logprobs, when asked for, are scripted too (`scripted_logprob`):
    a generated token's, and with prompt_logprobs its prompt's on the first message."""

    def __init__(self, config: RouterConfig, on_change, max_num_seqs: int = 4,
                 address: str = "", adapters: tuple[str, ...] = (), stub=None,
                 reported: bool = True) -> None:
        super().__init__(address or config.engines[0], config, on_change, stub=stub)
        self.stub = stub  # the fake RPCs it was given (embed and the adapter calls), for tests
        if reported:  # else: an engine that has not reported since the router started
            self.report_load(max_num_seqs=max_num_seqs, available_adapters=adapters)
        self.tokens = 3
        self.error: grpc.aio.AioRpcError | None = None
        self.requests: list[engine_pb2.EngineGenerateRequest] = []

    def report_load(self, **fields) -> None:
        """A load report as the engine would send it: room for 4, 64 free blocks, and `fields`."""
        self.take_report(engine_pb2.LoadReport(**{"max_num_seqs": 4, "num_total_blocks": 64,
                                                 "num_free_blocks": 64, **fields}))

    async def generate(  # type: ignore[override]
        self, request: engine_pb2.EngineGenerateRequest, timeout: float | None = None
    ) -> AsyncGenerator[engine_pb2.EngineGenerateResponse, None]:
        self.requests.append(request)
        if self.error is not None:
            raise self.error
        count = min(self.tokens, request.sampling.max_tokens)
        for i in range(1, count + 1):
            finish = inference_pb2.LENGTH if i == count else inference_pb2.FINISH_REASON_UNSPECIFIED
            out = engine_pb2.EngineGenerateResponse(
                token_ids=[5], num_output_tokens=i, finish_reason=finish,
                num_prompt_tokens=len(request.prompt_token_ids))
            sampling = request.sampling
            if sampling.logprobs:
                out.logprobs.append(scripted_logprob(5, 0, sampling.logprobs))
            if i == 1 and sampling.prompt_logprobs:
                prompt = request.prompt_token_ids
                out.prompt_logprobs.extend(scripted_logprob(prompt[p], p, sampling.prompt_logprobs)
                                           for p in range(1, len(prompt)))
            yield out


def scripted_logprob(token: int, position: int, top: int) -> inference_pb2.TokenLogprob:
    """A scripted engine's logprob of `token` at prompt `position` (0: a generated token):
    -position / 10 - 0.5, its top alternatives w60, w61, ... at -0.1, -0.2, ..."""
    return inference_pb2.TokenLogprob(
        token_id=token, logprob=-position / 10 - 0.5,
        top=[inference_pb2.TopLogprob(token_id=60 + j, logprob=-(j + 1) / 10) for j in range(top)])


def refusal(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return rpc_error(code, details)


class Router:
    """A Pipeline with one ScriptedEngine; `await router.start()` and `close()` in a loop."""

    def __init__(self, tmp_path: Path, tenants: dict, stub=None, **flags) -> None:
        """`stub`: the first engine's fake RPCs (Embed, the adapter calls); `flags`: the
        router's configuration."""
        self._stub = stub
        keys = tmp_path / "keys.json"
        keys.write_text(json.dumps({"tenants": tenants}))
        self.config = RouterConfig(model=str(tmp_path), engines=("127.0.0.1:1",),
                                   keys_file=str(keys), **flags)
        self.limits = ModelLimits(model_id="m", context=1024, vocab_size=VOCAB,
                                  max_prompt_tokens=1000, max_tokens=1000)
        self.queue: RequestQueue[Ticket] = RequestQueue(self.config.priority_aging_seconds,
                                                        self.config.queue_policy)
        self.fleet = Fleet()
        self.dispatcher = Dispatcher(self.fleet, self.queue)
        self.fleet.subscribe(self.dispatcher.notify)

    async def start(self) -> Router:
        self.engine = ScriptedEngine(self.config, self.fleet.changed, stub=self._stub)
        self.fleet.add(self.engine)
        metrics = RouterMetrics(self.queue, self.fleet, self.limits.model_id)
        keys = KeyStore.open(self.config.keys_file, self.config.tenant_limits)
        self.pipeline = Pipeline(self.config, self.limits, word_tokenizer(), keys,
                                 self.dispatcher, self.fleet, metrics)
        self.dispatcher.start()
        return self

    def add_engine(self, address: str, adapters: tuple[str, ...] = (), **kwargs) -> ScriptedEngine:
        """One more scripted engine behind the router, with `adapters` on its disk."""
        engine = ScriptedEngine(self.config, self.fleet.changed, address=address,
                                adapters=adapters, **kwargs)
        self.fleet.add(engine)
        return engine

    async def close(self) -> None:
        await self.dispatcher.close()
        for engine in self.fleet:
            await engine.close()


def prompt(tokens: int, max_tokens: int, **fields) -> inference_pb2.GenerateRequest:
    """A request whose prompt is `tokens` token ids."""
    return inference_pb2.GenerateRequest(
        token_ids=inference_pb2.TokenIds(ids=list(range(1, tokens + 1))),
        sampling=inference_pb2.SamplingParams(max_tokens=max_tokens), **fields)
