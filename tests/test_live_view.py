"""The live view of ``meshtrain launch``: status frames, the panel model, its table, and
real launches on the namespace hosts, under a pseudo-terminal (live panel) and piped
(today's prefixed lines, unchanged).

The end-to-end tests need network namespaces and sshd (skipped with the reason otherwise).
"""

from __future__ import annotations

import io
import os
import re
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
from rich.console import Console
from terminal import ANSI, run_on_a_terminal

from meshtrain.heartbeat import (
    STATUS_MAX_BYTES,
    RankStatus,
    StatusReporter,
    decode_status,
    last_sync_step,
    split_status,
)
from meshtrain.launch.live import (
    DONE,
    FAILED,
    FINISHING,
    LOST,
    STARTING,
    STOPPED_STATE,
    TRAINING,
    ClusterView,
    LiveOutput,
    render_cluster,
)
from meshtrain.launch.output import STOPPED, RankOutput


def frame(status: RankStatus) -> str:
    """A status frame as the launcher's reader hands it over: one line, newline removed."""
    return status.encode().decode().rstrip("\n")


# --------------------------------------------------------------------------- the message
def test_status_frame_round_trip_is_small_versioned_json() -> None:
    status = RankStatus(12, 20, 0.53125, 8.5, 1_234_567, 300_000_000, 10)
    raw = status.encode()
    assert raw.startswith(b'\x02{"v":1,') and raw.endswith(b"\x03\n") and len(raw) <= STATUS_MAX_BYTES
    text, found, cut_short = split_status(frame(status))
    assert (text, found, cut_short) == ("", [status], True)
    # Fields a rank cannot know are left out, and come back as None.
    assert RankStatus(0).encode() == b'\x02{"v":1,"step":0}\x03\n'
    assert decode_status('{"v":1,"step":0}') == RankStatus(0)
    full = RankStatus(12, 20, 0.5, 8.5, 1, 2, 10, 97.54, 3_000_000_000, 21)
    assert split_status(frame(full))[1] == [RankStatus(12, 20, 0.5, 8.5, 1, 2, 10, 97.5, 3_000_000_000, 21)]


@pytest.mark.parametrize("payload", [
    '{"v":2,"step":3}',  # a newer rank's message: ignored, not misread
    '{"v":1}',  # no step
    '{"v":1,"step":"3"}',  # wrong types
    '{"v":1,"step":3.5}',
    '{"v":1,"step":true}',
    '{"v":1,"step":3,"loss":"low"}',
    '[1,2]',
    '{"v":1,"step":3',  # cut off
    # What a hostile host could send: NaN, infinities, absurd or negative counts, a huge frame.
    '{"v":1,"step":3,"loss":NaN}',
    '{"v":1,"step":3,"cpu":-5}',  # CPU use is never negative
    '{"v":1,"step":3,"batch":-1}',
    '{"v":1,"step":3,"sps":Infinity}',
    '{"v":1,"step":1e400}',
    '{"v":1,"step":99999999999999999999999}',
    '{"v":1,"step":-1}',
    '{"v":1,"step":3,"pad":"' + "x" * 600 + '"}',
])
def test_a_message_that_is_not_a_version_1_status_is_ignored(payload: str) -> None:
    assert decode_status(payload) is None


def test_frames_are_taken_out_of_the_programs_lines_wherever_they_land() -> None:
    stream = io.StringIO()
    out = RankOutput(["box0", "box1"], stream=stream)
    seen: list[tuple[int, RankStatus]] = []
    out._status = lambda rank, status: seen.append((rank, status))  # type: ignore[method-assign]
    a, b = RankStatus(1, 4), RankStatus(2, 4, 0.5)
    out.line(0, "loss so far: " + frame(a))  # mid-line: the frame's newline cut the line short
    out.line(0, "0.25")  # ... and the rest of the program's line follows
    out.line(1, frame(b))  # a line that is only a frame prints nothing
    out.line(1, "see \x02{not a frame\x03 here")  # no JSON object between the markers: text
    out.line(1, "\x02" + '{"v":9,"step":1}' + "\x03")  # a well-formed frame of a newer version: dropped
    out.line(1, "")  # the program's own empty line stays
    assert stream.getvalue().splitlines() == [
        "box0 r0 | loss so far: 0.25",
        "box1 r1 | see \\x02{not a frame\\x03 here",  # shown, its control characters made visible
        "box1 r1 | ",
    ]
    assert seen == [(0, a), (1, b)]
    assert out.tail(0) == ["loss so far: 0.25"]


