"""Incremental detokenization: token ids in, text deltas out.

Decoding token by token is wrong in two ways: a character split over several byte
tokens decodes to U+FFFD until its last byte arrives, and decoders that strip or merge
at token boundaries (SentencePiece's leading space) decode a lone token differently
than in context. So each step decodes a short window twice, with and without the new
tokens, and emits the difference (the approach of TGI and vLLM):

    ids:  ... | prefix ... | new ...
                ^ prefix     ^ read
    delta = decode(ids[prefix:])[len(decode(ids[prefix:read])):]

Text is held back while it ends in U+FFFD (an incomplete character) and while the last
token is a byte-fallback token (<0xNN>): the ByteFallback decoder turns a whole run of
byte tokens into U+FFFDs if any byte in it is invalid, so a run is final only once a
non-byte token follows (skipped special tokens do not count: they vanish before the
decoder sees the run). `flush()` releases whatever is held when the request ends.
Concatenating every delta and the flush equals `tokenizer.decode(all_ids)`.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence

from tokenizers import Tokenizer

_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")
_REPLACEMENT = "\ufffd"


def byte_fallback_ids(tokenizer: Tokenizer) -> frozenset[int]:
    """Ids of the tokenizer's <0xNN> byte-fallback tokens (empty for byte-level BPE)."""
    vocab = tokenizer.get_vocab(with_added_tokens=False)
    return frozenset(i for token, i in vocab.items() if _BYTE_TOKEN.fullmatch(token))


def special_ids(tokenizer: Tokenizer) -> frozenset[int]:
    """Ids of special tokens, which decoding with skip_special_tokens drops."""
    return frozenset(i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special)


class IncrementalDetokenizer:
    """Turns one request's stream of token ids into text deltas."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        byte_ids: frozenset[int] | None = None,
        skipped_ids: frozenset[int] | None = None,
        skip_special_tokens: bool = True,
    ) -> None:
        """`byte_ids`, `skipped_ids`: byte_fallback_ids(tokenizer) and
        special_ids(tokenizer), computed here unless given (pass them to share one set)."""
        self._tokenizer = tokenizer
        self._byte_ids = byte_fallback_ids(tokenizer) if byte_ids is None else byte_ids
        self._skip_special = skip_special_tokens
        if not skip_special_tokens:
            self._skipped_ids: frozenset[int] = frozenset()
        else:
            self._skipped_ids = special_ids(tokenizer) if skipped_ids is None else skipped_ids
        self._ids: list[int] = []
        self._prefix = 0  # start of the decode window: a point where the text was final
        self._read = 0  # end of the text already emitted

    def push(self, token_ids: Sequence[int]) -> str:
        """Adds new tokens; returns the text they complete (possibly "")."""
        self._ids.extend(token_ids)
        if len(self._ids) == self._read or self._ends_in_byte_run():
            return ""
        prefix_text, full_text = self._window()
        if full_text.endswith(_REPLACEMENT) or not full_text.startswith(prefix_text):
            return ""
        delta = full_text[len(prefix_text) :]
        if not delta:
            # Nothing new (e.g. a stripped leading space, a skipped special token): keep
            # the window where it is, so those tokens keep their context for later ones.
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return delta

    def flush(self) -> str:
        """Everything not emitted yet, complete or not. Call once, at the end."""
        if len(self._ids) == self._read:
            return ""
        prefix_text, full_text = self._window()
        self._prefix = self._read = len(self._ids)
        # Were the window's start rewritten by the new tokens (push() then held back),
        # the common prefix keeps the result as close to decode(all) as a stream can.
        return full_text[len(os.path.commonprefix([prefix_text, full_text])) :]

    def _ends_in_byte_run(self) -> bool:
        for i in reversed(self._ids):
            if i not in self._skipped_ids:
                return i in self._byte_ids
        return False

    def _window(self) -> tuple[str, str]:
        decode = self._tokenizer.decode
        prefix_text = decode(
            self._ids[self._prefix : self._read], skip_special_tokens=self._skip_special
        )
        full_text = decode(self._ids[self._prefix :], skip_special_tokens=self._skip_special)
        return prefix_text, full_text
