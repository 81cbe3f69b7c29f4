"""Each rank's lines, prefixed with host and rank: plain when piped, coloured on a terminal."""

from __future__ import annotations

import io

from meshtrain.launch.output import TAIL_LINES, RankOutput


def test_piped_output_is_plain_and_aligned() -> None:
    stream = io.StringIO()
    out = RankOutput(["studio-1", "mb"], stream=stream)
    out.line(0, "step 1/10  loss 2.3")
    out.line(1, "[rank1] warning")  # brackets are text, not markup
    out.note("all ranks stopped in 0.4 s")
    assert stream.getvalue().splitlines() == [
        "studio-1 r0 | step 1/10  loss 2.3",
        "mb r1       | [rank1] warning",
        "meshtrain: all ranks stopped in 0.4 s",
    ]


def test_terminal_output_is_coloured_and_tails_are_kept() -> None:
    stream = io.StringIO()
    out = RankOutput(["a", "b"], stream=stream, force_terminal=True)  # as on a terminal
    for i in range(TAIL_LINES + 5):
        out.line(1, f"line {i}")
    first = stream.getvalue().splitlines()[0]
    assert first == "\x1b[1;35mb r1 | \x1b[0mline 0"  # the prefix coloured, the line as printed
    assert out.tail(1) == [f"line {i}" for i in range(5, TAIL_LINES + 5)]
    assert out.tail(0) == []