def test_a_line_cut_short_by_the_last_frame_is_printed_when_the_rank_ends(tmp_path: Path) -> None:
    stream = io.StringIO()
    out = RankOutput(["box0"], stream=stream, log_dir=tmp_path / "logs")
    out.line(0, "first")
    out.line(0, "no newline at the end" + frame(RankStatus(3)))
    assert stream.getvalue() == "box0 r0 | first\n"
    out.ended(0, "ok")
    assert stream.getvalue().splitlines()[-1] == "box0 r0 | no newline at the end"
    assert (tmp_path / "logs" / "box0-r0.log").read_text() == "first\nno newline at the end\n"


def test_reporter_sends_at_most_every_half_second_plus_first_and_last() -> None:
    now = [100.0]
    read_fd, write_fd = os.pipe()
    try:
        reporter = StatusReporter(write_fd, 48, interval=0.5, clock=lambda: now[0])
        sent = []
        for step in range(1, 49):
            now[0] += 0.125  # fast steps: 8 a second (exact in binary)
            sent.append(reporter.step_done(step, 2.0 / step, 1000 * step))
        assert reporter.step_done(48, 0.04, 60_000, final=True)  # the last one always goes
        raw = os.read(read_fd, 65536).decode()
    finally:
        os.close(read_fd)
        os.close(write_fd)
    assert sent[0] and sum(sent) == 12  # the first, then one per 0.5 s
    statuses = [s for line in raw.splitlines() for s in split_status(line)[1]]
    assert [s.step for s in statuses] == [1, 5, 9, 13, 17, 21, 25, 29, 33, 37, 41, 45, 48]
    assert statuses[1].steps_per_second == 8.0
    # CPU use from the second status on: this process's CPU time over the (fake) clock's time.
    assert statuses[0].cpu_percent is None and all(s.cpu_percent >= 0 for s in statuses[1:])
    assert statuses[-1] == RankStatus(48, 48, 0.04, 8.0, 60_000, statuses[-1].rss_bytes,
                                      cpu_percent=statuses[-1].cpu_percent)
    assert statuses[-1].rss_bytes is not None and statuses[-1].rss_bytes > 10_000_000  # this python


def test_slow_steps_each_send_a_status() -> None:
    now = [0.0]
    read_fd, write_fd = os.pipe()
    try:
        reporter = StatusReporter(write_fd, 3, clock=lambda: now[0])
        for step in (1, 2, 3):
            now[0] += 2.0
            assert reporter.step_done(step, float("nan"), 0)  # a NaN loss is left out, not sent as NaN
        raw = os.read(read_fd, 65536).decode()
    finally:
        os.close(read_fd)
        os.close(write_fd)
    statuses = [s for line in raw.splitlines() for s in split_status(line)[1]]
    assert [(s.step, s.loss, s.steps_per_second) for s in statuses] == [(1, None, None), (2, None, 0.5),
                                                                       (3, None, 0.5)]


def test_a_status_pipe_closed_before_the_first_step_never_stops_training() -> None:
    """The launcher's end of the status pipe gone at once (before the announcement): every
    later step's report returns False quietly. It once raised TypeError on the second step
    (the time since a status that was never sent)."""
    now = [0.0]
    read_fd, write_fd = os.pipe()
    os.close(read_fd)  # nobody listens: writing raises BrokenPipeError (Python ignores SIGPIPE)
    try:
        reporter = StatusReporter(write_fd, 5, interval=0.5, clock=lambda: now[0])
        reporter.announce(0)
        for step in range(1, 6):
            now[0] += 2.0
            assert reporter.step_done(step, 1.0, 0, final=step == 5) is False
    finally:
        os.close(write_fd)


