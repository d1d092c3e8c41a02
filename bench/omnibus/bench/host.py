"""The serving path's host cost: the real router in front of the real engine with the null
model (`--load-format null`, no weights, a near-free forward), on this CPU.

    python -m omnibus.bench.host [--out docs/benchmarks/host.md] [--baseline before.json]

For 64, 256 and 1024 concurrent streams (every request sent at once; 32-token prompts,
200 output tokens, greedy, ignore_eos) it measures output tokens/s, TTFT p50/p99,
inter-token latency p99 and the CPU each process spent per streamed token (utime + stime
deltas of its CPU-time clock over the run), then projects the tokens/s one router core
and one engine host process could sustain at that cost. `--save-json` keeps a run's
numbers; `--baseline` puts an earlier run (e.g. before a change) beside this one.

Unloaded TTFT (`--only ttft` runs it alone and rewrites only its section of `--out`):
requests one at a time (16-token prompts, 4 output tokens, greedy), each timed from
submit to its first token (a) in this process, on an AsyncEngine built from the engine
process's own flags the way its server builds it, (b) over gRPC to the engine process's
Session stream (the router's own EngineSession client), (c) through the router's public
Generate; the three paths take turns request by request, so drift on a shared machine
falls on all of them alike. Taking turns with them, the transport floor: a bare grpc.aio
server in its own process (uvloop, as the engine and router run) answering (d) one
message on a long-lived bidi stream (the engine hop's floor) and (e) a unary-stream call
with one small message (the public Generate's floor); b − a − d and c − b − e are what
Omnibus adds above gRPC itself on each hop.

Per-request cost (`--only requests` runs it alone and rewrites only its section of
`--out`): requests of one output token (max_tokens 1, 32-token prompts), 256 kept in
flight by this client (a closed loop: each ending request starts the next), through the
router to the null-model engine: requests/s and each process's CPU per request (ms).
Taking turns with it, run by run, the 256-stream run of the stream levels on the same
processes, so the router's CPU per request stands beside its CPU per token; and the
transport floor's bare server answering as many unary-stream calls with one message each
(the public Generate's shape), as many in flight: its CPU per call.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import itertools
import json
import os
import random
import statistics
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from omnibus.bench.processes import (
    step_loop_pid,
    ServerProcess,
    engine_and_router,
    engine_configs,
    engine_process,
    free_port,
    router_process,
    torch_threads,
)
from omnibus.bench.report import machine, spread
from omnibus.bench.serve import RunConfig, run_workload
from omnibus.bench.stats import percentile
from omnibus.bench.workloads import BenchRequest

STREAMS = (64, 256, 1024)
PROMPT_LEN = 32
OUTPUT_LEN = 200
# An assumption for the projection, not a measurement: decode rate of an 8B model on one
# H200 at batch 256 (bf16, memory-bound decode).
ASSUMED_GPU_TOKENS_S = 25_000
TTFT_REQUESTS = 200
TTFT_WARMUP = 20  # requests per path before the timed ones (connections, caches)
TTFT_PROMPT_LEN = 16
TTFT_MAX_TOKENS = 4
# Pause after each request, so each finds idle engines (an engine checks its KV pool's
# bookkeeping only after 0.25 s without a command, so the check never runs in between).
TTFT_GAP_S = 0.03
FLOOR_SERVICE = "omnibus.bench.Floor"  # the transport floor's bare server (serve_floor)
TTFT_MARKER = "<!-- bench.host: unloaded TTFT; `--only ttft` rewrites from here to the notes -->"
REQUESTS_MARKER = ("<!-- bench.host: per-request cost; `--only requests` rewrites from here to "
                   "the notes -->")
REQUESTS_CLIENTS = 256  # requests kept in flight
REQUESTS_PER_RUN = 4096
REQUESTS_MAX_TOKENS = 1
PACED_MARKER = "<!-- bench.host: GPU-paced; `--only paced` rewrites from here to the TTFT part -->"
NOTES_MARKER = "<!-- written by hand below: kept whenever bench.host rewrites this file -->"
PACED_STREAMS = 256
# A step time at which PACED_STREAMS sequences decode ASSUMED_GPU_TOKENS_S tokens/s.
PACED_STEP_MS = round(1000 * PACED_STREAMS / ASSUMED_GPU_TOKENS_S, 2)
PACED_INTERVALS = (1, 4)  # router --stream-interval values measured at that pace
PACED_OVERLAP = (False, True)  # the engine in lockstep, and with overlapped scheduling
_SCHEDULING = {False: "lockstep", True: "overlapped"}
NULL_CONFIG = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=64, intermediate_size=128,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=2048, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
    tie_word_embeddings=False,
)
WORDS = ("the fox river forest green quick brown lazy time upon once there little every day "
         "looked fish numbers symbols appear café naïve résumé über straße 東京 こんにちは ☕ 12345 "
         "{}[]()<>!?").split()


def build_model(path: Path, vocab_size: int = 2048) -> Path:
    """config.json (the null model reads no weights) and a byte-level BPE tokenizer.json,
    so the router decodes bytes and multi-byte characters as with a real Llama 3 tokenizer."""
    vocab = build_tokenizer(path, vocab_size)
    config = dict(NULL_CONFIG, vocab_size=vocab)
    (path / "config.json").write_text(json.dumps(config))
    return path


def build_tokenizer(path: Path, vocab_size: int = 2048, corpus: list[str] | None = None) -> int:
    """Writes path/tokenizer.json (byte-level BPE of at most `vocab_size` ids, trained on
    `corpus`, by default a synthetic one of WORDS); returns its vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    path.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    if corpus is None:
        rng = random.Random(0)
        corpus = [" ".join(rng.choice(WORDS) + str(rng.randrange(100)) * (rng.random() < 0.2)
                           for _ in range(30)) for _ in range(2000)]
    tok.train_from_iterator(corpus, trainer=trainer)
    tok.save(str(path / "tokenizer.json"))
    return tok.get_vocab_size()


def cpu_seconds(pid: int) -> float:
    """CPU time (user + system) of a process, all its threads (ended ones included), so
    far, to the nanosecond: Linux's CPU-time clock of another process (clock_getcpuclockid;
    /proc/<pid>/stat counts 10 ms ticks, which round a short window's milliseconds to 0)."""
    return time.clock_gettime(~pid << 3 | 2)  # the kernel's encoding: ~pid << 3 | CPUCLOCK_SCHED


