"""Checkpoint loading: clear errors for what cannot be served."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from omnibus.engine.config import EngineConfig, ModelConfig, ModelLoadError
from omnibus.engine.engine import Engine
from tests.checkpoints import make_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("base"), "llama")


def copy(ckpt, tmp_path):
    dst = tmp_path / "m"
    shutil.copytree(ckpt, dst)
    return dst


def test_missing_directory(tmp_path):
    with pytest.raises(ModelLoadError, match="config.json not found"):
        Engine(EngineConfig(model=str(tmp_path / "nope")))


def test_missing_weights(ckpt, tmp_path):
    m = copy(ckpt, tmp_path)
    (m / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="no model.safetensors"):
        Engine(EngineConfig(model=str(m)))


def test_pickle_checkpoint_refused(ckpt, tmp_path):
    m = copy(ckpt, tmp_path)
    (m / "model.safetensors").unlink()
    (m / "pytorch_model.bin").write_bytes(b"\x80\x04not really a pickle")
    with pytest.raises(ModelLoadError, match="pickle checkpoint"):
        Engine(EngineConfig(model=str(m)))


def test_unsupported_architecture(ckpt, tmp_path):
    m = copy(ckpt, tmp_path)
    cfg = json.loads((m / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    (m / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="unsupported architecture 'gpt2'"):
        Engine(EngineConfig(model=str(m)))


def test_shape_mismatch(ckpt, tmp_path):
    m = copy(ckpt, tmp_path)
    cfg = json.loads((m / "config.json").read_text())
    cfg["intermediate_size"] = 96
    (m / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=r"shape mismatch for model.layers.0.mlp.(gate|up|down)_proj.weight"):
        Engine(EngineConfig(model=str(m)))


def test_missing_tensor(ckpt, tmp_path):
    m = copy(ckpt, tmp_path)
    tensors = load_file(m / "model.safetensors")
    del tensors["model.layers.1.self_attn.v_proj.weight"]
    save_file(tensors, m / "model.safetensors")
    with pytest.raises(ModelLoadError, match="lacks weights for: layers.1.self_attn.qkv_proj.weight"):
        Engine(EngineConfig(model=str(m)))


def test_missing_shard(tmp_path):
    m = make_checkpoint(tmp_path / "sharded", "llama", max_shard_size="100KB")
    shard = sorted(m.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(ModelLoadError, match=f"shard {shard.name} .* is missing"):
        Engine(EngineConfig(model=str(m)))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_dtypes_load_and_run(ckpt, dtype):
    engine = Engine(EngineConfig(model=str(ckpt), dtype=dtype, num_kv_blocks=32))
    assert engine.runner.kv_caches[0][0].dtype == getattr(torch, dtype)
    from omnibus.engine.worker.sampling import SamplingParams
    (out,) = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    assert len(out) == 3


def test_config_values_validated():
    with pytest.raises(ValueError, match="block_size must be a power of two"):
        EngineConfig(model="x", block_size=12)
    with pytest.raises(ValueError, match="dtype must be one of"):
        EngineConfig(model="x", dtype="int8")
    with pytest.raises(ValueError, match="batching must be"):
        EngineConfig(model="x", batching="sometimes")


def test_rope_scaling_parsed():
    base = dict(model_type="llama", vocab_size=10, hidden_size=8, intermediate_size=16,
                num_hidden_layers=1, num_attention_heads=2)
    cfg = ModelConfig.from_dict(base | {"rope_scaling": {"rope_type": "llama3", "factor": 8.0,
                                                         "original_max_position_embeddings": 8192}})
    assert cfg.rope_scaling.kind == "llama3" and cfg.rope_scaling.factor == 8.0
    with pytest.raises(ModelLoadError, match="unsupported rope scaling 'yarn'"):
        ModelConfig.from_dict(base | {"rope_scaling": {"rope_type": "yarn", "factor": 2.0}})