def test_last_sync_step_is_the_strategys_answer() -> None:
    """The heartbeat asks the strategy (tests/test_strategy_registry.py checks every
    registered one on real communicators); before set-up, and for what is no strategy,
    there is no answer."""
    from meshtrain.strategies import DDP, DiLoCo

    assert last_sync_step(DDP()) is None  # not set up: no communicator, nothing synced
    assert last_sync_step(DiLoCo(H=5)) is None
    assert last_sync_step(SimpleNamespace(last_sync=9)) is None  # the old attribute means nothing now
    assert last_sync_step(SimpleNamespace(last_synced=lambda: 10)) == 10
    assert last_sync_step(SimpleNamespace(last_synced=lambda: True)) is None


# --------------------------------------------------------------------------- the model
def test_cluster_view_folds_a_stream_of_statuses_and_endings() -> None:
    view = ClusterView(["box0", "box1", "box2", "box3"])
    assert [r.state for r in view.rows] == [STARTING] * 4
    view.fold(0, RankStatus(0, 20), now=1.0)
    assert view.rows[0].state == TRAINING and view.rows[0].step == 0
    view.fold(0, RankStatus(12, 20, 0.5, 8.0, 5000, 10**8, 10), now=2.0)
    view.fold(0, RankStatus(13, 20, 0.4), now=2.5)  # fields left out keep their last value
    row = view.rows[0]
    assert (row.step, row.loss, row.steps_per_second, row.bytes_sent, row.rss_bytes, row.last_sync) == \
        (13, 0.4, 8.0, 5000, 10**8, 10)
    assert row.silent_for(4.0) == pytest.approx(1.5)
    view.heard(0, 3.5)  # a heartbeat
    view.heard(0, None)
    assert row.silent_for(4.0) == pytest.approx(0.5)
    view.fold(1, RankStatus(20, 20), now=3.0)
    assert view.rows[1].state == FINISHING  # past the last step: writing the run directory
    view.ended(1, "ok", now=4.0)
    view.ended(2, "exited with status 3", now=4.0)
    view.ended(3, "sent no heartbeat for 31 s (process stopped or hung; heartbeat_timeout 30 s)", now=4.0)
    view.ended(0, STOPPED, now=5.0)
    view.ended(2, STOPPED, now=5.0)  # the first outcome counts
    view.fold(0, RankStatus(14, 20), now=6.0)  # a late status does not revive it
    assert [r.state for r in view.rows] == [STOPPED_STATE, DONE, FAILED, LOST]
    assert view.rows[2].reason == "exited with status 3" and view.rows[0].step == 13
    assert view.rows[0].silent_for(100.0) == pytest.approx(1.5)  # frozen when it stopped
    view.started(2)  # a restart: the row starts afresh
    assert view.rows[2].state == STARTING and view.rows[2].reason is None


def test_lost_connection_and_silent_host_are_lost_not_failed() -> None:
    view = ClusterView(["a", "b"])
    view.ended(0, "lost connection (host down, asleep, or off the network)", now=1.0)
    view.ended(1, "stopped answering for 7 s (host down or off the network)", now=1.0)
    assert [r.state for r in view.rows] == [LOST, LOST]


# --------------------------------------------------------------------------- rendering
def _table_rows(text: str) -> dict[str, list[str]]:
    """Body rows of a rendered table, by host: the cells, stripped."""
    rows = {}
    for line in text.splitlines():
        if line.startswith("│"):
            cells = [c.strip() for c in line.strip("│").split("│")]
            rows[cells[0]] = cells
    return rows


