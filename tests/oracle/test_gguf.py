"""GGUF files served as transformers serves them.

With `--quantization none` every weight is dequantized by the `gguf` package, as
transformers' GGUF loader does, so greedy output is token for token transformers' on the
same file, in every batching policy, with chunked prefill and prefix-cache hits. With the
default `auto`, Q4_0/Q4_1/Q4_K projections stay 4-bit and run on torch's INT4 CPU kernel
(bfloat16 activations): not bit-exact, held to a stated tolerance against the dequantized
reference. The 4-bit decoders are checked block for block against gguf's own dequantizer.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import gguf
from omnibus.engine.config import EngineConfig, ModelConfig, ModelLoadError, RopeScaling
from omnibus.engine.engine import Engine
from omnibus.engine.model.llama import ForwardBatch, rope_inv_freq
from omnibus.engine.model.formats.gguf import _INT4_DECODERS, _int4
from omnibus.engine.worker.sampling import SamplingParams
from tests.checkpoints import hf_greedy, load_hf, make_checkpoint
from tests.gguf_files import hf_from_gguf, write_gguf
from tests.oracle.test_lora import make_adapter, run

VOCAB = 384
PROMPTS = [[5], [7, 40, 9, 200, 31], list(range(20, 37)), [3, 3, 3, 9]]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
# max |logprob(INT4 kernel) - logprob(dequantized)| of each token of PROMPTS and their
# greedy continuations, given the tokens before it. Measured on this random model (bf16
# activations and scales): Q4_0 0.084, Q4_1 0.067 (over the whole vocabulary: 0.16, 0.30);
# greedy agreement 3 and 4 of 4. Bound with margin.
INT4_LOGPROB_TOLERANCE = 0.2


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("hf") / "m", "llama", vocab_size=VOCAB,
                           hidden_size=64, intermediate_size=128)


@pytest.fixture(scope="module", params=["Q8_0", "Q4_0", "Q4_1", "F16"])
def gguf_file(request, hf_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("gguf") / f"tiny-{request.param}.gguf"
    return write_gguf(hf_dir, out, projection_type=request.param, embedding_type="Q8_0")


@pytest.fixture(scope="module")
def hf_outputs(gguf_file):
    hf = hf_from_gguf(gguf_file)
    return [hf_greedy(hf, p, GREEDY.max_tokens) for p in PROMPTS]


@pytest.mark.parametrize("policy", ["continuous", "static", "dynamic", "none"])
def test_dequantized_gguf_is_token_exact_with_transformers(gguf_file, hf_outputs, policy):
    engine = Engine(EngineConfig(model=str(gguf_file), dtype="float32", num_kv_blocks=64, quantization="none",
                                 batching=policy))
    assert engine.generate(PROMPTS, GREEDY) == hf_outputs
    engine.check_integrity()


def test_chunked_prefill_and_prefix_hits_stay_exact(gguf_file, hf_outputs):
    engine = Engine(EngineConfig(model=str(gguf_file), dtype="float32", num_kv_blocks=64, quantization="none",
                                 max_num_batched_tokens=8, block_size=4))
    assert engine.generate(PROMPTS, GREEDY) == hf_outputs
    assert engine.generate(PROMPTS, GREEDY) == hf_outputs  # the prompts' blocks are cached now


def _logprobs(engine: Engine, ids: list[int]) -> torch.Tensor:
    """log-softmax of the model's next-token logits at every position of `ids` (one
    cache-free forward of the whole sequence)."""
    n = len(ids)
    batch = ForwardBatch(
        input_ids=torch.tensor(ids), positions=torch.arange(n), slot_mapping=torch.zeros(n, dtype=torch.long),
        block_tables=torch.zeros(1, 1, dtype=torch.int32), query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        seq_lens=torch.tensor([n], dtype=torch.int32), max_query_len=n, logits_indices=torch.arange(n))
    model = engine.runner.model
    return model.compute_logits(model(batch, None)).log_softmax(-1)


def _token_logprob_gap(a: Engine, b: Engine, ids: list[int]) -> float:
    nxt = torch.tensor(ids[1:])[:, None]
    return (_logprobs(a, ids)[:-1].gather(1, nxt) - _logprobs(b, ids)[:-1].gather(1, nxt)).abs().max().item()


@pytest.mark.parametrize(("kind", "tied"), [("Q4_0", False), ("Q4_1", False), ("Q4_1", True)])
def test_int4_kernels_hold_their_tolerance(hf_dir, tmp_path, kind, tied):
    """Untied, the head is a Q4 projection like the others; tied, it multiplies through an
    INT8 copy of the (Q8_0) embedding table."""
    if tied:
        hf_dir = make_checkpoint(tmp_path / "tied", "llama", vocab_size=VOCAB, tie_word_embeddings=True)
    path = write_gguf(hf_dir, tmp_path / f"{kind}.gguf", projection_type=kind,
                      embedding_type="Q8_0" if tied else "F32")
    quant = Engine(EngineConfig(model=str(path), dtype="float32", num_kv_blocks=64))
    ref = Engine(EngineConfig(model=str(path), dtype="float32", num_kv_blocks=64, quantization="none"))
    kernels = {type(m.kernel).__name__ for m in quant.runner.model.modules() if getattr(m, "kernel", None)}
    assert kernels == ({"Int4CpuKernel", "Int8CpuKernel"} if tied else {"Int4CpuKernel"})
    assert (quant.runner.model.lm_head.weight is quant.runner.model.embed_tokens.weight) == tied
    expected = ref.generate(PROMPTS, GREEDY)
    worst = max(_token_logprob_gap(quant, ref, p + t) for p, t in zip(PROMPTS, expected))
    assert worst <= INT4_LOGPROB_TOLERANCE
    agree = sum(a == b for a, b in zip(quant.generate(PROMPTS, GREEDY), expected))
    assert agree >= len(PROMPTS) - 1  # make bench-quant reports the agreement over more prompts


@pytest.mark.parametrize("kind", sorted(_INT4_DECODERS))
def test_int4_blocks_decode_exactly_as_gguf_dequantizes(kind):
    """Random bytes are valid 4-bit blocks once their f16 scales are finite."""
    qtype = gguf.GGMLQuantizationType[kind]
    block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    rows, per_row = 6, 2 * 256 // block
    raw = np.random.default_rng(0).integers(0, 256, (rows * per_row, block_bytes), dtype=np.uint8)
    halves = 2 if kind == "Q4_0" else 4  # leading f16 fields: d (and m / dmin)
    raw[:, :halves] = np.frombuffer(np.random.default_rng(1).uniform(-0.1, 0.1, rows * per_row * halves // 2)
                                    .astype(np.float16).tobytes(), dtype=np.uint8).reshape(rows * per_row, halves)
    raw = raw.reshape(rows, -1)
    expected = torch.from_numpy(gguf.quants.dequantize(raw, qtype).copy())
    assert torch.equal(_int4(raw, kind, rows).dequantize(), expected)


def test_a_truncated_gguf_is_refused_naming_the_file(hf_dir, tmp_path):
    good = write_gguf(hf_dir, tmp_path / "ok.gguf", projection_type="Q4_0")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(good.read_bytes()[: good.stat().st_size - 1000])
    with pytest.raises(ModelLoadError, match=r"cut\.gguf.*truncated"):
        Engine(EngineConfig(model=str(cut), dtype="float32", num_kv_blocks=64))


def test_a_qwen2_gguf_is_token_exact_with_transformers(tmp_path):
    """Qwen2: q/k/v biases, no llama.cpp row permutation."""
    hf = make_checkpoint(tmp_path / "qwen2", "qwen2", vocab_size=VOCAB)
    path = write_gguf(hf, tmp_path / "qwen2.gguf", projection_type="Q8_0")
    engine = Engine(EngineConfig(model=str(path), dtype="float32", num_kv_blocks=64, quantization="none"))
    assert engine.model_config.model_type == "qwen2"
    model = hf_from_gguf(path)
    assert engine.generate(PROMPTS, GREEDY) == [hf_greedy(model, p, GREEDY.max_tokens) for p in PROMPTS]


def test_a_mistral_gguf_as_llama_cpp_writes_it_serves_the_checkpoint(tmp_path):
    """llama.cpp writes Mistral as arch "llama" named "mistral", q/k permuted like Llama's:
    served as Mistral with the rows put back. F32 projections, so the reference is
    transformers on the checkpoint itself (transformers 5.23 cannot load such a file:
    gguf-py names no "mistral" model type)."""
    hf = make_checkpoint(tmp_path / "mistral", "mistral", vocab_size=VOCAB)
    path = write_gguf(hf, tmp_path / "mistral.gguf", projection_type="F32", arch="llama", name="mistral")
    engine = Engine(EngineConfig(model=str(path), dtype="float32", num_kv_blocks=64))
    assert engine.model_config.model_type == "mistral"
    model = load_hf(hf)
    assert engine.generate(PROMPTS, GREEDY) == [hf_greedy(model, p, GREEDY.max_tokens) for p in PROMPTS]


def test_a_llama_3_1_gguf_scales_its_rope_by_the_files_factors(tmp_path):
    """llama.cpp writes Llama 3.1's rope scaling as a rope_freqs tensor (no scaling metadata):
    the file serves the checkpoint token for token as transformers on it (F32 projections),
    with the rotary frequencies transformers' llama3 scaling gives, not the unscaled ones."""
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    hf = make_checkpoint(tmp_path / "llama31", "llama", vocab_size=VOCAB, max_position_embeddings=128,
                         rope_parameters=rope)
    path = write_gguf(hf, tmp_path / "llama31.gguf", projection_type="F32")
    engine = Engine(EngineConfig(model=str(path), dtype="float32", num_kv_blocks=64))
    model = load_hf(hf)
    scaling = engine.model_config.rope_scaling
    assert scaling.kind == "freq_factors"
    ours = rope_inv_freq(engine.model_config.head_dim, engine.model_config.rope_theta, scaling)
    unscaled = rope_inv_freq(engine.model_config.head_dim, engine.model_config.rope_theta, RopeScaling())
    torch.testing.assert_close(ours, model.model.rotary_emb.inv_freq.float(), rtol=1e-6, atol=0)
    assert not torch.allclose(ours, unscaled, rtol=1e-3)
    prompts = PROMPTS + [list(range(40, 100))]
    assert engine.generate(prompts, GREEDY) == [hf_greedy(model, p, GREEDY.max_tokens) for p in prompts]


