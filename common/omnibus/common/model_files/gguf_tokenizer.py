"""A GGUF file's tokenizer as transformers 5 builds it from `tokenizer.ggml.*`: byte-level
BPE for model "gpt2", SentencePiece-style BPE with byte fallback for "llama"."""

from __future__ import annotations

from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from omnibus.common.model_files.gguf_header import GgufHeader, or_default

GGUF_TOKENIZER_MODELS = ("gpt2", "llama")  # tokenizer.ggml.model values served

# tokenizer_config.json's special tokens and the metadata key of each one's id
TOKEN_ID_KEYS = {"bos": "bos_token_id", "eos": "eos_token_id", "unk": "unknown_token_id", "pad": "padding_token_id"}
_CONTROL, _USER_DEFINED = 3, 4  # tokenizer.ggml.token_type values

# The pre-tokenizer split of each `tokenizer.ggml.pre` that transformers knows (its
# GGUF_PRE_TOKENIZER_SPLITS); any other byte-level vocabulary splits as GPT-2 does.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN35_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
                 r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
                 r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
                 r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT4O_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
                r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
                r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_PRE_SPLITS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
                     "jina-v5-nano", "dbrx", "smaug-bpe"), _LLAMA3_SPLIT),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"), _QWEN2_SPLIT),
    "qwen35": _QWEN35_SPLIT,
    "tekken": _TEKKEN_SPLIT,
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), _GPT4O_SPLIT),
}


def byte_level_chars() -> dict[int, str]:
    """GPT-2's byte-level alphabet, byte -> character: printable Latin-1 bytes stand for
    themselves, the other 68 for the characters from U+0100 up, in byte order."""
    printable = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    shifted = iter(range(0x100, 0x200))
    return {byte: chr(byte) if byte in printable else chr(next(shifted)) for byte in range(256)}


def token_strings(header: GgufHeader) -> list[str]:
    tokens = header.items("tokenizer.ggml.tokens", str)
    if not tokens:
        raise ValueError(f"{header.path}: the GGUF metadata has no tokenizer.ggml.tokens")
    return tokens


def _special_token(header: GgufHeader, tokens: list[str], name: str) -> str | None:
    """The text of the `name` token (bos, eos, unk, pad); None when the file names none."""
    key = f"tokenizer.ggml.{TOKEN_ID_KEYS[name]}"
    token_id = header.get(key, int)
    if token_id is None:
        return None
    if not 0 <= token_id < len(tokens):
        raise ValueError(f"{header.path}: {key} is {token_id}, outside the vocabulary of {len(tokens)} tokens")
    return tokens[token_id]


def gguf_tokenizer_config(header: GgufHeader) -> dict[str, Any]:
    """tokenizer_config.json as transformers reads this file: the special tokens as text,
    add_bos_token (a SentencePiece vocabulary that does not say adds BOS, as llama.cpp
    does), add_eos_token and the chat template."""
    config: dict[str, Any] = {}
    if any(header.get(f"tokenizer.ggml.{key}", int) is not None for key in TOKEN_ID_KEYS.values()):
        tokens = token_strings(header)
        named = {f"{name}_token": _special_token(header, tokens, name) for name in TOKEN_ID_KEYS}
        config.update({name: token for name, token in named.items() if token is not None})
    default_bos = header.get("tokenizer.ggml.model", str) == "llama"
    config["add_bos_token"] = or_default(header.get("tokenizer.ggml.add_bos_token", bool), default_bos)
    config["add_eos_token"] = or_default(header.get("tokenizer.ggml.add_eos_token", bool), False)
    template = header.get("tokenizer.chat_template", str)
    if template is not None:
        config["chat_template"] = template
    return config


def gguf_tokenizer(header: GgufHeader, config: dict[str, Any]) -> str:
    """tokenizer.json for this file, as transformers 5 builds it (its GGUF tokenizer
    mapping): the model's BPE, its control tokens as special added tokens and its
    user-defined ones as plain added tokens, BOS/EOS added as add_bos/eos_token say."""
    model = header.get("tokenizer.ggml.model", str)
    if model not in GGUF_TOKENIZER_MODELS:
        raise ValueError(f"{header.path}: unsupported tokenizer model {model!r} (tokenizer.ggml.model); "
                         f"supported: {', '.join(GGUF_TOKENIZER_MODELS)}")
    tokens = token_strings(header)
    tokenizer = _byte_level_bpe(header, tokens) if model == "gpt2" else _sentencepiece_bpe(header, tokens)
    _add_tokens(tokenizer, header, tokens, config)
    tokenizer.post_processor = _post_processor(tokenizer, config)
    return tokenizer.to_str()


