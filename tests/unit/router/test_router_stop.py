"""Stop strings over streamed text, including matches that span token boundaries."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from omnibus.router.text.detokenizer import IncrementalDetokenizer
from omnibus.router.text.stop import StopStringMatcher
from tests.checkpoints import build_tokenizer


def run(stops: list[str], deltas: list[str]) -> tuple[str, bool]:
    matcher = StopStringMatcher(stops)
    out = "".join(matcher.feed(d) for d in deltas)
    if not matcher.stopped:
        out += matcher.flush()
    return out, matcher.stopped


def test_stop_string_split_over_three_deltas_is_cut_with_nothing_after():
    assert run(["STOP"], ["hello S", "T", "OP and more", " text"]) == ("hello ", True)


def test_held_prefix_is_released_when_the_match_fails():
    matcher = StopStringMatcher(["STOP"])
    assert matcher.feed("abc ST") == "abc "  # "ST" could start STOP
    assert matcher.feed("ART") == "START"
    assert matcher.stopped is False


def test_unfinished_prefix_is_flushed_at_the_end():
    assert run(["STOP"], ["x", "ST"]) == ("xST", False)


def test_earliest_of_several_stop_strings_wins():
    assert run(["world", "lo w"], ["hel", "lo wor", "ld"]) == ("hel", True)


def test_empty_stop_string_is_refused():
    with pytest.raises(ValueError):
        StopStringMatcher([""])


TOKENIZER = build_tokenizer(384)


def test_stop_string_spanning_tokens_through_the_detokenizer():
    text = "Once upon a time there was a little fox"
    ids = TOKENIZER.encode(text).ids
    stop = "time th"  # ends inside the token for " there"
    pieces = [TOKENIZER.decode([i]) for i in ids]
    assert not any(stop in p for p in pieces)  # really spans tokens
    detok, matcher = IncrementalDetokenizer(TOKENIZER), StopStringMatcher([stop])
    out = ""
    for i in ids:
        out += matcher.feed(detok.push([i]))
        if matcher.stopped:
            break
    assert (out, matcher.stopped) == ("Once upon a ", True)


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="ab c", max_size=30),
    stop=st.text(alphabet="ab c", min_size=1, max_size=4),
    cuts=st.lists(st.integers(0, 30), max_size=6),
)
def test_output_is_text_up_to_the_first_stop_however_it_is_split(text, stop, cuts):
    bounds = sorted(set(cuts) | {0, len(text)})
    deltas = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    hit = text.find(stop)
    expected = (text, False) if hit < 0 else (text[:hit], True)
    assert run([stop], deltas) == expected


def reference(text: str, stops: list[str]) -> tuple[str, bool]:
    """The whole text at once: the stop that ends first wins; at a tie, the longest."""
    hits = [(i + len(s), -len(s), i) for s in stops if (i := text.find(s)) >= 0]
    return (text[: min(hits)[2]], True) if hits else (text, False)


@pytest.mark.parametrize("splits", [["abcd"], ["abc", "d"], ["a", "b", "c", "d"], ["ab", "cd"]])
def test_the_stop_completed_first_wins_however_the_text_is_split(splits):
    # "c" completes before "abcd" does, so "ab" is emitted whatever the deltas.
    assert run(["abcd", "c"], splits) == ("ab", True)
    # Both end at the same character: the longer one starts first and wins.
    assert run(["cd", "bcd"], splits) == ("a", True)


def test_a_stop_string_spanning_many_deltas_after_a_long_output():
    deltas = ["x" * 1000, "ab"] + list("cdab") + ["cde", "tail"]
    assert run(["abcde"], deltas) == ("x" * 1000 + "abcd", True)


@settings(max_examples=500, deadline=None)
@given(
    text=st.text(alphabet="ab c", max_size=40),
    stops=st.lists(st.text(alphabet="ab c", min_size=1, max_size=5), min_size=1, max_size=4),
    cuts=st.lists(st.integers(0, 40), max_size=8),
)
def test_several_overlapping_stops_match_the_whole_text_reference(text, stops, cuts):
    bounds = sorted(set(cuts) | {0, len(text)})
    deltas = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    assert run(stops, deltas) == reference(text, stops)


def test_no_stop_strings_passes_text_through():
    matcher = StopStringMatcher([])
    assert matcher.feed("abc") == "abc" and matcher.flush() == "" and not matcher.stopped
