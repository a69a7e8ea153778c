"""pipeline/openai_api/stop.py: stop strings matched on streamed text, split across pieces however the engine's
steps fall, with nothing at or after the match released."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.openai_api.stop import StopMatcher


def run(pieces: list[str], stops: tuple[str, ...]) -> tuple[list[str], bool]:
    """What a client receives piece by piece, and whether a stop string matched."""
    matcher, out = StopMatcher(stops), []
    for piece in pieces:
        text, stopped = matcher.feed(piece)
        out.append(text)
        if stopped:
            return out, True
    return out + [matcher.flush()], False


def test_a_match_inside_one_piece_cuts_before_it():
    assert run(["x = 1\nEND y"], ("END",)) == (["x = 1\n"], True)


def test_a_stop_string_split_across_pieces_still_matches_and_is_held_back():
    out, stopped = run(["foo E", "N", "D bar"], ("END",))
    assert stopped and out == ["foo ", "", ""]  # "E" and "N" were held: they could have started END


def test_a_false_start_is_released_with_the_next_piece():
    assert run(["abE", "x", "tail"], ("END",)) == (["ab", "Ex", "tail", ""], False)


def test_held_text_is_flushed_when_generation_ends():
    assert run(["abc E"], ("END",)) == (["abc ", "E"], False)


def test_the_stop_string_complete_first_wins_however_the_text_is_split():
    assert run(["one two three"], ("three", "two")) == (["one "], True)
    # "bca" starts earlier but "c" is complete first: generating one token at a time would stop there
    assert run(["abca"], ("bca", "c")) == run(["abc", "a"], ("bca", "c")) == (["ab"], True)
    assert run(["xabc"], ("c", "abc")) == (["x"], True)  # both complete at once: the longer, earlier one


def test_no_stop_strings_pass_everything_at_once():
    assert run(["a", "b"], ()) == (["a", "b", ""], False)


@settings(max_examples=300, deadline=None)
@given(text=st.text(alphabet="abc", max_size=30), cuts=st.lists(st.integers(0, 30), max_size=6),
       stops=st.lists(st.text(alphabet="abc", min_size=1, max_size=4), max_size=3))
def test_any_split_gives_the_text_up_to_the_first_stop(text, cuts, stops):
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    out, stopped = run(pieces, tuple(stops))
    hits = [(i + len(s), i) for s, i in ((s, text.find(s)) for s in stops) if i >= 0]
    assert "".join(out) == (text[:min(hits)[1]] if hits else text)  # cut where the first complete stop starts
    assert stopped == bool(hits)