def step_loop_seconds(pids: list[int]) -> float:
    """CPU time so far of the engine's step-loop thread (named STEP_THREAD_NAME), in
    whichever of `pids` (its server process, its step-loop process) it runs."""
    from omnibus.engine.serving.step_loop import STEP_THREAD_NAME

    total = 0.0
    for pid in pids:
        for task in Path(f"/proc/{pid}/task").iterdir():
            try:
                if (task / "comm").read_text().strip() == STEP_THREAD_NAME:
                    # ns on the CPU (another process's thread clocks are not readable)
                    total += int((task / "schedstat").read_text().split()[0]) / 1e9
            except FileNotFoundError:  # the thread ended meanwhile
                pass
    return total


def requests(n: int, vocab: int, seed: int, max_tokens: int = OUTPUT_LEN) -> list[BenchRequest]:
    rng = random.Random(seed)
    return [BenchRequest(tuple(rng.randrange(3, vocab) for _ in range(PROMPT_LEN)), max_tokens)
            for _ in range(n)]


def engine_steps(address: str) -> int:
    """Steps the engine at `address` has run since it started (its Stats)."""
    import grpc
    from omnibus.v1 import engine_pb2, engine_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        stats = engine_pb2_grpc.EngineStub(channel).Stats(engine_pb2.StatsRequest(), timeout=30)
    return stats.num_steps


def run_level(target: str, pids: dict[str, int], n: int, vocab: int, seed: int,
              engine_address: str | None = None, max_tokens: int = OUTPUT_LEN,
              concurrency: int | None = None) -> dict:
    """One run of `n` requests of `max_tokens` output tokens, all sent at once (`n`
    concurrent streams) or `concurrency` kept in flight; what the client saw, each
    process's CPU and, given the engine's address, the tokens its steps carried on average."""
    steps = engine_steps(engine_address) if engine_address else 0
    engine_pids = [pid for name, pid in pids.items() if name in ("engine", "engine_core")]
    before = {name: cpu_seconds(pid) for name, pid in pids.items()}
    step_loop_before = step_loop_seconds(engine_pids)
    config = RunConfig(target=target, progress=False, timeout_s=600, concurrency=concurrency,
                       request_id_prefix=f"host{seed}-{max_tokens}")
    out = asyncio.run(run_workload(requests(n, vocab, seed, max_tokens), config))
    cpu = {name: cpu_seconds(pid) - before[name] for name, pid in pids.items()}
    step_loop = step_loop_seconds(engine_pids) - step_loop_before
    steps = engine_steps(engine_address) - steps if engine_address else 0
    if "engine_core" in cpu:  # "engine" is all of the engine: its server and step-loop processes
        cpu["engine"] += cpu["engine_core"]
    ok = [r for r in out.results if r.ok]
    tokens = sum(r.output_tokens for r in ok)
    itls = [x for r in ok for x in r.itls]
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    errors: dict[str, int] = {}
    for r in out.results:
        if not r.ok:
            errors[r.code] = errors.get(r.code, 0) + 1
    return {
        "streams": n, "concurrency": concurrency, "max_tokens": max_tokens, "ok": len(ok),
        "errors": errors, "tokens": tokens, "duration_s": out.duration,
        "tokens_per_s": tokens / out.duration,
        "ttft_p50_ms": percentile(ttfts, 50) * 1e3, "ttft_p99_ms": percentile(ttfts, 99) * 1e3,
        "itl_p50_ms": percentile(itls, 50) * 1e3, "itl_p99_ms": percentile(itls, 99) * 1e3,
        "tokens_per_message": tokens / max(1, sum(len(r.token_counts) for r in ok)),
        "tokens_per_step": tokens / steps if steps else None,
        "ms_per_step": out.duration * 1e3 / steps if steps else None,
        "requests_per_s": len(ok) / out.duration,
        "cpu_us_per_token": {name: s / tokens * 1e6 for name, s in cpu.items()},
        "cpu_ms_per_request": {name: s / max(1, len(ok)) * 1e3 for name, s in cpu.items()},
        # the part of the engine's that its step-loop thread spent
        "step_loop_us_per_token": step_loop / tokens * 1e6 if engine_pids else None,
    }


def measure(repeats: int, streams: tuple[int, ...], engine_seats: int,
            ttft_requests: int = 0, step_loop: str = "auto", stream_interval: int = 1,
            requests_per_run: int = 0, requests_clients: int = REQUESTS_CLIENTS) -> dict:
    """The stream levels (none when `streams` is empty); when `ttft_requests`, the
    unloaded TTFT of the three paths, measured first on the freshly started processes;
    when `requests_per_run`, the per-request cost (measure_requests) after it.
    The in-process engines run on one torch thread, as `omnibus-engine` runs the null
    model on a CPU (engine/omnibus/engine/serving/cli.py)."""
    with torch_threads(1), tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        model = build_model(tmp_path / "model")
        vocab = json.loads((model / "config.json").read_text())["vocab_size"]
        flags = ("--load-format", "null", "--max-num-seqs", str(engine_seats),
                 "--step-loop", step_loop)
        result: dict = {}
        router_flags = ("--stream-interval", str(stream_interval))
        with engine_and_router(model, tmp_path, flags, router_flags) as (engine, router):
            if ttft_requests:
                with floor_process(tmp_path) as floor:
                    result["ttft"] = unloaded_ttft(model, flags, engine.address, router.address,
                                                   floor.address, vocab, ttft_requests)
            pids = {"router": router.proc.pid, "engine": engine.proc.pid, "client": os.getpid()}
            core = step_loop_pid(engine.proc.pid)
            if core is not None:
                pids["engine_core"] = core
            if requests_per_run:
                with floor_process(tmp_path) as floor:
                    result["requests"] = measure_requests(
                        router.address, engine.address, pids, vocab, repeats, requests_per_run,
                        requests_clients, floor)
            if streams:
                run_level(router.address, pids, 16, vocab, seed=999)  # warm-up: connections, caches
                result["runs"] = [run_level(router.address, pids, n, vocab, seed=r,
                                            engine_address=engine.address)
                                  for n in streams for r in range(repeats)]
        if streams:
            result["in_process"] = in_process_rate(model, vocab, engine_seats)
        return result


