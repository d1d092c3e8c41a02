"""config.json read as transformers reads it: the context (defaults, sliding windows), rope
parameters, and refusals of what cannot be served. The engine and the router share the
context rule (omnibus.common.checkpoint), so the router advertises what engines serve."""

from __future__ import annotations

import json

import pytest
import transformers

from omnibus.common.checkpoint import context_length
from omnibus.engine.config import ModelConfig, ModelLoadError
from omnibus.router.admission.validation import ModelLimits
from omnibus.router.config import RouterConfig

BASE = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2)
LLAMA3 = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0}


def hf_config(tmp_path, raw: dict):
    (tmp_path / "config.json").write_text(json.dumps(raw))
    return transformers.AutoConfig.from_pretrained(tmp_path)


def hf_context(cfg) -> int:
    """The context within which transformers' attention is full attention in every layer:
    LlamaModel has no window; MistralModel masks with config.sliding_window; Qwen2Model
    with it on the layers layer_types marks sliding."""
    window = None if cfg.model_type == "llama" else cfg.sliding_window
    if cfg.model_type == "qwen2" and "sliding_attention" not in cfg.layer_types:
        window = None
    return cfg.max_position_embeddings if window is None else min(cfg.max_position_embeddings, window)


@pytest.mark.parametrize(("raw", "context"), [
    (dict(model_type="llama"), 2048),  # no max_position_embeddings: LlamaConfig's default
    (dict(model_type="mistral", sliding_window=None), 4096 * 32),  # MistralConfig's default
    (dict(model_type="qwen2"), 32768),  # Qwen2Config's default
    (dict(model_type="llama", max_position_embeddings=64, sliding_window=16, use_sliding_window=True), 64),
    # Mistral without a sliding_window key: MistralConfig's 4096
    (dict(model_type="mistral", max_position_embeddings=8192), 4096),
    # Mistral has no use_sliding_window switch: the window applies anyway
    (dict(model_type="mistral", max_position_embeddings=64, sliding_window=16, use_sliding_window=False), 16),
    (dict(model_type="qwen2", max_position_embeddings=64, sliding_window=16), 64),  # use_sliding_window off
    # Qwen2 use_sliding_window without a sliding_window key: 4096, on layers >= max_window_layers
    (dict(model_type="qwen2", max_position_embeddings=8192, use_sliding_window=True, max_window_layers=1), 4096),
    (dict(model_type="qwen2", max_position_embeddings=64, use_sliding_window=True, sliding_window=16,
          max_window_layers=1), 16),
    # no layer slides (max_window_layers >= num_hidden_layers): no window
    (dict(model_type="qwen2", max_position_embeddings=64, use_sliding_window=True, sliding_window=16,
          max_window_layers=2), 64),
    (dict(model_type="qwen2", max_position_embeddings=8192, use_sliding_window=True), 8192),  # default 28 layers
    (dict(model_type="qwen2", max_position_embeddings=64, use_sliding_window=True, sliding_window=16,
          max_window_layers=0, layer_types=["full_attention", "full_attention"]), 64),
])  # fmt: skip
def test_context_follows_transformers_per_architecture(tmp_path, raw, context):
    raw = BASE | raw
    assert hf_context(hf_config(tmp_path, raw)) == context  # the rule is transformers'
    assert context_length(raw) == context
    assert ModelConfig.from_dict(raw).max_model_len == context
    (tmp_path / "config.json").write_text(json.dumps(raw))
    limits = ModelLimits.load(RouterConfig(model=str(tmp_path), engines=("127.0.0.1:1",)))
    assert limits.context == context  # the router advertises what the engine serves


@pytest.mark.parametrize(("raw", "original"), [
    (dict(max_position_embeddings=256, rope_parameters=LLAMA3), 256),  # default: max_position_embeddings
    (dict(max_position_embeddings=256, rope_parameters=LLAMA3 | {"original_max_position_embeddings": 64}), 64),
    # a top-level value wins over the dict's (transformers' Phi3 rule, for every model)
    (dict(max_position_embeddings=256, original_max_position_embeddings=32,
          rope_parameters=LLAMA3 | {"original_max_position_embeddings": 64}), 32),
    (dict(max_position_embeddings=256, original_max_position_embeddings=32, rope_parameters=LLAMA3), 32),
])  # fmt: skip
def test_llama3_original_context_follows_transformers(raw, original):
    scaling = ModelConfig.from_dict(BASE | {"model_type": "llama"} | raw).rope_scaling
    assert (scaling.kind, scaling.original_max_position_embeddings) == ("llama3", original)


