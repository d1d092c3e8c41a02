"""A token's bytes for logprobs: concatenated over any ids they are the decoded text's
bytes, partial characters included, on byte-level BPE and SentencePiece byte fallback."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from omnibus.router.text.token_bytes import TokenBytes, as_text
from tests.unit.router.test_router_detokenizer import BPE, SENTENCEPIECE, TEXT

TOKENIZERS = {"byte_level_bpe": BPE, "byte_fallback": SENTENCEPIECE}


@pytest.mark.parametrize("name", TOKENIZERS)
@settings(max_examples=200, deadline=None)
@given(text=TEXT)
def test_token_bytes_concatenate_to_the_text(name: str, text: str) -> None:
    tokenizer = TOKENIZERS[name]
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    token_bytes = TokenBytes(tokenizer)
    joined = b"".join(token_bytes.of(i) for i in ids).decode()
    decoded = tokenizer.decode(ids)
    # SentencePiece's decoder strips the first token's leading space; a token keeps it.
    assert joined == decoded or joined == " " + decoded


def test_a_character_split_over_byte_tokens_gives_its_real_bytes() -> None:
    for tokenizer in (BPE, SENTENCEPIECE):
        token_bytes = TokenBytes(tokenizer)
        ids = tokenizer.encode("😀", add_special_tokens=False).ids
        # SentencePiece's normalizer puts a "▁" token first
        parts = [b for b in map(token_bytes.of, ids) if b != b" "]
        assert len(parts) > 1  # split: no token holds the whole emoji
        ids = [i for i in ids if token_bytes.of(i) != b" "]
        assert b"".join(parts) == "😀".encode()
        texts = [token_bytes.text(i) for i in ids]
        assert all(t.startswith("bytes:\\x") for t in texts)
        assert len(set(texts)) == len(set(parts))  # different bytes, different names


def test_the_leading_space_of_a_sentencepiece_word_is_kept() -> None:
    token_bytes = TokenBytes(SENTENCEPIECE)
    assert token_bytes.text(SENTENCEPIECE.token_to_id("▁the")) == " the"
    assert SENTENCEPIECE.decode([SENTENCEPIECE.token_to_id("▁the")]) == "the"


def test_special_tokens_are_their_content() -> None:
    for tokenizer in (BPE, SENTENCEPIECE):
        assert TokenBytes(tokenizer).text(tokenizer.token_to_id("</s>")) == "</s>"


@given(data=st.binary(max_size=8))
def test_as_text_is_utf8_or_the_bytes_form(data: bytes) -> None:
    text = as_text(data)
    try:
        assert text == data.decode()
    except UnicodeDecodeError:
        assert text.startswith("bytes:")
        assert bytes(int(h, 16) for h in text[len("bytes:"):].split("\\x")[1:]) == data


def offsets(tokenizer, ids: list[int]) -> tuple[list[int], str]:
    """text_offset of completions logprobs for `ids`, and the text the router streams."""
    from omnibus.v1 import inference_pb2 as pb

    from omnibus.router.http.shapes import Choice, CompletionShape
    from omnibus.router.text.detokenizer import IncrementalDetokenizer

    shape = CompletionShape(0, False, TokenBytes(tokenizer), lambda: IncrementalDetokenizer(tokenizer))
    choice = Choice(0)
    logprobs = [pb.TokenLogprob(token_id=i, logprob=-1.0) for i in ids]
    detok = IncrementalDetokenizer(tokenizer)
    text = "".join(detok.push([i]) for i in ids) + detok.flush()
    return shape._format(logprobs, choice)["text_offset"], text


def test_text_offsets_index_the_streamed_text():
    sp, ids = SENTENCEPIECE, SENTENCEPIECE.token_to_id
    # SentencePiece strips the first space: " fox" starts at 0 of "foxab"
    assert offsets(sp, [ids("▁fox"), ids("a"), ids("b")]) == ([0, 3, 4], "foxab")
    # an invalid byte run is one U+FFFD per byte, held until a token closes it
    assert offsets(sp, [ids("<0xE6>"), ids("<0x97>"), ids("a"), ids("b")]) == ([0, 0, 2, 3], "\ufffd\ufffdab")
    # a character split over byte tokens: each part starts where the character does
    run = [ids(f"<0x{b:02X}>") for b in "日".encode()]
    assert offsets(sp, [ids("a"), *run, ids("b")]) == ([0, 1, 1, 1, 2], "a日b")
    # a skipped special token adds nothing to the text
    assert offsets(BPE, [BPE.token_to_id("a"), BPE.token_to_id("</s>"), BPE.token_to_id("b")]) == (
        [0, 1, 1], "ab")


def test_completion_top_logprobs_always_hold_the_sampled_token():
    """As the OpenAI API: up to logprobs + 1 entries, the sampled token's among them, also
    with logprobs 0 and when it is not among the alternatives."""
    from omnibus.v1 import inference_pb2 as pb

    from omnibus.router.http.shapes import Choice, CompletionShape
    from omnibus.router.text.detokenizer import IncrementalDetokenizer

    a, b, c = (BPE.token_to_id(t) for t in "abc")
    sampled = [pb.TokenLogprob(token_id=a, logprob=-0.5,
                               top=[pb.TopLogprob(token_id=b, logprob=-0.1), pb.TopLogprob(token_id=c, logprob=-2.0)])]
    for k, expected in ((0, {"a": -0.5}), (1, {"b": -0.1, "a": -0.5}), (2, {"b": -0.1, "c": -2.0, "a": -0.5})):
        shape = CompletionShape(k, False, TokenBytes(BPE), lambda: IncrementalDetokenizer(BPE))
        (top,) = shape._format(sampled, Choice(0))["top_logprobs"]
        assert top == pytest.approx(expected)
