"""Tensor parallelism on this CPU (`make bench-tp`, docs/benchmarks/tp.md).

One process runs the same engine at --tensor-parallel-size 1 and 2 on the same random-weight
Llama-shaped model (load_format dummy), each rank on one torch thread: output tokens/s at
batch 1 and 64 (greedy, ignore_eos, 16-token prompts), each step's time split into rank 0's
communication (the step's inputs broadcast to the other ranks, the all-reduces, the
gathered logits: the time rank 0 spends inside torch.distributed, which includes waiting
for the slower rank) and the rest, and each rank's weight bytes. On 2 CPU cores this
measures the mechanism's overhead, not a speedup: two single-thread ranks do half the
arithmetic each but pay a broadcast, 2 all-reduces per layer and a gather per step, and
the step loop, the scheduler and sampling stay on rank 0.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from omnibus.bench.quant import weight_bytes
from omnibus.bench.report import write_keeping_reading
from omnibus.bench.shapes import TINY, write_config
from omnibus.engine.config import EngineConfig
from omnibus.engine.engine import Engine
from omnibus.engine.worker.sampling import SamplingParams

SHAPE = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
             num_key_value_heads=4, vocab_size=32000, max_position_embeddings=2048)
COLLECTIVES = ("all_reduce", "all_gather", "broadcast", "broadcast_object_list")


class CommClock:
    """Seconds rank 0 spends inside torch.distributed's collectives (patched in place)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._saved = {name: getattr(dist, name) for name in COLLECTIVES}
        for name, fn in self._saved.items():
            setattr(dist, name, self._timed(name, fn))

    def _timed(self, name, fn):
        def run(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - t
                self.calls[name] += 1
        return run

    def reset(self) -> None:
        self.seconds.clear()
        self.calls.clear()

    def restore(self) -> None:
        for name, fn in self._saved.items():
            setattr(dist, name, fn)


@dataclass
class Row:
    tp: int
    batch: int
    tok_s: float
    step_ms: float
    comm_ms: float
    weight_mib: float
    calls_per_step: float


def measure(model_dir: Path, tp: int, batches: list[int], tokens: int, clock: CommClock) -> list[Row]:
    engine = Engine(EngineConfig(model=str(model_dir), load_format="dummy", dtype="float32", seed=0,
                                 tensor_parallel_size=tp, num_kv_blocks=1024, max_num_seqs=max(batches)))
    rows = []
    try:
        mib = weight_bytes(engine) / (1 << 20)
        params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
        engine.generate([[5] * 16], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))  # warm
        for batch in batches:
            prompts = [[3 + (i * 7 + j) % 500 for j in range(16)] for i in range(batch)]
            steps = engine.stats().num_steps
            clock.reset()
            t = time.perf_counter()
            engine.generate(prompts, params)
            elapsed = time.perf_counter() - t
            n = engine.stats().num_steps - steps
            comm = sum(clock.seconds.values())
            rows.append(Row(tp, batch, batch * tokens / elapsed, 1000 * elapsed / n, 1000 * comm / n, mib,
                            sum(clock.calls.values()) / n))
    finally:
        engine.close()
    return rows


def run(shape: dict, batches: list[int], tokens: int) -> list[Row]:
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"  # the ranks the engine starts read it at import
    clock = CommClock()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            model_dir = write_config(Path(tmp), shape)
            return [row for tp in (1, 2) for row in measure(model_dir, tp, batches, tokens, clock)]
    finally:
        clock.restore()


def markdown(rows: list[Row], shape: dict, tokens: int) -> str:
    base = {r.batch: r for r in rows if r.tp == 1}
    one_mib = next(r.weight_mib for r in rows if r.tp == 1)
    lines = [
        "# Tensor parallelism on the CPU", "",
        f"`make bench-tp` on this host: one random-weight Llama-shaped model ({shape}), float32, "
        f"each rank one torch thread, gloo between the ranks; greedy, ignore_eos, 16-token prompts, "
        f"{tokens} output tokens each. *comm* is the time rank 0 spends inside torch.distributed per step "
        "(the step's inputs broadcast, two all-reduces per layer, the embedding's all-reduce, the gathered "
        "logits), waiting for the other rank included; *compute* is the rest of the step. x tp1 is the ratio "
        "to the TP=1 row of the same batch in this run. On 2 CPU cores this measures the mechanism's "
        "overhead, not a speedup.", "",
        "| TP | batch | tok/s | x tp1 | step ms | compute ms | comm ms | collectives / step | weights MiB per rank | x tp1 |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r.tp} | {r.batch} | {r.tok_s:.1f} | {r.tok_s / base[r.batch].tok_s:.2f} | {r.step_ms:.1f} | "
                     f"{r.step_ms - r.comm_ms:.1f} | {r.comm_ms:.1f} | {r.calls_per_step:.0f} | {r.weight_mib:.1f} | "
                     f"{r.weight_mib / one_mib:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help="write the markdown report here")
    parser.add_argument("--tiny", action="store_true", help="a tiny shape and few tokens (the tests' smoke run)")
    parser.add_argument("--tokens", type=int, default=None)
    args = parser.parse_args(argv)
    shape = TINY if args.tiny else SHAPE
    tokens = args.tokens or (4 if args.tiny else 32)
    batches = [1, 4] if args.tiny else [1, 64]
    report = markdown(run(shape, batches, tokens), shape, tokens)
    print(report)
    if args.out:
        write_keeping_reading(args.out, report)


if __name__ == "__main__":
    main()
