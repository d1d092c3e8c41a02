"""The serving path's host cost: the real router in front of the real engine with the null
model (`--load-format null`, no weights, a near-free forward), on this CPU.

    python -m omnibus.bench.host [--out docs/benchmarks/host.md] [--baseline before.json]

For 64, 256 and 1024 concurrent streams (every request sent at once; 32-token prompts,
200 output tokens, greedy, ignore_eos) it measures output tokens/s, TTFT p50/p99,
inter-token latency p99 and the CPU each process spent per streamed token (utime + stime
deltas from /proc/<pid>/stat over the run), then projects the tokens/s one router core
and one engine host process could sustain at that cost. `--save-json` keeps a run's
numbers; `--baseline` puts an earlier run (e.g. before a change) beside this one.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from omnibus.bench.processes import engine_process, router_process
from omnibus.bench.serve import RunConfig, run_workload
from omnibus.bench.stats import percentile
from omnibus.bench.workloads import BenchRequest

STREAMS = (64, 256, 1024)
PROMPT_LEN = 32
OUTPUT_LEN = 200
# An assumption for the projection, not a measurement: decode rate of an 8B model on one
# H200 at batch 256 (bf16, memory-bound decode).
ASSUMED_GPU_TOKENS_S = 25_000
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
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    path.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    rng = random.Random(0)
    corpus = [" ".join(rng.choice(WORDS) + str(rng.randrange(100)) * (rng.random() < 0.2)
                       for _ in range(30)) for _ in range(2000)]
    tok.train_from_iterator(corpus, trainer=trainer)
    tok.save(str(path / "tokenizer.json"))
    config = dict(NULL_CONFIG, vocab_size=tok.get_vocab_size())
    (path / "config.json").write_text(json.dumps(config))
    return path


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (all its threads) so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def requests(n: int, vocab: int, seed: int) -> list[BenchRequest]:
    rng = random.Random(seed)
    return [BenchRequest(tuple(rng.randrange(3, vocab) for _ in range(PROMPT_LEN)), OUTPUT_LEN)
            for _ in range(n)]


def run_level(target: str, pids: dict[str, int], n: int, vocab: int, seed: int) -> dict:
    """One run of `n` concurrent streams; what the client saw and each process's CPU."""
    before = {name: cpu_seconds(pid) for name, pid in pids.items()}
    config = RunConfig(target=target, progress=False, timeout_s=600, request_id_prefix=f"host{seed}")
    out = asyncio.run(run_workload(requests(n, vocab, seed), config))
    cpu = {name: cpu_seconds(pid) - before[name] for name, pid in pids.items()}
    ok = [r for r in out.results if r.ok]
    tokens = sum(r.output_tokens for r in ok)
    itls = [x for r in ok for x in r.itls]
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    errors: dict[str, int] = {}
    for r in out.results:
        if not r.ok:
            errors[r.code] = errors.get(r.code, 0) + 1
    return {
        "streams": n, "ok": len(ok), "errors": errors, "tokens": tokens, "duration_s": out.duration,
        "tokens_per_s": tokens / out.duration,
        "ttft_p50_ms": percentile(ttfts, 50) * 1e3, "ttft_p99_ms": percentile(ttfts, 99) * 1e3,
        "itl_p99_ms": percentile(itls, 99) * 1e3,
        "cpu_us_per_token": {name: s / tokens * 1e6 for name, s in cpu.items()},
    }


