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


@pytest.mark.parametrize(("field", "value", "error"), [
    ("hidden_act", "gelu", "unsupported hidden_act 'gelu'; supported: silu"),
    ("hidden_size", "wide", "config.json's hidden_size must be an integer, got 'wide'"),
    ("num_attention_heads", 0, "wrong type or value"),  # hidden_size // 0 for head_dim
    ("num_hidden_layers", None, "num_hidden_layers must be an integer, got None"),
    # Refused, not coerced as Python would (bool("false") is True, int(2.7) is 2).
    ("num_hidden_layers", 2.7, "num_hidden_layers must be an integer, got 2.7"),
    ("attention_bias", "false", "attention_bias must be true or false, got 'false'"),
    ("tie_word_embeddings", "false", "tie_word_embeddings must be true or false"),
    ("max_position_embeddings", 100.9, "max_position_embeddings must be an integer, got 100.9"),
    ("rms_norm_eps", "1e-6", "rms_norm_eps must be a number, got '1e-6'"),
    ("vocab_size", -1, "sizes must be positive: vocab_size=-1"),
])  # fmt: skip
def test_bad_config_values_are_load_errors(ckpt, tmp_path, field, value, error):
    """A config.json value the model cannot be built from is a ModelLoadError naming it,
    not a traceback (and not a silently different model: gelu is not SwiGLU)."""
    m = copy(ckpt, tmp_path)
    cfg = json.loads((m / "config.json").read_text())
    cfg[field] = value
    cfg.pop("head_dim", None)
    (m / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=error):
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
    del tensors["model.layers.0.mlp.gate_proj.weight"]
    del tensors["model.norm.weight"]
    save_file(tensors, m / "model.safetensors")
    # The checkpoint's own names (a user can find them), not the fused parameters they fill.
    with pytest.raises(ModelLoadError, match=r"lacks weights for: model\.layers\.0\.mlp\.gate_proj\.weight, "
                       r"model\.layers\.1\.self_attn\.v_proj\.weight, model\.norm\.weight$"):
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
    with pytest.raises(ValueError, match=r"device must be cpu or cuda\[:N\], got 'cuda:x'"):
        EngineConfig(model="x", device="cuda:x")


def test_a_cuda_device_this_process_cannot_use_is_a_clear_error(ckpt, monkeypatch):
    from omnibus.engine.serving.loading import EngineLoadError, load_engine

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", None)
    with pytest.raises(EngineLoadError, match="--device cuda: this torch build has no CUDA; use --device cpu"):
        load_engine(EngineConfig(model=str(ckpt), device="cuda"))
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    with pytest.raises(EngineLoadError, match="finds no GPU: check the driver and CUDA_VISIBLE_DEVICES"):
        load_engine(EngineConfig(model=str(ckpt), device="cuda:0"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(EngineLoadError, match=r"--device cuda:2: there are 2 GPUs \(cuda:0 to cuda:1\)"):
        load_engine(EngineConfig(model=str(ckpt), device="cuda:2"))


def test_rope_scaling_parsed():
    base = dict(model_type="llama", vocab_size=10, hidden_size=8, intermediate_size=16,
                num_hidden_layers=1, num_attention_heads=2)
    cfg = ModelConfig.from_dict(base | {"rope_scaling": {"rope_type": "llama3", "factor": 8.0,
                                                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                         "original_max_position_embeddings": 8192}})
    assert cfg.rope_scaling.kind == "llama3" and cfg.rope_scaling.factor == 8.0
    with pytest.raises(ModelLoadError, match="unsupported rope scaling 'yarn'"):
        ModelConfig.from_dict(base | {"rope_scaling": {"rope_type": "yarn", "factor": 2.0}})


def test_generation_config_eos_ids_stop_generation_as_in_transformers(ckpt, tmp_path):
    """An end-of-turn id listed only in generation_config.json (as Llama 3 Instruct lists
    <|eot_id|>) ends generation, where transformers' generate ends it."""
    from omnibus.engine.worker.sampling import SamplingParams
    from tests.checkpoints import load_hf

    model = copy(ckpt, tmp_path)
    prompt = [5, 6, 7, 8]
    free = Engine(EngineConfig(model=str(model), dtype="float32", num_kv_blocks=32))
    (tokens,) = free.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    turn_end = next(t for t in tokens[2:] if t not in tokens[:2])  # first seen at step 3 or later
    eos = ModelConfig.from_dir(model).eos_token_ids
    assert turn_end not in eos
    generation = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps(generation | {"eos_token_id": [*eos, turn_end]}))
    assert ModelConfig.from_dir(model).eos_token_ids == (*eos, turn_end)

    engine = Engine(EngineConfig(model=str(model), dtype="float32", num_kv_blocks=32))
    (stopped,) = engine.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0))
    assert stopped == tokens[: tokens.index(turn_end) + 1]
    hf = load_hf(model)
    ids = torch.tensor([prompt])
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert out[0, len(prompt):].tolist() == stopped


