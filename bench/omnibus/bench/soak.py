"""Soak: a router in front of two null-model engines under a bounded mixed workload for a
set time, sampling each process's RSS, open fds and threads (/proc) and each engine's free
KV blocks every few seconds; fails on growth past the stated tolerances.

Workload (every part always running): full streams, streams the client cancels after a
few tokens, streams whose deadline passes mid-decode, Embed calls, and every few seconds
an overload burst that the router's queue cap answers RESOURCE_EXHAUSTED.

Checks (a leak shows as growth while the workload is steady, so RSS is compared over the
second half, when allocator pools and caches have reached their size):
  - RSS of each process: last samples vs mid-run samples grow < 10% + 20 MB;
  - open fds and threads once idle again: the post-warm-up idle baseline ± FD_SLACK /
    THREAD_SLACK;
  - every engine ends idle with every KV block free;
  - every call ends with an expected status (never UNKNOWN, INTERNAL or UNAVAILABLE).

`python -m omnibus.bench.soak --duration 600 --out docs/benchmarks/soak.md`, or
`make soak DURATION=600`; tests/bench/test_soak.py runs it for ~10 s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from omnibus.v1 import engine_pb2, engine_pb2_grpc
from omnibus.v1 import inference_pb2 as pb
from omnibus.v1 import inference_pb2_grpc

from omnibus.bench.host import build_model
from omnibus.bench.processes import ServerProcess, engine_process, router_process, wait_until

RSS_GROWTH_FRACTION, RSS_GROWTH_BYTES = 0.10, 20 << 20
FD_SLACK, THREAD_SLACK = 8, 4
SAMPLE_S = 2.0
STREAMERS, CANCELLERS, DEADLINERS, EMBEDDERS = 6, 2, 2, 1
BURST_EVERY_S, BURST_SIZE = 5.0, 40
MAX_QUEUED = 8  # the router's --max-queued-requests: bursts overflow it
ENGINE_SEATS = 8
EXPECTED = {"OK", "CANCELLED", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED"}


@dataclass
class Sample:
    t: float  # seconds since the workload started
    rss: dict[str, int]  # bytes, per process (its whole process tree)
    fds: dict[str, int]
    threads: dict[str, int]
    free_blocks: dict[str, int]


@dataclass
class Soak:
    duration_s: float
    samples: list[Sample] = field(default_factory=list)
    baseline: Sample | None = None  # idle, after a warm-up
    final: Sample | None = None  # idle, after the workload
    outcomes: Counter[str] = field(default_factory=Counter)
    total_blocks: dict[str, int] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)


# ---- /proc -------------------------------------------------------------------------


def process_tree(pid: int) -> list[int]:
    """pid and its descendants (an engine may run its step loop in a child)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for tid in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{tid}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except OSError:
            continue
    return out


def proc_numbers(pid: int) -> tuple[int, int, int]:
    """(RSS bytes, open fds, threads) of pid's process tree."""
    rss = fds = threads = 0
    for p in process_tree(pid):
        try:
            status = Path(f"/proc/{p}/status").read_text().splitlines()
            fields = dict(line.split(":", 1) for line in status if ":" in line)
            rss += int(fields["VmRSS"].split()[0]) * 1024
            threads += int(fields["Threads"])
            fds += len(os.listdir(f"/proc/{p}/fd"))
        except (OSError, KeyError):
            continue
    return rss, fds, threads


def stats(address: str) -> engine_pb2.StatsResponse:
    with grpc.insecure_channel(address) as channel:
        return engine_pb2_grpc.EngineStub(channel).Stats(engine_pb2.StatsRequest(), timeout=10)


def sample(t: float, procs: dict[str, ServerProcess], engines: list[str]) -> Sample:
    numbers = {name: proc_numbers(p.proc.pid) for name, p in procs.items()}
    return Sample(
        t=round(t, 1),
        rss={n: v[0] for n, v in numbers.items()},
        fds={n: v[1] for n, v in numbers.items()},
        threads={n: v[2] for n, v in numbers.items()},
        free_blocks={a: stats(a).load.num_free_blocks for a in engines},
    )


def engines_idle(engines: list[str], total: dict[str, int]) -> bool:
    for address in engines:
        s = stats(address)
        if s.num_active_streams or s.load.num_running or s.load.num_waiting:
            return False
        if s.load.num_free_blocks != total[address]:
            return False
    return True


# ---- the workload --------------------------------------------------------------------


def request(rng: random.Random, vocab: int, max_tokens: int) -> pb.GenerateRequest:
    prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(4, 64))]
    return pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=prompt),
        sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
    )


