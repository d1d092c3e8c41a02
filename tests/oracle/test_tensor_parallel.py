"""Tensor parallelism on this CPU (gloo, 2 ranks, one thread each): greedy outputs equal
transformers' token for token on the tests' checkpoints, with chunked prefill, prefix-cache
hits, preemption, speculation and prompt logprobs; shapes that do not split are refused
before any rank starts.

Summing two ranks' partial products can round differently from one matmul in float32's
last bits; the checkpoints' logits are well separated (tests/checkpoints.py), so greedy
outputs are expected to match exactly and the tests hold them to that. Prompt logprobs
are held to 1e-4 against transformers' for the same reason.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from omnibus.engine.config import EngineConfig, ModelLoadError
from omnibus.engine.engine import Engine
from omnibus.engine.worker.sampling import SamplingParams
from tests.checkpoints import hf_greedy, load_hf, make_checkpoint
from tests.oracle.test_engine_oracle import workload
from tests.oracle.test_prompt_logprobs import Reference, check, run
from tests.oracle.test_prompt_logprobs import prompts as logprob_prompts

VOCAB = 385  # odd: the last rank's block of the vocabulary is padded


def tp_engine(path, **kw) -> Engine:
    return Engine(EngineConfig(model=str(path), dtype="float32", tensor_parallel_size=2, **kw))


def greedy(max_tokens):
    return [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in max_tokens]


def assert_transformers(engine: Engine, path, prompts, max_tokens) -> None:
    hf = load_hf(path)
    outputs = engine.generate(prompts, greedy(max_tokens))
    for i, (prompt, m, got) in enumerate(zip(prompts, max_tokens, outputs)):
        assert got == hf_greedy(hf, prompt, m), f"request {i} (prompt {len(prompt)} tokens) diverged"
    assert engine.check_integrity().referenced == 0


def no_rank_left() -> None:
    """No process of this one runs omnibus.engine.parallel.ranks."""
    mine = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rpartition(")")[2].split()[1])
            cmdline = (stat.parent / "cmdline").read_bytes()
        except (OSError, ValueError):
            continue
        if ppid == os.getpid() and b"omnibus.engine.parallel.ranks" in cmdline:
            mine.append(stat.parent.name)
    assert mine == []


@pytest.mark.parametrize("arch,kw", [
    ("llama", {}),  # 4 query heads, 2 KV heads: one of each per rank
    ("qwen2", {}),  # q/k/v biases split with their rows
    ("mistral", {"tie_word_embeddings": True, "num_key_value_heads": 1}),  # MQA: the KV head replicated; tied head
    ("llama", {"attention_bias": True, "mlp_bias": True}),  # o/down biases added once
    ("llama", {"head_dim": 32, "rope_parameters": {  # head_dim != hidden / heads; Llama 3.1 rope scaling
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}),
])
def test_two_ranks_match_transformers(tmp_path, arch, kw):
    path = make_checkpoint(tmp_path / "ckpt", arch, vocab_size=VOCAB, **kw)
    prompts, max_tokens = workload(seed=1, n=8)
    engine = tp_engine(path, num_kv_blocks=256)
    try:
        assert engine.runner.tp.size == 2 and engine.runner.model.embed_tokens.weight.shape[0] == 193
        assert_transformers(engine, path, prompts, max_tokens)
    finally:
        engine.close()
    no_rank_left()


def test_chunked_prefill_prefix_hits_and_preemption_on_two_ranks(tmp_path):
    """A pool too small for the batch (preemption), 32-token steps (chunked prefill) and
    the workload run twice (the second time from the prefix cache)."""
    path = make_checkpoint(tmp_path / "ckpt", "llama", vocab_size=VOCAB)
    prompts, max_tokens = workload(seed=2, n=10, shared_prefix=40)
    engine = tp_engine(path, num_kv_blocks=48, block_size=8, max_num_batched_tokens=32)
    try:
        assert_transformers(engine, path, prompts, max_tokens)
        hits = engine.stats().num_prefix_cache_hit_blocks
        assert_transformers(engine, path, prompts, max_tokens)
        stats = engine.stats()
        assert stats.num_preemptions > 0 and stats.num_prefix_cache_hit_blocks > hits
    finally:
        engine.close()


def test_every_batching_policy_on_two_ranks(tmp_path):
    """none, static and dynamic in turn on one engine (continuous: every other test); the
    policy decides admission on rank 0 only, so the ranks see steps as any other."""
    from omnibus.engine.core.policies import make_policy

    path = make_checkpoint(tmp_path / "ckpt", "llama", vocab_size=VOCAB)
    prompts, max_tokens = workload(seed=3, n=5)
    engine = tp_engine(path, num_kv_blocks=256)
    try:
        for batching in ("none", "static", "dynamic"):
            engine.scheduler.policy = make_policy(batching, 2, 1.0)
            assert_transformers(engine, path, prompts, max_tokens)
    finally:
        engine.close()


def test_padded_decode_graph_buckets_and_overlap_on_two_ranks(tmp_path):
    """--decode-graphs on a CPU runs the graphs' padded static buffers eagerly (CUDA
    captures them): every rank pads the same decode step to the same bucket; with
    overlapped scheduling the next step's inputs are sent before this one's picks are read."""
    path = make_checkpoint(tmp_path / "ckpt", "llama", vocab_size=VOCAB)
    prompts, max_tokens = workload(seed=4, n=6)
    engine = tp_engine(path, num_kv_blocks=256, decode_graphs=True, overlap_scheduling=True)
    try:
        assert_transformers(engine, path, prompts, max_tokens)
        assert engine.runner.graphs.num_runs > 0
    finally:
        engine.close()


def test_the_triton_kernels_on_each_shard(tmp_path, monkeypatch):
    """Each rank's KV store and paged attention on the Triton kernels (interpreted on the
    CPU; the ranks inherit OMNIBUS_FORCE_TRITON) over its own heads' cache."""
    monkeypatch.setenv("OMNIBUS_FORCE_TRITON", "1")
    path = make_checkpoint(tmp_path / "ckpt", "llama", vocab_size=VOCAB)
    engine = tp_engine(path, num_kv_blocks=64, max_num_batched_tokens=24)
    try:
        assert_transformers(engine, path, [[5 + i for i in range(n)] for n in (3, 17)], [3, 3])
    finally:
        engine.close()


