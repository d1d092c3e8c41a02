"""On a CUDA device: the engine on Triton kernels with CUDA-graph decode and overlapped
scheduling equals its eager lockstep run and transformers, token for token (run with `make test-gpu` where a GPU is lent)."""

import pytest
import torch

from omnibus.engine.config import EngineConfig
from omnibus.engine.engine import Engine
from omnibus.engine.worker.sampling import SamplingParams
from tests.checkpoints import hf_greedy, load_hf, make_checkpoint

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_cuda_graphs_and_kernels_match_eager_and_transformers(tmp_path):
    path = make_checkpoint(tmp_path / "m", "llama")
    prompts = [[5 + (i * 7 + j) % 300 for j in range(n)] for i, n in enumerate((1, 9, 16, 17, 40, 130, 300))]
    lengths = [12, 5, 20, 8, 16, 10, 6]
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in lengths]
    hf = load_hf(path)
    expected = [hf_greedy(hf, p, m) for p, m in zip(prompts, lengths)]
    outs = {}
    # CUDA graphs with overlapped scheduling (the CUDA default), graphs in lockstep, eager lockstep.
    for graphs, overlap in ((True, True), (True, False), (False, False)):
        engine = Engine(EngineConfig(model=str(path), device="cuda", dtype="float32", decode_graphs=graphs,
                                     overlap_scheduling=overlap, kv_cache_memory=64 << 20,
                                     max_num_batched_tokens=64))
        assert engine.overlap == overlap
        outs[graphs, overlap] = engine.generate(prompts, params)
        if graphs:
            assert engine.runner.graphs.graphs and engine.runner.graphs.num_runs > 0
        torch.cuda.synchronize()
        meter = engine.runner.idle_meter
        assert 0.0 <= meter.idle_share < 1.0 and meter.busy_ms > 0
        engine.check_integrity()
    assert outs[True, True] == outs[True, False] == outs[False, False] == expected


async def test_the_process_step_loop_on_cuda_streams_transformers_tokens(tmp_path):
    """`--step-loop auto` puts the step loop in its own process on CUDA: the spawned process
    builds the engine on the device (graphs, overlap) and its tokens come back exact."""
    from omnibus.engine.serving.async_engine import AsyncEngine
    from omnibus.engine.serving.step_loop_runners import StepLoopProcess

    path = make_checkpoint(tmp_path / "m", "llama")
    prompts = [[5 + (i * 11 + j) % 300 for j in range(n)] for i, n in enumerate((3, 17, 64))]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    hf = load_hf(path)
    expected = [hf_greedy(hf, p, 12) for p in prompts]
    aengine = AsyncEngine(StepLoopProcess(EngineConfig(model=str(path), device="cuda", dtype="float32",
                                                       kv_cache_memory=64 << 20)))
    aengine.start()
    try:
        got = []
        for i, prompt in enumerate(prompts):
            got.append([t async for out in aengine.generate(f"g{i}", prompt, params)
                        for t in out.new_token_ids])
        assert got == expected
    finally:
        aengine.shutdown()


@pytest.mark.skipif(torch.cuda.device_count() < 2,
                    reason=f"tensor parallelism needs 2 CUDA devices; this host has {torch.cuda.device_count()}")
def test_tensor_parallel_over_two_gpus_equals_one_gpu_and_transformers(tmp_path):
    """TP=2 over NCCL (cuda:0, cuda:1) against TP=1 on cuda:0 and transformers, in float32
    and in bfloat16 (where the partial sums may round apart: the bf16 rows are compared
    with each other for agreement, and reported)."""
    path = make_checkpoint(tmp_path / "m", "llama")
    prompts = [[5 + (i * 13 + j) % 300 for j in range(n)] for i, n in enumerate((4, 33, 120))]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    hf = load_hf(path)
    expected = [hf_greedy(hf, p, 16) for p in prompts]
    outs = {}
    for dtype in ("float32", "bfloat16"):
        for size in (1, 2):
            engine = Engine(EngineConfig(model=str(path), device="cuda", dtype=dtype, tensor_parallel_size=size,
                                         kv_cache_memory=64 << 20))
            try:
                outs[dtype, size] = engine.generate(prompts, params)
            finally:
                engine.close()
    assert outs["float32", 1] == outs["float32", 2] == expected
    agree = sum(a == b for x, y in zip(outs["bfloat16", 1], outs["bfloat16", 2]) for a, b in zip(x, y))
    print(f"bf16 TP=2 vs TP=1 greedy agreement {agree}/{16 * len(prompts)}")