@pytest.mark.parametrize("case", ["generation lists another", "generation lists none", "no generation config"])
def test_the_eos_ids_are_the_ones_transformers_generate_stops_at(ckpt, tmp_path, case):
    """generation_config.json's eos_token_id, where that file exists, replaces config.json's
    (it was their union: the engine stopped where transformers goes on)."""
    from omnibus.engine.worker.sampling import SamplingParams
    from tests.checkpoints import load_hf

    model = copy(ckpt, tmp_path)
    prompt = [5, 6, 7, 8]
    free = Engine(EngineConfig(model=str(model), dtype="float32", num_kv_blocks=32))
    (tokens,) = free.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    fresh = [t for i, t in enumerate(tokens) if t not in tokens[:i]]
    early, late = fresh[1], fresh[-1]  # config.json's id comes first, generation's later
    raw = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(raw | {"eos_token_id": early}))
    generation = model / "generation_config.json"
    if case == "no generation config":
        generation.unlink()
    else:
        gen = {k: v for k, v in json.loads(generation.read_text()).items() if k != "eos_token_id"}
        generation.write_text(json.dumps(gen | ({"eos_token_id": [late]} if case == "generation lists another" else {})))
    engine = Engine(EngineConfig(model=str(model), dtype="float32", num_kv_blocks=32))
    (stopped,) = engine.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0))
    hf = load_hf(model)
    ids = torch.tensor([prompt])
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert stopped == out[0, len(prompt):].tolist()
    stop = {"generation lists another": late, "generation lists none": None, "no generation config": early}[case]
    assert stopped == (tokens if stop is None else tokens[: tokens.index(stop) + 1])


@pytest.mark.parametrize(("content", "error"), [
    ("{nope", "cannot be read as JSON"),
    ('{"eos_token_id": "</s>"}', "eos_token_id must be a token id or a list of them"),
    ('[1, 2]', "is not a JSON object"),
])  # fmt: skip
def test_a_bad_generation_config_is_a_clear_error(ckpt, tmp_path, content, error):
    model = copy(ckpt, tmp_path)
    (model / "generation_config.json").write_text(content)
    with pytest.raises(ModelLoadError, match=error):
        ModelConfig.from_dir(model)


def test_a_max_model_len_past_the_models_context_is_capped_with_a_warning(ckpt):
    from structlog.testing import capture_logs

    limit = ModelConfig.from_dir(ckpt).max_model_len
    with capture_logs() as logs:
        engine = Engine(EngineConfig(model=str(ckpt), max_model_len=limit * 4, num_kv_blocks=8))
    assert engine.model_config.max_model_len == limit
    assert [(e["event"], e["requested"], e["serving"]) for e in logs if e["log_level"] == "warning"] == [
        ("max_model_len_capped", limit * 4, limit)]


def test_a_model_that_does_not_fit_in_memory_is_a_clear_error(ckpt):
    """An allocation failure at load (here a KV pool of ~10^12 blocks) names what must fit
    and the flags that size it, instead of a traceback from the allocator."""
    from omnibus.engine.serving.loading import EngineLoadError, load_engine

    with pytest.raises(EngineLoadError, match=r"out of cpu memory .*--kv-cache-memory, --num-kv-blocks.*"
                       r"--max-model-len"):
        load_engine(EngineConfig(model=str(ckpt), num_kv_blocks=10**12))


def test_an_unexpected_bias_points_at_the_config_switch(ckpt, tmp_path):
    """A Llama checkpoint with biases its config.json does not declare: refused, naming the
    tensor and the config fields that declare biases."""
    m = copy(ckpt, tmp_path)
    tensors = load_file(m / "model.safetensors")
    tensors["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(
        tensors["model.layers.0.self_attn.q_proj.weight"].shape[0])
    save_file(tensors, m / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"unexpected tensor 'model.layers.0.self_attn.q_proj.bias' .*"
                       r"attention_bias / mlp_bias"):
        Engine(EngineConfig(model=str(m)))


def test_a_preload_adapter_that_cannot_be_served_is_named_as_such(ckpt, tmp_path):
    """Not "cannot load <model dir>": the model is fine, the --preload-adapters one is not."""
    from omnibus.engine.serving.loading import EngineLoadError, load_engine

    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "adapter_config.json").write_text(json.dumps({"r": 2, "target_modules": ["q_proj"]}))
    with pytest.raises(EngineLoadError, match=r"^--preload-adapters: adapter 'x' has no adapter_model.safetensors"):
        load_engine(EngineConfig(model=str(ckpt), adapter_dir=str(tmp_path), preload_adapters=("x",)))
