"""docs/benchmarks/gpu.md from the files scripts/gpu_check.sh returned, never by hand:

    python -m omnibus.bench.gpu_report --in RUN_DIR [--in RERUN_DIR] --out docs/benchmarks/gpu.md
    make gpu-report IN="RUN_DIR [RERUN_DIR]"
    python -m omnibus.bench.gpu_report --in RUN_DIR --summary      # the short table, to stdout

A later --in (a rerun of some parts on the same machine) adds to and overrides an earlier
one; runs on different devices never mix. Every number is printed with the device it was
measured on. A CPU smoke run (`scripts/gpu_check.sh --smoke`) is refused unless
--allow-smoke is given, and then the report says on every line that it is a smoke run.
Only the standard library: it runs where the results land, without torch.
"""

from __future__ import annotations

import argparse
import json
import sys
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

from omnibus.bench.gpu_check import OUTCOMES, count, outcome

SMOKE_LABEL = "CPU SMOKE RUN, not GPU numbers"
NO_GPU_LABEL = "NO CUDA DEVICE, not GPU numbers"


class RefusedError(Exception):
    """The files cannot make the report asked for."""


@dataclass
class Run:
    dirs: list[Path]
    versions: dict
    parts: list[dict] = field(default_factory=list)
    tests: ET.Element | None = None
    bench: dict = field(default_factory=dict)

    @property
    def smoke_reasons(self) -> list[str]:
        v, b = self.versions, self.bench
        reasons = []
        if v.get("smoke"):
            reasons.append("versions.json: smoke run")
        if not v.get("cuda"):
            reasons.append(f"versions.json: no CUDA device (device {v.get('device')!r})")
        if b and b.get("smoke"):
            reasons.append("bench.json: smoke run")
        if b and (b.get("device") == "cpu" or b.get("cuda") is False):
            reasons.append("bench.json: measured on the CPU")
        if b and b.get("shape") not in (None, "llama-3-8b"):
            reasons.append(f"bench.json: {b.get('shape')} shape, not Llama-3-8B")
        return reasons

    @property
    def smoke(self) -> bool:
        return bool(self.smoke_reasons)

    @property
    def label(self) -> str | None:
        """Why these are not GPU numbers, or None for a GPU run."""
        if not self.smoke:
            return None
        return SMOKE_LABEL if self.versions.get("smoke") or self.bench.get("smoke") else NO_GPU_LABEL

    @property
    def device(self) -> str:
        """The label every number carries."""
        name = self.versions.get("device") or "unknown device"
        return f"{name} ({self.label})" if self.label else name


def load(dirs: list[Path]) -> Run:
    run: Run | None = None
    for i, d in enumerate(dirs, 1):
        vpath = d / "versions.json"
        if not vpath.is_file():
            raise RefusedError(f"{d}: no versions.json, so not the output of scripts/gpu_check.sh "
                               "(or its versions part failed): the device is unknown")
        versions = json.loads(vpath.read_text())
        if run is None:
            run = Run(dirs=list(dirs), versions=versions)
        else:
            for key in ("device", "smoke", "cuda"):
                if versions.get(key) != run.versions.get(key):
                    raise RefusedError(f"{d}: {key} {versions.get(key)!r} differs from the first run's "
                                       f"{run.versions.get(key)!r}; runs on different machines never mix")
            run.versions.update({k: v for k, v in versions.items() if v is not None})
        ppath = d / "parts.jsonl"
        if ppath.is_file():
            for line in ppath.read_text().splitlines():
                if line.strip():
                    try:
                        run.parts.append(dict(json.loads(line), run=i))
                    except json.JSONDecodeError:
                        run.parts.append({"run": i, "part": "?", "status": "unreadable", "note": line[:80]})
        tpath = d / "tests.xml"
        if tpath.is_file():
            try:
                run.tests = ET.parse(tpath).getroot()
            except ET.ParseError as exc:
                raise RefusedError(f"{tpath}: not junit xml ({exc})") from exc
        bpath = d / "bench.json"
        if bpath.is_file():
            bench = json.loads(bpath.read_text())
            if bench.get("device") != versions.get("device"):
                raise RefusedError(f"{bpath}: measured on {bench.get('device')!r} but versions.json names "
                                   f"{versions.get('device')!r}; a number must carry its own device")
            if bench.get("smoke") is not None and bench.get("smoke") != versions.get("smoke"):
                raise RefusedError(f"{bpath}: smoke {bench.get('smoke')} but versions.json smoke "
                                   f"{versions.get('smoke')}; smoke and GPU results never mix")
            seconds = {**run.bench.get("section_seconds", {}), **bench.get("section_seconds", {})}
            run.bench.update(bench)
            if seconds:
                run.bench["section_seconds"] = seconds
    assert run is not None
    return run


def pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def num(x: float | None, fmt: str = ".2f") -> str:
    return "n/a" if x is None else format(x, fmt)


def ratio(a: float | None, b: float | None) -> str:
    return "n/a" if not a or not b else f"{a / b:.2f}×"


def quant_tables(b: dict, dev: str | None = None) -> str:
    """The quant section's W4A16 and FP8 tables (``omnibus.bench.matmul``'s rows), each row
    naming ``dev`` when given; also `make bench-gpu`'s markdown (omnibus.bench.gpu)."""
    dense = b.get("quant_dtype", "bfloat16")
    col, sep, cell = (" device |", "---|", f" {dev} |") if dev else ("", "", "")
    w4a16, fp8 = b.get("w4a16", []), b.get("fp8", [])
    intro = (f"W4A16: int4 codes with a float32 scale and zero per group of "
             f"{w4a16[0]['group'] if w4a16 else '?'} input columns (kernels' Triton int4 matmul); "
             "FP8: e4m3 with row-wise scales (`torch._scaled_mm`, bfloat16 out), the GEMM alone, the "
             f"per-token quantization of x timed apart; both against `F.linear` on the {dense} weight "
             "of the same shape. Weight GB/s = weight bytes (codes + scales + zeros, or the dense "
             "matrix) ÷ time, as a share of the measured copy bandwidth; each weight cycles through "
             "copies larger than the L2 cache, and on a GPU the calls are timed as one CUDA-graph "
             "replay.\n")
    out = [intro] + [f"The {key} measurement failed: {b[f'{key}_error']}\n"
                     for key in ("w4a16", "fp8") if b.get(f"{key}_error")]
    if w4a16:
        head = (f"| out x in | T |{col} W4A16 (us) | {dense} (us) | {dense} ÷ W4A16 | W4A16 weight GB/s | "
                f"share of bandwidth | {dense} weight GB/s | share of bandwidth |\n"
                f"|---|---:|{sep}---:|---:|---:|---:|---:|---:|---:|\n")
        out.append(head + "\n".join(
            f"| {w['out']}x{w['in']} | {w['tokens']} |{cell} {num(w['w4a16_us'], '.1f')} | "
            f"{num(w['dense_us'], '.1f')} | {num(w['w4a16_speedup'])}× | {num(w['w4a16_weight_gb_s'], '.0f')} | "
            f"{pct(w['w4a16_of_bandwidth'])} | {num(w['dense_weight_gb_s'], '.0f')} | "
            f"{pct(w['dense_of_bandwidth'])} |" for w in w4a16) + "\n")
    if fp8:
        head = (f"| out x in | T |{col} FP8 GEMM (us) | quantize x (us) | {dense} (us) | {dense} ÷ FP8 | "
                f"FP8 TFLOP/s | {dense} TFLOP/s |\n|---|---:|{sep}---:|---:|---:|---:|---:|---:|\n")
        out.append(head + "\n".join(
            f"| {f['out']}x{f['in']} | {f['tokens']} |{cell} {num(f['fp8_us'], '.1f')} | "
            f"{num(f['fp8_quant_us'], '.1f')} | {num(f['dense_us'], '.1f')} | {num(f['fp8_speedup'])}× | "
            f"{num(f['fp8_tflops'], '.1f')} | {num(f['dense_tflops'], '.1f')} |" for f in fp8) + "\n")
    return "\n".join(out)


