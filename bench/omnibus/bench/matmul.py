"""Weight-format matmuls beside bf16 dense at the same shapes: the ``quant`` section of
omnibus.bench.gpu (the ``quant`` part of scripts/gpu_check.sh).

- W4A16 at decode: the kernels' Triton int4 matmul (group 128) against ``F.linear`` on the
  bf16 weight, and the rate at which each reads its weight bytes (codes + scales + zeros,
  or the bf16 matrix) beside the measured copy bandwidth: decode is bound by those bytes.
- FP8: ``torch._scaled_mm`` with row-wise scales (e4m3 activations with one float32 scale
  per token, times the e4m3 weight transposed with one per output channel, bf16 out)
  against ``F.linear`` in bf16; the activations' per-token quantization is timed apart.

Each weight is held in enough copies that the timed calls cycle through several times the
L2 cache (50 MB on an H200), so the weights come from HBM: a 4096 x 4096 bf16 weight
(32 MiB) would otherwise be read from L2 after the first call. On a GPU the calls are timed
as one CUDA-graph replay (no Python launch cost, as in the engine's decode).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F

LLAMA3_8B_SHAPES = [(4096, 4096), (14336, 4096)]  # (out, in): q/o and gate/up projections
TINY_SHAPES = [(48, 256), (100, 256)]
GROUP = 128
FP8_MAX = 448.0  # float8_e4m3fn's largest finite value


def time_us(calls: list[Callable[[], object]], device: torch.device, iters: int) -> float:
    """Mean microseconds per call, cycling over ``calls`` (one per weight copy), after
    warm-up calls (the first compiles a Triton kernel). On a GPU the calls are captured in
    one CUDA graph, as the engine's decode steps run, and a replay is timed by CUDA events:
    a decode-sized kernel takes a few microseconds, less than launching it from Python."""
    for call in calls[:3]:
        call()
    if device.type != "cuda":
        t0 = time.perf_counter()
        for i in range(iters):
            calls[i % len(calls)]()
        return 1e6 * (time.perf_counter() - t0) / iters
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(iters):
            calls[i % len(calls)]()
    graph.replay()  # the first replay uploads the graph
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    return 1e3 * start.elapsed_time(end) / iters


def copies_for(nbytes: int, device: torch.device) -> int:
    """Copies of a weight of ``nbytes`` that add up to 4x the L2 cache (1 on the CPU)."""
    if device.type != "cuda":
        return 1
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 64 << 20)
    return max(2, math.ceil(4 * l2 / nbytes))


def w4a16_rows(shapes: list[tuple[int, int]], tokens: list[int], device: torch.device,
               dtype: torch.dtype, bandwidth: float, iters: int) -> list[dict]:
    """One row per (shape, T): W4A16 and dense times, their ratio, and the weight bytes'
    rate in GB/s and as a share of ``bandwidth`` (bytes/s)."""
    if device.type != "cuda":  # the CPU runs Triton in its interpreter (set before its import)
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from omnibus.kernels.quant.reference import pack_int4
    from omnibus.kernels.quant.triton_kernels import int4_matmul_triton

    rows = []
    for out_dim, in_dim in shapes:
        dense_bytes = out_dim * in_dim * torch.finfo(dtype).bits // 8
        int4_bytes = out_dim * in_dim // 2 + 2 * 4 * out_dim * (in_dim // GROUP)  # codes, scales, zeros
        n_int4, n_dense = copies_for(int4_bytes, device), copies_for(dense_bytes, device)
        int4 = [(pack_int4(torch.randint(0, 16, (out_dim, in_dim), dtype=torch.uint8, device=device)),
                 0.002 + 0.01 * torch.rand(out_dim, in_dim // GROUP, device=device),
                 0.005 * torch.randn(out_dim, in_dim // GROUP, device=device)) for _ in range(n_int4)]
        dense = [0.02 * torch.randn(out_dim, in_dim, device=device, dtype=dtype) for _ in range(n_dense)]
        for t in tokens:
            x = torch.randn(t, in_dim, device=device, dtype=dtype)
            w4_us = time_us([partial(int4_matmul_triton, x, *w, GROUP) for w in int4], device, iters)
            bf_us = time_us([partial(F.linear, x, w) for w in dense], device, iters)
            w4_rate, bf_rate = int4_bytes / (w4_us * 1e-6), dense_bytes / (bf_us * 1e-6)  # weight bytes/s
            rows.append({
                "out": out_dim, "in": in_dim, "tokens": t, "group": GROUP,
                "w4a16_us": w4_us, "dense_us": bf_us, "w4a16_speedup": bf_us / w4_us,
                "w4a16_weight_gb_s": w4_rate / 1e9, "dense_weight_gb_s": bf_rate / 1e9,
                "w4a16_of_bandwidth": w4_rate / bandwidth, "dense_of_bandwidth": bf_rate / bandwidth,
            })
            print_row("W4A16", rows[-1], "w4a16")
    return rows


def fp8_rows(shapes: list[tuple[int, int]], tokens: list[int], device: torch.device,
             dtype: torch.dtype, iters: int) -> list[dict]:
    """One row per (shape, T): the FP8 GEMM, the activations' quantization and dense times,
    the ratio of the GEMMs and their TFLOP/s."""
    rows = []
    for out_dim, in_dim in shapes:
        n = copies_for(out_dim * in_dim * 2, device)  # the bf16 weight's copies cover the fp8 ones too
        dense = [0.02 * torch.randn(out_dim, in_dim, device=device, dtype=dtype) for _ in range(n)]
        fp8 = [quantize_rows(w) for w in dense]  # (out, in) e4m3 and (out, 1) scales
        fp8_t = [(q.t(), s.t().contiguous()) for q, s in fp8]  # (in, out) column-major, (1, out)
        for t in tokens:
            x = torch.randn(t, in_dim, device=device, dtype=dtype)
            xq, sx = quantize_rows(x)  # (T, in) e4m3, (T, 1) float32
            fp8_us = time_us([partial(torch._scaled_mm, xq, q, scale_a=sx, scale_b=s, out_dtype=torch.bfloat16)
                              for q, s in fp8_t], device, iters)
            quant_us = time_us([partial(quantize_rows, x)], device, iters)
            bf_us = time_us([partial(F.linear, x, w) for w in dense], device, iters)
            flops = 2 * t * out_dim * in_dim
            rows.append({
                "out": out_dim, "in": in_dim, "tokens": t, "fp8_us": fp8_us, "fp8_quant_us": quant_us,
                "dense_us": bf_us, "fp8_speedup": bf_us / fp8_us,
                "fp8_tflops": flops / (fp8_us * 1e-6) / 1e12, "dense_tflops": flops / (bf_us * 1e-6) / 1e12,
            })
            print_row("FP8", rows[-1], "fp8")
    return rows


def quantize_rows(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(R, C) -> (R, C) float8_e4m3fn and the (R, 1) float32 scales: one per row, its
    largest magnitude mapped to e4m3's largest finite value."""
    af = a.float()
    scale = (af.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
    return (af / scale).to(torch.float8_e4m3fn), scale


def print_row(kind: str, row: dict, key: str) -> None:
    extra = (f", weights {row['w4a16_weight_gb_s']:.0f} vs {row['dense_weight_gb_s']:.0f} GB/s "
             f"({100 * row['w4a16_of_bandwidth']:.0f}% vs {100 * row['dense_of_bandwidth']:.0f}% of copy bandwidth)"
             if kind == "W4A16" else
             f" (+{row['fp8_quant_us']:.1f} us to quantize x), {row['fp8_tflops']:.1f} vs "
             f"{row['dense_tflops']:.1f} TFLOP/s")
    print(f"{kind} {row['out']}x{row['in']} T={row['tokens']}: {row[f'{key}_us']:.1f} us vs dense "
          f"{row['dense_us']:.1f} us = {row[f'{key}_speedup']:.2f}x{extra}", flush=True)