def test_the_host_tier_on_cuda_loads_what_it_saved(tmp_path):
    """--kv-offload-bytes on a GPU: blocks saved to pinned host slots and loaded back with
    copies queued on the stream (no host sync between them and the forwards that reuse the
    blocks); turn 2 reads its evicted history from host and equals transformers."""
    import random

    path = make_checkpoint(tmp_path / "m", "llama")
    hf = load_hf(path)
    rng = random.Random(0)
    first = [rng.randrange(3, 300) for _ in range(60)]
    others = [[rng.randrange(3, 300) for _ in range(60)] for _ in range(2)]
    engine = Engine(EngineConfig(model=str(path), device="cuda", dtype="float32", num_kv_blocks=12,
                                 block_size=8, kv_offload_bytes=1 << 20))
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    (reply,) = engine.generate([first], params)
    for other in others:
        engine.generate([other], params)
    turn2 = first + reply + [5, 6, 7]
    assert engine.generate([turn2], params) == [hf_greedy(hf, turn2, 4)]
    assert engine.stats().num_host_cache_hit_blocks == 7
    engine.check_integrity()



def test_kv_moves_between_engines_on_cuda_through_host_staging(tmp_path):
    """--kv-transfer on a GPU: each engine's pool is staged through pinned host memory (its
    default 2 GiB cut to 16 MiB here): a prefill engine's KV, read by a decode engine, goes
    on token for token as transformers (greedy) with no prompt token computed twice, and
    both pools' blocks are all free at the end."""
    pytest.importorskip("mooncake.engine", reason="Mooncake's transfer engine: make gpu-wheels GPU_KV_WHEELS=1 carries it")
    kv_round_trip(tmp_path, "cuda")


def kv_pair(tmp_path, device: str, **kw):
    """The test checkpoint's transformers model and two engines on `device` moving KV
    through 16 MiB of host staging."""
    path = make_checkpoint(tmp_path / "m", "llama")
    config = EngineConfig(model=str(path), device=device, dtype="float32", kv_cache_memory=64 << 20, block_size=8,
                          kv_transfer="mooncake", kv_transfer_staging_bytes=16 << 20, **kw)
    return load_hf(path), (Engine(config), Engine(config))


def kv_round_trip(tmp_path, device: str) -> None:
    import random

    from omnibus.engine.request import EngineRequest

    hf, (p, d) = kv_pair(tmp_path, device)
    rng = random.Random(3)

    def run(engine, request):
        engine.add_request(request)
        outs = []
        while engine.has_unfinished():
            outs += engine.step()
        return outs

    try:
        for n in (45, 16, 130):
            ids = [rng.randrange(3, 300) for _ in range(n)]
            (first,) = run(p, EngineRequest(f"p{n}", ids, SamplingParams(max_tokens=1, temperature=0.0,
                                                                         ignore_eos=True), kv_hold=True))
            assert first.kv_handle is not None and first.kv_handle.num_tokens == n
            rest = SamplingParams(max_tokens=11, temperature=0.0, ignore_eos=True, output_offset=1)
            outs = run(d, EngineRequest(f"d{n}", ids + first.new_token_ids, rest, kv_source=first.kv_handle))
            assert first.new_token_ids + [t for o in outs for t in o.new_token_ids] == hf_greedy(hf, ids, 12), n
            assert outs[0].num_cached_tokens == n  # read, not computed
            assert p.abort(f"p{n}")
        stats = d.kv.stats()
        assert stats.load_failures == 0 and stats.loaded_tokens == 45 + 16 + 130
        for e in (p, d):
            assert e.check_integrity().referenced == 0 and not e.kv.held
    finally:
        for e in (p, d):
            e.close()


def test_early_handles_on_cuda_are_read_while_the_prefill_runs(tmp_path):
    """--kv-transfer-overlap on a GPU (a staged pool, overlapped scheduling): a chunked
    prefill hands its KV on when seated, its staged copy and progress words advancing at
    each step's end; a second engine reads it as it goes, computes the last prompt token
    itself and goes on as transformers, nothing recomputed."""
    pytest.importorskip("mooncake.engine", reason="Mooncake's transfer engine: make gpu-wheels GPU_KV_WHEELS=1 carries it")
    kv_early(tmp_path, "cuda")


def kv_early(tmp_path, device: str) -> None:
    import random
    import time

    from omnibus.engine.request import EngineRequest

    hf, (holder, reader) = kv_pair(tmp_path, device, kv_transfer_overlap=True, max_num_batched_tokens=16)
    rng = random.Random(5)
    ids = [rng.randrange(3, 300) for _ in range(61)]  # 4 chunks of 16
    try:
        holder.add_request(EngineRequest("e", ids, SamplingParams(max_tokens=1, temperature=0.0), kv_hold=True))
        (out,) = holder.step()
        assert out.kv_handle is not None and out.kv_handle.progress_addr and not out.new_token_ids
        reader.add_request(EngineRequest("e", ids, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
                                         kv_source=out.kv_handle))
        got, start = [], time.monotonic()
        while reader.has_unfinished():
            holder.step()
            got += [t for o in reader.step() for t in o.new_token_ids]
            time.sleep(0.002)
            assert time.monotonic() - start < 60, "the reader never finished"
        assert got == hf_greedy(hf, ids, 12)
        stats = reader.kv.stats()
        assert (stats.loaded_tokens, stats.load_failures) == (len(ids) - 1, 0)
        assert holder.abort("e")
        for e in (holder, reader):
            assert e.check_integrity().referenced == 0 and not e.kv.held
    finally:
        for e in (holder, reader):
            e.close()
