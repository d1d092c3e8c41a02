"""The prefix cache's host tier (--kv-offload-bytes, core/block_allocator.py): a turn-2
prompt whose turn-1 blocks were evicted from a small device pool is served from host
memory (cached_tokens counts them, nothing recomputed), token for token as transformers,
in one device and on two tensor-parallel ranks; a tier too small keeps the most recent
blocks; the pool's and the tier's bookkeeping hold after every step."""

from __future__ import annotations

import random

import pytest

from omnibus.engine.config import EngineConfig
from omnibus.engine.engine import Engine
from omnibus.engine.worker.sampling import SamplingParams
from tests.checkpoints import hf_greedy, load_hf, make_checkpoint

VOCAB = 384
BLOCK = 8
MAX_TOKENS = 4


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = make_checkpoint(tmp_path_factory.mktemp("host-tier"), "llama", vocab_size=VOCAB)
    return path, load_hf(path)


def serve(engine: Engine, prompt: list[int]) -> tuple[list[int], int]:
    """One request alone: its greedy tokens and the prompt tokens it read from a cache."""
    engine.add_request(f"r{engine.num_steps}", prompt, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0,
                                                                       ignore_eos=True))
    tokens, cached = [], 0
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.new_token_ids
            cached = out.num_cached_tokens
        engine.check_integrity()
    return tokens, cached


def conversation(seed: int) -> tuple[list[int], list[list[int]]]:
    rng = random.Random(seed)
    first = [rng.randrange(3, VOCAB) for _ in range(60)]  # 7 full blocks and 4 tokens
    others = [[rng.randrange(3, VOCAB) for _ in range(60)] for _ in range(2)]
    return first, others


@pytest.mark.parametrize("tp", [1, 2])
def test_a_turn_whose_prefix_left_the_device_is_loaded_from_host_memory(model, tp):
    path, hf = model
    first, others = conversation(tp)
    kw = dict(model=str(path), dtype="float32", num_kv_blocks=12, block_size=BLOCK, tensor_parallel_size=tp)
    cached, stats = {}, {}
    for name, offload in (("tier", 1 << 20), ("none", 0)):  # one after the other: one TP group per process
        engine = Engine(EngineConfig(**kw, kv_offload_bytes=offload))
        try:
            reply, _ = serve(engine, first)
            assert reply == hf_greedy(hf, first, MAX_TOKENS)
            for other in others:  # each fills the 11-block pool: the first turn's blocks are evicted
                serve(engine, other)
            turn2 = first + reply + [5, 6, 7, 8, 9]
            tokens, cached[name] = serve(engine, turn2)
            assert tokens == hf_greedy(hf, turn2, MAX_TOKENS), name
            stats[name] = engine.stats()
        finally:
            engine.close()
    assert cached["none"] == 0  # gone from the device, recomputed
    # every full block turn 1 computed (its last token's KV never was), from host
    assert cached["tier"] == (len(first) + MAX_TOKENS - 1) // BLOCK * BLOCK
    assert stats["tier"].num_host_cache_hit_blocks == cached["tier"] // BLOCK
    assert stats["tier"].num_host_cache_blocks > 0


def test_a_small_tier_keeps_the_most_recent_blocks_and_reports_their_keys(model):
    path, hf = model
    first, others = conversation(3)
    engine = Engine(EngineConfig(model=str(path), dtype="float32", num_kv_blocks=12, block_size=BLOCK))
    per_block = engine.runner.kv_bytes_per_block
    engine = Engine(EngineConfig(model=str(path), dtype="float32", num_kv_blocks=12, block_size=BLOCK,
                                 kv_offload_bytes=4 * per_block))  # four blocks of host memory
    assert engine.runner.num_host_blocks == 4
    serve(engine, first)
    for other in others:
        serve(engine, other)
    stats = engine.stats()
    assert stats.num_host_cache_blocks == 4  # full: the least recently saved were dropped
    keys = engine.allocator.cached_keys(10_000)
    assert len(keys) == len(set(keys)) and set(engine.allocator.host_keys.values()) <= set(keys)
    # the first turn's oldest blocks went first: a turn 2 now recomputes them
    tokens, cached = serve(engine, first + [5, 6, 7])
    assert tokens == hf_greedy(hf, first + [5, 6, 7], MAX_TOKENS) and cached == 0