def measure_requests(router_address: str, engine_address: str, pids: dict[str, int], vocab: int,
                     repeats: int, n: int, clients: int = REQUESTS_CLIENTS,
                     floor: ServerProcess | None = None) -> dict:
    """`repeats` rounds of: `n` requests of REQUESTS_MAX_TOKENS output tokens with `clients`
    in flight, then `clients` streams of OUTPUT_LEN tokens sent at once (the stream level
    of that size), on the same router and engine; given the floor's server, then `n` calls
    to its First with `clients` in flight (floor_calls)."""
    run_level(router_address, pids, min(n, clients), vocab, seed=998,  # warm-up
              max_tokens=REQUESTS_MAX_TOKENS, concurrency=clients)
    runs: list[dict] = []
    stream_runs: list[dict] = []
    floors: list[dict] = []
    for r in range(repeats):
        runs.append(run_level(router_address, pids, n, vocab, seed=10_000 + r,
                              engine_address=engine_address, max_tokens=REQUESTS_MAX_TOKENS,
                              concurrency=clients))
        stream_runs.append(run_level(router_address, pids, clients, vocab, seed=20_000 + r,
                                     engine_address=engine_address))
        if floor is not None:
            floors.append(asyncio.run(floor_calls(floor.address, floor.proc.pid, n, clients)))
    return {"requests": n, "clients": clients, "max_tokens": REQUESTS_MAX_TOKENS,
            "prompt_len": PROMPT_LEN, "runs": runs, "stream_runs": stream_runs, "floor": floors}


def in_process_rate(model: Path, vocab: int, seats: int, n: int = 256) -> dict:
    """Engine.generate on the null model in this process: the step loop alone, no gRPC."""
    from omnibus.engine.config import EngineConfig
    from omnibus.engine.engine import Engine
    from omnibus.engine.worker.sampling import SamplingParams

    engine = Engine(EngineConfig(model=str(model), load_format="null", max_num_seqs=seats))
    prompts = [list(r.prompt_ids) for r in requests(n, vocab, 0)]
    params = SamplingParams(max_tokens=OUTPUT_LEN, temperature=0.0, ignore_eos=True)
    engine.warmup()
    t0, c0 = time.perf_counter(), cpu_seconds(os.getpid())
    tokens = sum(len(o) for o in engine.generate(prompts, params))
    wall, cpu = time.perf_counter() - t0, cpu_seconds(os.getpid()) - c0
    return {"streams": n, "tokens": tokens, "tokens_per_s": tokens / wall,
            "cpu_us_per_token": cpu / tokens * 1e6}


# ---- at a GPU's pace: the null model's steps take a GPU's step time --------------------------


async def floor_stream(address: str, pid: int, n: int, count: int, step_ms: float = 0.0) -> dict:
    """`n` concurrent calls to the floor's Stream, `count` messages each, one per `step_ms`
    (0: as fast as it goes): messages/s and the floor process's CPU µs per message."""
    import grpc

    async with grpc.aio.insecure_channel(address) as channel:
        call = channel.unary_stream(f"/{FLOOR_SERVICE}/Stream")
        request = f"{count}:{step_ms}".encode()

        async def one() -> int:
            return sum([1 async for _ in call(request)])

        await asyncio.gather(*(one() for _ in range(16)))  # warm-up
        c0, t0 = cpu_seconds(pid), time.perf_counter()
        messages = sum(await asyncio.gather(*(one() for _ in range(n))))
        wall, cpu = time.perf_counter() - t0, cpu_seconds(pid) - c0
    return {"streams": n, "step_ms": step_ms, "messages": messages,
            "messages_per_s": messages / wall, "cpu_us_per_message": cpu / messages * 1e6}


