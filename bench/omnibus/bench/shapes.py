"""Model shapes the benchmarks run at random weights (load_format dummy), and the
config.json that describes one: shared by the benchmarks and the tests that size them."""

from __future__ import annotations

import json
from pathlib import Path

LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192,
                 rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=512, max_position_embeddings=1024)


def write_config(path: Path, shape: dict) -> Path:
    """A Llama checkpoint directory holding only config.json, of `shape`."""
    path.mkdir(parents=True, exist_ok=True)
    cfg = dict(shape, model_type="llama", rms_norm_eps=1e-5, tie_word_embeddings=False,
               bos_token_id=1, eos_token_id=2, dtype="bfloat16")
    (path / "config.json").write_text(json.dumps(cfg))
    return path
