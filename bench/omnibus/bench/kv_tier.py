"""The prefix cache's host tier on this CPU (`make bench-kv-tier`, docs/benchmarks/kv-tier.md).

One process, one random-weight Llama-shaped model (load_format dummy), each engine on the
same pool: a conversation's first turn (a long history), then other conversations that
fill the device pool and evict it, then its second turn (the history, the reply and a
short question). Without a tier the second turn prefills the whole history again; with
`--kv-offload-bytes` its blocks come back from host memory. Printed: turn 2's TTFT (time
to its first token, the request alone), the prompt tokens it read from a cache, the host
tier's loads, and the ratio of the two TTFTs, median of `--rounds` conversations.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from omnibus.bench.report import write_keeping_reading
from omnibus.bench.shapes import TINY, write_config
from omnibus.engine.config import EngineConfig
from omnibus.engine.engine import Engine
from omnibus.engine.worker.sampling import SamplingParams

SHAPE = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
             num_key_value_heads=4, vocab_size=32000, max_position_embeddings=4096)


@dataclass
class Turn:
    ttft_ms: float
    cached_tokens: int


def first_token(engine: Engine, prompt: list[int], max_tokens: int) -> tuple[Turn, list[int]]:
    """`prompt` alone: the time to its first token, the tokens it read from a cache, its output."""
    engine.add_request(f"q{time.monotonic_ns()}", prompt,
                       SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    t0, ttft, cached, out = time.perf_counter(), None, 0, []
    while engine.has_unfinished():
        for o in engine.step():
            if o.new_token_ids and ttft is None:
                ttft = time.perf_counter() - t0
                cached = o.num_cached_tokens
            out += o.new_token_ids
    return Turn(1000 * (ttft or 0.0), cached), out


def conversation(engine: Engine, rng: random.Random, history: int, others: int, vocab: int) -> Turn:
    first = [rng.randrange(3, vocab) for _ in range(history)]
    _, reply = first_token(engine, first, 8)
    for _ in range(others):  # other conversations fill the pool: the first turn's blocks are evicted
        first_token(engine, [rng.randrange(3, vocab) for _ in range(history)], 8)
    turn, _ = first_token(engine, first + reply + [rng.randrange(3, vocab) for _ in range(16)], 1)
    return turn


def run(shape: dict, history: int, rounds: int, offload_bytes: int) -> dict[str, list[Turn]]:
    torch.set_num_threads(max(1, torch.get_num_threads()))
    results: dict[str, list[Turn]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = write_config(Path(tmp), shape)
        blocks = history // 16 * 3 // 2 + 4  # one and a half conversations: the next two evict the first
        for name, offload in (("recompute", 0), ("host tier", offload_bytes)):
            engine = Engine(EngineConfig(model=str(path), load_format="dummy", dtype="float32", seed=0,
                                         num_kv_blocks=blocks, block_size=16, kv_offload_bytes=offload,
                                         max_num_batched_tokens=2048))
            rng = random.Random(0)
            results[name] = [conversation(engine, rng, history, 2, shape["vocab_size"]) for _ in range(rounds)]
            if offload:
                results["loads"] = [Turn(0.0, engine.stats().num_host_cache_hit_blocks)]
            engine.close()
    return results


def markdown(results: dict[str, list[Turn]], shape: dict, history: int) -> str:
    med = {k: statistics.median(t.ttft_ms for t in v) for k, v in results.items() if k != "loads"}
    cached = {k: statistics.median(t.cached_tokens for t in v) for k, v in results.items() if k != "loads"}
    return "\n".join([
        "# The prefix cache's host tier on the CPU", "",
        f"`make bench-kv-tier` on this host, one process: a random-weight Llama-shaped model ({shape}), "
        f"float32, a device pool that holds one and a half {history}-token conversations; each round a conversation's "
        "first turn, two other conversations (which evict it from the device), then its second turn "
        "(history, reply and a 16-token question), alone. Median of the rounds.", "",
        "| engine | turn 2 TTFT ms | prompt tokens read from a cache | x recompute |",
        "|---|---|---|---|",
        *(f"| {k} | {med[k]:.1f} | {cached[k]:.0f} | {med[k] / med['recompute']:.2f} |" for k in med),
        "", f"Host tier loads over the run: {results['loads'][0].cached_tokens} blocks.", ""])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--tiny", action="store_true", help="a tiny shape (the tests' run)")
    parser.add_argument("--rounds", type=int, default=None)
    args = parser.parse_args(argv)
    shape, history = (TINY, 64) if args.tiny else (SHAPE, 1000)
    results = run(shape, history, args.rounds or (1 if args.tiny else 2), 1 << 30)
    report = markdown(results, shape, history)
    print(report)
    if args.out:
        write_keeping_reading(args.out, report)


if __name__ == "__main__":
    main()
