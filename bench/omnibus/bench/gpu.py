"""GPU roofline benchmark: `make bench-gpu` (python -m omnibus.bench.gpu --out build/bench-gpu/gpu.md).

On a lent GPU, scripts/gpu_check.sh runs its sections within the loan's time and
`make gpu-report` (omnibus.bench.gpu_report) writes docs/benchmarks/gpu.md from the results.

A Llama-3-8B-shaped bf16 model with random weights made on the device (no download).
It reports, in sections that can run as separate commands (`--sections roofline,decode`,
then `--sections offline`, ...; each fits a 10-minute limit, results accumulate in the
JSON file beside --out and the markdown is rewritten after every section):

1. decode step time at batch 1, 8, 32, 128, 256 against the roofline: (weight bytes +
   KV bytes read) ÷ the device-to-device copy bandwidth (section roofline);
2. offline output tokens/s on a ShareGPT-shaped workload (prompts ~200 tokens,
   outputs ~180, both log-normal, ignore_eos; section offline) against transformers'
   static `generate` and continuous batching (section hf, its own random weights:
   the lengths are fixed, so only the speed is compared);
3. the share of each step in which the GPU waits on Python;
4. throughput with 8 and 32 LoRA adapters (rank 16, q/k/v/o) against base only;
5. weight-format matmuls at Llama-3-8B's projection shapes (section quant,
   omnibus.bench.matmul): W4A16 decode against bf16 dense with the weight bytes' rate
   beside the copy bandwidth, and FP8 (`torch._scaled_mm`, row-wise scales) against bf16.

`--smoke` runs the same code at a tiny shape (on the CPU when there is no GPU), which
is how the test suite keeps this script runnable.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from omnibus.bench.shapes import LLAMA3_8B, TINY, write_config  # noqa: F401 (the bench's shapes)

from omnibus.bench.peers import hf_continuous_tok_s, hf_static_tok_s
from omnibus.bench.workloads import LogNormal, ShareGptSpec

def copy_bandwidth(device: torch.device, nbytes: int, copies: int = 50) -> float:
    """Bytes/s of back-to-back device-to-device copies, counting bytes read plus bytes written.
    On CUDA the copies are timed by events around all of them: one 1 GiB copy takes ~0.5 ms
    on an H200, too short for a host timer around a synchronize."""
    src = torch.randn(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(device)
        start.record()
        for _ in range(copies):
            dst.copy_(src)
        end.record()
        end.synchronize()
        seconds = start.elapsed_time(end) / 1e3
    else:
        t0 = time.perf_counter()
        for _ in range(copies):
            dst.copy_(src)
        seconds = time.perf_counter() - t0
    return 2 * src.numel() * 4 * copies / seconds


def copy_bandwidth_gb_s(device: torch.device) -> float:
    """The roofline's bandwidth: copies of 1 GiB on a GPU, 16 MiB on the CPU (smoke runs)."""
    return copy_bandwidth(device, (1 << 30) if device.type == "cuda" else (16 << 20)) / 1e9


def make_engine(path: Path, device: str, dtype: str, **kw):
    from omnibus.engine.config import EngineConfig
    from omnibus.engine.engine import Engine

    return Engine(EngineConfig(model=str(path), device=device, dtype=dtype, load_format="dummy",
                               max_num_seqs=256, max_num_batched_tokens=8192, **kw))


def weight_bytes(engine) -> int:
    """Bytes a decode step must read: every matmul weight (the embedding table is gathered)."""
    model = engine.runner.model
    return sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "embed_tokens" not in n)