def test_rope_factors_of_the_wrong_count_are_refused(tmp_path):
    raw = json.loads((make_checkpoint(tmp_path / "m", "llama", vocab_size=VOCAB) / "config.json").read_text())
    raw["rope_scaling"] = {"rope_type": "freq_factors", "factors": [1.0, 2.0]}
    with pytest.raises(ModelLoadError, match="2 frequency factors where head_dim 16 has 8 frequencies"):
        ModelConfig.from_dict(raw)
    raw["rope_scaling"] = {"rope_type": "freq_factors", "factors": [1.0, -2.0]}
    with pytest.raises(ModelLoadError, match="positive numbers"):
        ModelConfig.from_dict(raw)


def test_lora_and_speculation_on_a_gguf_match_peft_and_transformers(hf_dir, tmp_path):
    """F32 projections, so the GGUF's weights are the checkpoint's: an adapter trained on the
    checkpoint serves on the GGUF token for token as PEFT on the checkpoint, and n-gram
    speculation leaves the base model's greedy output as transformers'."""
    path = write_gguf(hf_dir, tmp_path / "f32.gguf", projection_type="F32")
    adapters = tmp_path / "adapters"
    peft_model = make_adapter(hf_dir, adapters / "a-r8", 8, 16, ["q_proj", "k_proj", "v_proj", "down_proj"],
                              False, seed=7)
    engine = Engine(EngineConfig(model=str(path), dtype="float32", num_kv_blocks=64, adapter_dir=str(adapters),
                                 speculative="ngram"))
    got = run(engine, [("a-r8", p, GREEDY.max_tokens) for p in PROMPTS] + [(None, p, GREEDY.max_tokens)
                                                                           for p in PROMPTS])
    assert got[:len(PROMPTS)] == [hf_greedy(peft_model, p, GREEDY.max_tokens) for p in PROMPTS]
    base = hf_from_gguf(path)
    assert got[len(PROMPTS):] == [hf_greedy(base, p, GREEDY.max_tokens) for p in PROMPTS]
