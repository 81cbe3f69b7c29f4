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


def test_a_flood_without_newline_is_read_in_bounded_memory() -> None:
    from meshtrain.hosts.host_output import LINE_LIMIT, TAIL_KEPT, LineSplitter

    lines = LineSplitter()
    chunk = b"y" * 65536
    for _ in range(20 * 16):  # 20 MiB, as a host sends it: 64 KiB reads
        assert lines.feed(chunk) == []
        assert lines.buffered <= LINE_LIMIT + TAIL_KEPT
    [line] = lines.feed(b"END\nnext")
    assert line.startswith(b"y" * LINE_LIMIT) and line.endswith(b"yEND")
    assert b" \xe2\x80\xa6 [cut 20.0 MiB] \xe2\x80\xa6 " in line and len(line) < LINE_LIMIT + TAIL_KEPT + 40
    assert lines.flush() == b"next" and lines.flush() is None


def test_control_characters_are_made_visible_and_printed_once() -> None:
    stream = io.StringIO()
    out = RankOutput(["a"], stream=stream)
    out.line(0, "\x1b[31mred\x1b[0m\ttab \x9b2J bell\x07 del\x7f")
    assert stream.getvalue() == "a r0 | \\x1b[31mred\\x1b[0m\ttab \\x9b2J bell\\x07 del\\x7f\n"
    assert out.tail(0) == ["\\x1b[31mred\\x1b[0m\ttab \\x9b2J bell\\x07 del\\x7f"]


def test_only_the_keyed_exit_frame_counts() -> None:
    from meshtrain.hosts.host_output import take_exit_status

    key = "ab" * 16
    assert take_exit_status(f"done\x02MESHTRAIN_EXIT {key} 0\x03", key) == ("done", 0)
    forged = f"\x02MESHTRAIN_EXIT {'cd' * 16} 0\x03"
    assert take_exit_status(forged, key) == (forged, None)
    for line in ("__MESHTRAIN_EXIT__", "__MESHTRAIN_EXIT__ 0", "\x02MESHTRAIN_EXIT\x03",
                 f"\x02MESHTRAIN_EXIT {key} 99999\x03"):
        assert take_exit_status(line, key) == (line, None)