def test_speculation_and_prompt_logprobs_on_two_ranks(tmp_path):
    """n-gram speculation (its guesses scored by the ranks' logits) on an echo model, a
    draft model's, and
    prompt logprobs (scored in chunks through the gathered LM head) against transformers."""
    path = make_checkpoint(tmp_path / "echo", "llama", vocab_size=VOCAB, echo=True)
    engine = tp_engine(path, num_kv_blocks=128, speculative="ngram", num_speculative_tokens=3)
    try:
        assert_transformers(engine, path, [[5, 6, 7, 5, 6, 7, 5, 6], list(range(20, 37))], [12, 12])
        assert engine.stats().speculative.accepted > 0
    finally:
        engine.close()
    plain = make_checkpoint(tmp_path / "plain", "llama", vocab_size=VOCAB)
    draft = make_checkpoint(tmp_path / "draft", "llama", vocab_size=VOCAB, seed=1, num_hidden_layers=1)
    engine = tp_engine(plain, num_kv_blocks=128, speculative="draft", speculative_draft_model=str(draft))
    try:  # the draft model runs whole on rank 0 (one device), the target over both ranks
        assert engine.speculator.proposer.runner.tp.size == 1
        assert_transformers(engine, plain, [list(range(20, 37)), [9, 8, 7]], [10, 10])
        assert engine.stats().speculative.proposed > 0
    finally:
        engine.close()
    path = plain
    ref = Reference(path)
    engine = tp_engine(path, num_kv_blocks=128, max_num_batched_tokens=32)
    try:
        batch = logprob_prompts(3)
        check(ref, batch, run(engine, batch))
    finally:
        engine.close()