def quant_headline(b: dict, dev: str) -> list[str]:
    """W4A16 at T=1 and FP8 at the largest T, both on the first (smallest) shape."""
    lines, dense = [], b.get("quant_dtype", "bfloat16")
    decode = [w for w in b.get("w4a16", []) if w["tokens"] == 1]
    if decode:
        w = decode[0]
        lines.append(f"W4A16 decode on {dev} ({w['out']}x{w['in']}, T=1): {num(w['w4a16_us'], '.1f')} us, "
                     f"{num(w['w4a16_speedup'])}× {dense} dense; weight bytes at "
                     f"{num(w['w4a16_weight_gb_s'], '.0f')} GB/s = {pct(w['w4a16_of_bandwidth'])} of the measured "
                     f"copy bandwidth ({dense}: {pct(w['dense_of_bandwidth'])}).")
    fp8 = [f for f in b.get("fp8", []) if (f["out"], f["in"]) == (b["fp8"][0]["out"], b["fp8"][0]["in"])]
    if fp8:
        f = fp8[-1]
        lines.append(f"FP8 GEMM on {dev} ({f['out']}x{f['in']}, T={f['tokens']}): {num(f['fp8_speedup'])}× "
                     f"{dense} ({num(f['fp8_tflops'], '.0f')} vs {num(f['dense_tflops'], '.0f')} TFLOP/s).")
    return lines


def tests_by_file(root: ET.Element) -> list[tuple[str, dict, list[tuple[str, str, str, float]]]]:
    """[(file, counts, [(test, outcome, message, seconds)])] in file order."""
    files: dict[str, list] = {}
    for suite in root.iter("testsuite"):
        name = suite.get("file") or suite.get("name") or "?"
        rows = files.setdefault(name, [])
        for case in suite.iter("testcase"):
            result, message = outcome(case)
            rows.append((case.get("name", "?"), result, message, float(case.get("time") or 0)))
    out = []
    for name, rows in files.items():
        counts = dict.fromkeys(OUTCOMES, 0)
        for _, result, _, _ in rows:
            counts[result] += 1
        out.append((name, counts, rows))
    return out


def no_results(run: Run, name: str) -> str:
    seen = [p for p in run.parts if p.get("part") == name]
    if not seen:
        return f"No results: the {name} part was not run.\n"
    last = seen[-1]
    how = {"timeout": "was cut by its time cap", "skipped": "was skipped", "ok": "ended without them"}.get(
        last.get("status"), f"ended {last.get('status')}")
    return (f"No results: the {name} part {how} after {last.get('seconds')} s of its {last.get('cap')} s cap "
            f"(run {last['run']}; {last.get('note') or 'see log.txt'}).\n")


def counts_text(c: dict) -> str:
    return ", ".join(f"{c[k]} {'errors' if k == 'error' else k}" for k in OUTCOMES)