def test_legacy_rope_scaling_replaces_rope_parameters():
    """transformers takes a legacy rope_scaling dict whole; rope_theta then comes from it or
    the top level, not from rope_parameters."""
    cfg = ModelConfig.from_dict(BASE | {"model_type": "llama", "rope_theta": 77.0,
                                        "rope_scaling": {"type": "linear", "factor": 2.0},
                                        "rope_parameters": {"rope_type": "default", "rope_theta": 123.0}})
    assert (cfg.rope_theta, cfg.rope_scaling.kind, cfg.rope_scaling.factor) == (77.0, "linear", 2.0)


@pytest.mark.parametrize(("change", "error"), [
    ({"rope_parameters": {"rope_type": "linear", "factor": 0.0}}, "rope scaling factor must be positive, got 0.0"),
    ({"rope_parameters": {"rope_type": "llama3", "factor": -8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}},
     "rope scaling factor must be positive, got -8.0"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 0.0}}, "rope_theta must be positive, got 0.0"),
    ({"rope_theta": -5.0}, "rope_theta must be positive, got -5.0"),
    ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0}},  # transformers: KeyError
     "llama3 rope scaling needs low_freq_factor, high_freq_factor"),
    ({"hidden_size": 60}, "head_dim is 15: rotary embeddings .* need an even head_dim"),
    ({"head_dim": 15}, "head_dim is 15"),
    ({"model_type": None}, "config.json has no model_type; supported: llama, mistral, qwen2"),
    ({"model_type": "gemma"}, "unsupported architecture 'gemma'"),
    ({"sliding_window": 0}, "sliding_window must be a positive number of tokens or null, got 0"),
])  # fmt: skip
def test_configs_that_cannot_be_served_exactly_are_refused(change, error):
    raw = {k: v for k, v in (BASE | {"model_type": "mistral"} | change).items() if v is not None}
    with pytest.raises(ModelLoadError, match=error):
        ModelConfig.from_dict(raw)


def test_router_reads_the_context_of_a_config_without_max_position_embeddings(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(BASE | {"model_type": "llama"}))
    limits = ModelLimits.load(RouterConfig(model=str(tmp_path), engines=("127.0.0.1:1",), max_tokens_limit=8192))
    assert (limits.context, limits.max_tokens) == (2048, 2047)


@pytest.mark.parametrize(("raw", "error"), [
    (dict(model_type="qwen2", use_sliding_window="false", sliding_window=16), "use_sliding_window must be true or false"),
    (dict(model_type="mistral", sliding_window=16.5), "sliding_window must be an integer, got 16.5"),
    (dict(model_type="llama", max_position_embeddings="4096"), "max_position_embeddings must be an integer"),
    (dict(model_type="llama", max_position_embeddings=True), "max_position_embeddings must be an integer"),
])  # fmt: skip
def test_a_context_field_of_the_wrong_json_type_is_refused_not_coerced(raw, error):
    """bool("false") is True: a Qwen2 context would silently become its window."""
    with pytest.raises(ValueError, match=error):
        context_length(raw)


@pytest.mark.parametrize(("rope", "error"), [
    ({"rope_type": "linear", "factor": "2"}, "factor must be a number, got '2'"),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": True},
     "high_freq_factor must be a number, got True"),
    ({"rope_type": "default", "rope_theta": "1e4"}, "rope_theta must be a number, got '1e4'"),
])  # fmt: skip
def test_rope_parameters_of_the_wrong_json_type_are_refused_not_coerced(rope, error):
    base = dict(model_type="llama", vocab_size=10, hidden_size=8, intermediate_size=16,
                num_hidden_layers=1, num_attention_heads=2)
    with pytest.raises(ModelLoadError, match=error):
        ModelConfig.from_dict(base | {"rope_parameters": rope})