async def floor_calls(address: str, pid: int, n: int, clients: int) -> dict:
    """`n` calls to the floor's First (a unary-stream call answered with one message),
    `clients` kept in flight: calls/s and the floor process's CPU µs per call."""
    import grpc

    async with grpc.aio.insecure_channel(address) as channel:
        call = channel.unary_stream(f"/{FLOOR_SERVICE}/First")

        async def worker(calls: int) -> None:
            for _ in range(calls):
                async for _ in call(b""):
                    pass

        async def run(calls: int) -> None:
            await asyncio.gather(*(worker(calls // clients + (i < calls % clients))
                                   for i in range(clients)))

        await run(min(n, clients))  # warm-up
        c0, t0 = cpu_seconds(pid), time.perf_counter()
        await run(n)
        wall, cpu = time.perf_counter() - t0, cpu_seconds(pid) - c0
    return {"calls": n, "clients": clients, "calls_per_s": n / wall,
            "cpu_us_per_call": cpu / n * 1e6}


def measure_paced(repeats: int, step_ms: float, intervals: tuple[int, ...],
                  overlap: tuple[bool, ...] = PACED_OVERLAP, streams: int = PACED_STREAMS,
                  engine_seats: int = 1024, step_loop: str = "auto") -> dict:
    """`streams` streams through a router in front of a null-model engine whose steps run
    `step_ms` on its simulated device (--null-step-ms), as on a GPU: an engine per
    scheduling mode in `overlap` (lockstep, overlapped), in front of each a router per
    --stream-interval in `intervals`, the configurations taking turns run by run; after
    each round, the floor's bare server streaming as many messages, one per step on the
    same clock and as fast as it goes."""
    with torch_threads(1), tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        model = build_model(tmp_path / "model")
        vocab = json.loads((model / "config.json").read_text())["vocab_size"]
        flags = ("--load-format", "null", "--null-step-ms", str(step_ms),
                 "--max-num-seqs", str(engine_seats), "--step-loop", step_loop)
        engines: dict[bool, ServerProcess] = {}
        routers: dict[tuple[bool, int], ServerProcess] = {}
        try:
            for o in overlap:
                engines[o] = engine_process(
                    model, tmp_path, f"engine-{_SCHEDULING[o]}", *flags,
                    "--overlap-scheduling" if o else "--no-overlap-scheduling")
            for o, k in itertools.product(overlap, intervals):
                routers[o, k] = router_process(model, [engines[o].address], tmp_path,
                                               f"router-{_SCHEDULING[o]}-{k}",
                                               "--stream-interval", str(k))
            for child in (*engines.values(), *routers.values()):
                child.wait_serving()
            cores = {o: step_loop_pid(e.proc.pid) for o, e in engines.items()}
            runs, floors = [], []
            with floor_process(tmp_path) as floor:
                for router in routers.values():  # warm-up: connections, caches
                    run_level(router.address, {}, 16, vocab, seed=999)
                for rep in range(repeats):
                    for (o, k), router in routers.items():
                        engine = engines[o]
                        pids = {"router": router.proc.pid, "engine": engine.proc.pid,
                                "client": os.getpid()}
                        if cores[o] is not None:
                            pids["engine_core"] = cores[o]
                        run = run_level(router.address, pids, streams, vocab, seed=rep,
                                        engine_address=engine.address)
                        runs.append({**run, "overlap": o, "stream_interval": k})
                    for pace in (step_ms, 0.0):
                        floors.append(asyncio.run(floor_stream(
                            floor.address, floor.proc.pid, streams, OUTPUT_LEN, pace)))
        finally:
            for child in (*routers.values(), *engines.values()):
                child.stop()
    return {"step_ms": step_ms, "streams": streams, "intervals": list(intervals),
            "overlap": list(overlap), "runs": runs, "floor": floors}


def paced_section(result: dict) -> str:
    p = result["paced"]
    lines = [
        PACED_MARKER, "", f"## At a GPU's pace: {result['label']}", "",
        (f"`python -m omnibus.bench.host --only paced`. The null model's steps run "
         f"{p['step_ms']:g} ms each on a simulated device (`--null-step-ms`: a step's tokens "
         "are ready that long after the device is free to run it; the host sleeps while it "
         f"waits for them), the step time at which {p['streams']} sequences decode "
         f"{ASSUMED_GPU_TOKENS_S:,} tok/s, the H200 rate assumed above. Without it the null "
         "model steps as fast as the host goes: the router takes a burst of calls in one at a "
         "time, so few sequences are on the engine at once and its steps carry a few tokens "
         "each (tokens/step above), unlike a GPU's. "
         f"{p['streams']} streams sent at once, {PROMPT_LEN}-token prompts, {OUTPUT_LEN} "
         "output tokens; one engine in lockstep and one with overlapped scheduling (it plans "
         "and launches step N+1 while step N runs on the device, as on CUDA by default), in "
         "front of each a router per `--stream-interval`, the configurations taking turns run "
         "by run. ms/step: the run's duration over the engine's steps in it (ramp-up and "
         "tail included). CPU µs per streamed token as above; of the engine's, the part its "
         "step-loop thread spent (the rest is its gRPC server's). The floor, below the "
         f"table: the bare grpc.aio server of the TTFT part streaming {OUTPUT_LEN} "
         f"pre-serialized one-token GenerateResponses on each of {p['streams']} calls at once "
         "(its µs per message; its client is this benchmark). Values: median (min–max) over "
         "the rounds."),
        "",
        "| engine | router --stream-interval | output tok/s | ms/step | TTFT p50 ms | "
        "ITL p50 ms | ITL p99 ms | tokens/step | tokens/message | router µs/tok | "
        "engine µs/tok | of which step loop | client µs/tok | router-core tok/s | "
        "engine-process tok/s | failed |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for o, k in itertools.product(p["overlap"], p["intervals"]):
        runs = [r for r in p["runs"] if r["overlap"] == o and r["stream_interval"] == k]
        cpu = {name: [r["cpu_us_per_token"][name] for r in runs]
               for name in ("router", "engine", "client")}
        cols = [
            spread([r["tokens_per_s"] for r in runs]),
            spread([r["ms_per_step"] for r in runs], "{:.1f}"),
            spread([r["ttft_p50_ms"] for r in runs]),
            spread([r["itl_p50_ms"] for r in runs], "{:,.1f}"),
            spread([r["itl_p99_ms"] for r in runs], "{:,.1f}"),
            spread([r["tokens_per_step"] for r in runs], "{:,.0f}"),
            spread([r["tokens_per_message"] for r in runs], "{:.2f}"),
            spread(cpu["router"], "{:.1f}"), spread(cpu["engine"], "{:.1f}"),
            spread([r["step_loop_us_per_token"] for r in runs], "{:.1f}"),
            spread(cpu["client"], "{:.1f}"),
            spread([1e6 / x for x in cpu["router"]]), spread([1e6 / x for x in cpu["engine"]]),
            f"{sum(p['streams'] - r['ok'] for r in runs)} of {p['streams'] * len(runs)}",
        ]
        lines.append(f"| {_SCHEDULING[o]} | {k} | " + " | ".join(cols) + " |")
    paced = [f for f in p["floor"] if f["step_ms"]]
    busy = [f for f in p["floor"] if not f["step_ms"]]
    us = lambda fs: spread([f["cpu_us_per_message"] for f in fs], "{:.1f}")  # noqa: E731
    lines += [
        "",
        (f"Floor: the bare grpc.aio server streaming one-token messages to {p['streams']} calls "
         f"at once spent {us(paced)} CPU µs per message when it sent one per stream every "
         f"{p['step_ms']:g} ms, on one clock for all streams (as a router does at "
         f"`--stream-interval 1` behind an engine at that pace: "
         f"{spread([f['messages_per_s'] for f in paced])} messages/s), and {us(busy)} when it "
         "sent them as fast as it could (many completions per event-loop wake-up). At one "
         "token per message the first is what gRPC alone costs a router per token at a "
         "GPU's pace on this machine."),
    ]
    return "\n".join(lines) + "\n"


# ---- unloaded TTFT: in process, engine gRPC, router gRPC, the transport floor ----------------


async def serve_floor(port: int) -> None:
    """The transport floor: a bare grpc.aio server (health aside, no interceptors, no
    Omnibus code) whose Echo answers each message of a bidi stream with one small
    message, whose First answers a unary-stream call with one (an EngineGenerateResponse
    with one token id) and whose Stream answers one with as many GenerateResponses of one
    token (serialized once) as the request says, b"<count>" as fast as it can, b"<count>:<ms>"
    one per <ms> step, every stream on one shared clock. Raw bytes in and out."""
    import grpc
    from grpc_health.v1 import health, health_pb2_grpc
    from omnibus.v1 import engine_pb2, inference_pb2

    reply = engine_pb2.EngineGenerateResponse(token_ids=[7]).SerializeToString()
    token = inference_pb2.GenerateResponse(
        request_id="floor", text=" word", token_ids=[7]).SerializeToString()

    async def echo(requests, context):
        async for _ in requests:
            yield reply

    async def first(request, context):
        yield reply

    loop = asyncio.get_running_loop()
    ticks: dict[float, asyncio.Future] = {}  # step seconds -> the next step's end
    tickers: dict[float, asyncio.Task] = {}

    async def ticker(step: float) -> None:
        while True:
            await asyncio.sleep(step)
            tick = ticks.pop(step, None)
            if tick is not None:
                tick.set_result(None)

    def next_tick(step: float) -> asyncio.Future:
        if step not in ticks:
            ticks[step] = loop.create_future()
            if step not in tickers:
                tickers[step] = loop.create_task(ticker(step))
        return ticks[step]

    async def stream(request, context):  # the request: b"<messages>[:<step ms>]"
        count, _, ms = request.decode().partition(":")
        step = float(ms or 0) / 1000
        for _ in range(int(count)):
            if step:  # one message per step, as a router sends a token per engine step
                await next_tick(step)
            yield token

    server = grpc.aio.server()
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(FLOOR_SERVICE, {
        "Echo": grpc.stream_stream_rpc_method_handler(echo),
        "First": grpc.unary_stream_rpc_method_handler(first),
        "Stream": grpc.unary_stream_rpc_method_handler(stream),
    }),))
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


