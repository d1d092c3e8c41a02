"""KV that moves, measured on this CPU (`make bench-pd`, docs/benchmarks/pd.md).

Real processes: two engine workers (SmolLM2-135M, one torch thread each, `--kv-transfer
mooncake`) and a router, over loopback.

1. Disaggregation: decode-heavy streams (64-token prompts, 96 tokens out) run while long
   requests (2,000-token prompts, 8 tokens out) arrive every few seconds; the same two
   engines as `--role both` (mixed: a long prefill shares steps with the decodes) and as
   `--role prefill` + `--role decode` (split). Printed: the decode-heavy streams'
   inter-token time p50 / p99 (TPOT), the long requests' TTFT, and the KV transfer's
   bytes and time per request (the decode engine's Stats).
2. Drain: 32 streams on engine A, which is then SIGTERMed: with --kv-transfer its streams
   move with their KV (migrated), without it they are aborted and recomputed elsewhere.
   Printed: tokens lost, streams moved, and the largest gap between two tokens of a moved
   stream (the time the move cost it), median and max over the streams.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import signal
import statistics
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
from omnibus.v1 import engine_pb2, engine_pb2_grpc
from omnibus.v1 import inference_pb2 as pb
from omnibus.v1 import inference_pb2_grpc

from omnibus.bench.processes import engine_process, free_port, router_process
from omnibus.bench.quant import smollm2_path
from omnibus.bench.report import write_keeping_reading
from omnibus.bench.stats import percentile

ENV = {"OMP_NUM_THREADS": "1"}
BASE = ("--num-kv-blocks", "2400", "--block-size", "16", "--max-num-seqs", "48", "--step-loop", "process")


@contextlib.contextmanager
def fleet(model: Path, logs: Path, roles: tuple[str, str], kv: bool, drain_s: float = 30.0,
          early: bool = False) -> Iterator[dict]:
    logs.mkdir(parents=True, exist_ok=True)
    flags = (*BASE, "--drain-seconds", str(drain_s), *(("--kv-transfer", "mooncake") if kv else ()),
             *(("--kv-transfer-overlap",) if early else ()))
    engines = [engine_process(model, logs, f"engine-{i}-{role}", *flags, *(("--role", role) if kv else ()),
                              env=ENV) for i, role in enumerate(roles)]
    procs = list(engines)
    try:
        for e in engines:
            e.wait_serving(300)
        metrics = free_port()
        router = router_process(model, [e.address for e in engines], logs, "router", f"--metrics-port={metrics}",
                                "--engine-stale-seconds=5")
        procs.append(router)
        router.wait_serving(300)
        yield {"engines": engines, "stub": inference_pb2_grpc.InferenceStub(grpc.insecure_channel(router.address)),
               "metrics": metrics}
    finally:
        for p in reversed(procs):
            p.stop()


def stream(stub, ids: list[int], max_tokens: int, times: list[float], tokens: list[int]) -> None:
    req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), sampling=pb.SamplingParams(
        max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    times.append(time.perf_counter())  # sent
    for r in stub.Generate(req, timeout=600):
        for t in r.token_ids:
            times.append(time.perf_counter())
            tokens.append(t)


def engine_stats(address: str) -> engine_pb2.StatsResponse:
    with grpc.insecure_channel(address) as ch:
        return engine_pb2_grpc.EngineStub(ch).Stats(engine_pb2.StatsRequest(), timeout=10)


def disaggregation(model: Path, logs: Path, roles: tuple[str, str], n_decode: int, n_long: int,
                   gap_s: float, early: bool = False) -> dict:
    rng = random.Random(1)
    with fleet(model, logs / ("-".join(roles) + ("-early" if early else "")), roles, kv=True, early=early) as f:
        stub = f["stub"]
        stream(stub, [rng.randrange(100, 40000) for _ in range(32)], 4, [], [])  # warm both paths
        decode_times: list[list[float]] = [[] for _ in range(n_decode)]
        long_times: list[list[float]] = [[] for _ in range(n_long)]
        threads = [threading.Thread(target=stream, args=(stub, [rng.randrange(100, 40000) for _ in range(64)], 96,
                                                         decode_times[i], [])) for i in range(n_decode)]
        for t in threads:
            t.start()
        time.sleep(1.0)
        longs = []
        for i in range(n_long):
            t = threading.Thread(target=stream, args=(stub, [rng.randrange(100, 40000) for _ in range(2000)], 8,
                                                      long_times[i], []))
            t.start()
            longs.append(t)
            time.sleep(gap_s)
        for t in threads + longs:
            t.join()
        gaps = [b - a for ts in decode_times for a, b in zip(ts[1:], ts[2:])]  # after each stream's first token
        decode_addr = f["engines"][1].address if roles[0] == "prefill" else None
        kv = engine_stats(decode_addr).kv_transfer if decode_addr else None
        return {
            "tpot_p50": 1000 * percentile(gaps, 50), "tpot_p99": 1000 * percentile(gaps, 99),
            "ttft_long": 1000 * statistics.median(ts[1] - ts[0] for ts in long_times),
            "ttft_decode": 1000 * statistics.median(ts[1] - ts[0] for ts in decode_times),
            "kv_bytes": kv.loaded_bytes / kv.loads if kv and kv.loads else 0.0,
            "kv_ms": 1000 * kv.load_seconds / kv.loads if kv and kv.loads else 0.0,
            "kv_loads": kv.loads if kv else 0, "kv_failures": kv.load_failures if kv else 0,
        }


def drain(model: Path, logs: Path, kv: bool, n: int, max_tokens: int) -> dict:
    rng = random.Random(2)
    with fleet(model, logs / f"drain-{kv}", ("both", "both"), kv=kv, drain_s=30.0 if kv else 0.0) as f:
        stub = f["stub"]
        stream(stub, [rng.randrange(100, 40000) for _ in range(32)], 4, [], [])
        times: list[list[float]] = [[] for _ in range(n)]
        toks: list[list[int]] = [[] for _ in range(n)]
        prompts = [[rng.randrange(100, 40000) for _ in range(64)] for _ in range(n)]
        threads = [threading.Thread(target=stream, args=(stub, prompts[i], max_tokens, times[i], toks[i]))
                   for i in range(n)]
        for t in threads:
            t.start()
        while min(len(ts) for ts in times) < 6:
            time.sleep(0.05)
        victim = f["engines"][0]
        running = engine_stats(victim.address).load.num_running
        t_sig = time.perf_counter()
        victim.signal(signal.SIGTERM)
        for t in threads:
            t.join()
        survivor = engine_stats(f["engines"][1].address).kv_transfer if kv else None
        moved_gaps = []
        for ts in times:
            after = [b - a for a, b in zip(ts[1:], ts[2:]) if b >= t_sig]
            if after:
                moved_gaps.append(max(after))
        return {
            "running": running, "lost": sum(max_tokens - len(t) for t in toks),
            "moved_gap_p50": 1000 * statistics.median(moved_gaps), "moved_gap_max": 1000 * max(moved_gaps),
            "loaded_tokens": survivor.loaded_tokens if survivor else 0,
        }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--decode-streams", type=int, default=8)
    ap.add_argument("--long-requests", type=int, default=4)
    ap.add_argument("--long-gap", type=float, default=2.0)
    ap.add_argument("--drain-streams", type=int, default=32)
    args = ap.parse_args()
    model = smollm2_path()
    logs = Path(tempfile.mkdtemp(prefix="bench-pd-"))
    rows = {}
    for name, roles, early in (("mixed (both + both)", ("both", "both"), False),
                               ("split (prefill + decode)", ("prefill", "decode"), False),
                               ("split, early handles (--kv-transfer-overlap)", ("prefill", "decode"), True)):
        rows[name] = disaggregation(model, logs, roles, args.decode_streams, args.long_requests, args.long_gap, early)
        print(name, rows[name], flush=True)
    drains = {}
    for name, kv in (("migrated (--kv-transfer)", True), ("recomputed (no transfer)", False)):
        drains[name] = drain(model, logs, kv, args.drain_streams, 64)
        print(name, drains[name], flush=True)
    mixed, split = rows["mixed (both + both)"], rows["split (prefill + decode)"]
    early = rows["split, early handles (--kv-transfer-overlap)"]
    lines = [
        "# KV that moves: prefill/decode disaggregation and live migration (CPU)", "",
        "`make bench-pd` (bench/omnibus/bench/pd.py): two engine processes (SmolLM2-135M Q4_1, one torch "
        "thread each, `--kv-transfer mooncake` over loopback TCP) and a router, on this 2-core VM. "
        "CPU figures, not GPU ones.", "",
        f"## Disaggregation: {args.decode_streams} decode-heavy streams (64-token prompts, 96 out) while "
        f"{args.long_requests} 2,000-token prompts (8 out) arrive {args.long_gap:g} s apart", "",
        "| engines | decode TPOT p50 ms | decode TPOT p99 ms | long TTFT ms (median) | decode TTFT ms | "
        "KV read per request | read ms per request |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in rows.items():
        kvb = f"{r['kv_bytes'] / 1e6:.1f} MB ({r['kv_loads']} reads, {r['kv_failures']} failed)" if r["kv_loads"] else "-"
        kvt = f"{r['kv_ms']:.1f}" if r["kv_loads"] else "-"
        lines.append(f"| {name} | {r['tpot_p50']:.1f} | {r['tpot_p99']:.1f} | {r['ttft_long']:.0f} | "
                     f"{r['ttft_decode']:.0f} | {kvb} | {kvt} |")
    lines += ["", f"Split / mixed: decode TPOT p99 {split['tpot_p99'] / mixed['tpot_p99']:.2f}x, "
              f"p50 {split['tpot_p50'] / mixed['tpot_p50']:.2f}x; long-prompt TTFT "
              f"{split['ttft_long'] / mixed['ttft_long']:.2f}x. Early / late handles: long-prompt TTFT "
              f"{early['ttft_long'] / split['ttft_long']:.2f}x, decode-heavy TTFT "
              f"{early['ttft_decode'] / split['ttft_decode']:.2f}x, TPOT p99 "
              f"{early['tpot_p99'] / split['tpot_p99']:.2f}x (an early handle's read ms is from the "
              "handle to the last block, most of it waiting on the prefill).", "",
              f"## Drain: {args.drain_streams} streams (64 out) over two engines, one SIGTERMed mid-stream", "",
              "| drain | streams it ran | tokens lost | tokens read, not computed | largest gap of a moved "
              "stream, median ms | max ms |", "|---|---:|---:|---:|---:|---:|"]
    for name, d in drains.items():
        lines.append(f"| {name} | {d['running']} | {d['lost']} | {d['loaded_tokens']} | {d['moved_gap_p50']:.0f} | "
                     f"{d['moved_gap_max']:.0f} |")
    report = "\n".join(lines) + "\n"
    print(report)
    if args.out:
        write_keeping_reading(args.out, report)


if __name__ == "__main__":
    main()