async def outcome_of(coro) -> str:  # noqa: ANN001
    """The call's status name (a call the client cancelled itself says so)."""
    try:
        return await coro or "OK"
    except grpc.RpcError as err:
        return err.code().name


async def full_stream(stub, rng: random.Random, vocab: int) -> None:  # noqa: ANN001
    async for _ in stub.Generate(request(rng, vocab, rng.randint(8, 96))):
        pass


async def long_stream(stub, rng: random.Random, vocab: int) -> None:  # noqa: ANN001
    """A burst's request: long enough to hold its seat while the rest of the burst
    arrives."""
    async for _ in stub.Generate(request(rng, vocab, 400)):
        pass


async def cancelled_stream(stub, rng: random.Random, vocab: int) -> str:  # noqa: ANN001
    call = stub.Generate(request(rng, vocab, 500))
    for _ in range(rng.randint(1, 5)):
        await call.read()
    call.cancel()
    return "CANCELLED"


async def deadline_stream(stub, rng: random.Random, vocab: int) -> None:  # noqa: ANN001
    async for _ in stub.Generate(request(rng, vocab, 1000), timeout=rng.uniform(0.05, 0.5)):
        pass


async def embed(stub, rng: random.Random, vocab: int) -> None:  # noqa: ANN001
    inputs = [pb.EmbedInput(token_ids=pb.TokenIds(ids=[rng.randrange(3, vocab)] * rng.randint(1, 32)))
              for _ in range(rng.randint(1, 4))]
    await stub.Embed(pb.EmbedRequest(inputs=inputs))


async def worker(kind, stub, soak: Soak, end: float, seed: int, vocab: int) -> None:  # noqa: ANN001
    rng = random.Random(seed)
    while time.monotonic() < end:
        soak.outcomes[f"{kind.__name__}:{await outcome_of(kind(stub, rng, vocab))}"] += 1


async def bursts(stub, soak: Soak, end: float, vocab: int) -> None:  # noqa: ANN001
    rng = random.Random(7)
    while time.monotonic() + BURST_EVERY_S < end:
        await asyncio.sleep(BURST_EVERY_S)
        calls = [outcome_of(long_stream(stub, rng, vocab)) for _ in range(BURST_SIZE)]
        for code in await asyncio.gather(*calls):
            soak.outcomes[f"burst:{code}"] += 1


async def sampler(soak: Soak, procs, engines, start: float, end: float) -> None:  # noqa: ANN001
    while time.monotonic() < end:
        soak.samples.append(await asyncio.to_thread(sample, time.monotonic() - start, procs, engines))
        await asyncio.sleep(SAMPLE_S)


async def workload(router: str, soak: Soak, procs, engines, vocab: int) -> None:  # noqa: ANN001
    async with grpc.aio.insecure_channel(router) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        start = time.monotonic()
        end = start + soak.duration_s
        kinds = ([full_stream] * STREAMERS + [cancelled_stream] * CANCELLERS
                 + [deadline_stream] * DEADLINERS + [embed] * EMBEDDERS)
        await asyncio.gather(
            *(worker(k, stub, soak, end, i, vocab) for i, k in enumerate(kinds)),
            bursts(stub, soak, end, vocab),
            sampler(soak, procs, engines, start, end),
        )


async def warm_up(router: str, vocab: int) -> None:
    """Each kind of call a few times, so that connections, threads and caches exist before
    the baseline."""
    async with grpc.aio.insecure_channel(router) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        rng = random.Random(0)
        for kind in (full_stream, cancelled_stream, deadline_stream, embed) * 3:
            await outcome_of(kind(stub, rng, vocab))
        await asyncio.gather(*(outcome_of(long_stream(stub, rng, vocab)) for _ in range(BURST_SIZE)))


# ---- checks and the run ---------------------------------------------------------------