@contextmanager
def floor_process(log_dir: Path) -> Iterator[ServerProcess]:
    """serve_floor in a child process (uvloop, as the engine and router run), SERVING."""
    port = free_port()
    floor = ServerProcess(["-m", "omnibus.bench.host", "--serve-floor", str(port)],
                          log_dir / "floor.log", f"127.0.0.1:{port}")
    try:
        yield floor.wait_serving()
    finally:
        floor.stop()


def serving_engine(model: Path, flags: tuple[str, ...]):
    """An AsyncEngine in this process, built from the engine process's flags as its
    server builds it: the CLI's configs, the engine loaded and warmed up, the step thread
    started."""
    from omnibus.engine.serving.async_engine import AsyncEngine
    from omnibus.engine.serving.loading import load_engine

    config, server = engine_configs(model, *flags)
    engine = load_engine(config)
    aengine = AsyncEngine(engine, server.embed_batching)
    aengine.start()
    return aengine


async def first_token_s(start: Callable[[], AsyncIterator], tokens: str) -> float:
    """Seconds from `start()` (which submits the request) to the first item whose
    `tokens` field is non-empty; reads the stream to its end."""
    t0 = time.perf_counter()
    first = None
    async for item in start():
        if first is None and getattr(item, tokens):
            first = time.perf_counter() - t0
    if first is None:
        raise RuntimeError("the stream ended without a token")
    return first


async def ttft_paths(aengine, engine_address: str, router_address: str, floor_address: str,
                     vocab: int, n: int, warmup: int = TTFT_WARMUP,
                     gap: float = TTFT_GAP_S) -> dict[str, list[float]]:
    """TTFT (s) of `n` requests per path, sent one at a time (`gap` s after the previous
    one ended), the paths taking turns; the floor's calls count as paths."""
    import grpc
    from omnibus.common.sampling import SamplingParams
    from omnibus.router.dispatch.session import EngineSession
    from omnibus.v1 import engine_pb2, engine_pb2_grpc, inference_pb2, inference_pb2_grpc

    params = SamplingParams(max_tokens=TTFT_MAX_TOKENS, temperature=0.0, ignore_eos=True)
    rng = random.Random(7)

    def prompt() -> list[int]:  # a fresh one each time: no prefix-cache hits
        return [rng.randrange(3, vocab) for _ in range(TTFT_PROMPT_LEN)]

    async with (grpc.aio.insecure_channel(engine_address) as engine_channel,
                grpc.aio.insecure_channel(router_address) as router_channel,
                grpc.aio.insecure_channel(floor_address) as floor_channel):
        session = EngineSession(engine_pb2_grpc.EngineStub(engine_channel), engine_address)
        router = inference_pb2_grpc.InferenceStub(router_channel)
        reply = engine_pb2.EngineGenerateResponse.FromString
        echo = floor_channel.stream_stream(f"/{FLOOR_SERVICE}/Echo", response_deserializer=reply)()
        first = floor_channel.unary_stream(f"/{FLOOR_SERVICE}/First", response_deserializer=reply)

        async def echo_round_trip(rid: str) -> AsyncIterator:  # on the one open stream
            await echo.write(rid.encode())
            yield await echo.read()

        paths = {
            "in_process": (lambda rid: aengine.generate(rid, prompt(), params), "new_token_ids"),
            "engine_grpc": (lambda rid: session.generate(engine_pb2.EngineGenerateRequest(
                request_id=rid, prompt_token_ids=prompt(), sampling=params.to_proto())),
                "token_ids"),
            "router_grpc": (lambda rid: router.Generate(inference_pb2.GenerateRequest(
                token_ids=inference_pb2.TokenIds(ids=prompt()), request_id=rid,
                sampling=inference_pb2.SamplingParams(
                    max_tokens=TTFT_MAX_TOKENS, temperature=0.0, ignore_eos=True))),
                "token_ids"),
            "floor_bidi": (echo_round_trip, "token_ids"),
            "floor_unary_stream": (lambda rid: first(rid.encode()), "token_ids"),
        }
        names, k = list(paths), len(paths)
        out: dict[str, list[float]] = {name: [] for name in names}
        try:
            for i in range(warmup + n):
                for name in itertools.islice(itertools.cycle(names), i % k, i % k + k):
                    start, tokens = paths[name]
                    ttft = await first_token_s(functools.partial(start, f"ttft-{name}-{i}"), tokens)
                    if i >= warmup:
                        out[name].append(ttft)
                    await asyncio.sleep(gap)
        finally:
            echo.cancel()
            await session.close()
    return out


