"""The load generator: sends a workload to an `omnibus.v1.Inference` server and times it.

    run = await run_workload(requests, RunConfig(target="127.0.0.1:50051", rate=4.0))
    summary = stats.summarize(run.results, run.duration, slo)

`run_tenants` runs several such workloads at once, each with its own API key (a
tenant mix: a flooding tenant beside a steady one).

Three arrival modes: Poisson arrivals at `rate` requests/s, a fixed number of
requests in flight (`concurrency`), or everything at once (neither set). Each request
streams through `Generate` with token-id prompts, temperature 0 and ignore_eos, and
the client records when every token-bearing message arrives. `max_duration_s` bounds
a run: requests still streaming then are cancelled (code CANCELLED) and requests not
yet sent are counted as NOT_SENT, so an overloaded server cannot make a run endless.

`EngineMonitor` optionally watches an engine worker directly (its Stats and WatchLoad
RPCs, omnibus.v1.Engine) during a run: counters before and after, and a time-weighted
summary of its load (running and waiting sequences, KV blocks in use).
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, field

import grpc
from omnibus.v1 import engine_pb2, engine_pb2_grpc, inference_pb2, inference_pb2_grpc

from omnibus.bench.stats import RequestResult, stored_token_seconds
from omnibus.bench.workloads import BenchRequest, poisson_arrivals

# Engine counters the study reads when the engine's StatsResponse has them (summed over
# steps since start; see protos/omnibus/v1/engine.proto).
ENGINE_COUNTERS = (
    "num_steps",
    "num_requests",
    "slots_stepped",
    "useful_tokens",
    "kv_tokens_stored",
    "kv_tokens_reserved",
    "num_preemptions",
)
NOT_SENT = "NOT_SENT"


@dataclass(frozen=True)
class RunConfig:
    target: str  # host:port of the Inference server (a router)
    rate: float | None = (
        None  # Poisson arrivals per second; None with concurrency None: all at once
    )
    concurrency: int | None = None  # requests kept in flight
    max_duration_s: float | None = None  # cancel what is left after this long
    timeout_s: float | None = None  # per-request gRPC deadline
    temperature: float = 0.0
    api_key: str | None = None  # sent as "authorization: Bearer <key>"
    seed: int = 0  # Poisson arrival times
    progress: bool = True
    request_id_prefix: str = "bench"

    def __post_init__(self) -> None:
        if self.rate is not None and self.concurrency is not None:
            raise ValueError("choose one of rate and concurrency (neither: all at once)")
        if self.rate is not None and not self.rate > 0:
            raise ValueError(f"rate must be > 0 requests/s, got {self.rate}")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        for name in ("max_duration_s", "timeout_s"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {value}")

    @property
    def mode(self) -> str:
        if self.rate is not None:
            return f"poisson {self.rate:g} req/s"
        if self.concurrency is not None:
            return f"concurrency {self.concurrency}"
        return "all at once"


@dataclass
class RunOutput:
    results: list[RequestResult]
    duration: float  # first send to last completion (or the time limit)
    started_wall: float  # time.time() at the start
    engine: dict = field(default_factory=dict)  # EngineMonitor.summary(), when watched


async def list_models(target: str, api_key: str | None = None) -> inference_pb2.ListModelsResponse:
    async with grpc.aio.insecure_channel(target) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        return await stub.ListModels(
            inference_pb2.ListModelsRequest(), metadata=_auth(api_key), timeout=30
        )


def check_fits(requests: list[BenchRequest], model: inference_pb2.ModelInfo) -> None:
    """ValueError naming the first request the server would refuse for its length or ids."""
    for i, r in enumerate(requests):
        if len(r.prompt_ids) + r.max_tokens > model.max_context_length:
            raise ValueError(
                f"request {i}: prompt {len(r.prompt_ids)} + output {r.max_tokens} tokens "
                f"exceeds the context of {model.max_context_length}; lower --scale"
            )
        if r.max_tokens > model.max_tokens_limit:
            raise ValueError(
                f"request {i}: {r.max_tokens} output tokens is over the server's "
                f"max_tokens limit of {model.max_tokens_limit}"
            )
        if max(r.prompt_ids) >= model.vocab_size:
            raise ValueError(f"request {i}: token ids must be < vocab_size {model.vocab_size}")


async def run_workload(
    requests: list[BenchRequest], config: RunConfig, monitor: EngineMonitor | None = None
) -> RunOutput:
    """Sends `requests` as `config` says and returns what the client saw."""
    results = [
        RequestResult(i, len(r.prompt_ids), r.max_tokens, r.adapter, r.priority)
        for i, r in enumerate(requests)
    ]
    times = poisson_arrivals(len(requests), config.rate if config.rate else math.inf, config.seed)
    for res, t in zip(results, times):
        res.scheduled = t
    bar = _progress(len(requests), config)
    async with grpc.aio.insecure_channel(config.target) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        await channel.channel_ready()
        t0 = await monitor.start() if monitor else time.monotonic()
        started_wall = time.time()
        await _Sender(stub, config, t0, bar).launch(requests, results)
        duration = max((r.end for r in results if r.end is not None), default=0.0)
        if config.max_duration_s is not None and any(r.code == NOT_SENT for r in results):
            duration = max(duration, config.max_duration_s)  # the run lasted to the limit
        engine = await monitor.stop(results, duration) if monitor else {}
    if bar is not None:
        bar.close()
    return RunOutput(results, duration, started_wall, engine)


async def run_tenants(
    mixes: dict[str, tuple[list[BenchRequest], RunConfig]]
) -> dict[str, RunOutput]:
    """Runs every tenant's workload at the same time (each RunConfig carries that
    tenant's api_key); returns each tenant's RunOutput, timed from a common start."""
    names = list(mixes)
    outputs = await asyncio.gather(*(run_workload(*mixes[n]) for n in names))
    return dict(zip(names, outputs))


class _Sender:
    """Starts one task per request on the chosen schedule; owns the time limit."""

    def __init__(
        self, stub: inference_pb2_grpc.InferenceStub, config: RunConfig, t0: float, bar
    ) -> None:
        self.stub, self.config, self.t0, self.bar = stub, config, t0, bar
        self.deadline = None if config.max_duration_s is None else t0 + config.max_duration_s
        self.slots = asyncio.Semaphore(config.concurrency) if config.concurrency else None

    def now(self) -> float:
        return time.monotonic() - self.t0

    async def launch(self, requests: list[BenchRequest], results: list[RequestResult]) -> None:
        """Sends every request on schedule and returns when all have ended."""
        tasks: list[asyncio.Task] = []
        limit = asyncio.get_running_loop().create_task(self._enforce_limit(tasks))
        try:
            for req, res in zip(requests, results):
                if not await self._wait_turn(res.scheduled):
                    res.code, res.error, res.sent = (
                        NOT_SENT,
                        "not sent within --max-duration",
                        res.scheduled,
                    )
                    if self.bar is not None:
                        self.bar.update(1)
                    continue
                tasks.append(asyncio.get_running_loop().create_task(self._one(req, res)))
            await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            limit.cancel()
        for res in results:
            if res.code == "OK" and res.end is None:  # cancelled before its task ever ran
                res.code, res.error, res.end = (
                    "CANCELLED",
                    "still running at --max-duration",
                    self.now(),
                )

    async def _wait_turn(self, scheduled: float) -> bool:
        """Waits until the request may be sent; False once the time limit has passed."""
        delay = scheduled - self.now()
        if self.deadline is not None:
            delay = min(delay, self.deadline - time.monotonic())
        if delay > 0:
            await asyncio.sleep(delay)
        if self.slots is not None:
            if self.deadline is None:
                await self.slots.acquire()
            else:
                try:
                    async with asyncio.timeout_at(_loop_time(self.deadline)):
                        await self.slots.acquire()
                except TimeoutError:
                    return False
        return self.deadline is None or time.monotonic() < self.deadline

    async def _enforce_limit(self, tasks: list[asyncio.Task]) -> None:
        if self.deadline is None:
            return
        await asyncio.sleep(max(0.0, self.deadline - time.monotonic()))
        for task in tasks:
            task.cancel()

    async def _one(self, req: BenchRequest, res: RequestResult) -> None:
        message = inference_pb2.GenerateRequest(
            token_ids=inference_pb2.TokenIds(ids=req.prompt_ids),
            sampling=inference_pb2.SamplingParams(
                max_tokens=req.max_tokens, temperature=self.config.temperature, ignore_eos=True
            ),
            priority=req.priority,
            request_id=f"{self.config.request_id_prefix}-{res.index}",
        )
        metadata = _auth(self.config.api_key) + (
            (("x-adapter-id", req.adapter),) if req.adapter else ()
        )
        res.sent = self.now()
        res.deadline_s = req.deadline_s if req.deadline_s is not None else self.config.timeout_s
        call = self.stub.Generate(message, metadata=metadata or None, timeout=res.deadline_s)
        try:
            async for resp in call:
                t = self.now()
                if resp.token_ids:
                    res.token_times.append(t)
                    res.token_counts.append(len(resp.token_ids))
                if resp.finish_reason:
                    res.finish_reason = inference_pb2.FinishReason.Name(resp.finish_reason)
                    res.cached_tokens = resp.usage.cached_prompt_tokens
                    res.queue_s = resp.timing.queue_seconds
            res.end = self.now()
        except grpc.aio.AioRpcError as exc:
            res.code, res.error, res.end = exc.code().name, exc.details() or "", self.now()
        except asyncio.CancelledError:
            call.cancel()
            res.code, res.error, res.end = (
                "CANCELLED",
                "still running at --max-duration",
                self.now(),
            )
        finally:
            if self.slots is not None:
                self.slots.release()
            if self.bar is not None:
                self.bar.update(1)


def _loop_time(monotonic_deadline: float) -> float:
    loop = asyncio.get_running_loop()
    return loop.time() + (monotonic_deadline - time.monotonic())


def _auth(api_key: str | None) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {api_key}"),) if api_key else ()


def _progress(total: int, config: RunConfig):
    if not config.progress:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=config.mode, unit="req", leave=False)


class EngineMonitor:
    """Watches one engine worker during a run: Stats before and after, WatchLoad between."""

    def __init__(self, address: str, interval_ms: int = 20) -> None:
        self.address = address
        self.interval_ms = interval_ms
        self._channel: grpc.aio.Channel | None = None
        self._before: dict[str, int] = {}
        self._samples: list[tuple[float, engine_pb2.LoadReport]] = []
        self._task: asyncio.Task | None = None
        self._t0 = 0.0

    async def start(self) -> float:
        """Reads the counters and starts watching; returns the run's t0 (time.monotonic())."""
        self._channel = grpc.aio.insecure_channel(self.address)
        self._stub = engine_pb2_grpc.EngineStub(self._channel)
        self._before = await self._counters()
        self._t0 = time.monotonic()
        self._task = asyncio.get_running_loop().create_task(self._watch())
        return self._t0

    async def _counters(self) -> dict[str, int]:
        stats = await self._stub.Stats(engine_pb2.StatsRequest(), timeout=10)
        return stats_counters(stats)

    async def _watch(self) -> None:
        call = self._stub.WatchLoad(engine_pb2.WatchLoadRequest(interval_ms=self.interval_ms))
        try:
            async for report in call:
                self._samples.append((time.monotonic() - self._t0, report))
        except grpc.aio.AioRpcError:
            return  # the summary says how many samples there were

    async def stop(self, results: list[RequestResult], duration: float) -> dict:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        after = await self._counters()
        await self._channel.close()
        deltas = {k: after[k] - self._before.get(k, 0) for k in after}
        return {
            "counters": deltas,
            **load_summary(self._samples, duration),
            **derived_ratios(deltas),
            "client_stored_token_seconds": stored_token_seconds(results),
        }