def check(soak: Soak) -> None:
    f = soak.failures
    unexpected = {k: n for k, n in soak.outcomes.items() if k.split(":")[1] not in EXPECTED}
    if unexpected:
        f.append(f"unexpected call outcomes: {unexpected}")
    if not any(k == "burst:RESOURCE_EXHAUSTED" for k in soak.outcomes):
        f.append("no overload burst was refused RESOURCE_EXHAUSTED: the workload missed a case")
    assert soak.baseline is not None and soak.final is not None
    for name in soak.baseline.rss:
        mid, last = rss_mid_last(soak, name)
        limit = mid * RSS_GROWTH_FRACTION + RSS_GROWTH_BYTES
        if last - mid > limit:
            f.append(f"{name} RSS grew {(last - mid) >> 20} MB over the second half "
                     f"(limit {int(limit) >> 20} MB)")
        for what, slack in (("fds", FD_SLACK), ("threads", THREAD_SLACK)):
            before, after = getattr(soak.baseline, what)[name], getattr(soak.final, what)[name]
            if abs(after - before) > slack:
                f.append(f"{name} {what}: {before} idle before, {after} idle after (± {slack})")
    for address, free in soak.final.free_blocks.items():
        if free != soak.total_blocks[address]:
            f.append(f"engine {address}: {free} of {soak.total_blocks[address]} KV blocks free")


def rss_mid_last(soak: Soak, name: str) -> tuple[float, float]:
    """Median RSS of the samples around the middle and of the last samples (3 each, or
    fewer in a short run)."""
    values = [s.rss[name] for s in soak.samples]
    k = max(1, min(3, len(values) // 4))
    mid = len(values) // 2
    return statistics.median(values[mid - k // 2: mid - k // 2 + k]), statistics.median(values[-k:])


def run(duration_s: float, log_dir: Path) -> Soak:
    soak = Soak(duration_s)
    model = build_model(log_dir / "model")
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    flags = ("--load-format", "null", "--max-num-seqs", str(ENGINE_SEATS),
             "--num-kv-blocks", "512", "--block-size", "16")
    engines = [engine_process(model, log_dir, f"soak-engine-{i}", *flags) for i in range(2)]
    procs: dict[str, ServerProcess] = {}
    try:
        for i, e in enumerate(engines):
            procs[f"engine-{i}"] = e.wait_serving()
        router = router_process(model, [e.address for e in engines], log_dir, "soak-router",
                                f"--max-queued-requests={MAX_QUEUED}")
        procs["router"] = router
        router.wait_serving()
        addresses = [e.address for e in engines]
        soak.total_blocks = {a: stats(a).load.num_total_blocks for a in addresses}
        asyncio.run(warm_up(router.address, vocab))
        wait_until(lambda: engines_idle(addresses, soak.total_blocks), 60, "idle after warm-up")
        soak.baseline = sample(0.0, procs, addresses)
        asyncio.run(workload(router.address, soak, procs, addresses, vocab))
        wait_until(lambda: engines_idle(addresses, soak.total_blocks), 60, "idle after the soak")
        time.sleep(SAMPLE_S)  # closed calls' threads and sockets wind down
        soak.final = sample(duration_s, procs, addresses)
        dead = [n for n, p in procs.items() if p.proc.poll() is not None]
        if dead:
            soak.failures.append(f"processes died: {dead}")
        check(soak)
    finally:
        for p in reversed([*engines, *procs.values()]):
            p.stop()
    return soak


def report(soak: Soak) -> str:
    assert soak.baseline is not None and soak.final is not None
    mb = 1 << 20
    lines = [
        f"Soak: {soak.duration_s:.0f} s of mixed workload (router + 2 null-model engines, "
        f"{len(soak.samples)} samples every {SAMPLE_S:.0f} s).", "",
        "| process | RSS idle before (MB) | RSS mid-run (MB) | RSS end of run (MB) | "
        "RSS idle after (MB) | fds before / after | threads before / after |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in soak.baseline.rss:
        mid, last = rss_mid_last(soak, name)
        lines.append(
            f"| {name} | {soak.baseline.rss[name] / mb:.1f} | {mid / mb:.1f} | {last / mb:.1f} | "
            f"{soak.final.rss[name] / mb:.1f} | {soak.baseline.fds[name]} / {soak.final.fds[name]} | "
            f"{soak.baseline.threads[name]} / {soak.final.threads[name]} |"
        )
    lines += ["", "Calls by kind and outcome: " + ", ".join(
        f"{k} {n}" for k, n in sorted(soak.outcomes.items())) + ".", "",
        "KV blocks free at the end: " + ", ".join(
            f"{soak.final.free_blocks[a]}/{soak.total_blocks[a]}" for a in soak.total_blocks) + ".",
        "", "Result: " + ("PASS" if not soak.failures else "FAIL: " + "; ".join(soak.failures)),
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=600.0, help="seconds of workload")
    ap.add_argument("--out", type=Path, default=None, help="write the report here (markdown)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        soak = run(args.duration, Path(tmp))
    text = report(soak)
    print(text)
    if args.out:
        args.out.write_text(text)
    sys.exit(1 if soak.failures else 0)


if __name__ == "__main__":
    main()