def unloaded_ttft(model: Path, flags: tuple[str, ...], engine_address: str, router_address: str,
                  floor_address: str, vocab: int, n: int, warmup: int = TTFT_WARMUP) -> dict:
    """p50 / p99 TTFT (ms) of each path (a fresh in-process engine built from `flags`, the
    engine process's, for the first) and the differences between them (TTFT_DIFFS)."""
    aengine = serving_engine(model, flags)
    try:
        ttfts = asyncio.run(ttft_paths(aengine, engine_address, router_address, floor_address,
                                       vocab, n, warmup))
    finally:
        aengine.shutdown()
    out: dict = {"requests": n, "warmup": warmup, "prompt_len": TTFT_PROMPT_LEN,
                 "max_tokens": TTFT_MAX_TOKENS, "gap_ms": TTFT_GAP_S * 1e3}
    for name, values in ttfts.items():
        out[name] = {"n": len(values), "p50_ms": percentile(values, 50) * 1e3,
                     "p99_ms": percentile(values, 99) * 1e3}
    out["diffs"] = ttft_diffs(out)
    return out


TTFT_ROWS = (("in_process", "(a) in process: AsyncEngine on the engine's own config"),
             ("engine_grpc", "(b) engine gRPC: Session stream to the engine process"),
             ("router_grpc", "(c) router gRPC: public Generate, router → engine"),
             ("floor_bidi", "(d) gRPC floor, bidi: one message each way on an open stream"),
             ("floor_unary_stream", "(e) gRPC floor, unary-stream: a call to its first message"))
# (key, label, paths added, paths subtracted), in the JSON's "diffs" under the key
TTFT_DIFFS = (
    ("engine_hop", "engine gRPC hop (b − a)", ("engine_grpc",), ("in_process",)),
    ("router_hop", "router added (c − b)", ("router_grpc",), ("engine_grpc",)),
    ("both_hops", "router + engine vs in process (c − a)", ("router_grpc",), ("in_process",)),
    ("floors", "the two hops' gRPC floor (d + e)", ("floor_bidi", "floor_unary_stream"), ()),
    ("engine_hop_above_floor", "engine hop above its floor (b − a − d)", ("engine_grpc",),
     ("in_process", "floor_bidi")),
    ("router_hop_above_floor", "router hop above its floor (c − b − e)", ("router_grpc",),
     ("engine_grpc", "floor_unary_stream")),
)


def ttft_diffs(t: dict) -> dict[str, dict[str, float]]:
    """TTFT_DIFFS of one run's paths, p50 and p99 (ms), by key."""
    return {key: {q: sum(t[k][q] for k in plus) - sum(t[k][q] for k in minus)
                  for q in ("p50_ms", "p99_ms")}
            for key, _, plus, minus in TTFT_DIFFS}


def ttft_section(result: dict) -> str:
    t = result["ttft"]
    lines = [
        TTFT_MARKER, "", f"## Unloaded TTFT: {result['label']}", "",
        (f"`python -m omnibus.bench.host --only ttft`. {t['requests']} requests per path, one "
         f"at a time, each {t['gap_ms']:.0f} ms after the previous one ended (idle engines; "
         "their idle check of the KV bookkeeping waits for 0.25 s without a request), "
         f"{t['prompt_len']}-token prompts (fresh ids each: no prefix-cache hits), "
         f"{t['max_tokens']} output tokens, greedy; TTFT from submit to the first token-bearing "
         "output, in the benchmark's process. The paths take turns request by request after "
         f"{t['warmup']} warm-up requests each. The differences are between percentiles, not "
         "percentiles of per-request differences. #11's target: router + engine vs in process "
         f"< 1 ms at p50. The machine's {os.cpu_count()} cores were shared with other work: "
         "p99 is noisy."),
        "",
        "| path | TTFT p50 ms | TTFT p99 ms |",
        "|---|---:|---:|",
    ]
    lines += [f"| {label} | {t[k]['p50_ms']:.3f} | {t[k]['p99_ms']:.3f} |"
              for k, label in TTFT_ROWS]
    diffs = ttft_diffs(t)
    lines += [f"| {label} | {diffs[key]['p50_ms']:+.3f} | {diffs[key]['p99_ms']:+.3f} |"
              for key, label, _, _ in TTFT_DIFFS]
    d = {key: v["p50_ms"] for key, v in diffs.items()}
    lines += [
        "",
        ("The floor (d, e) is a bare grpc.aio server in its own process (uvloop, as the engine "
         "and router run; no interceptors, no Omnibus code) answering with one small message, "
         f"timed by this client like the other paths: gRPC alone costs {d['floors']:.2f} ms "
         f"of the two hops at p50, so #11's < 1 ms for c − a (here {d['both_hops']:.2f}) is "
         "below what gRPC itself takes on this machine. Above the floor, Omnibus adds "
         f"{d['engine_hop_above_floor']:.2f} ms on the engine hop (Session stream, the "
         f"engine's server and step loop) and {d['router_hop_above_floor']:.2f} ms on the "
         "router hop (validate, admit, queue, dispatch, the second hop's client, detokenize). "
         "This client runs asyncio's own event loop and the router uvloop, so the router's "
         "engine hop inside c can be quicker than b's, which lowers c − b − e. Differences "
         "of p99s are mostly noise on a shared machine."),
    ]
    return "\n".join(lines) + "\n"


