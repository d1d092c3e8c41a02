"""Offline throughput on the CPU: Omnibus vs transformers, in one run.

    python -m omnibus.bench.offline [--out docs/benchmarks/offline.md] [--requests 64]

Builds a ~20M-parameter Llama-shaped checkpoint (hidden 512, 6 layers, 8 heads,
4 KV heads, vocab 2048, random weights) and a workload of 128-token prompts with
output lengths drawn from an exponential distribution (mean 64, cap 256,
ignore_eos so lengths are exact). Measures output tokens/s of:

1. this engine (continuous batching, paged KV, chunked prefill), with its CPU default
   `--cpu-matmul onednn` and with torch's default linear (`--cpu-matmul aten`);
2. transformers static `generate`, batches of 16, each run to its longest request
   (1. and 2. take turns `--rounds` times);
3. transformers continuous batching (`init_continuous_batching`, per-request
   max_new_tokens), once;

and reports the ratios, this engine's share of the CPU's measured matmul FLOP/s,
and scheduler + allocator time per step at 256 running sequences (model stubbed).

Served vs in process (`--only served` runs it alone and rewrites only its section of
`--out`): the same requests through an engine process (1.'s engine flags and torch
threads) behind a router process, all sent at once over gRPC, against 1. measured in the
same invocation.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch
from omnibus.bench.processes import engine_and_router, engine_configs, torch_threads
from omnibus.bench.report import machine, replace_section, spread

BENCH_MODEL = dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=6, num_attention_heads=8,
                   num_key_value_heads=4, vocab_size=2048, max_position_embeddings=1024,
                   initializer_range=0.02, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
# The engine's configuration, in process and served alike (as `omnibus.engine serve` flags).
ENGINE_FLAGS = ("--dtype", "float32", "--max-num-seqs", "256", "--max-num-batched-tokens", "2048",
                "--no-prefix-caching")


def build_model(path: Path) -> Path:
    import transformers

    if (path / "config.json").is_file():
        return path
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**BENCH_MODEL)).eval()
    model.save_pretrained(path)
    return path


def workload(n: int, prompt_len: int = 128, mean: float = 64, cap: int = 256, seed: int = 0):
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, BENCH_MODEL["vocab_size"]) for _ in range(prompt_len)] for _ in range(n)]
    lengths = [max(1, min(cap, round(rng.expovariate(1 / mean)))) for _ in range(n)]
    return prompts, lengths


def matmul_gflops(n: int = 2048, reps: int = 10) -> float:
    """Measured float32 matmul rate of this CPU (the FLOP/s ceiling)."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    for _ in range(3):
        a @ b
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t0)
    return 2 * n**3 / statistics.median(times) / 1e9


def matmul_params() -> int:
    """Parameters that take part in a matmul per token (all but the embedding table)."""
    c = BENCH_MODEL
    h, i, layers = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
    kv = h // c["num_attention_heads"] * c["num_key_value_heads"]
    per_layer = h * h * 2 + h * kv * 2 + 3 * h * i
    return layers * per_layer + h * c["vocab_size"]


def run_omnibus(path: Path, prompts, lengths, *flags: str) -> float:
    """Output tok/s of `Engine.generate` on the workload (ENGINE_FLAGS, then `flags`)."""
    from omnibus.engine.engine import Engine
    from omnibus.engine.worker.sampling import SamplingParams

    engine = Engine(engine_configs(path, *ENGINE_FLAGS, *flags)[0])
    engine.warmup()
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in lengths]
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params)
    elapsed = time.perf_counter() - t0
    assert [len(o) for o in outs] == lengths
    return sum(lengths) / elapsed


