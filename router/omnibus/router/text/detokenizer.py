"""Incremental detokenization: token ids in, text deltas out.

Decoding token by token is wrong in two ways: a character split over several byte
tokens decodes to U+FFFD until its last byte arrives, and decoders that strip or merge
at token boundaries (SentencePiece's leading space) decode a lone token differently
than in context. The tokenizers library's `DecodeStream` (Rust) handles both the way
TGI and vLLM do: it decodes a short window of recent ids with and without the new ones
and emits the difference, holding text back while it ends in U+FFFD, and keeping the
window where it is while new tokens add nothing (a stripped leading space, a skipped
special token), so those tokens keep their context for later ones.

The stream starts from the end of the prompt (`context`), as vLLM's and TGI's do, so the
output reads as the prompt's continuation: decoders that strip the first token's leading
space (SentencePiece's Metaspace, Strip) keep it, and the text is what
decode(prompt + output) adds to decode(prompt).

One case it does not handle is held here: the ByteFallback decoder turns a whole run of
<0xNN> byte tokens into U+FFFDs if any byte in it is invalid, so a run is final only once
a non-byte token follows (skipped special tokens do not count: they vanish before the
decoder sees the run). Byte-run ids are kept back and handed to the stream together with
the token that closes the run. `flush()` releases whatever is held when the request ends.
Concatenating every delta and the flush equals that continuation (`decode(all_ids)`
without a context).

When new tokens rewrite text the stream already holds as final (the output's first bytes
complete, or break, a character the prompt ends with; a byte run turned invalid), the
stream cannot go on ("invalid prefix"): the text is then settled against the decode of
all output so far, as `flush()` does, and a new stream starts after it. Until that decode
stops ending inside a character, nothing is emitted.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from os.path import commonprefix

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")
# The stream starts from the prompt's last tokens: at least this many that decoding keeps
# (vLLM starts from 4), looking back at most _MAX_CONTEXT.
_MIN_CONTEXT, _MAX_CONTEXT = 4, 64


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
        context: Sequence[int] = (),
    ) -> None:
        """`byte_ids`, `skipped_ids`: byte_fallback_ids(tokenizer) and
        special_ids(tokenizer), computed here unless given (pass them to share one set).
        `context`: the prompt's ids, whose end the output continues."""
        self._tokenizer = tokenizer
        self._byte_ids = byte_fallback_ids(tokenizer) if byte_ids is None else byte_ids
        self._skip_special = skip_special_tokens
        if not skip_special_tokens:
            self._skipped_ids: frozenset[int] = frozenset()
        else:
            self._skipped_ids = special_ids(tokenizer) if skipped_ids is None else skipped_ids
        self._context = self._tail(context)
        self._stream: DecodeStream | None = None  # None: settling (push)
        self._start_stream(self._context)
        self._ids: list[int] = []  # every id pushed, for flush()
        self._byte_run: list[int] = []  # ids of an open byte run, not yet given to the stream
        self._in_byte_run = False  # the last id that is not skipped is a byte token
        self._deltas: list[str] = []  # everything emitted
        self._pending = False  # ids pushed since the last delta

    def push(self, token_ids: Sequence[int]) -> str:
        """Adds new tokens; returns the text they complete (possibly "")."""
        if not token_ids:
            return ""
        self._ids.extend(token_ids)
        self._pending = True
        if self._byte_ids and self._opens_byte_run(token_ids):
            self._byte_run.extend(token_ids)
            return ""
        ids = [*self._byte_run, *token_ids] if self._byte_run else list(token_ids)
        self._byte_run = []
        if self._stream is None:  # settling a rewrite (module docstring)
            return self._resync()
        try:
            delta = self._stream.step(self._tokenizer, ids)
        except Exception:  # noqa: BLE001 (tokenizers raises a bare Exception: "invalid prefix")
            self._stream = None
            return self._resync()
        if not delta:
            return ""
        self._deltas.append(delta)
        self._pending = False
        return delta

    def _resync(self) -> str:
        """After a rewrite: what decode(all output) adds to the text emitted so far, once it
        no longer ends inside a character; the stream then starts again after it."""
        full = self._decode(self._ids)
        if full.endswith("\ufffd"):
            return ""
        delta = self._settle(full)
        self._start_stream(self._tail(self._context + self._ids))
        return delta

    def _start_stream(self, context: list[int]) -> None:
        """A DecodeStream after `context`, unless its text ends inside a character: its
        first step would emit that text whole (settling goes on until one can start)."""
        if not self._tokenizer.decode(context, skip_special_tokens=self._skip_special).endswith("\ufffd"):
            self._stream = DecodeStream(context, self._skip_special)

    def _settle(self, full: str) -> str:
        """What `full` (decode of all output) adds to the text emitted so far; text already
        emitted that `full` rewrote stays as sent (the common prefix is kept)."""
        emitted = "".join(self._deltas)
        self._deltas = [full]
        self._pending = False
        if full.startswith(emitted):
            return full[len(emitted):]
        return full[len(commonprefix([emitted, full])):]

    def flush(self) -> str:
        """Everything not emitted yet, complete or not. Call once, at the end."""
        if not self._pending:
            return ""
        return self._settle(self._decode(self._ids))

    def _tail(self, context: Sequence[int]) -> list[int]:
        """The fewest last ids of `context` holding at least _MIN_CONTEXT that decoding keeps
        (skipped special tokens, as at the end of a chat prompt, do not count), at most
        _MAX_CONTEXT. A tail that starts inside a character may begin with U+FFFD: both
        decodes of the context share it. One that ends inside a character (a token-id
        prompt) is kept: the output continues it, settled against decode(context + output)
        until a stream can start (push)."""
        kept, lowest = 0, max(0, len(context) - _MAX_CONTEXT)
        start = len(context)
        while start > lowest and kept < _MIN_CONTEXT:
            start -= 1
            kept += context[start] not in self._skipped_ids
        # A byte run cut inside a character at the tail's start would decode to U+FFFDs
        # whole (ByteFallback): the tail starts at the character's first byte (at most 3
        # continuation bytes back, however long the run).
        for _ in range(3):
            if not (start > 0 and context[start - 1] in self._byte_ids
                    and self._continuation_byte(context[start])):
                break
            start -= 1
        return list(context[start:])

    def _continuation_byte(self, token_id: int) -> bool:
        """Whether `token_id` is a <0xNN> byte token for a UTF-8 continuation byte."""
        if token_id not in self._byte_ids:
            return False
        return int(self._tokenizer.id_to_token(token_id)[3:5], 16) & 0xC0 == 0x80

    def _decode(self, ids: list[int]) -> str:
        """What `ids` add to the context's text."""
        if not self._context:
            return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)
        before, after = self._tokenizer.decode_batch([self._context, self._context + ids],
                                                     skip_special_tokens=self._skip_special)
        if after.startswith(before):
            return after[len(before):]
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)

    def _opens_byte_run(self, token_ids: Sequence[int]) -> bool:
        """Whether, after `token_ids`, the last id that is not skipped is a byte token."""
        for i in reversed(token_ids):
            if i not in self._skipped_ids:
                self._in_byte_run = i in self._byte_ids
                break
        return self._in_byte_run