def headline(run: Run) -> list[str]:
    dev, b, lines = run.device, run.bench, []
    decode = {d["batch"]: d for d in b.get("decode", [])}
    if 1 in decode:
        d = decode[1]
        lines.append(f"Batch-1 decode on {dev}: {num(d.get('overlap_ms'))} ms per step, "
                     f"{pct(d.get('of_roofline'))} of the measured copy bandwidth "
                     f"({num(b.get('roofline_copy_bandwidth_gb_s'), '.0f')} GB/s; floor "
                     f"{num(d.get('roofline_ms'))} ms = weight + KV bytes ÷ bandwidth).")
    lines += quant_headline(b, dev)
    if "offline_omnibus_tok_s" in b:
        ours = b["offline_omnibus_tok_s"]
        lines.append(f"Offline on {dev}: Omnibus {num(ours, '.0f')} output tokens/s = "
                     f"{ratio(ours, b.get('hf_continuous_tok_s'))} transformers continuous batching, "
                     f"{ratio(ours, b.get('hf_static_tok_s'))} transformers static `generate`.")
    idle = [(k, d) for k, d in decode.items() if d.get("overlap_idle") is not None]
    if idle:
        lines.append(f"GPU idle share per decode step on {dev}, overlapped vs lockstep: " + "; ".join(
            f"batch {k}: {pct(d['overlap_idle'])} vs {pct(d.get('lockstep_idle'))}" for k, d in idle) + ".")
    if b.get("offline_gpu_idle_share") is not None:
        lines.append(f"GPU idle share over the offline run on {dev}: {pct(b['offline_gpu_idle_share'])}.")
    if "lora" in b:
        lo = b["lora"]
        lines.append(f"LoRA on {dev}: 8 adapters at {num(lo.get('8_vs_base'))}× and 32 at "
                     f"{num(lo.get('32_vs_base'))}× the base model's throughput.")
    if run.tests is not None:
        c = count(run.tests)
        lines.append(f"GPU tests on {dev}: {counts_text(c)}.")
    return lines