def decode_roofline(engine, batch_sizes: list[int], prompt_len: int, bw: float,
                    on_row: Callable[[list[dict]], None] | None = None) -> list[dict]:
    """Decode step time per batch size, with and without overlapped scheduling, against
    the bandwidth floor, plus the share of each step the GPU waited on Python. `on_row`
    gets the rows so far after each batch size (a time limit then keeps what ran)."""
    from omnibus.engine.worker.sampling import SamplingParams

    mc = engine.model_config
    kv_per_token = 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim * engine.runner.kv_caches[0][0].element_size()
    meter = engine.runner.idle_meter
    rng = random.Random(0)
    rows = []
    for bs in batch_sizes:
        params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
        ids = [f"d{bs}-{i}" for i in range(bs)]
        for rid in ids:
            engine.add_request(rid, [rng.randrange(3, mc.vocab_size) for _ in range(prompt_len)], params)
        while any(s.num_computed_tokens < s.num_tokens - 1 for s in engine.scheduler.running) or \
                engine.scheduler.num_waiting:
            engine.step()
        row = {"batch": bs}
        default = engine.overlap
        for overlap in (True, False):
            engine.overlap = overlap
            for _ in range(3):
                engine.step()
            ctx = sum(s.num_tokens for s in engine.scheduler.running)
            steps = 10
            _sync(engine.runner.device)
            if meter is not None:
                meter.reset()
            t0 = time.perf_counter()
            for _ in range(steps):  # back to back: an overlapped step is only hidden behind the next
                engine.step()
            _sync(engine.runner.device)
            key = "overlap" if overlap else "lockstep"
            row[f"{key}_ms"] = 1e3 * (time.perf_counter() - t0) / steps
            row[f"{key}_idle"] = meter.idle_share if meter is not None else None
        engine.overlap = default
        for rid in ids:
            engine.abort(rid)
        while engine.has_unfinished():
            engine.step()
        floor = (weight_bytes(engine) + (ctx + 5 * bs) * kv_per_token) / bw
        row["roofline_ms"] = 1e3 * floor
        row["of_roofline"] = row["roofline_ms"] / row["overlap_ms"]
        rows.append(row)
        if on_row:
            on_row(rows)
    return rows


def workload(n: int, vocab: int, scale: float, seed: int = 0):
    spec = ShareGptSpec(LogNormal(200, 0.5, 16, 1024), LogNormal(180, 0.5, 16, 512)).scaled(scale)
    rng = random.Random(seed)
    lengths = spec.lengths(n, rng)
    prompts = [[rng.randrange(3, vocab) for _ in range(p)] for p, _ in lengths]
    return prompts, [o for _, o in lengths]


def omnibus_tok_s(engine, prompts, lengths, adapters: list[str] | None = None) -> float:
    from omnibus.engine.worker.sampling import SamplingParams

    for i, (p, m) in enumerate(zip(prompts, lengths)):
        engine.add_request(f"w{time.monotonic_ns()}-{i}", p,
                           SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True),
                           adapter=adapters[i % len(adapters)] if adapters else None)
    produced = 0
    _sync(engine.runner.device)
    t0 = time.perf_counter()
    while engine.has_unfinished():
        for out in engine.step():
            if out.error:
                raise RuntimeError(out.error)
            produced += len(out.new_token_ids)
    return produced / (time.perf_counter() - t0)


def make_adapters(root: Path, shape: dict, count: int, rank: int = 16) -> list[str]:
    """Random PEFT-format LoRA adapters (q/k/v/o) written as safetensors."""
    from safetensors.torch import save_file

    h, heads, kv = shape["hidden_size"], shape["num_attention_heads"], shape["num_key_value_heads"]
    hd = h // heads
    outs = {"q_proj": heads * hd, "k_proj": kv * hd, "v_proj": kv * hd, "o_proj": h}
    names = []
    for a in range(count):
        d = root / f"lora{a}"
        d.mkdir(parents=True, exist_ok=True)
        g = torch.Generator().manual_seed(a)
        tensors = {}
        for layer in range(shape["num_hidden_layers"]):
            for proj, out in outs.items():
                in_f = heads * hd if proj == "o_proj" else h
                pre = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
                tensors[f"{pre}.lora_A.weight"] = (torch.randn(rank, in_f, generator=g) * 0.01).bfloat16()
                tensors[f"{pre}.lora_B.weight"] = (torch.randn(out, rank, generator=g) * 0.01).bfloat16()
        save_file(tensors, d / "adapter_model.safetensors")
        (d / "adapter_config.json").write_text(json.dumps(
            {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(outs)}))
        names.append(d.name)
    return names


