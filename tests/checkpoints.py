"""Small random Hugging Face checkpoints built by the tests themselves (no downloads).

`make_checkpoint(tmp_path, arch="llama", **overrides)` writes a directory with
`config.json`, safetensors weights (sharded when `max_shard_size` is given) and a
`tokenizer.json` trained with the `tokenizers` library on a few sentences.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

CORPUS = [
    "Once upon a time there was a little fox who lived in a green forest.",
    "Every day the fox ran to the river and looked at the fish.",
    "The quick brown dog jumps over the lazy cat, café au lait ☕ naïve résumé.",
    "Numbers like 12345 and symbols like {}[]()<>!? appear too.",
]

_BASE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
    tie_word_embeddings=False,
    # Larger than HF's 0.02 so that random logits are well separated and greedy
    # argmax does not hinge on float rounding differences between implementations.
    initializer_range=0.2,
)


def build_tokenizer(vocab_size: int) -> Tokenizer:
    """Byte-level BPE with <unk>, <s>, </s> at ids 0, 1, 2 (so every byte is encodable)."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 4, trainer=trainer)
    return tok


def make_checkpoint(
    path: Path,
    arch: str = "llama",
    *,
    vocab_size: int = 384,
    max_shard_size: str | None = None,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    echo: bool = False,
    **overrides,
) -> Path:
    """Write a random-weight checkpoint of `arch` ("llama", "mistral", "qwen2") to `path`.
    `echo`: every layer adds nothing (o_proj, down_proj zero) and the embeddings are tied,
    so the logits are the last token's embedding against all: greedy repeats the last
    token (a model whose output n-gram speculation guesses right)."""
    import transformers

    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    }[arch]
    kwargs = dict(_BASE, vocab_size=vocab_size)
    if arch == "mistral":
        kwargs["head_dim"] = kwargs["hidden_size"] // kwargs["num_attention_heads"]
        kwargs["sliding_window"] = None
    kwargs.update(overrides)
    if echo:
        kwargs["tie_word_embeddings"] = True
    config = config_cls(**kwargs)
    torch.manual_seed(seed)
    model = model_cls(config).to(dtype).eval()
    if echo:
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.o_proj.weight.zero_()
                layer.mlp.down_proj.weight.zero_()
    path.mkdir(parents=True, exist_ok=True)
    save_kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **save_kwargs)
    tok = build_tokenizer(vocab_size)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"})
    )
    return path


def load_hf(path: Path):
    """The transformers reference model for a checkpoint directory (float32, eval)."""
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_greedy(model, prompt: list[int], max_new_tokens: int, grammar=None, eos: int | None = None) -> list[int]:
    """Greedy continuation of one prompt with transformers, never stopping at EOS (the
    engine's counterpart is `ignore_eos=True`); with `grammar` (an xgrammar compiled
    grammar), under xgrammar's Hugging Face logits processor, stopping at `eos`."""
    kw: dict = {}
    if grammar is None:
        model.generation_config.eos_token_id = None
    else:
        import xgrammar

        kw = dict(eos_token_id=eos, logits_processor=[xgrammar.contrib.hf.LogitsProcessor(grammar)])
    ids = torch.tensor([prompt])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=0,
        **kw,
    )
    return out[0, len(prompt):].tolist()