def render(run: Run, command: str = "make gpu-report") -> str:
    v, b, dev = run.versions, run.bench, run.device
    out = []
    if run.smoke:
        out.append(f"# {run.label}: scripts/gpu_check.sh\n")
        out.append("> **This is not a GPU run** (a CPU smoke run at tiny shapes, or a machine without a "
                   "CUDA device). It shows that every part of the GPU check runs; none of its numbers "
                   "measures a GPU, and none may be quoted as one. Why: "
                   + "; ".join(run.smoke_reasons) + ".\n")
    else:
        out.append(f"# GPU check on {dev}\n")
    runs = f"{len(run.dirs)} runs" if len(run.dirs) > 1 else "one run"
    out.append(f"Written by `{command}` from the files `scripts/gpu_check.sh` returned ({runs}, the first "
               f"on {v.get('date_utc', '?')} UTC, commit {v.get('commit') or 'not recorded'}); regenerate it "
               "rather than editing it. Every number below was measured on the device named beside it.\n")
    lines = headline(run)
    if lines:
        out.append("## Headline\n\n" + "\n".join(f"- {x}" for x in lines) + "\n")

    rows = [("device", v.get("device")), ("memory", f"{v['memory_gib']} GiB" if v.get("memory_gib") else None),
            ("compute capability", v.get("capability")), ("driver", v.get("driver")),
            ("CUDA (torch build)", v.get("cuda_runtime")), ("nvcc", v.get("nvcc")), ("torch", v.get("torch")),
            ("triton", v.get("triton")), ("transformers", v.get("transformers")), ("python", v.get("python")),
            ("host", v.get("machine"))]
    out.append("## Machine\n\n| | |\n|---|---|\n" + "\n".join(f"| {k} | {val or 'n/a'} |" for k, val in rows)
               + "\n" + "".join(f"\nNote: {n}." for n in v.get("notes", [])) + "\n")

    if run.parts:
        prow = "\n".join(f"| {p['run']} | {p.get('part')} | {p.get('status')} | {p.get('seconds')} | "
                         f"{p.get('cap')} | {p.get('note') or ''} |" for p in run.parts)
        out.append(f"## Parts of the run (budget {v.get('budget_s')} s)\n\n"
                   "| run | part | status | seconds | cap (s) | note |\n|---:|---|---|---:|---:|---|\n" + prow + "\n")

    out.append(f"## GPU tests on {dev}\n")
    if run.tests is None:
        out.append(no_results(run, "tests"))
    else:
        files = tests_by_file(run.tests)
        out.append("Kernels at serving shapes in bf16 and fp16 against float32 references; the engine on "
                   "CUDA graphs + Triton, overlapped and lockstep, against eager and transformers, token "
                   "for token (`tests/gpu`).\n\n"
                   "| file | device | " + " | ".join(OUTCOMES) + " |\n|---|---|" + "---:|" * len(OUTCOMES) + "\n"
                   + "\n".join(f"| {name} | {dev} | " + " | ".join(str(c[k]) for k in OUTCOMES) + " |"
                               for name, c, _ in files) + "\n")
        cases = "\n".join(f"| {name.split('/')[-1]}::{t} | {dev} | {res} | {secs:.1f} | "
                          f"{msg.splitlines()[0][:160].replace('|', '/') if msg else ''} |"
                          for name, _, rows in files for t, res, msg, secs in rows)
        out.append("| test | device | outcome | seconds | message |\n|---|---|---|---:|---|\n" + cases + "\n")

    out.append(f"## Decode step vs roofline on {dev}\n")
    if "decode" not in b:
        out.append(no_results(run, "roofline"))
    else:
        out.append(f"{b.get('shape')} shape, {b.get('dtype')}, random weights, prompts of "
                   f"{b.get('decode_prompt_len', '?')} tokens; measured device-to-device copy bandwidth "
                   f"on {dev}: {num(b.get('roofline_copy_bandwidth_gb_s'), '.0f')} GB/s (read + write). "
                   "Roofline = (weight bytes + KV bytes read) ÷ that bandwidth; share of bandwidth = "
                   "roofline ÷ measured step. Ten back-to-back steps per row; overlapped plans step "
                   "N+1 before step N's tokens are read back, lockstep waits; GPU idle = share of the "
                   "steps' wall time with nothing queued on the GPU.\n")
        drow = "\n".join(
            f"| {d['batch']} | {dev} | {num(d.get('overlap_ms'))} | {num(d.get('lockstep_ms'))} | "
            f"{num(d.get('roofline_ms'))} | {pct(d.get('of_roofline'))} | "
            f"{pct(d['roofline_ms'] / d['lockstep_ms'] if d.get('lockstep_ms') else None)} | "
            f"{pct(d.get('overlap_idle'))} | {pct(d.get('lockstep_idle'))} |" for d in b["decode"])
        out.append("| batch | device | overlapped step (ms) | lockstep step (ms) | roofline (ms) | "
                   "share of bandwidth, overlapped | share of bandwidth, lockstep | GPU idle, overlapped | "
                   "GPU idle, lockstep |\n|---:|---|---:|---:|---:|---:|---:|---:|---:|\n" + drow + "\n")

    out.append(f"## Weight-format matmuls on {dev}\n")
    if not any(k in b for k in ("w4a16", "fp8", "w4a16_error", "fp8_error")):
        out.append(no_results(run, "quant"))
    else:
        out.append(quant_tables(b, dev))

    out.append(f"## Offline throughput vs transformers on {dev}\n")
    if "offline_omnibus_tok_s" not in b and "hf_continuous_tok_s" not in b:
        out.append(no_results(run, "offline"))
    else:
        n = b.get("offline_requests", b.get("requests"))
        ours = b.get("offline_omnibus_tok_s")
        orow = []
        for label, key in (("Omnibus", "offline_omnibus_tok_s"),
                           ("transformers continuous batching", "hf_continuous_tok_s"),
                           (f"transformers static `generate` (batches of 16; the first "
                            f"{b.get('hf_static_requests', n)} requests)", "hf_static_tok_s")):
            value = b.get(key)
            orow.append(f"| {label} | {dev} | {num(value, '.0f') if key in b else 'not reached'} | "
                        f"{ratio(ours, value) if key != 'offline_omnibus_tok_s' else '1.00×'} |")
        lengths = ("prompts ~20 tokens, outputs ~18 (the smoke run's ×0.1 scale)" if b.get("smoke")
                   else "prompts ~200 tokens, outputs ~180")
        out.append(f"{n} ShareGPT-shaped requests ({lengths}, log-normal, "
                   "ignore_eos), the same lengths for all three, in one process; transformers with its "
                   "own random weights of the same shape.\n\n| system | device | output tokens/s | "
                   "Omnibus ÷ system |\n|---|---|---:|---:|\n" + "\n".join(orow) + "\n")
        if b.get("offline_gpu_idle_share") is not None:
            out.append(f"GPU idle share over the Omnibus offline run on {dev}: {pct(b['offline_gpu_idle_share'])}.\n")
        if "hf_static_tok_s" not in b:
            out.append("transformers static `generate` was not reached. " + no_results(run, "offline"))

    out.append(f"## Multi-LoRA on {dev}\n")
    if "lora" not in b:
        out.append(no_results(run, "lora"))
    else:
        lo = b["lora"]
        out.append(f"{b.get('lora_requests', '?')} requests per run, random rank-{b.get('lora_rank', '?')} "
                   "adapters on q/k/v/o, "
                   "requests spread round-robin over the adapters.\n\n"
                   f"| adapters | device | output tokens/s | vs base |\n|---:|---|---:|---:|\n"
                   f"| base | {dev} | {num(lo.get('base_tok_s'), '.0f')} | 1.00 |\n"
                   f"| 8 | {dev} | {num(lo.get('8_adapters_tok_s'), '.0f')} | {num(lo.get('8_vs_base'))} |\n"
                   f"| 32 | {dev} | {num(lo.get('32_adapters_tok_s'), '.0f')} | {num(lo.get('32_vs_base'))} |\n")
    return "\n".join(out)