SECTIONS = ("roofline", "quant", "decode", "offline", "hf", "lora")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=None, help="markdown file for the results")
    ap.add_argument("--json", type=Path, default=None,
                    help="results file, read first and rewritten after each section (default: --out as .json)")
    ap.add_argument("--sections", default=",".join(SECTIONS),
                    help=f"comma-separated subset of {','.join(SECTIONS)}; run them in separate commands "
                         "to keep each under a time limit (results accumulate in --json)")
    ap.add_argument("--smoke", action="store_true", help="tiny shape, CPU allowed (keeps the script tested)")
    ap.add_argument("--requests", type=int, default=None, help="offline workload size (default 256; smoke 8)")
    ap.add_argument("--skip-hf", action="store_true", help="skip the transformers peers (the hf section)")
    ap.add_argument("--hf-static-requests", type=int, default=None,
                    help="time transformers' static `generate` on the first K requests only (batches of 16 "
                         "run one after another, so its tokens/s does not depend on how many; default all)")
    ap.add_argument("--batches", default=None,
                    help="decode batch sizes, comma-separated (default 1,8,32,64,128,256; smoke 1,2,4)")
    ap.add_argument("--kv-cache-gib", type=float, default=None,
                    help="KV pool per engine in GiB (default: 80%% of the GPU's memory in all; smoke 64 MiB); "
                         "a fixed pool leaves room for the transformers peers in the same process")
    args = ap.parse_args(argv)
    sections = [x for x in args.sections.split(",") if x]
    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown:
        ap.error(f"unknown sections {unknown}; choose from {', '.join(SECTIONS)}")
    if args.skip_hf:
        sections = [x for x in sections if x != "hf"]

    cuda = torch.cuda.is_available()
    if not cuda and not args.smoke:
        raise SystemExit("no CUDA device: run with --smoke to exercise the script on the CPU")
    device = torch.device("cuda" if cuda else "cpu")
    shape = TINY if args.smoke else LLAMA3_8B
    dtype = "bfloat16" if cuda else "float32"
    n = args.requests or (8 if args.smoke else 256)
    json_path = args.json or (args.out.with_suffix(".json") if args.out else None)
    result: dict = json.loads(json_path.read_text()) if json_path and json_path.exists() else {}
    device_name = torch.cuda.get_device_name() if cuda else "cpu"
    if result and result.get("smoke", args.smoke) != args.smoke:
        raise SystemExit(f"{json_path} holds a {'smoke' if result.get('smoke') else 'full'} run: "
                         "smoke and full results never mix")
    if result.get("device", device_name) != device_name:
        raise SystemExit(f"{json_path} holds results from {result['device']}, not {device_name}: they never mix")
    result.update({"device": device_name, "torch": torch.__version__,
                   "shape": "tiny" if args.smoke else "llama-3-8b", "dtype": dtype, "requests": n,
                   "smoke": args.smoke, "cuda": cuda})
    seconds = result.setdefault("section_seconds", {})
    this_run: dict[str, float] = {}
    tmp = tempfile.TemporaryDirectory()
    path = write_config(Path(tmp.name) / "model", shape)
    if args.kv_cache_gib is not None:
        util = {"kv_cache_memory": int(args.kv_cache_gib * (1 << 30))}
    else:
        util = {"gpu_memory_utilization": 0.8} if cuda else {"kv_cache_memory": 64 << 20}
    prompts, lengths = workload(n, shape["vocab_size"], 0.1 if args.smoke else 1.0)
    engine = None
    started = time.perf_counter()

    def done(section: str) -> None:
        """Partial results on disk after every section (atomically: a run cut by a time
        limit leaves the previous complete file, never half of one)."""
        nonlocal started
        now = time.perf_counter()
        this_run[section] = this_run.get(section, 0.0) + now - started  # a rerun replaces, never adds
        seconds[section] = this_run[section]
        started = now
        print(f"section {section} done", flush=True)
        if json_path:
            json_path.parent.mkdir(parents=True, exist_ok=True)
            tmp_json = json_path.with_name(json_path.name + ".tmp")
            tmp_json.write_text(json.dumps(result, indent=2))
            os.replace(tmp_json, json_path)
        if args.out:
            write_markdown(args.out, result)

    if "roofline" in sections:
        result["roofline_copy_bandwidth_gb_s"] = copy_bandwidth_gb_s(device)
        done("roofline")
    if "quant" in sections:
        quant_section(result, device, args.smoke, done)
    if "decode" in sections:
        if "roofline_copy_bandwidth_gb_s" not in result:
            raise SystemExit("the decode section needs the roofline section's bandwidth (run it first)")
        engine = make_engine(path, device.type, dtype, **util)
        if args.batches:
            batches = [int(b) for b in args.batches.split(",") if b]
        else:
            batches = [1, 2, 4] if args.smoke else [1, 8, 32, 64, 128, 256]
        result["decode_prompt_len"] = 64 if args.smoke else 512

        def decode_row(rows: list[dict]) -> None:
            result["decode"] = rows
            done("decode")
        decode_roofline(engine, batches, result["decode_prompt_len"], result["roofline_copy_bandwidth_gb_s"] * 1e9,
                        on_row=decode_row)
    if "offline" in sections:
        engine = engine or make_engine(path, device.type, dtype, **util)
        meter = engine.runner.idle_meter
        if meter is not None:
            meter.reset()
        result["offline_requests"] = n
        result["offline_omnibus_tok_s"] = omnibus_tok_s(engine, prompts, lengths)
        result["offline_gpu_idle_share"] = meter.idle_share if meter is not None else None
        done("offline")
    del engine
    gc.collect()  # the engine's cycles too, before transformers needs the memory
    if cuda:
        torch.cuda.empty_cache()
    if "hf" in sections:
        import transformers

        cfg = transformers.LlamaConfig(**shape, tie_word_embeddings=False)
        with torch.device(device):
            hf = transformers.LlamaForCausalLM._from_config(cfg, dtype=getattr(torch, dtype)).eval()
        if args.smoke:
            _small_continuous_batching(hf)
        # Continuous batching first: the stronger peer, and the quicker one, is the one a
        # time limit should not cut.
        result["hf_requests"] = n
        result["hf_continuous_tok_s"] = hf_continuous_tok_s(hf, prompts, lengths)
        done("hf")
        k = min(args.hf_static_requests or n, n)
        result["hf_static_requests"] = k
        result["hf_static_tok_s"] = hf_static_tok_s(hf, prompts[:k], lengths[:k])
        done("hf")
        del hf
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    if "lora" in sections:
        result["lora_rank"] = 8 if args.smoke else 16
        adapters = make_adapters(Path(tmp.name) / "adapters", shape, 32, rank=result["lora_rank"])
        lora_engine = make_engine(path, device.type, dtype, adapter_dir=str(Path(tmp.name) / "adapters"),
                                  max_loras=32, max_cpu_loras=32, max_lora_rank=16, **util)
        result["lora_requests"] = n
        lora = result["lora"] = {"base_tok_s": omnibus_tok_s(lora_engine, prompts, lengths)}
        done("lora")
        for k in (8, 32):
            lora[f"{k}_adapters_tok_s"] = omnibus_tok_s(lora_engine, prompts, lengths, adapters[:k])
            lora[f"{k}_vs_base"] = lora[f"{k}_adapters_tok_s"] / lora["base_tok_s"]
            done("lora")
    return result


