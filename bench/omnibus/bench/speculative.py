"""Speculative decoding on this machine (`make bench-spec`): output tokens/s and time
per output token at batch 1, 4 and 64, with and without the n-gram proposer, every row in
one run of one process, on

- (a) **repetitive**: prompts that repeat a span, greedy; the random-weight model's greedy
  output falls into loops that repeat its own spans, which prompt lookup catches;
- (b) **plain**: random 128-token prompts sampled at temperature 1 (guesses rarely right:
  what speculation costs when it does not pay);
- (c) **echo ceiling**: a model whose greedy output repeats its last token, so every
  guess is right: the most speculation can give on this machine at this k.

    python -m omnibus.bench.speculative [--out docs/benchmarks/speculative.md]

Model: bench/omnibus/bench/offline.py's checkpoint (Llama-shaped, 6 layers, hidden 512, ~20M
parameters, random weights, float32). The report is written from the JSON beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time
from pathlib import Path

from omnibus.bench.report import machine

BATCHES = (1, 4, 64)
K = 4  # --num-speculative-tokens


def _engine(model: Path, batch: int, speculative: str | None):
    from omnibus.engine.config import EngineConfig
    from omnibus.engine.engine import Engine

    engine = Engine(EngineConfig(model=str(model), dtype="float32", max_num_seqs=batch,
                                 max_num_batched_tokens=2048, speculative=speculative,
                                 num_speculative_tokens=K, seed=0))
    engine.warmup()
    return engine


def _workload(kind: str, batch: int, vocab: int, seed: int):
    from omnibus.engine.worker.sampling import SamplingParams

    rng = random.Random(seed)
    n = max(2 * batch, 4) if batch < 64 else batch
    out = 96 if batch < 64 else 48
    if kind == "plain":
        prompts = [[rng.randrange(3, vocab) for _ in range(128)] for _ in range(n)]
        return prompts, SamplingParams(max_tokens=out, temperature=1.0, ignore_eos=True)
    spans = [[rng.randrange(3, vocab) for _ in range(32)] for _ in range(n)]
    return [s * 4 for s in spans], SamplingParams(max_tokens=out, temperature=0.0, ignore_eos=True)


def measure(model: Path, kind: str, batch: int, speculative: str | None, vocab: int) -> dict:
    """One row: every request of the workload through a fresh engine, all at once."""
    engine = _engine(model, batch, speculative)
    prompts, params = _workload(kind, batch, vocab, seed=batch)
    cpu0, t0 = time.process_time(), time.perf_counter()
    outputs = engine.generate(prompts, params)
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    tokens = sum(len(o) for o in outputs)
    spec = engine.stats().speculative
    row = {"tok_s": round(tokens / wall, 1), "tpot_ms": round(1e3 * wall * batch / tokens, 2),
           "steps": engine.num_steps, "tokens": tokens, "cpu_us_per_token": round(1e6 * cpu / tokens, 1),
           "outputs_digest": hash(tuple(map(tuple, outputs))) & 0xFFFFFFFF}
    if spec is not None:
        row.update(acceptance=round(spec.acceptance_rate, 3), mean_accepted_length=round(spec.mean_accepted_length, 2),
                   speculating_steps=spec.steps)
    return row


def run(model: Path, echo: Path, vocab: int, rounds: int) -> dict:
    """Each row pair `rounds` times, alternating which side goes first; each side's best
    round is reported (a shared VM's noise only ever slows a run down)."""
    results: dict = {"k": K, "machine": machine(), "rounds": rounds, "rows": {}}
    for kind, path in (("repetitive", model), ("plain", model), ("echo ceiling", echo)):
        for batch in BATCHES:
            if kind == "echo ceiling" and batch != 1:
                continue
            runs: dict[str, list[dict]] = {"off": [], "ngram": []}
            for i in range(rounds):
                for spec in ((None, "ngram") if i % 2 == 0 else ("ngram", None)):
                    runs[spec or "off"].append(
                        measure(path, "repetitive" if kind != "plain" else "plain", batch, spec, vocab))
            off, on = (max(runs[side], key=lambda row: row["tok_s"]) for side in ("off", "ngram"))
            for side, row in (("off", off), ("ngram", on)):
                row["tok_s_rounds"] = [r["tok_s"] for r in runs[side]]
            greedy = kind != "plain"
            results["rows"][f"{kind}, batch {batch}"] = {
                "off": off, "ngram": on, "speedup": round(on["tok_s"] / off["tok_s"], 2),
                # greedy rows: the same tokens with and without speculation
                "same_output": (on["outputs_digest"] == off["outputs_digest"]) if greedy else None,
            }
            print(kind, batch, results["rows"][f"{kind}, batch {batch}"]["speedup"], flush=True)
    return results


def write_report(r: dict, path: Path) -> None:
    lines = [
        "# Speculative decoding (n-gram) on the CPU",
        "",
        f"Written by `make bench-spec` (bench/omnibus/bench/speculative.py) from {path.with_suffix('.json').name}. "
        f"Machine: {r['machine']}. **CPU only: no GPU was lent; none of these numbers is a GPU number.**",
        "",
        f"Every row pair ran in one process, on fresh engines, {r.get('rounds', 1)} rounds alternating which "
        "side goes first; each side's best round is shown (its rounds in the last column) "
        f"(k = {r['k']} guesses "
        "per sequence per step, `--speculative-max-batch` 8: at batch 64 speculation turns itself off). "
        "Model: bench/omnibus/bench/offline.py's ~20M-parameter Llama shape, random weights, float32. tok/s: output "
        "tokens over wall time; TPOT: time per output token of one sequence (wall x batch / tokens); "
        "acceptance: kept / proposed guesses; mean accepted length: tokens emitted per speculating "
        "sequence-step; CPU us/token: this process's CPU time per output token.",
        "",
        "| workload, batch | off tok/s | ngram tok/s | speedup | off TPOT ms | ngram TPOT ms | acceptance | "
        "mean accepted length | off CPU us/tok | ngram CPU us/tok | same greedy output | rounds tok/s (off; ngram) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for name, row in r["rows"].items():
        off, on = row["off"], row["ngram"]
        same = {True: "yes", False: "NO", None: "(sampled)"}[row["same_output"]]
        lines.append(f"| {name} | {off['tok_s']} | {on['tok_s']} | {row['speedup']}x | {off['tpot_ms']} | "
                     f"{on['tpot_ms']} | {on.get('acceptance', '')} | {on.get('mean_accepted_length', '')} | "
                     f"{off['cpu_us_per_token']} | {on['cpu_us_per_token']} | {same} | "
                     f"{off.get('tok_s_rounds', '')}; {on.get('tok_s_rounds', '')} |")
    lines += [
        "",
        "Workloads: (a) repetitive: prompts of a 32-token span repeated 4 times, greedy; (b) plain: "
        "random 128-token prompts sampled at temperature 1; (c) echo ceiling: the same prompts on a model "
        "whose greedy output repeats its last token (tests/checkpoints.py's echo checkpoint), so every "
        "guess is kept: the most k guesses per step can give here. Batch 1 and 4 send 4 and 8 requests of "
        "96 output tokens (max_num_seqs = batch); batch 64 sends 64 requests of 48.",
        "",
    ]
    path.write_text("\n".join(lines))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks/speculative.md"))
    parser.add_argument("--model-dir", type=Path, default=None)
    parser.add_argument("--report-only", action="store_true", help="rewrite --out from its JSON")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per row pair (best of each side shown)")
    args = parser.parse_args(argv)
    data = args.out.with_suffix(".json")
    if args.report_only:
        write_report(json.loads(data.read_text()), args.out)
        return
    from omnibus.bench.offline import BENCH_MODEL, build_model

    with tempfile.TemporaryDirectory() as tmp:
        model = build_model(args.model_dir or Path(tmp) / "bench-20m")
        echo = Path(tmp) / "echo"
        _build_echo(echo, BENCH_MODEL)
        os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))
        results = run(model, echo, BENCH_MODEL["vocab_size"], args.rounds)
    data.write_text(json.dumps(results, indent=1))
    write_report(results, args.out)


def _build_echo(path: Path, shape: dict) -> None:
    """bench/omnibus/bench/offline.py's shape with every layer's output zeroed and tied embeddings:
    greedy repeats the last token (the ceiling row)."""
    import torch
    import transformers

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**shape, "tie_word_embeddings": True})).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    model.save_pretrained(path)


if __name__ == "__main__":
    main()