def test_render_has_one_row_per_host_with_every_column() -> None:
    view = ClusterView(["studio-1", "studio-2", "mb"])
    view.fold(0, RankStatus(12, 20, 0.53125, 8.25, 1_230_000, 310_000_000, 10), now=10.0)
    view.fold(1, RankStatus(11, 20, 0.75), now=9.0)
    view.ended(1, "exited with status 3", now=10.5)
    console = Console(record=True, width=160, file=io.StringIO())
    console.print(render_cluster(view, now=10.25, title="run-1"))
    text = console.export_text()
    header = next(line for line in text.splitlines() if line.startswith("┃"))
    assert [c.strip() for c in header.strip("┃").split("┃")] == [
        "host", "rank", "state", "step", "loss", "steps/s", "last sync", "sent", "CPU", "memory", "heard"]
    rows = _table_rows(text)
    assert list(rows) == ["studio-1", "studio-2", "mb"]
    assert rows["studio-1"] == ["studio-1", "0", "training", "12/20", "0.5312", "8.2", "10", "1.23 MB",
                                "-", "310.00 MB", "0.2 s"]
    assert rows["studio-2"][2] == "failed (exited with status 3)" and rows["studio-2"][10] == "1.5 s"
    assert rows["mb"] == ["mb", "2", "starting", "-", "-", "-", "-", "-", "-", "-", "-"]


def test_render_shows_cpu_shares_and_gpu_memory_when_ranks_send_them() -> None:
    view = ClusterView(["studio", "air"])
    view.fold(0, RankStatus(5, 20, 0.5, 2.0, 1000, 300_000_000, 5, 97.5, 2_000_000_000, 21), now=1.0)
    view.fold(1, RankStatus(5, 20, 0.6, 2.0, 1000, 200_000_000, 5, 49.9, None, 11), now=1.0)
    console = Console(record=True, width=200, file=io.StringIO())
    console.print(render_cluster(view, now=1.0))
    text = console.export_text()
    header = next(line for line in text.splitlines() if line.startswith("┃"))
    assert [c.strip() for c in header.strip("┃").split("┃")][6:] == [
        "last sync", "samples/step", "sent", "CPU", "memory", "GPU memory", "heard"]
    rows = _table_rows(text)
    assert rows["studio"][7:12] == ["21", "1.00 kB", "98 %", "300.00 MB", "2.00 GB"]
    assert rows["air"][7:12] == ["11", "1.00 kB", "50 %", "200.00 MB", "-"]


def test_live_output_shows_the_panel_above_the_latest_lines() -> None:
    now = [50.0]
    stream = io.StringIO()
    out = LiveOutput(["box0", "box1"], stream=stream, force_terminal=True, clock=lambda: now[0])
    out.console.size = (140, 14)  # type: ignore[assignment]
    out.watch(0, SimpleNamespace(last_beat=49.0))
    out.watch(1, SimpleNamespace(last_beat=None))
    for i in range(30):
        out.line(0, f"line {i}" + (frame(RankStatus(i, 30, 1.0 / (i + 1))) if i == 29 else ""))
    out.line(0, "")  # the rest of line 29
    out.note("all ranks stopped in 0.4 s")
    console = Console(record=True, width=140, file=io.StringIO())
    console.print(out.renderable())
    text = console.export_text()
    rows = _table_rows(text)
    assert rows["box0"][2:5] == ["training", "29/30", "0.0333"] and rows["box0"][10] == "0.0 s"
    assert rows["box1"][2] == "starting"
    lines = text.splitlines()
    panel_end = lines.index(next(line for line in lines if line.startswith("└")))
    assert panel_end < lines.index("box0 r0 | line 28")
    assert lines[-2:] == ["box0 r0 | line 29", "meshtrain: all ranks stopped in 0.4 s"]
    assert "box0 r0 | line 20" not in lines  # only what fits under the panel (the rest is in the logs)
    assert stream.getvalue() == ""  # nothing printed outside the live display
    assert out.tail(0)[-1] == "line 29"