def run_served(path: Path, prompts, lengths, flags: tuple[str, ...] = ()) -> float:
    """Output tok/s of the same requests through an engine process (ENGINE_FLAGS, then
    `flags`; this process's torch threads) behind a router process,
    every request sent at once over the router's gRPC Generate (greedy, ignore_eos); one
    short request warms the path first."""
    from omnibus.bench.host import build_tokenizer
    from omnibus.bench.serve import RunConfig, run_workload
    from omnibus.bench.workloads import BenchRequest

    if not (path / "tokenizer.json").is_file():  # the router's; a checkpoint of its own otherwise
        build_tokenizer(path, BENCH_MODEL["vocab_size"])
    threads = str(torch.get_num_threads())
    requests = [BenchRequest(tuple(p), m) for p, m in zip(prompts, lengths)]
    with tempfile.TemporaryDirectory() as logs, engine_and_router(
            path, Path(logs), ENGINE_FLAGS + flags,
            env={"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}) as (_, router):
        config = RunConfig(target=router.address, progress=False, timeout_s=600,
                           request_id_prefix="served")
        asyncio.run(run_workload([BenchRequest(requests[0].prompt_ids, 4)],
                                 RunConfig(target=router.address, progress=False)))
        out = asyncio.run(run_workload(requests, config))
    failed = [f"{r.code}: {r.error}" for r in out.results if not r.ok]
    if failed or [r.output_tokens for r in out.results] != list(lengths):
        raise RuntimeError(f"the served run did not produce the workload: {failed[:3]}")
    return sum(lengths) / out.duration


def host_work_per_step(path: Path, batch_sizes=(64, 256), prompt_len: int = 128, steps: int = 20) -> dict:
    """Host time of one decode step outside the model: schedule, input preparation and
    update (ms), at each batch size. On a GPU in lockstep the device idles this long every
    step; overlapped scheduling hides it behind the previous step."""
    from omnibus.engine.config import EngineConfig
    from omnibus.engine.engine import Engine
    from omnibus.engine.worker.sampling import SamplingParams

    engine = Engine(EngineConfig(model=str(path), dtype="float32", max_num_seqs=max(batch_sizes),
                                 max_num_batched_tokens=2048, kv_cache_memory=1 << 30))
    rng = random.Random(1)
    out = {}
    for bs in batch_sizes:
        ids = [f"h{bs}-{i}" for i in range(bs)]
        for rid in ids:
            engine.add_request(rid, [rng.randrange(3, engine.model_config.vocab_size) for _ in range(prompt_len)],
                               SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True))
        while engine.scheduler.num_waiting or any(
                s.num_computed_tokens < s.num_tokens - 1 for s in engine.scheduler.running):
            engine.step()
        times = {"schedule": 0.0, "prepare": 0.0, "update": 0.0, "model": 0.0}
        for _ in range(steps):
            t0 = time.perf_counter()
            plan = engine.scheduler.schedule()
            t1 = time.perf_counter()
            batch = engine.runner.prepare(plan)
            t2 = time.perf_counter()
            sampled = engine.runner.run(plan, batch).result()
            t3 = time.perf_counter()
            engine.scheduler.update(plan, sampled)
            t4 = time.perf_counter()
            for key, dt in (("schedule", t1 - t0), ("prepare", t2 - t1), ("model", t3 - t2), ("update", t4 - t3)):
                times[key] += dt * 1e3 / steps
        out[bs] = times
        for rid in ids:
            engine.abort(rid)
        engine.step()
    return out


def load_hf(path: Path):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def in_process_rounds(path: Path, model, prompts, lengths, rounds: int) -> dict[str, list[float]]:
    """Output tok/s of Omnibus in process (oneDNN matmuls, the CPU default, and aten's) and
    of transformers static `generate` (batches of 16, `model`: the same weights), taking
    turns `rounds` times, each round starting one system later: a VM's speed drifts by tens
    of percent over minutes, so a ratio is only meaningful between runs this close
    together."""
    from omnibus.bench.peers import hf_static_tok_s

    systems = {
        "omnibus": lambda: run_omnibus(path, prompts, lengths),
        "omnibus_aten": lambda: run_omnibus(path, prompts, lengths, "--cpu-matmul", "aten"),
        "hf_static": lambda: hf_static_tok_s(model, prompts, lengths, batch=16),
    }
    out: dict[str, list[float]] = {name: [] for name in systems}
    names = list(systems)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            out[name].append(systems[name]())
    return out


def scheduler_step_time(num_seqs: int = 256, steps: int = 200) -> float:
    """Mean schedule()+update() time per decode step with the model stubbed out (ms)."""
    from omnibus.engine.core.block_allocator import BlockAllocator
    from omnibus.engine.core.policies import ContinuousPolicy
    from omnibus.engine.core.scheduler import Scheduler, SchedulerConfig
    from omnibus.engine.core.sequence import Sequence
    from omnibus.engine.worker.sampling import SamplerOutput, SamplingParams

    alloc = BlockAllocator(num_blocks=num_seqs * 40, block_size=16)
    sched = Scheduler(SchedulerConfig(num_seqs, 8192, 4096), alloc, ContinuousPolicy(), (2,))
    params = SamplingParams(max_tokens=100_000, ignore_eos=True, temperature=0.0)
    rng = random.Random(0)
    for i in range(num_seqs):
        sched.add(Sequence(f"r{i}", [rng.randrange(3, 2000) for _ in range(128)], params))
    for _ in range(8):  # prefill everything
        plan = sched.schedule()
        n = sum(x.samples for x in plan.scheduled)
        sched.update(plan, SamplerOutput([5] * n, [None] * n))
    assert len(sched.running) == num_seqs
    tokens = SamplerOutput([5] * num_seqs, [None] * num_seqs)
    t0 = time.perf_counter()
    for _ in range(steps):
        plan = sched.schedule()
        sched.update(plan, tokens)
    return (time.perf_counter() - t0) / steps * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=None, help="markdown file to write the results to")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--model-dir", type=Path, default=None, help="reuse/keep the benchmark checkpoint here")
    ap.add_argument("--only", choices=["served", "served-threads"], default=None,
                    help="served vs in process alone (--out then rewrites only its section); "
                    "served-threads: the same at 2 and 1 torch threads, interleaved, printed")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (of Omnibus and transformers static generate; "
                    "served-threads: of its configurations)")
    args = ap.parse_args()

    tmp = tempfile.TemporaryDirectory()
    path = build_model(args.model_dir or Path(tmp.name) / "bench-20m")
    prompts, lengths = workload(args.requests)
    if args.only == "served-threads":
        runs = served_by_threads(path, prompts, lengths, args.rounds)
        print(json.dumps(runs, indent=1))
        for name, values in runs.items():
            base = runs["in process, 2 threads" if "2 threads" in name else "in process, 1 thread"]
            ratios = ", ".join(f"{v / b:.2f}" for v, b in zip(values, base))
            print(f"| {name} | {spread(values, '{:.0f}')} | {ratios} |")
        return
    if args.only == "served":
        results = served_vs_in_process(path, prompts, lengths)
        print(json.dumps(results, indent=2))
        if args.out:
            write_served(args.out, results, args.requests)
        return
    peak = matmul_gflops()
    from omnibus.bench.peers import hf_continuous_tok_s

    model = load_hf(path)
    rounds = in_process_rounds(path, model, prompts, lengths, args.rounds)
    hf_continuous = hf_continuous_tok_s(model, prompts, lengths)
    med = {name: statistics.median(v) for name, v in rounds.items()}
    results = {
        "omnibus_tok_s": med["omnibus"],
        "omnibus_aten_tok_s": med["omnibus_aten"],
        "hf_static_tok_s": med["hf_static"],
        "hf_continuous_tok_s": hf_continuous,
        "rounds": rounds,
        "env": env_info(),
    }
    results |= {
        "vs_hf_static": results["omnibus_tok_s"] / results["hf_static_tok_s"],
        "vs_hf_static_rounds": [a / b for a, b in zip(rounds["omnibus"], rounds["hf_static"], strict=True)],
        "vs_hf_continuous": results["omnibus_tok_s"] / results["hf_continuous_tok_s"],
        "matmul_gflops": peak,
        "matmul_params": matmul_params(),
        "output_tokens": sum(lengths),
        "prompt_tokens": sum(map(len, prompts)),
        "scheduler_ms_per_step_256": scheduler_step_time(),
        "host_ms_per_decode_step": host_work_per_step(path),
    }
    results |= {k: v for k, v in served_vs_in_process(path, prompts, lengths).items() if k != "env"}
    # Output tokens only, as the target defines it; prompt tokens add matmul work on top.
    results["share_of_matmul_peak"] = 2 * results["matmul_params"] * results["omnibus_tok_s"] / (peak * 1e9)
    total_tokens = results["output_tokens"] + results["prompt_tokens"]
    results["share_of_matmul_peak_all_tokens"] = (
        results["share_of_matmul_peak"] * total_tokens / results["output_tokens"])
    print(json.dumps(results, indent=2))
    if args.out:
        write_markdown(args.out, results, args.requests)