def measure(repeats: int, streams: tuple[int, ...], engine_seats: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        model = build_model(tmp_path / "model")
        vocab = json.loads((model / "config.json").read_text())["vocab_size"]
        engine = engine_process(model, tmp_path, "engine", "--load-format", "null",
                                "--max-num-seqs", str(engine_seats)).wait_serving()
        router = None
        try:
            router = router_process(model, [engine.address], tmp_path, "router").wait_serving()
            pids = {"router": router.proc.pid, "engine": engine.proc.pid, "client": os.getpid()}
            run_level(router.address, pids, 16, vocab, seed=999)  # warm-up: connections, caches
            runs = [run_level(router.address, pids, n, vocab, seed=r)
                    for n in streams for r in range(repeats)]
        finally:
            if router is not None:
                router.stop()
            engine.stop()
        return {"runs": runs, "in_process": in_process_rate(model, vocab, engine_seats)}


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


# ---- the report ----------------------------------------------------------------------------


def spread(values: list[float], fmt: str = "{:,.0f}") -> str:
    """median, and min–max when there are several values."""
    med = fmt.format(statistics.median(values))
    if len(values) < 2:
        return med
    return f"{med} ({fmt.format(min(values))}–{fmt.format(max(values))})"


def table(result: dict) -> list[str]:
    lines = ["| streams | output tok/s | TTFT p50 ms | TTFT p99 ms | ITL p99 ms | router µs/tok | "
             "engine µs/tok | client µs/tok | router-core tok/s | engine-process tok/s | failed |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for n in sorted({r["streams"] for r in result["runs"]}):
        runs = [r for r in result["runs"] if r["streams"] == n]
        cpu = {k: [r["cpu_us_per_token"][k] for r in runs] for k in ("router", "engine", "client")}
        cols = [
            spread([r["tokens_per_s"] for r in runs]),
            spread([r["ttft_p50_ms"] for r in runs]), spread([r["ttft_p99_ms"] for r in runs]),
            spread([r["itl_p99_ms"] for r in runs], "{:,.1f}"),
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
    lines = [
        "# Host path: router + engine at GPU rates, measured on a CPU",
        "",
        "`make bench-host` (bench/host.py). One router and one engine worker on loopback; the "
        "engine serves the null model (`--load-format null`: real server, scheduler, KV "
        "allocator and sampler; no weights, a near-free forward). Every request is sent at "
        f"once: {PROMPT_LEN}-token prompts, {OUTPUT_LEN} output tokens, greedy, ignore_eos, "
        "a byte-level BPE tokenizer (2,048 ids). CPU µs/token: utime + stime of each process "
        "from /proc/<pid>/stat over the run, divided by the output tokens streamed (the "
        "client is this benchmark's own process). Values: median (min–max) over the repeats. "
        "router-core / engine-process tok/s: 1e6 / µs per token, what one core of each could "
        "sustain at that cost.",
        "",
        f"Projection basis (an assumption, not a measurement): an 8B model decodes about "
        f"{ASSUMED_GPU_TOKENS_S:,} tok/s on one H200 at batch 256. A serving path keeps up "
        f"when router-core and engine-process tok/s both exceed it; #11's targets: router "
        f"≤ 15 µs/token (66,667 tok/s per core), engine host ≤ 10 µs/token (100,000 tok/s).",
        "",
        f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        "shared with other work (noisy).",
        "",
    ]
    if baseline is not None:
        lines += [f"## Before: {baseline['label']}", "", *table(baseline), ""]
    lines += [f"## {'After' if baseline is not None else 'Now'}: {result['label']}", "",
              *table(result), ""]
    out.write_text("\n".join(lines))


def git_label() -> str:
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--", "router/text"],
                           capture_output=True, text=True).stdout.strip()
    return f"commit {rev.stdout.strip() or '?'}" + (" + uncommitted router/text" if dirty else "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=None, help="write the markdown report here")
    ap.add_argument("--save-json", type=Path, default=None, help="keep this run's numbers here")
    ap.add_argument("--baseline", type=Path, default=None, help="an earlier --save-json to compare")
    ap.add_argument("--label", default=None, help="what was measured (default: the git commit)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--streams", default=",".join(map(str, STREAMS)))
    ap.add_argument("--engine-seats", type=int, default=1024, help="engine --max-num-seqs")
    args = ap.parse_args()
    streams = tuple(int(x) for x in args.streams.split(","))
    result = measure(args.repeats, streams, args.engine_seats) | {"label": args.label or git_label()}
    print(json.dumps(result, indent=1))
    if args.save_json:
        args.save_json.write_text(json.dumps(result, indent=1))
    if args.out:
        baseline = json.loads(args.baseline.read_text()) if args.baseline else None
        write_markdown(args.out, result, baseline)


if __name__ == "__main__":
    main()