def requests_section(result: dict) -> str:
    q = result["requests"]
    lines = [
        REQUESTS_MARKER, "", f"## Per-request cost: {result['label']}", "",
        (f"`python -m omnibus.bench.host --only requests`. {q['requests']:,} requests per run "
         f"of {q['max_tokens']} output token each ({q['prompt_len']}-token prompts, greedy, "
         f"fresh ids: no prefix-cache hits), {q['clients']} kept in flight by this benchmark's "
         "client (a closed loop: each request that ends starts the next), through the router "
         "to the null-model engine. Taking turns with each run, on the same two processes: "
         f"{q['clients']} streams of {OUTPUT_LEN} tokens sent at once (the stream level of that "
         "size), so the per-token cost stands beside the per-request one. CPU as above "
         "(utime + stime from /proc over the run), divided by the requests that ended and by "
         "the tokens they streamed. tokens/step: the tokens streamed over the engine's steps in "
         "the run (ramp-up and tail included); with one token each, the requests per step. "
         "router-core req/s: 1e3 / router ms per request. "
         f"Values: median (min–max) over {len(q['runs'])} runs."),
        "",
        "| workload | requests/s | output tok/s | TTFT p50 ms | TTFT p99 ms | tokens/step | "
        "router ms/request | router µs/token | engine ms/request | engine µs/token | "
        "client ms/request | router-core req/s | failed |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, runs in ((f"{q['max_tokens']}-token requests, {q['clients']} in flight",
                        q["runs"]),
                       (f"{q['clients']} streams of {OUTPUT_LEN} tokens", q["stream_runs"])):
        per_req = {k: [r["cpu_ms_per_request"][k] for r in runs]
                   for k in ("router", "engine", "client")}
        per_tok = {k: [r["cpu_us_per_token"][k] for r in runs] for k in ("router", "engine")}
        per_step = [r["tokens_per_step"] for r in runs if r.get("tokens_per_step")]
        cols = [
            spread([r["requests_per_s"] for r in runs]), spread([r["tokens_per_s"] for r in runs]),
            spread([r["ttft_p50_ms"] for r in runs], "{:,.1f}"),
            spread([r["ttft_p99_ms"] for r in runs], "{:,.1f}"),
            spread(per_step, "{:,.1f}") if per_step else "–",
            spread(per_req["router"], "{:.3f}"), spread(per_tok["router"], "{:.1f}"),
            spread(per_req["engine"], "{:.3f}"), spread(per_tok["engine"], "{:.1f}"),
            spread(per_req["client"], "{:.3f}"),
            spread([1e3 / x for x in per_req["router"]]),
            f"{sum(r['streams'] - r['ok'] for r in runs)} of {sum(r['streams'] for r in runs)}",
        ]
        lines.append(f"| {name} | " + " | ".join(cols) + " |")
    req_ms = statistics.median(r["cpu_ms_per_request"]["router"] for r in q["runs"])
    tok_us = statistics.median(r["cpu_us_per_token"]["router"] for r in q["stream_runs"])
    lines += ["", (f"One request of {q['max_tokens']} token costs the router {req_ms:.3f} ms of "
                   f"CPU (medians), as much as {req_ms * 1e3 / tok_us:,.0f} tokens streamed at "
                   f"{tok_us:.1f} µs each.")]
    if q.get("floor"):
        f = q["floor"]
        lines[-1] += (
            " Floor, taking turns with the runs: the bare grpc.aio server of the TTFT part "
            f"answering {f[0]['calls']:,} unary-stream calls with one small message each, "
            f"{f[0]['clients']} in flight from this client, spent "
            f"{spread([x['cpu_us_per_call'] / 1e3 for x in f], '{:.3f}')} CPU ms per call "
            f"({spread([x['calls_per_s'] for x in f])} calls/s): the public call's share of "
            "the router's cost that gRPC alone takes; the router also sends and receives one "
            "message or more per request on its engine's session stream.")
    return "\n".join(lines) + "\n"


# ---- the report ----------------------------------------------------------------------------