@pytest.mark.parametrize("overrides,size,named", [
    ({"num_attention_heads": 4, "num_key_value_heads": 2}, 3, "4 attention heads"),
    ({"num_attention_heads": 6, "num_key_value_heads": 2, "hidden_size": 96}, 2, None),  # splits: no error
    ({"num_attention_heads": 8, "num_key_value_heads": 2, "hidden_size": 64}, 8, None),  # KV heads replicated
    ({"num_attention_heads": 6, "num_key_value_heads": 3, "hidden_size": 96}, 2, "3 KV heads"),
    ({"num_attention_heads": 8, "num_key_value_heads": 2, "hidden_size": 64}, 8 * 3, "8 attention heads"),
    ({"num_attention_heads": 4, "intermediate_size": 129}, 2, "129 MLP channels"),
])
def test_shapes_that_do_not_split_are_refused_naming_them(overrides, size, named):
    from omnibus.engine.config import ModelConfig
    from omnibus.engine.parallel.shard import check_divisible

    base = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, vocab_size=VOCAB,
                max_position_embeddings=128, rms_norm_eps=1e-5, model_type="llama",
                architectures=["LlamaForCausalLM"])
    cfg = ModelConfig.from_dict(base | overrides)
    if named is None:
        check_divisible(cfg, size)
        return
    with pytest.raises(ModelLoadError, match=f"--tensor-parallel-size {size} does not divide the model's .*{named}"):
        check_divisible(cfg, size)


def test_an_engine_that_does_not_split_starts_no_rank(tmp_path):
    path = make_checkpoint(tmp_path / "ckpt", "llama", vocab_size=VOCAB)
    with pytest.raises(ModelLoadError, match="--tensor-parallel-size 3 does not divide the model's 4 attention heads"):
        Engine(EngineConfig(model=str(path), dtype="float32", tensor_parallel_size=3, num_kv_blocks=16))
    no_rank_left()


def test_more_ranks_than_devices_are_refused(monkeypatch):
    from omnibus.engine.parallel import ranks

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    config = EngineConfig(model="m", device="cuda:1", tensor_parallel_size=2)
    with pytest.raises(ValueError, match=r"needs devices cuda:1..cuda:2, but this host has 2 CUDA device"):
        ranks.check_devices(config)
    ranks.check_devices(EngineConfig(model="m", device="cuda", tensor_parallel_size=2))
    with pytest.raises(ValueError, match="tensor_parallel_size must be 1 with load_format null"):
        EngineConfig(model="m", load_format="null", tensor_parallel_size=2)


# --- quantized checkpoints: each format's weights split (tests/oracle/test_quantized.py builds them)

from tests.oracle.test_quantized import PROMPTS as QPROMPTS  # noqa: E402
from tests.oracle.test_quantized import TOLERANCE, built, scored  # noqa: E402,F401 (built: a fixture)


@pytest.mark.parametrize("name", ["ct-w4a16", "ct-w8a8", "ct-fp8"])  # AWQ and GPTQ decode to ct-w4a16's kind
def test_quantized_checkpoints_split_over_two_ranks(built, name):  # noqa: F811
    """INT4 groups (compressed-tensors; AWQ and GPTQ decode to that kind), INT8 W8A8 and FP8 split along rows, and on
    group boundaries along columns; each rank's kernels multiply the checkpoint's own codes
    (tests/unit/test_tp_shards.py: a shard dequantizes to the dense shard exactly). Against
    the dequantized reference on one device they stay within the format's tolerance of
    one device's kernels (test_quantized.TOLERANCE): a rank's bf16 INT4 partial products
    round on their own, and W8A8/FP8 quantize each rank's slice of the activations per
    token, as every tensor-parallel server does."""
    ck = built(name)
    ref = Engine(EngineConfig(model=str(ck.path), dtype="float32", quantization="none", num_kv_blocks=64))
    two = tp_engine(ck.path, num_kv_blocks=64, max_num_batched_tokens=16)
    try:
        expected = ref.generate(QPROMPTS, greedy([6] * len(QPROMPTS)))
        seqs = [p + g for p, g in zip(QPROMPTS, expected)]
        deltas = [abs(a - b) for p, r, f in zip(QPROMPTS, scored(ref, seqs), scored(two, seqs))
                  for a, b in zip(r[len(p) - 1:], f[len(p) - 1:])]
        print(f"{name} on two ranks: max |d logprob| against the dequantized reference {max(deltas):.4f}")
        assert len(deltas) == 6 * len(QPROMPTS) and max(deltas) <= TOLERANCE[name]
    finally:
        two.close()


