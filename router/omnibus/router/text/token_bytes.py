"""The bytes of one token, for logprobs.

`tokenizer.decode([id])` is lossy for a token that holds part of a character (a byte
of byte-level BPE, a <0xNN> byte-fallback token): it gives U+FFFD, so the token's text,
its `bytes` and the completion's text offsets would all be wrong. The bytes come from
the vocabulary instead:

- byte-level BPE (GPT-2, Llama 3, Qwen): each character of the token string stands for
  one byte (GPT-2's printable mapping of the 256 bytes);
- SentencePiece byte fallback (Llama 2, Mistral): <0xNN> is byte NN;
- any other token: its text decoded after a plain anchor token, so a decoder that
  strips a leading space from the first token (SentencePiece's) keeps it here.

Added tokens (special or not) are what decoding them gives (a normalized added token's
normalized form). A token's text for the OpenAI API is
its bytes as UTF-8, or, when they are not valid UTF-8 on their own, OpenAI's
`bytes:\\xNN...` form, which keeps different byte tokens apart.
"""

from __future__ import annotations

import json
import re
from functools import lru_cache

from tokenizers import Tokenizer

from omnibus.common.model_files import byte_level_chars

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")
# GPT-2's byte-level alphabet, character -> byte (the one a GGUF's byte-level tokenizer is spelled in)
_BYTE_LEVEL = {char: byte for byte, char in byte_level_chars().items()}


def _decoder_types(decoder: object) -> set[str]:
    """Every decoder type in a tokenizer.json `decoder` entry (Sequences included)."""
    if not isinstance(decoder, dict):
        return set()
    types = {decoder.get("type", "")}
    for inner in decoder.get("decoders") or []:
        types |= _decoder_types(inner)
    return types


class TokenBytes:
    """token id → the bytes it stands for, cached."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        types = _decoder_types(json.loads(tokenizer.to_str()).get("decoder"))
        self._byte_level = "ByteLevel" in types
        self._byte_fallback = "ByteFallback" in types
        self._added = set(tokenizer.get_added_tokens_decoder())
        self._anchor = self._find_anchor()
        self._anchor_text = "" if self._anchor is None else self._decode([self._anchor])
        self.of = lru_cache(maxsize=1 << 16)(self._bytes)

    def text(self, token_id: int) -> str:
        """The token as the OpenAI API names it in logprobs."""
        return as_text(self.of(token_id))

    def _bytes(self, token_id: int) -> bytes:
        if token_id in self._added:
            return self._decode([token_id]).encode()
        token = self._tokenizer.id_to_token(token_id)
        if token is None:  # outside the vocabulary (a padded embedding row)
            return b""
        if self._byte_level and all(ch in _BYTE_LEVEL for ch in token):
            return bytes(_BYTE_LEVEL[ch] for ch in token)
        if self._byte_fallback and (match := _BYTE_TOKEN.fullmatch(token)):
            return bytes([int(match.group(1), 16)])
        if self._anchor is not None:
            both = self._decode([self._anchor, token_id])
            if both.startswith(self._anchor_text):
                return both[len(self._anchor_text):].encode()
        return self._decode([token_id]).encode()

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=False)

    def _find_anchor(self) -> int | None:
        """The first vocabulary token that decodes to plain letters on its own."""
        vocab = self._tokenizer.get_vocab(with_added_tokens=False)
        for token_id in sorted(vocab.values()):
            decoded = self._decode([token_id])
            if decoded.isascii() and decoded.isalpha():
                return token_id
        return None


def as_text(data: bytes) -> str:
    """`data` as UTF-8, or `bytes:\\xNN...` when it is not valid UTF-8."""
    try:
        return data.decode()
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in data)