def quant_section(result: dict, device: torch.device, smoke: bool, done: Callable[[str], None]) -> None:
    """W4A16 decode and FP8 GEMM rows beside bf16 dense (on the CPU: float32 activations,
    the Triton kernel interpreted); the bandwidth is the roofline section's when it ran."""
    from omnibus.bench.matmul import LLAMA3_8B_SHAPES, TINY_SHAPES, fp8_rows, w4a16_rows

    cuda = device.type == "cuda"
    if "roofline_copy_bandwidth_gb_s" not in result:
        result["roofline_copy_bandwidth_gb_s"] = copy_bandwidth_gb_s(device)
    shapes, iters = (TINY_SHAPES, 2) if smoke else (LLAMA3_8B_SHAPES, 50)
    dtype = torch.bfloat16 if cuda else torch.float32
    bandwidth = result["roofline_copy_bandwidth_gb_s"] * 1e9
    result["quant_dtype"] = str(dtype).removeprefix("torch.")
    tables: dict[str, Callable[[], list[dict]]] = {
        "w4a16": lambda: w4a16_rows(shapes, [1, 16, 64], device, dtype, bandwidth, iters),
        "fp8": lambda: fp8_rows(shapes, [16, 64] if smoke else [16, 256, 2048], device, dtype, iters),
    }
    errors = []
    for key, measure in tables.items():
        result.pop(key, None)  # a rerun replaces, rows or error
        result.pop(f"{key}_error", None)
        try:
            result[key] = measure()
        except Exception as exc:  # noqa: BLE001 - one GPU loan: the other table is still measured, the part still fails
            result[f"{key}_error"] = f"{type(exc).__name__}: {exc}"[:300]
            errors.append(f"{key}: {result[f'{key}_error']}")
        done("quant")
        if cuda:
            torch.cuda.empty_cache()
    if errors:
        raise SystemExit("quant section failed: " + "; ".join(errors))