def summary(run: Run) -> str:
    """The few lines the device tool's output tail should carry."""
    lines = [f"== {run.device}"]
    for p in run.parts:
        lines.append(f"  {p.get('part'):<9} {p.get('status'):<8} {p.get('seconds')}s / {p.get('cap')}s"
                     + (f"  {p['note']}" if p.get("note") else ""))
    lines += [f"  {x}" for x in headline(run)]
    if run.tests is not None:
        for name, _, rows in tests_by_file(run.tests):
            for t, res, msg, _ in rows:
                if res in ("failed", "error"):
                    lines.append(f"  {res.upper()} {name}::{t}: {(msg.splitlines() or [''])[0][:200]}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--in", dest="dirs", type=Path, action="append", required=True,
                    help="a folder of files scripts/gpu_check.sh wrote; repeat for a rerun (later overrides)")
    ap.add_argument("--out", type=Path, default=None, help="markdown to write (docs/benchmarks/gpu.md)")
    ap.add_argument("--summary", action="store_true", help="print the short summary to stdout")
    ap.add_argument("--allow-smoke", action="store_true",
                    help="write a report from a CPU smoke run too (labelled as one on every number)")
    args = ap.parse_args(argv)
    if not args.out and not args.summary:
        ap.error("give --out FILE, --summary, or both")
    try:
        run = load(args.dirs)
        if args.out and run.smoke and not args.allow_smoke:
            raise RefusedError(f"refusing to write {args.out}: {', '.join(map(str, args.dirs))} holds a CPU smoke "
                               f"or CPU-only run ({'; '.join(run.smoke_reasons)}), not GPU numbers. Pass "
                               "--allow-smoke to write a report labelled as such on every number.")
    except RefusedError as exc:
        print(f"gpu_report: {exc}", file=sys.stderr)
        return 2
    if args.summary:
        print(summary(run))
    if args.out:
        command = "make gpu-report" + (" GPU_REPORT_FLAGS=--allow-smoke" if args.allow_smoke else "")
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(render(run, command))
        print(f"wrote {args.out}" + (f" ({run.label})" if run.label else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