def served_by_threads(path: Path, prompts, lengths, rounds: int = 3) -> dict[str, list[float]]:
    """Output tok/s in process and served, at 2 and 1 torch threads, the engine's step loop
    in a process of its own and on a thread of its server, `rounds` interleaved rounds: how
    much of the served gap is the serving path and how much is the router, client and gRPC
    threads competing with the engine's compute threads for this machine's cores."""
    def served(step_loop: str):
        return lambda: run_served(path, prompts, lengths, flags=("--step-loop", step_loop))

    def in_process():
        return run_omnibus(path, prompts, lengths)

    configs = {  # name: (torch threads, run)
        "in process, 2 threads": (2, in_process),
        "served, engine 2 threads, step loop in a process (auto)": (2, served("process")),
        "served, engine 2 threads, step loop on a thread": (2, served("thread")),
        "in process, 1 thread": (1, in_process),
        "served, engine 1 thread, step loop in a process (auto)": (1, served("process")),
        "served, engine 1 thread, step loop on a thread": (1, served("thread")),
    }
    out: dict[str, list[float]] = {name: [] for name in configs}
    for _ in range(rounds):
        for name, (threads, run) in configs.items():
            with torch_threads(threads):
                out[name].append(run())
    return out


def env_info() -> dict:
    return {"torch": torch.__version__, "threads": torch.get_num_threads(),
            "cpu": machine(), "cores": os.cpu_count()}