def write_markdown(out: Path, r: dict) -> None:
    """The sections present in `r` (a partial run writes what it has)."""
    def pct(x: float | None) -> str:
        return "n/a" if x is None else f"{100 * x:.1f}%"
    parts = [f"""# GPU benchmark ({r['device']})

`make bench-gpu` (sections: `python -m omnibus.bench.gpu --sections ...`); {r['shape']} shape, {r['dtype']},
random weights; torch {r['torch']}.
"""]
    if "roofline_copy_bandwidth_gb_s" in r:
        parts.append(f"Measured device-to-device copy bandwidth: {r['roofline_copy_bandwidth_gb_s']:.0f} GB/s "
                     "(read + write, 50 back-to-back copies of 1 GiB timed by CUDA events).\n")
    if "decode" in r:
        rows = "\n".join(f"| {d['batch']} | {d['overlap_ms']:.2f} | {d['roofline_ms']:.2f} | {pct(d['of_roofline'])} | "
                         f"{pct(d['overlap_idle'])} | {d['lockstep_ms']:.2f} | {pct(d['lockstep_idle'])} |"
                         for d in r["decode"])
        parts.append(f"""## Decode step vs roofline (prompts of 512 tokens)

Ten back-to-back decode steps per row. "Overlapped" plans and launches step N+1 before
step N's tokens are read back (the default on CUDA); "lockstep" waits for each step's
tokens before planning the next. GPU idle = share of the steps' wall time in which the
GPU had nothing queued (CUDA events around each step's launches).

| batch | overlapped step (ms) | roofline (ms) | share of roofline | GPU idle | lockstep step (ms) | GPU idle, lockstep |
|---:|---:|---:|---:|---:|---:|---:|
{rows}
""")
    if "w4a16" in r or "fp8" in r:
        from omnibus.bench.gpu_report import quant_tables

        parts.append("## Weight-format matmuls\n\n" + quant_tables(r))
    if "offline_omnibus_tok_s" in r or "hf_static_tok_s" in r:
        rows = []
        ours = r.get("offline_omnibus_tok_s")
        for label, key in (("Omnibus", "offline_omnibus_tok_s"),
                           ("transformers static `generate` (batches of 16)", "hf_static_tok_s"),
                           ("transformers continuous batching", "hf_continuous_tok_s")):
            if key in r:
                ratio = f"{ours / r[key]:.1f}×" if ours else "n/a"
                rows.append(f"| {label} | {r[key]:.0f} | {ratio} |")
        idle = (f"\nGPU idle share over the whole offline run (waiting on Python): "
                f"{pct(r['offline_gpu_idle_share'])}.\n" if "offline_gpu_idle_share" in r else "")
        parts.append(f"""## Offline throughput ({r.get('offline_requests', r['requests'])} ShareGPT-shaped requests)

| system | output tokens/s | Omnibus ÷ system |
|---|---:|---:|
""" + "\n".join(rows) + "\n" + idle)
    if "lora" in r:
        lora = r["lora"]
        rows = "\n".join(f"| {k} | {lora[f'{k}_adapters_tok_s']:.0f} | {lora[f'{k}_vs_base']:.2f} |"
                         for k in (8, 32) if f"{k}_adapters_tok_s" in lora)  # a cut run has fewer
        parts.append(f"""## Multi-LoRA

| adapters | output tokens/s | vs base |
|---:|---:|---:|
| base | {lora['base_tok_s']:.0f} | 1.00 |
{rows}
""")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(parts))


def _small_continuous_batching(model) -> None:
    """Smoke runs only: transformers sizes its continuous-batching buffers from the memory
    it finds (on the CPU, ~10 s of zeroing for a tiny model); a few blocks do here."""
    import functools

    try:
        from transformers import ContinuousBatchingConfig
    except ImportError:  # older transformers: its own sizing
        return
    model.init_continuous_batching = functools.partial(
        model.init_continuous_batching,
        continuous_batching_config=ContinuousBatchingConfig(num_blocks=64, max_batch_tokens=256))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


if __name__ == "__main__":
    main()