def _byte_level_bpe(header: GgufHeader, tokens: list[str]) -> Tokenizer:
    """GPT-2's byte-level BPE; a token spelled outside the byte alphabet is respelled
    in it, byte by byte (as transformers does)."""
    spelling = byte_level_chars()
    alphabet = set(spelling.values())
    vocab = {token if set(token) <= alphabet else "".join(spelling[b] for b in token.encode()): index
             for index, token in enumerate(tokens)}
    merges = header.items("tokenizer.ggml.merges", str)
    if merges is None:
        raise ValueError(f"{header.path}: the GGUF metadata has no tokenizer.ggml.merges (a byte-level "
                         "BPE vocabulary needs them)")
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=_merge_pairs(header, merges), dropout=None,
                                     continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False))
    split = _PRE_SPLITS.get(header.get("tokenizer.ggml.pre", str) or "")
    if split is None:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _sentencepiece_bpe(header: GgufHeader, tokens: list[str]) -> Tokenizer:
    """SentencePiece as BPE with byte fallback (transformers' LlamaTokenizer): "▁" for
    spaces, one prepended to the text unless tokenizer.ggml.add_space_prefix is false;
    the merges the file lists, else the ones its scores imply."""
    vocab = {token: index for index, token in enumerate(tokens)}
    listed = header.items("tokenizer.ggml.merges", str)
    merges = _merge_pairs(header, listed) if listed is not None else _merges_by_score(header, tokens, vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True, dropout=None))
    prefix = or_default(header.get("tokenizer.ggml.add_space_prefix", bool), True)
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first" if prefix else "never", split=False)
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    tokenizer.decoder = decoders.Sequence(steps + [decoders.Strip(content=" ", left=1)] * prefix)
    return tokenizer


def _merge_pairs(header: GgufHeader, merges: list[str]) -> list[tuple[str, str]]:
    pairs = [tuple(merge.split(" ")) for merge in merges]
    bad = next((i for i, pair in enumerate(pairs) if len(pair) != 2), None)
    if bad is not None:
        raise ValueError(f"{header.path}: tokenizer.ggml.merges entry {bad} ({merges[bad]!r}) is not two "
                         "tokens separated by one space")
    return [(left, right) for left, right in pairs]


def _merges_by_score(header: GgufHeader, tokens: list[str], vocab: dict[str, int]) -> list[tuple[str, str]]:
    """The merges a scored vocabulary implies (transformers' generate_merges): every split
    of a token into two tokens, ordered by the token's score, best first (ties: the
    longer left piece, then the longer right one; then the vocabulary's order)."""
    scores = header.items("tokenizer.ggml.scores", float)
    if scores is None:
        raise ValueError(f"{header.path}: the GGUF metadata has neither tokenizer.ggml.merges nor "
                         "tokenizer.ggml.scores, so the vocabulary has no merge order")
    found: list[tuple[str, str, float]] = []
    for piece, score in dict(zip(tokens, scores)).items():
        splits = [(piece[:i], piece[i:], score) for i in range(1, len(piece))
                  if piece[:i] in vocab and piece[i:] in vocab]
        found += sorted(splits, key=lambda m: (vocab[m[0]], vocab[m[1]]))
    found.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in found]


def _add_tokens(tokenizer: Tokenizer, header: GgufHeader, tokens: list[str], config: dict[str, Any]) -> None:
    """Control tokens and the named special ones as special added tokens (matched whole,
    never split); user-defined ones (<think>) as plain added tokens. In a byte-level
    vocabulary a control token outside the byte alphabet is a llama.cpp mislabel, left
    out (as transformers does): adding it would grow the vocabulary."""
    types = header.items("tokenizer.ggml.token_type", int) or []
    vocab = tokenizer.get_vocab()
    control = [t for t, kind in zip(tokens, types) if kind == _CONTROL and t in vocab]
    named = [config[f"{name}_token"] for name in TOKEN_ID_KEYS if config.get(f"{name}_token") in vocab]
    special = list(dict.fromkeys(control + named))
    tokenizer.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in special])
    user = [t for t, kind in zip(tokens, types) if kind == _USER_DEFINED and t in vocab and t not in special]
    tokenizer.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])


def _post_processor(tokenizer: Tokenizer, config: dict[str, Any]) -> processors.TemplateProcessing:
    """BOS before and EOS after each sequence where add_bos/eos_token say (transformers'
    update_post_processor)."""
    ids = tokenizer.get_vocab()
    bos, eos = (config.get(f"{name}_token") if config[f"add_{name}_token"] else None for name in ("bos", "eos"))
    bos, eos = (token if token in ids else None for token in (bos, eos))
    single = f"{f'{bos}:0 ' if bos else ''}$A:0{f' {eos}:0' if eos else ''}"
    pair = f"{single}{f' {bos}:1' if bos else ''} $B:1{f' {eos}:1' if eos else ''}"
    special = [(token, ids[token]) for token in dict.fromkeys((bos, eos)) if token]
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)