def served_vs_in_process(path: Path, prompts, lengths) -> dict:
    in_process = run_omnibus(path, prompts, lengths)
    served = run_served(path, prompts, lengths)
    return {"in_process_tok_s": in_process, "served_tok_s": served,
            "served_vs_in_process": served / in_process, "output_tokens": sum(lengths),
            "env": env_info()}


KEEP_MARKER = "<!-- written by hand below: kept when bench.offline rewrites this file -->"
SERVED_MARKER = "<!-- bench.offline: served vs in process; `--only served` rewrites this part -->"


def write_served(out: Path, r: dict, n: int) -> None:
    """Rewrites the served section of `out` alone; the rest is kept as it is."""
    old = out.read_text() if out.exists() else ""
    out.write_text(replace_section(old, SERVED_MARKER, served_section(r, n), KEEP_MARKER))


def served_section(r: dict, n: int) -> str:
    threads = r["env"]["threads"]
    return f"""{SERVED_MARKER}

## Served vs in process

The same {n} requests ({r['output_tokens']} output tokens, greedy, ignore_eos, the same
max_tokens) through an engine process (`omnibus.engine serve {' '.join(ENGINE_FLAGS)}`:
the in-process engine's configuration, its step loop in a process of its own as `--step-loop
auto` puts it; OMP_NUM_THREADS={threads}: its torch threads) behind
a router process, every request sent at once to the router's gRPC Generate; the
in-process `Engine.generate` row is measured again in the same invocation. Router, engine
and client (this benchmark) share the machine's {r['env']['cores']} cores; when this was
measured, with other work too (noisy). #11's target: served ≥ 90% of in process.

| path | output tokens/s | ÷ in process |
|---|---:|---:|
| in process (`Engine.generate`) | {r['in_process_tok_s']:.0f} | 1.00 |
| served (client → router → engine process, gRPC) | {r['served_tok_s']:.0f} | \
{r['served_vs_in_process']:.2f} |

"""


