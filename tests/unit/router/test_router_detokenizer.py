"""Incremental detokenization: property tests on a byte-level BPE tokenizer (the test
checkpoints' kind) and on a SentencePiece-style tokenizer with <0xNN> byte-fallback
tokens, where multi-byte characters arrive one byte token at a time."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, normalizers

from omnibus.router.text.detokenizer import IncrementalDetokenizer, byte_fallback_ids
from tests.checkpoints import build_tokenizer

SPECIALS = ["<unk>", "<s>", "</s>"]
# Pieces with a leading "▁" and multi-byte characters; everything else falls back to bytes.
PIECES = ["▁", "▁the", "▁fox", "▁a", "é", "日本", "ab", "☕"] + [chr(c) for c in range(97, 123)]


def byte_fallback_tokenizer() -> Tokenizer:
    """A Llama-style tokenizer: Unigram pieces, <0xNN> byte fallback, Metaspace decoding
    that strips the first leading space."""
    bytes_ = [f"<0x{b:02X}>" for b in range(256)]
    vocab = [(p, -1.0) for p in SPECIALS + bytes_] + [
        (p, -float(i + 1)) for i, p in enumerate(PIECES)
    ]
    tok = Tokenizer(models.Unigram(vocab, unk_id=0, byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    tok.add_special_tokens(SPECIALS)
    return tok


BPE = build_tokenizer(384)
SENTENCEPIECE = byte_fallback_tokenizer()
TOKENIZERS = {"byte_level_bpe": BPE, "byte_fallback": SENTENCEPIECE}

# Text mixing ASCII, Latin accents, CJK (some in the vocabulary, some not), emoji and spaces.
TEXT = st.lists(
    st.sampled_from(list("the fox ab é日本語☕😀ñ\n{}!") + ["naïve", "café", "  "]),
    min_size=1,
    max_size=25,
).map("".join)


def stream(tokenizer: Tokenizer, ids: list[int], chunks: list[int], prompt: list[int] = ()) -> list[str]:
    """Pushes `ids` in chunks of the given sizes (cycled), then flushes; returns the deltas."""
    detok = IncrementalDetokenizer(tokenizer, context=prompt)
    deltas, i, c = [], 0, 0
    while i < len(ids):
        size = chunks[c % len(chunks)]
        deltas.append(detok.push(ids[i : i + size]))
        i, c = i + size, c + 1
    deltas.append(detok.flush())
    return deltas


@pytest.mark.parametrize("name", TOKENIZERS)
@settings(max_examples=300, deadline=None)
@given(text=TEXT, chunks=st.lists(st.integers(1, 3), min_size=1, max_size=5))
def test_encoded_text_streams_back_exactly_without_broken_characters(name, text, chunks):
    tokenizer = TOKENIZERS[name]
    ids = tokenizer.encode(text).ids
    deltas = stream(tokenizer, ids, chunks)
    assert "".join(deltas) == tokenizer.decode(ids)
    # Valid text has no U+FFFD, so any in a delta would be a split character.
    assert all("\ufffd" not in d for d in deltas)


@pytest.mark.parametrize("name", TOKENIZERS)
@settings(max_examples=300, deadline=None)
@given(data=st.data(), chunks=st.lists(st.integers(1, 3), min_size=1, max_size=5))
def test_any_id_sequence_concatenates_to_decode_of_all(name, data, chunks):
    """Arbitrary ids, including invalid byte runs and special tokens: the stream never
    emits text that decode(all) does not end up with."""
    tokenizer = TOKENIZERS[name]
    ids = data.draw(st.lists(st.integers(0, tokenizer.get_vocab_size() - 1), max_size=30))
    assert "".join(stream(tokenizer, ids, chunks)) == tokenizer.decode(ids)


def test_multibyte_character_from_byte_tokens_is_emitted_whole_once_complete():
    tok = SENTENCEPIECE
    ids = tok.encode("a 😀 b").ids
    pieces = [tok.id_to_token(i) for i in ids]
    assert pieces == ["▁a", "▁", "<0xF0>", "<0x9F>", "<0x98>", "<0x80>", "▁", "b"]
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.push([i]) for i in ids] + [detok.flush()]
    # The emoji's four byte tokens are held until the next non-byte token closes the run.
    assert deltas == ["a", " ", "", "", "", "", "😀 ", "b", ""]


def test_byte_level_split_character_is_held_until_complete():
    tok = BPE
    ids = tok.encode("語").ids  # not in the tiny vocabulary: one token per byte
    assert len(ids) == 3
    detok = IncrementalDetokenizer(tok)
    assert [detok.push([i]) for i in ids] == ["", "", "語"]
    assert detok.flush() == ""


def test_invalid_trailing_bytes_are_released_by_flush():
    tok = SENTENCEPIECE
    ids = tok.encode("x").ids + [tok.token_to_id("<0xE6>")]
    detok = IncrementalDetokenizer(tok)
    assert "".join(detok.push([i]) for i in ids) == "x"
    assert detok.flush() == "\ufffd"


def test_byte_fallback_ids_are_the_256_byte_tokens():
    assert len(byte_fallback_ids(SENTENCEPIECE)) == 256
    assert byte_fallback_ids(BPE) == frozenset()


def test_tokens_that_decode_to_nothing_keep_their_context():
    # '▁', <unk> (skipped), '▁': alone each first '▁' is stripped as a leading space, but
    # together they decode to one space; streamed one at a time the text must agree.
    ids = [259, 0, 259]
    assert SENTENCEPIECE.decode(ids) == " "
    assert "".join(stream(SENTENCEPIECE, ids, [1])) == " "


def continuation(tokenizer: Tokenizer, prompt: list[int], ids: list[int]) -> str:
    """What `ids` add to the prompt's text, as transformers' text-generation pipeline cuts it."""
    return tokenizer.decode(prompt + ids)[len(tokenizer.decode(prompt)):]


def test_the_first_word_keeps_its_leading_space_after_the_prompt():
    """SentencePiece decoders strip the first token's leading space: decoded alone, the
    output lost it ("Once upon a" + "time"); vLLM and TGI decode after the prompt."""
    tok = SENTENCEPIECE
    prompt, ids = tok.encode("the fox a").ids, tok.encode("the fox").ids
    assert tok.decode(ids) == "the fox"
    assert stream(tok, ids, [1], prompt) == [" the", " fox", ""]
    assert "".join(stream(tok, ids, [2], [1, *prompt])) == " the fox"  # after a BOS too


def test_a_prompt_ending_inside_a_character_is_still_the_context():
    """Outside probe: a token-id prompt ending inside a character got no context, so the
    first word lost its leading space ("the" for " the")."""
    tok = SENTENCEPIECE
    prompt = tok.encode("a 😀").ids[:-1]  # the emoji's last byte missing
    ids = tok.encode("the").ids
    assert "".join(stream(tok, ids, [1], prompt)) == continuation(tok, prompt, ids) == " the"
    bpe_prompt = BPE.encode("a 語").ids[:-1]  # byte-level: the character's last byte missing
    bpe_ids = BPE.encode(" the").ids
    assert "".join(stream(BPE, bpe_ids, [1], bpe_prompt)) == continuation(BPE, bpe_prompt, bpe_ids)


def test_output_that_rewrites_the_prompts_last_character_streams_on():
    """Outside probe: the prompt ends with a character made of byte tokens and the output
    starts with a stray byte, so decoding merges them into one invalid run, rewriting the
    prompt's text. The stream raised "invalid prefix" at every later token and sent no
    text until the request ended (so stop strings acted only at the end)."""
    tok = SENTENCEPIECE
    prompt = tok.encode("a 語").ids
    ids = [tok.token_to_id("<0x8C>"), *tok.encode("the fox a the fox").ids]
    deltas = stream(tok, ids, [1], prompt)
    assert not tok.decode(prompt + ids).startswith(tok.decode(prompt))  # a rewrite
    assert "".join(deltas) == tok.decode(ids)  # the output's own text
    assert deltas[:3] == ["", "\ufffd the", " fox"] and deltas[-1] == ""  # streamed as it comes


def test_a_prompts_partial_character_completed_by_the_output_streams_on():
    tok = SENTENCEPIECE
    full = tok.encode("a 語").ids  # ▁a ▁ <0xE8> <0xAA> <0x9E>
    prompt, ids = full[:-1], [full[-1], *tok.encode("the fox").ids]
    deltas = stream(tok, ids, [1], prompt)
    assert deltas == ["", "\ufffd the", " fox", ""]  # the byte held until a token closed its run
    assert "".join(deltas) == tok.decode(ids)  # the output's own text: the rewrite's rule


@pytest.mark.parametrize("chars", [10, 21, 22, 30, 100])
def test_output_bytes_after_a_byte_run_longer_than_the_context_window(chars):
    """Regression probe: a prompt ending in a byte run longer than the 64-token context
    window got a tail that began inside a character; the output's first bytes merged into
    that invalid run and came out as U+FFFDs ('��스l' for 'Hl스l')."""
    tok = SENTENCEPIECE
    prompt = tok.encode("語" * chars).ids  # not in the vocabulary: 3 byte tokens each
    ids = [tok.token_to_id("<0x48>"), *tok.encode("the fox").ids]
    assert "".join(stream(tok, ids, [1], prompt)) == continuation(tok, prompt, ids) == "H the fox"


@pytest.mark.parametrize("name", TOKENIZERS)
@settings(max_examples=300, deadline=None)
@given(data=st.data(), prompt=TEXT, chunks=st.lists(st.integers(1, 3), min_size=1, max_size=5))
def test_any_output_after_any_prompt_streams_its_continuation(name, data, prompt, chunks):
    """Arbitrary output ids (stray bytes, specials) after a prompt, whole or cut inside a
    character: where decode(prompt + output) extends decode(prompt), the stream is that
    continuation; where it rewrites the prompt's text, the output's own decode."""
    tokenizer = TOKENIZERS[name]
    prompt_ids = tokenizer.encode(prompt).ids
    prompt_ids = prompt_ids[:len(prompt_ids) - data.draw(st.integers(0, 2))]
    ids = data.draw(st.lists(st.integers(0, tokenizer.get_vocab_size() - 1), max_size=20))
    before, after = tokenizer.decode(prompt_ids), tokenizer.decode(prompt_ids + ids)
    expected = after[len(before):] if after.startswith(before) else tokenizer.decode(ids)
    assert "".join(stream(tokenizer, ids, chunks, prompt_ids)) == expected


@pytest.mark.parametrize("prompt", [
    "the fox a</s></s></s></s></s>",  # skipped special tokens do not count as context
    "a \ufffd the",  # a literal U+FFFD that is not at the end
    "a 語語",  # the last 4 byte tokens start inside a character: the tail grows to whole ones
])  # fmt: skip
def test_context_survives_special_tokens_and_split_characters(prompt):
    tok = SENTENCEPIECE
    prompt_ids, ids = tok.encode(prompt).ids, tok.encode("the fox").ids
    assert "".join(stream(tok, ids, [1], prompt_ids)) == continuation(tok, prompt_ids, ids) == " the fox"


@pytest.mark.parametrize("name", TOKENIZERS)
@settings(max_examples=200, deadline=None)
@given(prompt=TEXT, text=TEXT, chunks=st.lists(st.integers(1, 3), min_size=1, max_size=5))
def test_output_streams_as_the_prompts_continuation(name, prompt, text, chunks):
    tokenizer = TOKENIZERS[name]
    prompt_ids, ids = tokenizer.encode(prompt).ids, tokenizer.encode(text).ids
    assert "".join(stream(tokenizer, ids, chunks, prompt_ids)) == continuation(tokenizer, prompt_ids, ids)


BYTE_LEVEL = {"bpe_384": BPE, "bpe_1024": build_tokenizer(1024)}


@pytest.mark.parametrize("name", BYTE_LEVEL)
@pytest.mark.parametrize("skip_special", [True, False])
@settings(max_examples=200, deadline=None)
@given(data=st.data(), chunks=st.lists(st.integers(1, 4), min_size=1, max_size=5))
def test_long_random_id_streams_equal_decode_of_all(name, skip_special, data, chunks):
    """Byte-level BPE (the test and benchmark checkpoints' kind), random ids: split
    characters, special tokens anywhere. Every partial output is a prefix of the final
    text (nothing emitted is ever taken back) and the whole equals decode(all)."""
    tokenizer = BYTE_LEVEL[name]
    ids = data.draw(st.lists(st.integers(0, tokenizer.get_vocab_size() - 1), max_size=300))
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip_special)
    full = tokenizer.decode(ids, skip_special_tokens=skip_special)
    out, i, c = "", 0, 0
    while i < len(ids):
        size = chunks[c % len(chunks)]
        out += detok.push(ids[i : i + size])
        assert full.startswith(out)
        i, c = i + size, c + 1
    assert out + detok.flush() == full
    assert detok.flush() == ""


def test_special_tokens_are_kept_when_not_skipped():
    ids = BPE.encode("the fox").ids
    detok = IncrementalDetokenizer(BPE, skip_special_tokens=False)
    text = "".join(detok.push([i]) for i in [1, *ids, 2]) + detok.flush()
    assert text == "<s>the fox</s>" == BPE.decode([1, *ids, 2], skip_special_tokens=False)


def test_a_byte_run_turned_invalid_is_settled_by_flush():
    # The emoji's four bytes then a stray continuation byte: decode(all) turns the whole
    # run into U+FFFDs, so nothing of it may be emitted before the run is closed.
    tok = SENTENCEPIECE
    ids = tok.encode("a 😀").ids + [tok.token_to_id("<0x80>")] + tok.encode("b").ids
    assert "".join(stream(tok, ids, [1])) == tok.decode(ids)