def test_on_an_80_column_terminal_every_hosts_numbers_are_whole() -> None:
    """macOS Terminal opens at 80x24: the panel's 11 columns had been cut to "stu…",
    "123…", "2.3…". There each host is a line with its numbers under it, each after its
    name, and the latest log lines still fill what is left of the screen."""
    now = [50.0]
    out = LiveOutput(["studio-1", "macbook-air"], stream=io.StringIO(), force_terminal=True,
                     clock=lambda: now[0])
    out.console.size = (80, 24)  # type: ignore[assignment]
    for rank in range(2):
        out.watch(rank, SimpleNamespace(last_beat=48.0))
        out.line(rank, "x" + frame(RankStatus(1234, 5000, 2.3456, steps_per_second=12.3,
                                              bytes_sent=123_456_789, rss_bytes=2_345_678_901,
                                              last_sync=1200, cpu_percent=98.0)))
    for i in range(30):
        out.line(0, f"line {i}")
    console = Console(record=True, width=80, file=io.StringIO())
    console.print(out.renderable())
    lines = console.export_text().splitlines()
    assert "…" not in "\n".join(lines) and max(len(line) for line in lines) <= 80, lines
    for name in ("studio-1", "macbook-air"):
        below = " ".join(lines[lines.index(name) + 1:lines.index(name) + 4])
        for cell in ("rank ", "state training", "step 1234/5000", "loss 2.3456", "steps/s 12.3",
                     "last sync 1200", "sent 123.46 MB", "CPU 98 %", "memory 2.35 GB", "heard 0.0 s"):
            assert cell in below, (cell, lines)
    assert re.fullmatch(r"studio-1 r0 +\| line 29", lines[-1]) and len(lines) == 23, lines  # a line spare


# --------------------------------------------------------------------------- end to end
# Runs under an interactive terminal, as a user would: a pty sized 200x50.
TERMINAL_ENV = {"TERM": "xterm-256color", "COLUMNS": "200", "LINES": "50"}


@pytest.fixture(scope="module")
def world(netns_hosts: tuple[object, object]) -> tuple[object, object]:
    return netns_hosts  # the session's two namespace hosts (conftest.py)


def _inventory(world, tmp_path: Path) -> Path:  # noqa: ANN001 - the fixture's SshWorld
    from ssh_fixtures import free_port

    hosts = [{"name": f"box{i}", "host": s.address, "workdir": str(tmp_path / f"box{i}")}
             for i, s in enumerate(world.servers)]
    return world.inventory(tmp_path / "inv.yaml", hosts, iface="eth0",
                           rendezvous={"port": free_port(), "timeout": 60})


def _on_a_terminal(world, args: list[str], cwd: Path, timeout: float) -> tuple[int, str]:  # noqa: ANN001
    """Run ``meshtrain ARGS`` with stdout and stderr on a pty; exit status and what it showed."""
    from ssh_fixtures import PYTHON

    return run_on_a_terminal(world.command(PYTHON, "-m", "meshtrain", *args), cwd,
                             {**os.environ, **TERMINAL_ENV}, columns=200, timeout=timeout)


def _last_panel(shown: str) -> dict[str, list[str]]:
    """The rows of the panel as last drawn (after the escape codes of redrawing are removed)."""
    text = ANSI.sub("", shown).replace("\r", "")
    return _table_rows(text[text.rfind("┏"):])


@pytest.mark.slow
def test_live_panel_shows_every_rank_to_the_last_step(world, tmp_path: Path) -> None:
    ssh, _ = world
    code, shown = _on_a_terminal(ssh, [
        "launch", str(_inventory(ssh, tmp_path)), "--out", str(tmp_path / "runs"), "--run-id", "live",
        "--task", "digits", "--strategy", "diloco", "--steps", "10", "--set", "H=5", "--batch-size", "16",
        "--threads", "1"], cwd=tmp_path, timeout=240)
    plain = ANSI.sub("", shown)
    assert code == 0, plain[-4000:]
    rows = _last_panel(shown)
    assert list(rows) == ["box0", "box1"], plain[-4000:]
    for rank, name in enumerate(["box0", "box1"]):
        cells = rows[name]
        assert cells[1:4] == [str(rank), "done", "10/10"], cells
        assert float(cells[4]) > 0 and cells[6] == "10"  # a loss; DiLoCo's last outer sync after step 10
        assert cells[7].endswith("B") and cells[9].endswith("MB"), cells  # bytes sent, resident memory
        assert cells[8].endswith(" %"), cells  # CPU use, from the rank's CPU time
    assert "\x02" not in shown and "\x06" not in shown  # status frames and beats never reach the screen
    assert "box0 r0 | run directory: " in plain  # the log under the panel
    assert "all 2 ranks finished" in plain
    logs = tmp_path / "runs" / "live" / "ranks"  # every rank's lines, kept with the run
    assert "run directory: " in (logs / "box0-r0.log").read_text()
    assert (logs / "box1-r1.log").is_file() and not (tmp_path / "runs" / "live.ranks").exists()