def write_markdown(out: Path, r: dict, n: int) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    old = out.read_text() if out.exists() else ""
    kept = old[old.index(KEEP_MARKER):] if KEEP_MARKER in old else KEEP_MARKER + "\n"
    host_rows = "\n".join(
        f"| {bs} | {t['schedule']:.2f} | {t['prepare']:.2f} | {t['update']:.2f} | "
        f"{t['schedule'] + t['prepare'] + t['update']:.2f} | {t['model']:.1f} |"
        for bs, t in r["host_ms_per_decode_step"].items())
    head = f"""# Offline throughput (CPU)

Produced by `make bench-offline` (`python -m omnibus.bench.offline`). Model: Llama-shaped, hidden 512,
6 layers, 8 heads / 4 KV heads, vocab 2048, {r['matmul_params'] / 1e6:.1f}M matmul parameters,
random weights, float32. Workload: {n} requests, 128-token prompts, output lengths
~ Exp(mean 64) capped at 256 ({r['output_tokens']} output tokens in all), ignore_eos, greedy.
Machine: {r['env'].get('cpu') or str(r['env']['cores']) + ' cores'}, torch {r['env']['torch']}, {r['env']['threads']} threads.

Omnibus (both CPU matmuls) and transformers static `generate` took turns {len(r['rounds']['omnibus'])} times in one
process, each round starting with the next system (the VM's speed drifts between minutes);
tok/s: median (min–max) of those rounds; transformers continuous batching ran once after them.

| system | output tokens/s | Omnibus ÷ system |
|---|---:|---:|
| Omnibus (continuous batching, paged KV; `--cpu-matmul onednn`, the CPU default) | {spread(r['rounds']['omnibus'], '{:.0f}')} | 1.00 |
| Omnibus with torch's default linear (`--cpu-matmul aten`) | {spread(r['rounds']['omnibus_aten'], '{:.0f}')} | {r['omnibus_tok_s'] / r['omnibus_aten_tok_s']:.2f} |
| transformers static `generate`, batches of 16 | {spread(r['rounds']['hf_static'], '{:.0f}')} | {r['vs_hf_static']:.2f} (per round: {', '.join(f'{x:.2f}' for x in r['vs_hf_static_rounds'])}) |
| transformers continuous batching | {r['hf_continuous_tok_s']:.0f} | {r['vs_hf_continuous']:.2f} |

- Measured float32 matmul peak (2048² `torch.mm`): {r['matmul_gflops']:.0f} GFLOP/s.
- Omnibus share of that peak, output tokens only (2 × params × tok/s ÷ peak):
  {100 * r['share_of_matmul_peak']:.1f}%; counting prompt tokens too: {100 * r['share_of_matmul_peak_all_tokens']:.1f}%.
- Scheduler + allocator time per decode step at 256 running sequences (model stubbed):
  {r['scheduler_ms_per_step_256']:.3f} ms.

## Host work per decode step (what a GPU in lockstep would wait on)

Decode steps with 128-token prompts, this model, measured around the real step. On a
GPU the model column shrinks to the device's step time; the rest is Python that
overlapped scheduling (`--overlap-scheduling`, the CUDA default) runs while the
previous step is on the device.

| batch | schedule (ms) | prepare inputs (ms) | update (ms) | host total (ms) | model on this CPU (ms) |
|---:|---:|---:|---:|---:|---:|
{host_rows}
"""
    text = head + kept
    if "served_tok_s" in r:
        text = replace_section(text, SERVED_MARKER, served_section(r, n), KEEP_MARKER)
    out.write_text(text)


if __name__ == "__main__":
    main()