def table(result: dict) -> list[str]:
    lines = ["| streams | output tok/s | TTFT p50 ms | TTFT p99 ms | ITL p99 ms | tokens/step | "
             "router µs/tok | engine µs/tok | client µs/tok | router-core tok/s | "
             "engine-process tok/s | failed |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for n in sorted({r["streams"] for r in result["runs"]}):
        runs = [r for r in result["runs"] if r["streams"] == n]
        cpu = {k: [r["cpu_us_per_token"][k] for r in runs] for k in ("router", "engine", "client")}
        per_step = [r["tokens_per_step"] for r in runs if r.get("tokens_per_step")]
        cols = [
            spread([r["tokens_per_s"] for r in runs]),
            spread([r["ttft_p50_ms"] for r in runs]), spread([r["ttft_p99_ms"] for r in runs]),
            spread([r["itl_p99_ms"] for r in runs], "{:,.1f}"),
            spread(per_step, "{:,.0f}") if per_step else "–",
            spread(cpu["router"], "{:.1f}"), spread(cpu["engine"], "{:.1f}"),
            spread(cpu["client"], "{:.1f}"),
            spread([1e6 / x for x in cpu["router"]]), spread([1e6 / x for x in cpu["engine"]]),
        ]
        cols.append(f"{sum(n - r['ok'] for r in runs)} of {n * len(runs)}")
        lines.append(f"| {n} | " + " | ".join(cols) + " |")
    ip = result.get("in_process")
    if ip:
        lines += ["", f"In-process `Engine.generate` on the null model, {ip['streams']} requests: "
                  f"{ip['tokens_per_s']:,.0f} tok/s, {ip['cpu_us_per_token']:.1f} CPU µs/token."]
    return lines


def write_markdown(out: Path, result: dict, baseline: dict | None) -> None:
    """The report's parts this run measured (the stream levels, the GPU-paced runs, the
    unloaded TTFT); the parts it did not measure are kept from the existing report, and
    so is everything after NOTES_MARKER."""
    old = out.read_text() if out.exists() else ""
    markers = [m for m in _MARKERS if m in old]
    cut = min((old.index(m) for m in markers), default=len(old))
    head = stream_report(result, baseline) if "runs" in result else old[:cut]
    paced = paced_section(result) if "paced" in result else _part(old, PACED_MARKER)
    ttft = ttft_section(result) if "ttft" in result else _part(old, TTFT_MARKER)
    reqs = requests_section(result) if "requests" in result else _part(old, REQUESTS_MARKER)
    notes = _part(old, NOTES_MARKER)
    parts = [x.strip("\n") for x in (head, paced, ttft, reqs, notes) if x.strip()]
    out.write_text("\n\n".join(parts) + "\n")


# The generated parts' markers, in the report's order; the hand-written notes come last.
_MARKERS = (PACED_MARKER, TTFT_MARKER, REQUESTS_MARKER, NOTES_MARKER)


def _part(text: str, start: str) -> str:
    """`text` from the marker `start` up to the next of the other markers after it (to
    the end without one); "" without `start`."""
    begin = text.find(start)
    if begin < 0:
        return ""
    stops = [i for m in _MARKERS if m != start and (i := text.find(m, begin)) >= 0]
    return text[begin:min(stops, default=len(text))]


def stream_report(result: dict, baseline: dict | None) -> str:
    lines = [
        "# Host path: router + engine at GPU rates, measured on a CPU",
        "",
        "`make bench-host` (bench/omnibus/bench/host.py). One router and one engine worker on loopback; the "
        "engine serves the null model (`--load-format null`: real server, scheduler, KV "
        "allocator and sampler; no weights, a near-free forward). Every request is sent at "
        f"once: {PROMPT_LEN}-token prompts, {OUTPUT_LEN} output tokens, greedy, ignore_eos, "
        "a byte-level BPE tokenizer (2,048 ids). CPU µs/token: utime + stime of each process "
        "from its CPU-time clock (clock_getcpuclockid) over the run, divided by the output tokens streamed (the "
        "client is this benchmark's own process). Values: median (min–max) over the repeats. "
        "router-core / engine-process tok/s: 1e6 / µs per token, what one core of each could "
        "sustain at that cost.",
        "",
        f"Projection basis (an assumption, not a measurement): an 8B model decodes about "
        f"{ASSUMED_GPU_TOKENS_S:,} tok/s on one H200 at batch 256. A serving path keeps up "
        f"when router-core and engine-process tok/s both exceed it; #11's targets: router "
        f"≤ 15 µs/token (66,667 tok/s per core), engine host ≤ 10 µs/token (100,000 tok/s). "
        "Here the null model steps far faster than a GPU, so steps and client messages "
        "carry other numbers of tokens than at a GPU's rate (tokens/step); the paced part "
        "below measures at that rate, and its columns are the ones to project from.",
        "",
        f"Machine: {result.get('machine') or machine()}, shared with other work (noisy).",
        "",
    ]
    if baseline is not None:
        lines += [f"## Before: {baseline['label']}", "", *table(baseline), ""]
    lines += [f"## {'After' if baseline is not None else 'Now'}: {result['label']}", "",
              *table(result), ""]
    return "\n".join(lines)


def git_label() -> str:
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--", "router/omnibus/router/text"],
                           capture_output=True, text=True).stdout.strip()
    return f"commit {rev.stdout.strip() or '?'}" + (" + uncommitted router/omnibus/router/text" if dirty else "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=None, help="write the markdown report here")
    ap.add_argument("--save-json", type=Path, default=None, help="keep this run's numbers here")
    ap.add_argument("--baseline", type=Path, default=None, help="an earlier --save-json to compare")
    ap.add_argument("--label", default=None, help="what was measured (default: the git commit)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--streams", default=",".join(map(str, STREAMS)))
    ap.add_argument("--engine-seats", type=int, default=1024, help="engine --max-num-seqs")
    ap.add_argument("--only", choices=["streams", "paced", "ttft", "requests"], default=None,
                    help="one part alone (default: all); --out then rewrites only its part")
    ap.add_argument("--paced-step-ms", type=float, default=PACED_STEP_MS,
                    help="the paced part's --null-step-ms (default: the step time at which "
                    f"{PACED_STREAMS} sequences decode {ASSUMED_GPU_TOKENS_S:,} tok/s)")
    ap.add_argument("--paced-intervals", default=",".join(map(str, PACED_INTERVALS)),
                    help="the paced part's router --stream-interval values")
    ap.add_argument("--paced-scheduling", default="lockstep,overlapped",
                    help="the paced part's engines: lockstep, overlapped or both")
    ap.add_argument("--ttft-requests", type=int, default=TTFT_REQUESTS, help="per path")
    ap.add_argument("--requests-per-run", type=int, default=REQUESTS_PER_RUN,
                    help=f"the per-request part's {REQUESTS_MAX_TOKENS}-token requests per run")
    ap.add_argument("--requests-clients", type=int, default=REQUESTS_CLIENTS,
                    help="the per-request part's requests in flight")
    ap.add_argument("--step-loop", default="auto", choices=["auto", "process", "thread"],
                    help="the engine's --step-loop (the in-process TTFT path is a thread either way)")
    ap.add_argument("--stream-interval", type=int, default=1, help="the router's --stream-interval")
    ap.add_argument("--serve-floor", type=int, metavar="PORT", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve_floor:  # the child process of floor_process
        import uvloop

        uvloop.run(serve_floor(args.serve_floor))
        return
    streams = () if args.only not in (None, "streams") else tuple(
        int(x) for x in args.streams.split(","))
    ttft_requests = args.ttft_requests if args.only in (None, "ttft") else 0
    requests_per_run = args.requests_per_run if args.only in (None, "requests") else 0
    result = {}
    if streams or ttft_requests or requests_per_run:
        result = measure(args.repeats, streams, args.engine_seats, ttft_requests, args.step_loop,
                         args.stream_interval, requests_per_run, args.requests_clients)
    if args.only in (None, "paced"):
        intervals = tuple(int(x) for x in args.paced_intervals.split(","))
        modes = args.paced_scheduling.split(",")
        if not set(modes) <= set(_SCHEDULING.values()):
            ap.error(f"--paced-scheduling takes lockstep and/or overlapped, got {args.paced_scheduling}")
        overlap = tuple(x == "overlapped" for x in modes)
        result["paced"] = measure_paced(max(args.repeats, 3), args.paced_step_ms, intervals,
                                        overlap,
                                        engine_seats=args.engine_seats, step_loop=args.step_loop)
    result["step_loop"], result["stream_interval"] = args.step_loop, args.stream_interval
    result["label"] = args.label or git_label()
    result["machine"] = machine()
    print(json.dumps(result, indent=1))
    if args.save_json:
        args.save_json.write_text(json.dumps(result, indent=1))
    if args.out:
        baseline = json.loads(args.baseline.read_text()) if args.baseline else None
        write_markdown(args.out, result, baseline)


if __name__ == "__main__":
    main()