def test_an_act_order_checkpoint_is_refused_naming_why(built):  # noqa: F811
    with pytest.raises(ModelLoadError, match=r"(o|down)_proj.weight cannot be split over 2 ranks: act-order"):
        tp_engine(built("gptq-actorder").path, num_kv_blocks=16)
    no_rank_left()


@pytest.mark.parametrize("projection_type", ["Q4_1", "Q8_0"])
def test_a_gguf_file_on_two_ranks_is_transformers_token_for_token(tmp_path, projection_type):
    """A GGUF file (llama.cpp's layout: Q4_1 or Q8_0 projections, a Q8_0 token table), its
    blocks split along rows and on their 32-column boundaries, dequantized (--quantization
    none): transformers' greedy tokens on the same file."""
    from tests.gguf_files import hf_from_gguf, write_gguf

    hf_dir = make_checkpoint(tmp_path / "hf", "llama", vocab_size=VOCAB)
    path = write_gguf(hf_dir, tmp_path / "tiny.gguf", projection_type=projection_type, embedding_type="Q8_0")
    hf = hf_from_gguf(path)
    prompts, max_tokens = workload(seed=5, n=4)
    engine = Engine(EngineConfig(model=str(path), dtype="float32", quantization="none", num_kv_blocks=128,
                                 tensor_parallel_size=2))
    try:
        outputs = engine.generate(prompts, greedy(max_tokens))
        assert outputs == [hf_greedy(hf, p, m) for p, m in zip(prompts, max_tokens)]
    finally:
        engine.close()
    no_rank_left()


# --- LoRA: adapters split per layer as S-LoRA does (lora/slots.py shard_adapter)

from tests.oracle.test_lora import expected as peft_expected  # noqa: E402
from tests.oracle.test_lora import mixed_requests, setup  # noqa: E402,F401 (setup: a fixture)
from tests.oracle.test_lora import run as run_lora  # noqa: E402


def test_mixed_adapters_on_two_ranks_match_peft(setup):  # noqa: F811
    """Four adapters (q/k/v/o and MLP targets, ranks and alphas of their own) and the base
    in one batch, two device slots (so slots are refilled mid-run on every rank), a second
    pass from each adapter's own prefix cache: PEFT's greedy tokens, token for token."""
    base, adapters_dir, oracles = setup
    engine = tp_engine(base, adapter_dir=str(adapters_dir), max_loras=2, max_cpu_loras=4, max_lora_rank=16,
                       num_kv_blocks=256)
    try:
        reqs = mixed_requests()
        for _ in range(2):
            for (adapter, prompt, n), out in zip(reqs, run_lora(engine, reqs)):
                assert out == peft_expected(oracles, adapter, prompt, n), f"adapter {adapter} diverged"
        assert engine.adapters.stats().evictions > 0 and engine.stats().num_prefix_cache_hit_blocks > 0
    finally:
        engine.close()


def test_a_rank_that_cannot_start_fails_the_engine_at_once_naming_its_exit(tmp_path, monkeypatch):
    """Not a wait for the group's timeout: rank 0 watches its ranks while it joins."""
    import sys
    import time

    from omnibus.engine.parallel import ranks

    monkeypatch.setattr(ranks, "RANK_COMMAND", [sys.executable, "-c", "raise SystemExit(3)"])
    path = make_checkpoint(tmp_path / "ckpt", "llama", vocab_size=VOCAB)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"rank process\(es\) exited before joining the group .*, 3\)"):
        tp_engine(path, num_kv_blocks=16)
    assert time.monotonic() - start < 30
    no_rank_left()
