"""GGUF files built by the tests from the small Hugging Face checkpoints of tests/checkpoints.py,
the way llama.cpp's convert_hf_to_gguf.py writes them: llama.cpp's tensor names, Llama's q/k
rows permuted to llama.cpp's rotary order, the tokenizer (byte-level BPE: tokens, types,
merges) and special ids in the metadata, and each projection in a chosen ggml type
(quantized by the `gguf` package's own quantizers).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

import gguf

_LAYER = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}
_GLOBAL = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def gguf_name(hf: str) -> str:
    base, _, suffix = hf.rpartition(".")
    if base in _GLOBAL:
        return f"{_GLOBAL[base]}.{suffix}"
    _, _, layer, rest = base.split(".", 3)  # model.layers.N.<rest>
    return f"blk.{layer}.{_LAYER[rest]}.{suffix}"


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert permute (Hugging Face's half-split rotary -> adjacent pairs)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(hf_dir: Path, out: Path, projection_type: str = "Q8_0", embedding_type: str = "F32",
               chat_template: str | None = None, arch: str | None = None, name: str | None = None) -> Path:
    """`hf_dir`'s checkpoint as a GGUF file: projections (and an untied lm_head) in
    `projection_type`, the embedding table in `embedding_type`, norms in F32. `arch`
    (default: the checkpoint's model_type) and `general.name`: llama.cpp writes Mistral as
    arch "llama" named "mistral", q/k permuted like Llama's."""
    cfg = json.loads((hf_dir / "config.json").read_text())
    arch = arch or cfg["model_type"]
    tensors = load_file(str(hf_dir / "model.safetensors"))
    writer = gguf.GGUFWriter(str(out), arch)
    if name:
        writer.add_name(name)
    _metadata(writer, cfg)
    _tokenizer(writer, hf_dir, cfg, chat_template)
    factors = _llama3_rope_factors(cfg)
    if factors is not None:
        writer.add_tensor("rope_freqs.weight", factors)
    for name, t in tensors.items():
        w = t.float().numpy()
        if arch == "llama" and (".q_proj." in name or ".k_proj." in name):
            heads = cfg["num_attention_heads"] if ".q_proj." in name else cfg["num_key_value_heads"]
            w = _permute(w, heads)
        if name.endswith("_proj.weight") or name == "lm_head.weight":
            kind = projection_type
        elif name == "model.embed_tokens.weight":
            kind = embedding_type
        else:
            kind = "F32"
        qtype = gguf.GGMLQuantizationType[kind]
        data = gguf.quants.quantize(w, qtype) if kind != "F32" else w
        writer.add_tensor(gguf_name(name), data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _llama3_rope_factors(cfg: dict) -> np.ndarray | None:
    """Llama 3.1's rope scaling as llama.cpp's convert writes it: no scaling metadata, a
    rope_freqs tensor of one factor per frequency (each frequency is divided by it)."""
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if rope.get("rope_type") != "llama3":
        return None
    dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    freqs = 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope.get("original_max_position_embeddings", 8192)
    factors = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            factors.append(1.0)
        elif wavelen > old / low:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def _metadata(writer: gguf.GGUFWriter, cfg: dict) -> None:
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_rope_freq_base(float(cfg.get("rope_theta") or cfg.get("rope_parameters", {}).get("rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_vocab_size(cfg["vocab_size"])
    writer.add_rope_dimension_count(cfg["hidden_size"] // cfg["num_attention_heads"])
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)


def _tokenizer(writer: gguf.GGUFWriter, hf_dir: Path, cfg: dict, chat_template: str | None) -> None:
    tok = json.loads((hf_dir / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    tokens = [""] * cfg["vocab_size"]
    for piece, i in vocab.items():
        tokens[i] = piece
    for i, piece in enumerate(tokens):  # the trained vocabulary may be smaller than the table
        if not piece:
            tokens[i] = f"[PAD{i}]"
    specials = {a["id"] for a in tok.get("added_tokens", [])}
    types = [gguf.TokenType.CONTROL if i in specials else gguf.TokenType.NORMAL for i in range(len(tokens))]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(cfg.get("bos_token_id", 1))
    writer.add_eos_token_id(cfg.get("eos_token_id", 2))
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(False)
    if chat_template:
        writer.add_chat_template(chat_template)


def hf_from_gguf(path: Path):
    """transformers' model loaded from the GGUF file (dequantized by gguf, float32)."""
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                             dtype=torch.float32).eval()
