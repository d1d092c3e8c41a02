"""Checkpoints whose config.json or files are unusual, served token for token as
transformers serves them (float32 greedy on CPU), or refused at load naming what is wrong."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from omnibus.engine.config import EngineConfig, ModelLoadError
from omnibus.engine.engine import Engine
from omnibus.engine.worker.sampling import SamplingParams
from tests.checkpoints import hf_greedy, load_hf, make_checkpoint

VOCAB = 384
PROMPTS = [[5], [7, 40, 9, 200, 31], list(range(20, 37))]
LLAMA3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0}


def edit_config(path, **changes):
    """Rewrite config.json's keys; a value of None removes the key."""
    raw = json.loads((path / "config.json").read_text())
    for key, value in changes.items():
        raw.pop(key, None) if value is None else raw.__setitem__(key, value)
    (path / "config.json").write_text(json.dumps(raw))


def assert_matches(path, prompts=PROMPTS, max_tokens=8) -> Engine:
    engine = Engine(EngineConfig(model=str(path), dtype="float32", num_kv_blocks=64))
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    hf = load_hf(path)
    assert engine.generate(prompts, params) == [hf_greedy(hf, p, max_tokens) for p in prompts]
    return engine


@pytest.mark.parametrize("rope", [
    LLAMA3,  # no original_max_position_embeddings: transformers takes max_position_embeddings (128), not 8192
    LLAMA3 | {"original_max_position_embeddings": 64},  # with a top-level 32 next to it: 32 wins
])
def test_llama3_original_context_as_transformers(tmp_path, rope):
    path = make_checkpoint(tmp_path / "m", "llama", vocab_size=VOCAB, max_position_embeddings=128)
    edit_config(path, rope_parameters=rope,
                original_max_position_embeddings=32 if "original_max_position_embeddings" in rope else None)
    engine = assert_matches(path)
    expected = 32 if "original_max_position_embeddings" in rope else 128
    assert engine.model_config.rope_scaling.original_max_position_embeddings == expected


def test_mistral_window_applies_without_use_sliding_window(tmp_path):
    """transformers' Mistral ignores use_sliding_window: the window (16) caps the context,
    and within it the tokens are transformers'."""
    path = make_checkpoint(tmp_path / "m", "mistral", vocab_size=VOCAB, max_position_embeddings=64)
    edit_config(path, sliding_window=16, use_sliding_window=False)
    engine = assert_matches(path, [[5], [7, 40, 9, 200, 31], list(range(20, 28))], max_tokens=8)
    assert engine.model_config.max_model_len == 16
    with pytest.raises(ValueError, match="exceeds the model's context of 16 tokens"):
        engine.generate([list(range(20, 30))], SamplingParams(max_tokens=8, temperature=0.0))


@pytest.mark.parametrize(("max_window_layers", "context"), [(1, 16), (2, 64)])
def test_qwen2_window_only_when_a_layer_slides(tmp_path, max_window_layers, context):
    """Qwen2 slides on layers >= max_window_layers; with none (2 of 2 layers) it is full
    attention over the whole context, and 40-token sequences match transformers."""
    path = make_checkpoint(tmp_path / "m", "qwen2", vocab_size=VOCAB, max_position_embeddings=64,
                           use_sliding_window=True, sliding_window=16, max_window_layers=max_window_layers)
    edit_config(path, layer_types=None)
    prompts = [[5], list(range(20, 28))] + ([list(range(50, 82))] if context == 64 else [])
    engine = assert_matches(path, prompts, max_tokens=8)
    assert engine.model_config.max_model_len == context


def test_tied_config_with_a_distinct_stored_head_uses_the_stored_head(tmp_path):
    path = make_checkpoint(tmp_path / "m", "llama", vocab_size=VOCAB, tie_word_embeddings=True)
    tensors = load_file(path / "model.safetensors")
    assert "lm_head.weight" not in tensors
    tensors["lm_head.weight"] = torch.randn_like(tensors["model.embed_tokens.weight"]) * 0.2
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    engine = assert_matches(path)
    model = engine.runner.model  # untied: its own head (packed for oneDNN, which a tied one is not)
    assert getattr(model.lm_head, "weight", None) is not model.embed_tokens.weight


def test_tied_config_with_only_the_head_stored_ties_to_it(tmp_path):
    path = make_checkpoint(tmp_path / "m", "llama", vocab_size=VOCAB, tie_word_embeddings=True)
    tensors = load_file(path / "model.safetensors")
    tensors["lm_head.weight"] = tensors.pop("model.embed_tokens.weight")
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    engine = assert_matches(path)
    assert engine.runner.model.lm_head.weight is engine.runner.model.embed_tokens.weight


def test_model_safetensors_next_to_an_index_is_the_one_read(tmp_path):
    """transformers looks for model.safetensors first, even beside a shard index."""
    path = make_checkpoint(tmp_path / "m", "llama", vocab_size=VOCAB, max_shard_size="100KB")
    other = make_checkpoint(tmp_path / "other", "llama", vocab_size=VOCAB, seed=7)
    shutil.copy(other / "model.safetensors", path / "model.safetensors")
    assert (path / "model.safetensors.index.json").is_file()
    assert_matches(path)


def test_shard_outside_the_directory_is_refused_unopened(tmp_path):
    path = make_checkpoint(tmp_path / "m", "llama", vocab_size=VOCAB, max_shard_size="100KB")
    other = make_checkpoint(tmp_path / "x", "llama", vocab_size=VOCAB)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    index["weight_map"][next(iter(index["weight_map"]))] = "../x/model.safetensors"
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    assert (other / "model.safetensors").is_file()
    with pytest.raises(ModelLoadError, match=r"shard '../x/model.safetensors' listed in "
                                             r"model.safetensors.index.json points outside the model directory"):
        Engine(EngineConfig(model=str(path)))


def test_truncated_safetensors_error_names_the_file(tmp_path):
    path = make_checkpoint(tmp_path / "m", "llama", vocab_size=VOCAB)
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match=f"{path / 'model.safetensors'} is not a readable safetensors file"):
        Engine(EngineConfig(model=str(path)))
