"""TextStream's hold-back of a possible stop-string start: the per-stop `find` it uses gives the
same answer as the plain formula (the longest tail that some stop string starts with), which tried
every tail length against every stop string at every token."""

from hypothesis import assume, given, settings
from hypothesis import strategies as st

from stagewise.engine.text_stream import TextStream


def held_back_formula(text: str, emitted: int, stop: tuple[str, ...]) -> int:
    """The longest k <= longest stop - 1 such that text[-k:] (after `emitted`) begins a stop string."""
    end, longest = len(text), max(len(s) for s in stop)
    for k in range(min(longest - 1, end - emitted), 0, -1):
        if any(s.startswith(text[end - k :]) for s in stop):
            return k
    return 0


@settings(max_examples=200, deadline=None)
@given(
    text=st.text(alphabet="abc", max_size=30),
    stop=st.lists(st.text(alphabet="abc", min_size=1, max_size=8), min_size=1, max_size=5),
    emitted=st.integers(0, 30),
)
def test_held_back_equals_the_formula(text, stop, emitted):
    assume(not any(s in text for s in stop))  # a stop string in the text has cut it already
    stream = TextStream(decode=lambda ids: "", stop=tuple(stop), text=text, emitted=min(emitted, len(text)))
    assert stream._held_back(len(text)) == held_back_formula(text, stream.emitted, tuple(stop))


def test_streamed_text_with_many_long_stops_is_cut_as_one_search_would():
    pieces = ["The", " quick", " brown", " fox", " jumps", " over"]
    stops = tuple(f"never-{i}-" + "x" * 200 for i in range(15)) + (" fox j",)
    stream = TextStream(decode=lambda ids: "".join(pieces[: len(ids)]), stop=stops)
    out = "".join(stream.push(i) for i in range(len(pieces)))
    assert stream.stopped_by == " fox j" and out + stream.finish() == "The quick brown"
