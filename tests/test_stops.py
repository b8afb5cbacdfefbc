"""Stop strings (engines/stops.py): the earliest stop string ends the output, the text before it is
kept, and a streaming client is never shown any part of a stop string."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvflow_ray.engines.stops import StopMatcher, StopTokens
from kvflow_ray.engines.tokenizer import ByteTokenizer


def _feed_all(matcher: StopMatcher, pieces: list[str]) -> tuple[list[str], bool]:
    emitted = []
    for piece in pieces:
        out, stopped = matcher.feed(piece)
        emitted.append(out)
        if stopped:
            return emitted, True
    emitted.append(matcher.flush())
    return emitted, False


def test_a_stop_string_spanning_pieces_is_found_and_excluded() -> None:
    matcher = StopMatcher(["###"])
    emitted, stopped = _feed_all(matcher, ["Answer: 4", "2 #", "#", "# and more"])
    assert stopped and matcher.stopped
    assert "".join(emitted) == matcher.text == "Answer: 42 "
    assert emitted == ["Answer: 4", "2 ", "", ""]  # "#", then "##", were held back until "###" was known


def test_the_earliest_stop_wins_whatever_the_order_of_the_stops() -> None:
    for stops in (["world", "lo w"], ["lo w", "world"]):
        matcher = StopMatcher(stops)
        _feed_all(matcher, ["hel", "lo wor", "ld"])
        assert matcher.text == "hel"
    matcher = StopMatcher(["abc", "bcd"])  # overlapping candidates: "abc" starts first
    _feed_all(matcher, ["xa", "b", "cd"])
    assert matcher.text == "x"


def test_a_stop_at_the_very_start_leaves_no_text() -> None:
    matcher = StopMatcher(["\n"])
    assert matcher.feed("\nrest") == ("", True)
    assert matcher.text == ""


def test_streaming_holds_back_only_a_possible_start_of_a_stop() -> None:
    matcher = StopMatcher(["STOP", "xy"])
    assert matcher.feed("abcS") == ("abc", False)  # "S" may start "STOP"
    assert matcher.feed("T") == ("", False)  # "ST" still may
    assert matcher.feed("x") == ("ST", False)  # "STx" is no stop's start; "x" may start "xy"
    assert matcher.feed("z") == ("xz", False)
    assert matcher.flush() == ""
    matcher = StopMatcher(["STOP"])
    assert matcher.feed("end ST") == ("end ", False)
    assert matcher.flush() == "ST"  # generation ended: the held tail was text after all
    assert matcher.text == "end ST" and not matcher.stopped


def test_a_held_tail_that_turns_into_a_stop_is_never_emitted() -> None:
    matcher = StopMatcher(["aab"])
    assert matcher.feed("xaa") == ("x", False)
    assert matcher.feed("a") == ("a", False)  # "aaa": the first "a" cannot start "aab" any more
    assert matcher.feed("b") == ("", True)
    assert matcher.text == "xa"


def test_no_stops_emits_everything_at_once() -> None:
    matcher = StopMatcher([])
    assert matcher.feed("anything") == ("anything", False)


def test_bad_stops_are_refused() -> None:
    with pytest.raises(ValueError, match="empty"):
        StopMatcher(["ok", ""])
    with pytest.raises(TypeError, match="not one string"):
        StopMatcher("###")


# ------------------------------------------------------------------------------------------ over tokens
BYTES = ByteTokenizer()


def _run(stops: list[str], ids: list[int], decode: Callable[[list[int]], str] = BYTES.decode
         ) -> tuple[StopTokens, list[int], int]:
    """Push ids until a stop; (tracker, ids released for streaming in order, ids pushed)."""
    tracker = StopTokens(stops, decode)
    released: list[int] = []
    pushed = 0
    for token in ids:
        out, stopped = tracker.push(token)
        released += out
        pushed += 1
        if stopped:
            break
    released += tracker.finish()
    return tracker, released, pushed


def test_tokens_stop_before_a_stop_spanning_several_tokens() -> None:
    ids = list(b"The answer is 42.\nNext question")
    tracker, released, pushed = _run([".\n"], ids)
    assert tracker.stopped and tracker.text == "The answer is 42"
    assert tracker.tokens == released == list(b"The answer is 42")  # streamed == result: nothing of ".\n"
    assert pushed == len(b"The answer is 42.\n")  # nothing generated after the stop was complete


def test_without_a_stop_every_token_is_released_and_kept() -> None:
    ids = list(b"no stop here ##")
    tracker, released, pushed = _run(["###"], ids)
    assert not tracker.stopped and pushed == len(ids)
    assert tracker.tokens == released == ids and tracker.text == "no stop here ##"
    tracker, released, _ = _run([], ids)  # no stop strings at all
    assert tracker.tokens == released == ids and tracker.text == "no stop here ##"


def test_a_character_spelled_over_several_byte_tokens() -> None:
    ids = list("a€b€!zz".encode())  # "€" is three bytes: a stop starting with it spans tokens mid-character
    tracker, released, pushed = _run(["€!"], ids)
    assert tracker.text == "a€b" and tracker.tokens == released == list("a€b".encode())
    assert pushed == len("a€b€!".encode())
    tokenizer = ByteTokenizer()
    tracker = StopTokens(["€"], tokenizer.decode)
    first, stopped = tracker.push(0xE2)  # first byte of "€": held, it may start the stop
    assert (first, stopped) == ([], False)
    assert tracker.push(0x82) == ([], False)
    assert tracker.push(0xAC) == ([], True)
    assert tracker.tokens == [] and tracker.text == ""


def test_end_of_sequence_and_specials_release_with_the_rest() -> None:
    tokenizer = ByteTokenizer()
    ids = [*b"done #", tokenizer.EOS]  # "#" held (it may start "##"), then the end of sequence
    tracker, released, _ = _run(["##"], ids)
    assert not tracker.stopped and tracker.tokens == released == ids and tracker.text == "done #"


def test_multi_character_tokens_keep_the_text_before_a_stop_inside_a_token() -> None:
    vocab = ["Hel", "lo", " wor", "ld", "!"]

    def decode(ids: list[int]) -> str:
        return "".join(vocab[i] for i in ids)

    tracker, released, pushed = _run(["o w"], decode=decode, ids=[0, 1, 2, 3, 4])
    assert tracker.text == "Hell" and pushed == 3
    # "lo" reaches into the stop: left out of the tokens (a client decoding them never sees "o")
    assert tracker.tokens == released == [0]
    tracker, released, _ = _run(["ld!"], decode=decode, ids=[0, 1, 2, 3, 4])
    assert tracker.text == "Hello wor" and tracker.tokens == released == [0, 1, 2]


def test_pushing_after_a_stop_is_an_error() -> None:
    tracker = StopTokens(["x"], ByteTokenizer().decode)
    assert tracker.push(ord("x")) == ([], True)
    with pytest.raises(RuntimeError, match="stopped"):
        tracker.push(ord("y"))