def stats_counters(stats: engine_pb2.StatsResponse) -> dict[str, int]:
    """The counters among ENGINE_COUNTERS that this build's StatsResponse carries."""
    fields = stats.DESCRIPTOR.fields_by_name
    return {name: int(getattr(stats, name)) for name in ENGINE_COUNTERS if name in fields}


def derived_ratios(c: dict[str, int]) -> dict[str, float | None]:
    """Compute utilization and KV efficiency from engine counter deltas (None: not exposed)."""

    def ratio(a: str, b: str) -> float | None:
        return c[a] / c[b] if a in c and b in c and c[b] else None

    return {
        "compute_utilization": ratio("useful_tokens", "slots_stepped"),
        "kv_efficiency": ratio("kv_tokens_stored", "kv_tokens_reserved"),
    }


def load_summary(samples: list[tuple[float, engine_pb2.LoadReport]], duration: float) -> dict:
    """Time-weighted means of the engine's load reports over [first report, duration]
    (each report holds until the next one).

    A report describes the engine after its latest step, so during a long step (a big
    prefill) it still shows the state before it: "nothing running, requests waiting"
    right before a batch is admitted. Such an interval counts as busy when the next
    report shows sequences running (the engine was computing them); it counts as idle
    with work waiting only when the next report still shows nothing running."""
    if not samples or duration <= 0:
        return {"load_samples": len(samples)}
    acc = dict(running=0.0, waiting=0.0, busy=0.0, idle_with_work=0.0, kv_used_token_seconds=0.0)
    span = 0.0
    bounds = [t for t, _ in samples[1:]] + [max(duration, samples[-1][0])]
    nexts = [r for _, r in samples[1:]] + [samples[-1][1]]
    for (t, r), t_next, nxt in zip(samples, bounds, nexts):
        dt = max(0.0, min(t_next, duration) - t)
        span += dt
        waiting_start = r.num_running == 0 and r.num_waiting > 0
        acc["running"] += r.num_running * dt
        acc["waiting"] += r.num_waiting * dt
        acc["busy"] += (r.num_running > 0 or (waiting_start and nxt.num_running > 0)) * dt
        acc["idle_with_work"] += (waiting_start and nxt.num_running == 0) * dt
        acc["kv_used_token_seconds"] += (r.num_total_blocks - r.num_free_blocks) * r.block_size * dt
    last = samples[-1][1]
    out = {
        "load_samples": len(samples),
        "load_span_s": span,
        "kv_pool_tokens": last.num_total_blocks * last.block_size,
        "kv_used_token_seconds": acc["kv_used_token_seconds"],
    }
    if span > 0:
        out |= {
            "mean_running": acc["running"] / span,
            "mean_waiting": acc["waiting"] / span,
            "busy_fraction": acc["busy"] / span,
            "idle_with_work_fraction": acc["idle_with_work"] / span,
            "mean_kv_tokens_reserved": acc["kv_used_token_seconds"] / span,
        }
    return out