# Rank 1 gives up a second after rank 0 has sent its first status (the hosts share this
# machine's files): rank 0's import of torch may take longer than rank 1's, and a rank 0
# stopped before its status showed no step.
FAILING = textwrap.dedent("""
    import os, pathlib, sys, time
    from meshtrain.heartbeat import status_reporter
    rank = int(os.environ["RANK"])
    status = status_reporter(100)  # as a training loop would
    status.step_done(1, 0.5, 1000)
    print("rank", rank, "ready", flush=True)
    sent = pathlib.Path(sys.argv[1])
    if rank == 0:
        sent.touch()
    else:
        while not sent.exists():
            time.sleep(0.01)
        time.sleep(1.0)
        print("rank 1 gives up", flush=True)
        sys.exit(3)
    time.sleep(600)
""")


@pytest.mark.slow
def test_live_panel_marks_the_failing_rank_failed_and_the_run_still_stops(world, tmp_path: Path) -> None:
    ssh, _ = world
    (tmp_path / "failing.py").write_text(FAILING)
    code, shown = _on_a_terminal(ssh, [
        "launch", str(_inventory(ssh, tmp_path)), "--out", str(tmp_path / "runs"), "--run-id", "fails",
        "--upload", str(tmp_path / "failing.py"), "--", "python", "failing.py", str(tmp_path / "rank0-sent")],
        cwd=tmp_path, timeout=90)
    plain = ANSI.sub("", shown)
    assert code == 1, plain[-4000:]
    rows = _last_panel(shown)
    assert rows["box1"][2] == "failed (exited with status 3)", rows
    assert rows["box0"][2] == "stopped" and rows["box0"][3] == "1/100", rows
    assert re.search(r"failed: rank 1 on box1 \(root@10\.200\.0\.11:22\) exited with status 3", plain)
    assert "last lines of rank 1:\n  rank 1 ready\n  rank 1 gives up" in plain.replace("\r", "")
    logs = tmp_path / "runs" / "fails.ranks"  # no run directory came back: the logs stay beside it
    assert (logs / "box1-r1.log").read_text() == "rank 1 ready\nrank 1 gives up\n"


PRINTER = textwrap.dedent("""
    import os, time
    from meshtrain.heartbeat import status_reporter
    rank = os.environ["RANK"]
    status = status_reporter(2)
    print("rank", rank, "half a line, ", end="", flush=True)
    status.step_done(1, 0.5, 10, final=True)  # lands in the middle of the program's line
    print("the other half", flush=True)
    print("rank", rank, "done", flush=True)
""")


@pytest.mark.slow
def test_piped_and_plain_output_keep_todays_prefixed_lines(world, tmp_path: Path) -> None:
    from ssh_fixtures import meshtrain

    ssh, _ = world
    (tmp_path / "printer.py").write_text(PRINTER)
    args = ["launch", str(_inventory(ssh, tmp_path)), "--upload", str(tmp_path / "printer.py"), "--",
            "python", "printer.py"]
    piped = meshtrain(ssh, *args, cwd=tmp_path, timeout=60)
    assert piped.returncode == 0, piped.stdout + piped.stderr
    lines = piped.stdout.splitlines()
    for rank in (0, 1):
        assert f"box{rank} r{rank} | rank {rank} half a line, the other half" in lines, piped.stdout
        assert f"box{rank} r{rank} | rank {rank} done" in lines
    assert "\x02" not in piped.stdout and "┃" not in piped.stdout
    assert lines[-2].startswith("every rank's output: runs/") and lines[-1].startswith("all 2 ranks finished")

    code, shown = _on_a_terminal(ssh, [*args[:2], "--plain", *args[2:]], cwd=tmp_path, timeout=60)
    plain = ANSI.sub("", shown).replace("\r", "")
    assert code == 0, plain
    assert "box1 r1 | rank 1 half a line, the other half\n" in plain and "┃" not in plain
