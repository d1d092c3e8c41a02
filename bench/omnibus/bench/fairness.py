"""Scheduling for SLOs, measured on this machine (`make bench-fairness`): tenant fair
share (noisy neighbour, FIFO vs VTC), deadline-aware steps (EDF vs FIFO at 90% load)
and prefix-aware routing (cache-aware vs load-only, 2 and 4 engines).

Every run starts real engine and router processes on loopback serving bench/omnibus/bench/offline.py's
checkpoint (random weights) and drives them with the load generator (bench/omnibus/bench/serve.py).
The numbers go to a JSON file beside the report; the report is written from them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

from omnibus.bench.processes import ServerProcess, engine_process, router_process, torch_threads
from omnibus.bench.serve import RunConfig, RunOutput, run_tenants, run_workload
from omnibus.bench.stats import RequestResult, percentile
from omnibus.bench.strategies import prepare_model
from omnibus.bench.workloads import BenchRequest

KEYS = {"tenants": {"a": {"keys": ["sk-a"]}, "b": {"keys": ["sk-b"]}}}
SEATS = 8  # engine --max-num-seqs in the noisy-neighbour and deadline runs
STEP_TOKENS = 256  # --max-num-batched-tokens: short steps, so a short prefill waits little
NOISY_STEP_TOKENS = (256, 64)  # the noisy-neighbour runs, at each of these step budgets
ENGINE_THREADS: int | None = None  # --engine-threads: torch threads per engine process
CLIENT_TIMEOUT_S = 600.0  # the runs "with client timeouts": every request's gRPC deadline


def _prompt(rng: random.Random, n: int, vocab: int) -> tuple[int, ...]:
    return tuple(rng.randrange(3, vocab) for _ in range(n))


@contextmanager
def cluster(model: Path, logs: Path, name: str, engines: int, engine_flags: list[str],
            router_flags: list[str]) -> Iterator[str]:
    """`engines` engine workers (ENGINE_THREADS torch threads each; unset: the cores split
    between them) and one router; yields the router's address."""
    env = {"OMP_NUM_THREADS": str(ENGINE_THREADS or max(1, (os.cpu_count() or 1) // engines))}
    procs: list[ServerProcess] = []
    try:
        for i in range(engines):
            procs.append(engine_process(model, logs, f"{name}-e{i}", *engine_flags, env=env))
        for p in procs:
            p.wait_serving()
        router = router_process(model, [p.address for p in procs], logs, f"{name}-router",
                                "--keys-file", str(logs / "keys.json"), *router_flags)
        procs.append(router)
        router.wait_serving()
        time.sleep(1.0)  # the router's first load reports
        yield router.address
    finally:
        for p in procs:
            p.stop()


def _ttfts(results: list[RequestResult]) -> list[float]:
    return [r.ttft for r in results if r.ok and r.ttft is not None]


def _ms(values: list[float], q: float) -> float:
    return round(percentile(values, q) * 1e3, 1)


def _tok_s(out: RunOutput, seconds: float) -> float:
    return round(sum(r.output_tokens for r in out.results) / seconds, 1)


# ---- noisy neighbour -----------------------------------------------------------------


def noisy_neighbour(model: Path, logs: Path, vocab: int, seconds: float) -> dict:
    """Tenant A keeps 30 long requests in flight (10x its fair share of 8 seats split
    two ways, and more than the engine holds); tenant B sends short ones, Poisson. At
    each step budget of NOISY_STEP_TOKENS: on a CPU a step's time grows with its
    tokens, and B's first token waits for the step in flight."""
    rng = random.Random(1)
    a_reqs = [BenchRequest(_prompt(rng, 256, vocab), 32) for _ in range(4000)]
    b_reqs = [BenchRequest(_prompt(rng, 16, vocab), 8) for _ in range(int(2 * seconds))]
    a_cfg = RunConfig("", concurrency=30, max_duration_s=seconds, api_key="sk-a", progress=False)
    b_cfg = RunConfig("", rate=2.0, max_duration_s=seconds, api_key="sk-b", seed=2, progress=False)
    router = ["--max-inflight-per-engine", str(2 * SEATS)]  # the engine sees B's requests
    out: dict = {}
    for budget in NOISY_STEP_TOKENS:
        engine = ["--max-num-seqs", str(SEATS), "--max-num-batched-tokens", str(budget)]
        for label, policy, order, who, timeout in (
            ("B alone", "vtc", "slo", "b", None), ("A alone", "vtc", "slo", "a", None),
            ("A + B, FIFO", "fifo", "fifo", "ab", None), ("A + B, VTC", "vtc", "slo", "ab", None),
            # every client sets a gRPC deadline, as gRPC advises: a timeout, not an SLO
            ("A + B, VTC, 600 s client timeouts", "vtc", "slo", "ab", CLIENT_TIMEOUT_S),
        ):
            flags = ["--waiting-order", order]
            with cluster(model, logs, f"noisy-{budget}-{policy}-{who}", 1, engine + flags,
                         router + ["--queue-policy", policy]) as target:
                mixes = {}
                if "a" in who:
                    mixes["a"] = (a_reqs, replace(a_cfg, target=target, timeout_s=timeout))
                if "b" in who:
                    mixes["b"] = (b_reqs, replace(b_cfg, target=target, timeout_s=timeout))
                runs = asyncio.run(run_tenants(mixes))
            row: dict = {}
            if "b" in runs:
                t = _ttfts(runs["b"].results)
                q = [r.queue_s for r in runs["b"].results if r.ok and r.queue_s is not None]
                row.update(b_done=len(t), b_ttft_p50_ms=_ms(t, 50), b_ttft_p99_ms=_ms(t, 99),
                           b_router_queue_p99_ms=_ms(q, 99))
            if "a" in runs:
                row.update(a_done=sum(r.ok for r in runs["a"].results), a_tok_s=_tok_s(runs["a"], seconds))
            out[f"{budget} tok/step: {label}"] = row
    return out


def noisy_in_process(model: Path, vocab: int, seconds: float) -> dict:
    """The same mix against the engine alone (no router, no client, no gRPC), in steps:
    how many engine steps B's request waits for its first token, and how long those
    steps take on this CPU. Tenant A keeps 16 requests (8 running, 8 waiting, as the
    router's cap of 16 leaves them); B arrives Poisson 2/s between steps."""
    rng = random.Random(4)
    with torch_threads(ENGINE_THREADS or os.cpu_count() or 1):  # as the engine processes
        return {f"{budget} tok/step": _noisy_steps(model, budget, vocab, seconds, rng)
                for budget in NOISY_STEP_TOKENS}


def _noisy_steps(model: Path, budget: int, vocab: int, seconds: float, rng: random.Random) -> dict:
    from omnibus.engine.config import EngineConfig
    from omnibus.engine.engine import Engine
    from omnibus.engine.worker.sampling import SamplingParams

    engine = Engine(EngineConfig(model=str(model), max_num_seqs=SEATS, max_num_batched_tokens=budget))
    engine.warmup()
    ids = iter(range(10**9))

    def add(tenant: str, prompt: int, output: int) -> str:
        rid = f"{tenant}{next(ids)}"
        params = SamplingParams(max_tokens=output, ignore_eos=True, temperature=0.0)
        engine.add_request(rid, list(_prompt(rng, prompt, vocab)), params, tenant=tenant)
        return rid

    for _ in range(2 * SEATS):
        add("a", 256, 32)
    waiting: dict[str, tuple[float, int]] = {}  # B's request -> (arrival, steps before)
    ttfts: list[float] = []
    waits: list[int] = []
    steps: list[float] = []
    now = time.monotonic()
    end, next_b = now + seconds, now  # B's first request comes at once, then Poisson (2/s)
    while time.monotonic() < end or waiting:  # past the end: only until B's last first token
        if next_b <= time.monotonic() < end:
            waiting[add("b", 16, 8)] = (time.monotonic(), len(steps))
            next_b = time.monotonic() + rng.expovariate(2.0)
        t = time.perf_counter()
        outputs = engine.step()
        steps.append(time.perf_counter() - t)
        for o in outputs:
            if o.request_id in waiting and o.new_token_ids:
                arrived, before = waiting.pop(o.request_id)
                ttfts.append(time.monotonic() - arrived)
                waits.append(len(steps) - before)
            if o.finished and o.request_id.startswith("a"):
                add("a", 256, 32)
    return dict(
        b_done=len(ttfts), b_steps_p50=percentile(waits, 50), b_steps_max=max(waits),
        b_ttft_p50_ms=_ms(ttfts, 50), b_ttft_p99_ms=_ms(ttfts, 99),
        step_p50_ms=_ms(steps, 50), step_max_ms=_ms(steps, 100),
        preemptions=engine.scheduler.num_preemptions)


# ---- deadlines -------------------------------------------------------------------------


def deadlines(model: Path, logs: Path, vocab: int, seconds: float) -> dict:
    """Poisson arrivals at 90% of the measured capacity; half the requests carry a tight
    deadline, half a loose one; the engine holds the queue (the router overfills it)."""
    rng = random.Random(3)

    def reqs(n: int, tight: float | None = None, loose: float | None = None) -> list[BenchRequest]:
        """Alternate requests carry the tight and the loose deadline (none: neither)."""
        out = []
        for i in range(n):
            deadline = None if tight is None else (tight if i % 2 == 0 else loose)
            out.append(BenchRequest(_prompt(rng, 64, vocab), rng.randint(8, 24), deadline_s=deadline))
        return out

    engine = ["--max-num-seqs", str(SEATS), "--max-num-batched-tokens", str(STEP_TOKENS)]
    router = ["--max-inflight-per-engine", "256", "--queue-policy", "fifo"]
    with cluster(model, logs, "deadline-calibrate", 1, engine, router) as target:
        cal = asyncio.run(run_workload(reqs(2000), RunConfig(
            target, concurrency=SEATS, max_duration_s=seconds / 2, api_key="sk-a", progress=False)))
    done = [r for r in cal.results if r.ok]
    capacity = len(done) / (seconds / 2)
    latency = percentile([r.e2e for r in done], 50)
    rate = 0.9 * capacity
    tight, loose = 2.0 * latency, 10.0 * latency
    workload = reqs(int(rate * seconds), tight, loose)
    out: dict = {"capacity_req_s": round(capacity, 2), "rate_req_s": round(rate, 2),
                 "full_load_latency_p50_ms": round(latency * 1e3), "tight_ms": round(tight * 1e3),
                 "loose_ms": round(loose * 1e3), "requests": len(workload)}
    timeouts = [replace(r, deadline_s=CLIENT_TIMEOUT_S) if r.deadline_s == loose else r for r in workload]
    for i, (label, order, sent) in enumerate((("FIFO", "fifo", workload), ("EDF", "slo", workload),
                                              ("EDF, loose = 600 s client timeouts", "slo", timeouts))):
        with cluster(model, logs, f"deadline-{i}-{order}", 1, engine + ["--waiting-order", order],
                     router) as target:
            run = asyncio.run(run_workload(sent, RunConfig(
                target, rate=rate, seed=4, max_duration_s=seconds + 2 * loose, api_key="sk-a",
                progress=False)))
        row = {}
        for cls, bound in (("tight", tight), ("loose", loose)):
            # the loose half sent as client timeouts is judged by the loose bound all the same
            sent_as = CLIENT_TIMEOUT_S if sent is timeouts and cls == "loose" else bound
            mine = [r for r in run.results if r.deadline_s == sent_as]
            missed = sum(not (r.ok and r.e2e is not None and r.e2e <= bound) for r in mine)
            row[f"{cls}_missed"] = f"{missed}/{len(mine)}"
            row[f"{cls}_miss_rate"] = round(missed / len(mine), 3) if mine else None
        out[label] = row
    return out


# ---- prefix-aware routing ------------------------------------------------------------------


def prefix_routing(model: Path, logs: Path, vocab: int, seconds: float) -> dict:
    """8 system prompts of 192 tokens, each request one of them plus a 16-token question;
    every engine's KV pool holds about 4 of the prompts (64 blocks of 16 tokens)."""
    rng = random.Random(5)
    systems = [_prompt(rng, 192, vocab) for _ in range(8)]
    rate = 4.0
    workload = [BenchRequest(rng.choice(systems) + _prompt(rng, 16, vocab), 4)
                for _ in range(int(rate * seconds))]
    engine = ["--max-num-seqs", "4", "--num-kv-blocks", "65", "--max-num-batched-tokens", "512"]
    out: dict = {"requests": len(workload), "rate_req_s": rate}
    for n in (2, 4):
        for label, weight in (("load-only", "0"), ("cache-aware", "1")):
            with cluster(model, logs, f"prefix-{n}-{weight}", n, engine,
                         ["--prefix-weight", weight]) as target:
                run = asyncio.run(run_workload(workload, RunConfig(
                    target, rate=rate, seed=6, max_duration_s=seconds + 30, api_key="sk-a",
                    progress=False)))
            ok = [r for r in run.results if r.ok]
            t = _ttfts(ok)
            out[f"{n} engines, {label}"] = {
                "done": len(ok),
                "hit_rate": round(sum(r.cached_tokens for r in ok) / max(1, sum(r.prompt_tokens for r in ok)), 3),
                "ttft_p50_ms": _ms(t, 50), "ttft_p99_ms": _ms(t, 99),
            }
    return out


# ---- the report -----------------------------------------------------------------------------


def _table(rows: dict, columns: list[str]) -> str:
    lines = ["| run | " + " | ".join(columns) + " |", "|---|" + "---:|" * len(columns)]
    for name, row in rows.items():
        if isinstance(row, dict):
            lines.append(f"| {name} | " + " | ".join(str(row.get(c, "")) for c in columns) + " |")
    return "\n".join(lines)


MARKER = "<!-- hand-written analysis below: bench-fairness keeps it -->"


def write_report(r: dict, path: Path) -> None:
    n, d, p = r["noisy"], r["deadlines"], r["prefix"]
    old = path.read_text() if path.exists() else ""
    kept = old[old.index(MARKER):] if MARKER in old else MARKER + "\n"
    path.write_text(f"""# Scheduling for SLOs: fair share, deadlines, prefix-aware routing

Written by `make bench-fairness` (bench/omnibus/bench/fairness.py) from {path.with_suffix('.json').name}.
Machine: {r['env']['cores']} CPU cores (shared), Python {r['env']['python']}, no GPU.
Model: bench/omnibus/bench/offline.py's checkpoint (Llama-shaped, 6 layers, hidden 512, ~20M
parameters, random weights, float32), on the CPU. Engines and router are real
processes on loopback; each run lasts about {r['seconds']:.0f} s of load.

## Noisy neighbour: FIFO vs VTC

One engine, {SEATS} seats, {' or '.join(map(str, NOISY_STEP_TOKENS))} tokens per step; router
`--max-inflight-per-engine {2 * SEATS}` (it overfills the engine, whose waiting queue and
preemption follow the same order). Tenant A keeps 30 requests of 256 prompt + 32 output tokens in flight;
tenant B sends 16 + 8 token requests, Poisson 2/s. FIFO: `--queue-policy fifo` and
engine `--waiting-order fifo`; VTC: `--queue-policy vtc`, `--waiting-order slo`.
b_router_queue_p99_ms: B's time in the router's queue (the response's timing). The rows
"600 s client timeouts" send every request of both tenants with a 600 s gRPC deadline, as
well-behaved gRPC clients do; the others send none.

{_table(n, ['b_done', 'b_ttft_p50_ms', 'b_ttft_p99_ms', 'b_router_queue_p99_ms', 'a_done', 'a_tok_s'])}

The same mix against the engine alone, in process (no router, client or gRPC on the
cores; `--waiting-order slo`): A keeps {2 * SEATS} requests, B's first request comes at the
start and the rest Poisson 2/s between steps; the run goes on past its end until B's last
request has its first token. b_steps: engine steps from B's arrival to its first token (1: the next step).

{_table(r['noisy_steps'], ['b_done', 'b_steps_p50', 'b_steps_max', 'b_ttft_p50_ms', 'b_ttft_p99_ms', 'step_p50_ms', 'step_max_ms', 'preemptions'])}

## Deadlines at 90% load: EDF vs FIFO

One engine as above, router `--max-inflight-per-engine 256` (the queue is in the
engine). Capacity measured at {SEATS} in flight: {d['capacity_req_s']} req/s, median latency
{d['full_load_latency_p50_ms']} ms; Poisson {d['rate_req_s']} req/s, {d['requests']} requests of 64 prompt +
8-24 output tokens; alternate requests carry a tight ({d['tight_ms']} ms) or loose
({d['loose_ms']} ms) gRPC deadline. A miss: not completed within its deadline. The
"600 s client timeouts" row sends the loose half with a 600 s deadline instead (a client
timeout; judged by the loose bound all the same).

{_table({k: v for k, v in d.items() if isinstance(v, dict)}, ['tight_missed', 'tight_miss_rate', 'loose_missed', 'loose_miss_rate'])}

## Prefix-aware routing: cache-aware vs load-only

8 shared system prompts of 192 tokens, each request one of them + 16 unique tokens, 4
output tokens, Poisson {p['rate_req_s']} req/s, {p['requests']} requests. Each engine: 4 seats,
64 KV blocks of 16 tokens (about 4 system prompts), 512 tokens per step. Cache-aware:
`--prefix-weight 1`; load-only: `--prefix-weight 0`. Hit rate: prompt tokens served
from the prefix cache (usage.cached_prompt_tokens) over all prompt tokens.

{_table({k: v for k, v in p.items() if isinstance(v, dict)}, ['done', 'hit_rate', 'ttft_p50_ms', 'ttft_p99_ms'])}

""" + kept)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks/fairness.md"))
    parser.add_argument("--model-dir", type=Path, default=None)
    parser.add_argument("--seconds", type=float, default=30.0, help="load per run")
    parser.add_argument("--only", choices=["noisy", "deadlines", "prefix"], default=None)
    parser.add_argument("--engine-threads", type=int, default=None,
                        help="torch threads per engine process (default: the cores split between the engines)")
    args = parser.parse_args(argv)
    global ENGINE_THREADS
    ENGINE_THREADS = args.engine_threads
    from omnibus.bench.offline import BENCH_MODEL

    vocab = BENCH_MODEL["vocab_size"]
    with tempfile.TemporaryDirectory() as tmp:
        model = prepare_model(args.model_dir or Path(tmp) / "bench-20m")
        logs = Path(tmp)
        (logs / "keys.json").write_text(json.dumps(KEYS))
        data_path = args.out.with_suffix(".json")
        r = json.loads(data_path.read_text()) if args.only and data_path.exists() else {}
        r.update(env={"cores": os.cpu_count(), "python": platform.python_version()}, seconds=args.seconds)
        for name, study in (("noisy", noisy_neighbour), ("deadlines", deadlines), ("prefix", prefix_routing)):
            if args.only in (None, name):
                r[name] = study(model, logs, vocab, args.seconds)
                if name == "noisy":
                    r["noisy_steps"] = noisy_in_process(model, vocab, args.seconds)
                data_path.write_text(json.dumps(r, indent=1))
    write_report(r, args.out)


if __name__ == "__main__":
    main()
