"""The dashboard without a browser: the observer interface, the state model it feeds,
run directories, and the server's token check on 127.0.0.1 (tests/test_dashboard_browser.py
drives the page in a real browser)."""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers import MLP, regression_data

from meshtrain import Trainer, observers
from meshtrain.heartbeat import RankStatus
from meshtrain.launch.output import STOPPED, RankOutput
from meshtrain.observers import NodeUpdate

pytest.importorskip("aiohttp", reason="the dashboard extra is not installed: "
                               "pip install 'meshtrain[dashboard]'")

from meshtrain.dashboard.server import TOKEN_HEADER, DashboardServer, token_matches  # noqa: E402
from meshtrain.dashboard.state import (  # noqa: E402
    MAX_POINTS,
    DashboardState,
    RunDirError,
    find_run_directories,
)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Recorder:
    """An observer that keeps every call."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple]] = []

    def __getattr__(self, name: str):
        return lambda *args: self.calls.append((name, args))


# --------------------------------------------------------------------------- the state model
def test_state_folds_updates_endings_and_events_of_a_launch() -> None:
    clock = Clock()
    state = DashboardState(clock)
    live = state.live_run("r1", ["alpha", "beta"], "launch")
    live.node_started(0)
    live.node_started(1)
    clock.now += 1
    live.node_update(NodeUpdate(0, 5, 20, 0.9, 8.0, 1000, 2_000_000, None, 5))
    live.node_update(NodeUpdate(1, 5, 20, 1.1, 7.5, 1000, 2_100_000))
    clock.now += 1
    # A field an update leaves out keeps its value.
    live.node_update(NodeUpdate(0, 10, steps=None, loss=None, bytes_sent=2000))
    live.node_heard(1)
    clock.now += 0.5
    live.node_ended(1, "lost", "lost connection (host unreachable)")
    live.node_update(NodeUpdate(1, 12, 20, 0.5))  # late: a lost host does not come back
    live.event("note", "restart 1 of 2: starting every rank again from the newest checkpoint")
    snap = state.snapshot()
    run = snap["runs"][0]
    alpha, beta = run["nodes"]
    assert (alpha["state"], alpha["step"], alpha["steps"], alpha["loss"], alpha["bytes_sent"]) == \
        ("training", 10, 20, 0.9, 2000)
    assert alpha["silent_for"] == 0.5 and alpha["rss_bytes"] == 2_000_000 and alpha["last_sync"] == 5
    assert (beta["state"], beta["step"], beta["reason"]) == ("lost", 5, "lost connection (host unreachable)")
    assert beta["silent_for"] == 0.5  # heard at 1002, lost at 1002.5
    assert [e["kind"] for e in run["events"]] == ["lost", "restart"]
    assert run["events"][0]["text"].startswith("beta lost: ")
    # Curves: one per node, [step, loss, bytes, seconds since the run started].
    assert run["node_series"][0] == {"name": "alpha", "points": [[5, 0.9, 1000, 1.0]]}
    assert run["measured"] == [[5, 1.0], [10, 2.0]]
    json.dumps(snap, allow_nan=False)

    live.node_started(0)  # a restart: the row begins afresh, counting restarts
    row = state.snapshot()["runs"][0]["nodes"][0]
    assert (row["state"], row["step"], row["restarts"]) == ("starting", None, 1)


def test_finished_run_marks_nodes_done_and_takes_the_history() -> None:
    state = DashboardState(Clock())
    live = state.live_run("sim", ["node 0", "node 1"], "simulate")
    live.node_update(NodeUpdate(0, 1, 2, float("nan")))  # NaN never reaches the JSON
    history = [{"step": 1, "train_loss": 2.0, "val_loss": None, "total_bytes_sent": 10, "seconds": 0.5,
                "projected_seconds": 0.1},
               {"step": 2, "train_loss": 1.0, "val_loss": 1.5, "total_bytes_sent": 20, "seconds": 1.0,
                "projected_seconds": 0.2}]
    live.run_finished({"strategy": "ddp", "projected": {"total_seconds": 0.2, "cluster": "wifi"},
                       "final_train_loss": float("inf")}, history)
    run = state.snapshot()["runs"][0]
    assert run["status"] == "finished" and [n["state"] for n in run["nodes"]] == ["done", "done"]
    assert run["mean_series"]["points"] == [[1, 2.0, 10, 0.5], [2, 1.0, 20, 1.0]]
    assert run["val_series"]["points"] == [[2, 1.5, 20, 1.0]]
    assert run["projected"] == [[1, 0.1], [2, 0.2]] and run["measured"] == [[1, 0.5], [2, 1.0]]
    assert (run["projected_total"], run["projected_cluster"]) == (0.2, "wifi")
    assert run["summary"]["final_train_loss"] is None
    json.dumps(state.snapshot(), allow_nan=False)


def test_a_long_run_is_thinned_to_a_bounded_number_of_points() -> None:
    state = DashboardState(Clock())
    live = state.live_run("long", ["a"], "simulate")
    for step in range(1, 10 * MAX_POINTS):
        live.node_update(NodeUpdate(0, step, None, 1.0 / step))
    points = state.snapshot()["runs"][0]["node_series"][0]["points"]
    assert MAX_POINTS // 2 <= len(points) <= MAX_POINTS
    assert points[0][0] == 1 and points[-1][0] == 10 * MAX_POINTS - 1  # the ends stay
    assert [p[0] for p in points] == sorted(p[0] for p in points)


def test_finished_run_directories_and_bad_ones(tmp_path: Path) -> None:
    result = Trainer(MLP(), regression_data()).fit(nodes=2, max_steps=6, batch_size=8, out_dir=str(tmp_path),
                                                   run_id="small", progress=False, val_interval=3)
    state = DashboardState(Clock())
    assert find_run_directories(tmp_path) == [result.run_dir]
    run = state.add_run_directory(result.run_dir)
    snap = state.snapshot()["runs"][0]
    assert snap["id"] == "small" and snap["status"] == "finished" and len(snap["nodes"]) == 2
    assert [p[0] for p in snap["mean_series"]["points"]] == [1, 2, 3, 4, 5, 6]
    assert [p[0] for p in snap["projected"]] == [1, 2, 3, 4, 5, 6]
    assert snap["projected_total"] == pytest.approx(result.summary["projected"]["total_seconds"])
    assert run.info["config"]["train"]["nodes"] == 2
    state.add_run_directory(result.run_dir)  # the same run twice (compared with itself) gets its own id
    assert [r["id"] for r in state.snapshot()["runs"]] == ["small", "small'"]

    with pytest.raises(RunDirError, match=r"nothing-here: no such run directory"):
        find_run_directories(tmp_path / "nothing-here")
    (tmp_path / "empty").mkdir()
    with pytest.raises(RunDirError, match=r"empty: holds no run directory"):
        find_run_directories(tmp_path / "empty")
    (result.run_dir / "metrics.csv").unlink()
    with pytest.raises(RunDirError, match=r"metrics.csv: missing"):
        state.add_run_directory(result.run_dir)
    (result.run_dir / "summary.json").write_text("{not json")
    with pytest.raises(RunDirError, match=r"summary.json: unreadable"):
        state.add_run_directory(result.run_dir)
    # Nested deeper than the parsers follow (a launched run's files come from a host): named, no
    # RecursionError.
    deep = "[" * 5000 + "]" * 5000
    (result.run_dir / "summary.json").write_text('{"a": ' + deep + "}")
    with pytest.raises(RunDirError, match=r"summary.json: unreadable"):
        state.add_run_directory(result.run_dir)
    (result.run_dir / "summary.json").write_text("{}")
    (result.run_dir / "config.yaml").write_text(f"a: {deep}\n")
    with pytest.raises(RunDirError, match=r"config.yaml: not valid YAML \(nested too deeply to read\)$"):
        state.add_run_directory(result.run_dir)
    # Bytes that are not text (UnicodeDecodeError escaped this reader: a traceback in the server).
    (result.run_dir / "config.yaml").write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(RunDirError, match=r"config.yaml: not UTF-8 text \(byte 0: a binary file\?\)$"):
        state.add_run_directory(result.run_dir)


def test_a_folder_of_runs_and_comparisons_shows_every_run_named_as_runs_names_it(tmp_path: Path) -> None:
    """`meshtrain dashboard runs/` after a `meshtrain compare` had said "holds no run
    directory": the comparison's runs are one folder deeper. Now they are shown, each named
    after its comparison folder as `meshtrain runs` lists it (two comparisons' "ddp" apart)."""
    fit = dict(nodes=2, max_steps=4, batch_size=8, progress=False)
    Trainer(MLP(), regression_data()).fit(out_dir=str(tmp_path / "runs"), run_id="plain", **fit)
    for folder in ("compare-a", "compare-b"):
        for strategy in ("ddp", "diloco"):
            Trainer(MLP(), regression_data()).fit(out_dir=str(tmp_path / "runs" / folder), run_id=strategy,
                                                  **fit)
        (tmp_path / "runs" / folder / "comparison.json").write_text("{}")
    found = find_run_directories(tmp_path / "runs")
    assert [str(p.relative_to(tmp_path / "runs")) for p in found] == [
        "compare-a/ddp", "compare-a/diloco", "compare-b/ddp", "compare-b/diloco", "plain"]
    state = DashboardState(Clock())
    for run_dir in found:
        state.add_run_directory(run_dir)
    assert [r["id"] for r in state.snapshot()["runs"]] == [
        "compare-a/ddp", "compare-a/diloco", "compare-b/ddp", "compare-b/diloco", "plain"]
    assert find_run_directories(tmp_path / "runs" / "compare-a") == found[:2]  # one comparison


def test_rows_show_cpu_gpu_memory_and_each_nodes_share_live_and_finished(tmp_path: Path) -> None:
    state = DashboardState(Clock())
    live = state.live_run("r2", ["studio", "air"], "launch")
    live.node_update(NodeUpdate(0, 3, 20, 0.9, 8.0, 1000, 2_000_000, 97.5, 3, 4_000_000_000, 21))
    live.node_update(NodeUpdate(1, 3, 20, 1.0, 8.0, 1000, 2_000_000, 49.0, 3, None, 11))
    studio, air = state.snapshot()["runs"][0]["nodes"]
    assert (studio["cpu_percent"], studio["gpu_bytes"], studio["batch_size"]) == (97.5, 4_000_000_000, 21)
    assert (air["cpu_percent"], air["gpu_bytes"], air["batch_size"]) == (49.0, None, 11)
    # A finished --balance run shows the shares its summary recorded.
    result = Trainer(MLP(), regression_data(400)).fit(nodes=2, steps=2, batch_size=8, out_dir=str(tmp_path),
                                                      progress=False, balance=True,
                                                      straggler=["node=1,slowdown=3"])
    state.add_run_directory(result.run_dir)
    assert [n["batch_size"] for n in state.snapshot()["runs"][1]["nodes"]] == [12, 4]


# --------------------------------------------------------------------------- what feeds it
def test_a_failing_observer_is_dropped_and_the_run_goes_on() -> None:
    class Broken:
        def node_heard(self, node: int) -> None:
            raise RuntimeError("broken")

    kept = Recorder()
    with observers.watching(Broken()), observers.watching(kept):
        observers.notify("node_heard", 3)
        observers.notify("node_heard", 4)
    assert kept.calls == [("node_heard", (3,)), ("node_heard", (4,))]
    assert not observers.active()


@pytest.mark.parametrize("runtime", ["threads", pytest.param("processes", marks=pytest.mark.slow)])
def test_simulated_nodes_feed_every_node_skips_and_the_summary(runtime: str, tmp_path: Path) -> None:
    from helpers import ranked_factory
    from test_check_sync import SpikesOnNode1

    from meshtrain.strategies import DDP

    seen = Recorder()
    with observers.watching(seen):
        Trainer(SpikesOnNode1(), ranked_factory).fit(DDP("sgd", 0.1), nodes=2, max_steps=5, batch_size=4,
                                                     out_dir=tmp_path, progress=False, skip_nonfinite=True,
                                                     runtime=runtime)
    updates = [args[0] for name, args in seen.calls if name == "node_update"]
    assert {u.node for u in updates} == {0, 1}
    for node in (0, 1):
        mine = [u for u in updates if u.node == node]
        assert mine[0].step == 1 and mine[-1].step == 5 and mine[-1].steps == 5  # first and last always
        assert all(u.rss_bytes > 0 and u.bytes_sent > 0 for u in mine) and mine[0].loss > 0
    assert sorted(args[0] for name, args in seen.calls if name == "node_started") == [0, 1]
    finished = [args for name, args in seen.calls if name == "run_finished"]
    assert len(finished) == 1 and finished[0][0]["steps"] == 5 and len(finished[0][1]) == 5
    skips = [args for name, args in seen.calls if name == "event" and args[0] == "nonfinite"]
    assert [args[1].split(" skipped")[0] for args in skips] == ["step 3", "step 5"]  # node 1's NaN batches


def test_a_node_leaving_a_simulation_is_lost_with_an_event(tmp_path: Path) -> None:
    seen = Recorder()
    state = DashboardState()
    live = state.live_run("faults", ["node 0", "node 1", "node 2"], "simulate")
    with observers.watching(seen), observers.watching(live):
        Trainer(MLP(), regression_data()).fit(nodes=3, max_steps=6, batch_size=8, out_dir=tmp_path,
                                              progress=False, fail=["node=2,step=3"])
    assert ("node_ended", (2, "lost", "left at step 3 (--fail)")) in seen.calls
    assert ("event", ("left", "step 3: node 2 left (--fail); 2 go on")) in seen.calls
    run = state.snapshot()["runs"][0]
    assert [(n["state"], n["step"]) for n in run["nodes"]] == [("done", 6), ("done", 6), ("lost", 3)]
    assert [e["kind"] for e in run["events"]] == ["lost", "left"]


def test_the_launchers_output_feeds_statuses_endings_and_notes() -> None:
    import io

    seen = Recorder()
    output = RankOutput(["alpha", "beta"], stream=io.StringIO())
    frame = RankStatus(7, 20, 0.25, 3.0, 4096, 1 << 20, 5).encode().decode().rstrip("\n")
    with observers.watching(seen):
        output.watch(1, source=None)  # type: ignore[arg-type]
        output.line(1, f"hello{frame}")
        output.ended(0, "lost connection (timed out)")
        output.ended(1, STOPPED)
        output.note("restart 1 of 1: starting every rank again")
    assert seen.calls[0] == ("node_started", (1,))
    assert ("node_update", (NodeUpdate(1, 7, 20, 0.25, 3.0, 4096, 1 << 20, None, 5),)) in seen.calls
    assert ("node_heard", (1,)) in seen.calls
    assert ("node_ended", (0, "lost", "lost connection (timed out)")) in seen.calls
    assert ("node_ended", (1, "stopped", None)) in seen.calls
    assert seen.calls[-1] == ("event", ("note", "restart 1 of 1: starting every rank again"))


# --------------------------------------------------------------------------- the server
def _get(url: str, headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], str]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=10) as r:
            return r.status, dict(r.headers), r.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), err.read().decode()


@pytest.fixture()
def server() -> DashboardServer:
    state = DashboardState()
    live = state.live_run("r", ["alpha"], "launch")
    live.node_update(NodeUpdate(0, 3, 10, 0.5))
    with DashboardServer(state) as running:
        yield running


def test_server_listens_on_loopback_and_refuses_a_wrong_or_missing_token(server: DashboardServer) -> None:
    assert server.host == "127.0.0.1" and server.url.startswith(f"http://127.0.0.1:{server.port}/?token=")
    base = f"http://127.0.0.1:{server.port}"
    wrong = server.token[:-1] + ("A" if server.token[-1] != "A" else "B")
    for path in ("/", "/api/state", "/nothing"):
        for suffix in ("", "?token=", f"?token={wrong}", f"?token={server.token}x"):
            status, _, body = _get(base + path + suffix)
            assert status == 403, (path, suffix)
            assert "alpha" not in body
    assert _get(base + "/api/state", {TOKEN_HEADER: wrong})[0] == 403

    status, headers, body = _get(f"{base}/api/state?token={server.token}")
    assert status == 200 and headers["Cache-Control"] == "no-store"
    assert json.loads(body)["runs"][0]["nodes"][0]["name"] == "alpha"
    assert _get(base + "/api/state", {TOKEN_HEADER: server.token})[0] == 200


def test_requests_that_are_not_http_get_400_and_print_nothing(server: DashboardServer,
                                                               caplog: pytest.LogCaptureFixture,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Whoever reaches the port may send anything. aiohttp logged each request its parser
    refused with a traceback, which Python printed into the run's terminal; they are answered
    400 and not logged. The server's own errors still are."""
    caplog.set_level(logging.DEBUG)
    junk = [b"GET / HTTP/1.1\r\nConnection: close\r\n\r\n",  # no Host header
            b"GET / HTTP/1.1\r\nHost: x\r\nX: " + b"a" * 200_000 + b"\r\n\r\n",  # a huge header line
            b"GARBAGE\r\n\r\n", b"\xff\xfe\x00" * 1000]
    for raw in junk:
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as conn:
            conn.sendall(raw)
            assert conn.recv(64).startswith(b"HTTP/1.0 400 Bad Request"), raw[:20]
    assert _get(f"http://127.0.0.1:{server.port}/api/state?token={server.token}")[0] == 200
    assert not [r for r in caplog.records if r.name.startswith(("meshtrain.dashboard", "aiohttp"))]

    def broken() -> dict[str, object]:
        raise RuntimeError("a bug of the server's own")
    monkeypatch.setattr(server.state, "snapshot", broken)
    assert _get(f"http://127.0.0.1:{server.port}/api/state?token={server.token}")[0] == 500
    assert any(r.exc_info and "a bug of the server's own" in str(r.exc_info[1]) for r in caplog.records)


def test_the_page_is_self_contained(server: DashboardServer) -> None:
    status, headers, page = _get(server.url)
    assert status == 200 and headers["Content-Type"].startswith("text/html")
    csp = headers["Content-Security-Policy"]
    assert "default-src 'none'" in csp and "connect-src 'self'" in csp
    assert headers["Referrer-Policy"] == "no-referrer"
    # Nothing is loaded from anywhere else: no external script, style, font or image.
    assert "<script src" not in page and "<link rel=\"stylesheet\"" not in page and "@import" not in page
    assert "https://" not in page and page.count("http://") == page.count("http://www.w3.org/2000/svg")
    assert "api/state" in page and "function plot(" in page


def test_token_comparison() -> None:
    assert token_matches("abc", "abc")
    assert not token_matches("abd", "abc") and not token_matches("", "abc") and not token_matches(None, "abc")


def test_dashboard_command_names_a_bad_run_directory(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "meshtrain", "dashboard", str(tmp_path / "missing")],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr.strip() == f"error: {tmp_path / 'missing'}: no such run directory"


def test_an_empty_host_is_refused_not_every_interface() -> None:
    """``--host "$HOST"`` with HOST unset gave ``--host ''``, which binds every interface."""
    from typer.testing import CliRunner

    from meshtrain.cli.main import app

    result = CliRunner().invoke(app, ["dashboard", "--host", ""])
    assert result.exit_code == 2, result.output
    assert result.output.strip() == "error: --host must not be empty"


def _url_from(proc: subprocess.Popen[str], prefix: str) -> tuple[str, str]:
    """The dashboard URL ``proc`` printed, and everything it printed up to it."""
    assert proc.stdout is not None
    seen = ""
    for line in proc.stdout:  # the URL is among the first lines printed
        seen += line
        if prefix in line:
            return re.search(r"(http://127\.0\.0\.[12]:\d+/\?token=[\w-]+)", line).group(1), seen
    raise AssertionError(f"no dashboard URL in:\n{seen}")


def _wait_for(read: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not read():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


class Terminal:
    """A command on a pseudo-terminal (stdin and stdout), its output read as it comes."""

    def __init__(self, args: list[str]) -> None:
        import pty

        self.master, slave = pty.openpty()
        self.proc = subprocess.Popen(args, stdin=slave, stdout=slave, stderr=slave,
                                     env={**os.environ, "COLUMNS": "200", "TERM": "xterm"})
        os.close(slave)
        self.shown = ""

    def read_until(self, pattern: str, timeout: float) -> re.Match[str]:
        import select

        deadline = time.monotonic() + timeout
        while not (found := re.search(pattern, self.shown)):
            assert time.monotonic() < deadline, f"no {pattern!r} in:\n{self.shown}"
            if select.select([self.master], [], [], 0.2)[0]:
                try:
                    self.shown += os.read(self.master, 65536).decode(errors="replace")
                except OSError:  # EIO: the command has exited
                    time.sleep(0.1)
        return found

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()
        os.close(self.master)


@pytest.mark.slow
def test_simulate_dashboard_is_live_while_it_trains_and_stays_until_enter(tmp_path: Path) -> None:
    # 3,000 steps: 4-5 s here. The checks below need the nodes' second status (0.5 s after
    # the first) while they still train; 1,000 steps took 1.4 s, which a faster machine halves.
    term = Terminal([sys.executable, "-m", "meshtrain", "simulate", "--dashboard", "--nodes", "2",
                     "--steps", "3000", "--no-progress", "--out", str(tmp_path), "--run-id", "seen"])
    try:
        url = term.read_until(r"dashboard: .*?(http://127\.0\.0\.1:\d+/\?token=[\w-]+)", 60).group(1)
        api = url.replace("/?token=", "/api/state?token=")
        assert _get(api.replace("token=", "token=x"))[0] == 403

        def nodes() -> list[dict]:
            return json.loads(_get(api)[2])["runs"][0]["nodes"]
        _wait_for(lambda: all(n["state"] == "training" and n["step"] > 0 and n["cpu_percent"] is not None
                              for n in nodes()), 60)
        run = json.loads(_get(api)[2])["runs"][0]
        assert run["id"] == "seen" and run["kind"] == "simulate" and run["status"] == "running"
        assert [n["name"] for n in run["nodes"]] == ["node 0", "node 1"]
        # The run ends; on a terminal the page stays up, showing it finished, until Enter.
        term.read_until(r"press Enter to close it", 120)
        run = json.loads(_get(api)[2])["runs"][0]
        assert run["status"] == "finished" and [n["state"] for n in run["nodes"]] == ["done", "done"]
        assert run["mean_series"]["points"][-1][0] == 3000 and run["projected_total"] > 0
        os.write(term.master, b"\n")
        assert term.proc.wait(timeout=30) == 0
    finally:
        term.close()
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(api, timeout=5)


def test_dashboard_command_warns_when_listening_beyond_127_0_0_1(tmp_path: Path) -> None:
    # 127.0.0.2 is still this machine's loopback: the warning is shown without opening a port
    # to the network.
    proc = subprocess.Popen([sys.executable, "-m", "meshtrain", "dashboard", "--host", "127.0.0.2"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url, shown = _url_from(proc, "dashboard of 0 runs: http://127.0.0.2:")
        assert _get(url)[0] == 200 and _get(url.split("?")[0])[0] == 403
    finally:
        proc.terminate()
        proc.communicate(timeout=30)
    warning = " ".join(shown.split())
    assert "warning: the dashboard listens on 127.0.0.2: anyone who can reach this machine there" in warning


def test_dashboard_without_its_extra_is_one_line_naming_it(tmp_path: Path) -> None:
    # Both commands in one interpreter without aiohttp (one start-up of torch, not two): each
    # command's exit status and what it wrote to stderr, in turn.
    code = textwrap.dedent("""
        import json, sys
        sys.modules["aiohttp"] = None
        from meshtrain.cli.main import app
        for args in json.loads(sys.argv[1]):
            try:
                app(args)
            except SystemExit as exc:
                sys.stderr.write(f"\\n<exit {exc.code}>\\n")
    """)
    commands = [["dashboard"], ["simulate", "--dashboard", "--steps", "2", "--out", str(tmp_path / "runs")]]
    done = subprocess.run([sys.executable, "-c", code, json.dumps(commands)], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    results = [(int(status), text.strip()) for text, status in
               re.findall(r"(.*?)\n<exit (\d+)>\n", done.stderr, re.S)]
    hint = "the aiohttp package is not installed; pip install 'meshtrain[dashboard]'"
    assert results == [(2, f"error: meshtrain dashboard: {hint}"),
                       (2, f"error: --dashboard: {hint}")], done.stderr
    assert not (tmp_path / "runs").exists()  # nothing was prepared


# --------------------------------------------------------------------------- hostile run directories
def _crafted_run(folder: Path, run_id: str) -> Path:
    """A finished run's directory, written by hand (as a host could write it)."""
    folder.mkdir(parents=True)
    (folder / "summary.json").write_text(json.dumps({"run_id": run_id, "nodes": 2, "steps": 2}))
    (folder / "config.yaml").write_text("train: {nodes: 2}\n")
    (folder / "metrics.csv").write_text("step,train_loss,seconds\n1,0.5,0.1\n2,0.4,0.2\n")
    return folder


def test_one_damaged_run_directory_is_shown_as_damaged_and_the_others_served(tmp_path: Path) -> None:
    """`meshtrain dashboard runs/` exited 2 on the first run directory it could not read."""
    _crafted_run(tmp_path / "runs" / "good", "good")
    bad = _crafted_run(tmp_path / "runs" / "bad", "bad")
    (bad / "summary.json").write_text("{not json")
    proc = subprocess.Popen([sys.executable, "-m", "meshtrain", "dashboard", str(tmp_path / "runs")],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url, shown = _url_from(proc, "dashboard of 2 runs, 1 damaged: http://127.0.0.1:")
        runs = {r["id"]: r for r in json.loads(_get(url.replace("/?token=", "/api/state?token="))[2])["runs"]}
    finally:
        proc.terminate()
        proc.communicate(timeout=30)
    assert f"warning: {bad / 'summary.json'}: unreadable (not valid JSON (line 1: " in " ".join(shown.split())
    assert runs["good"]["status"] == "finished" and len(runs["good"]["nodes"]) == 2
    assert runs["bad"]["status"] == "damaged"
    assert runs["bad"]["events"][-1]["text"].startswith(f"{bad / 'summary.json'}: unreadable")


def test_a_fifo_named_metrics_csv_is_refused_without_blocking(tmp_path: Path) -> None:
    import threading

    folder = _crafted_run(tmp_path / "r", "r")
    (folder / "metrics.csv").unlink()
    os.mkfifo(folder / "metrics.csv")
    outcome: list[BaseException] = []

    def read() -> None:
        try:
            DashboardState().add_run_directory(folder)
        except RunDirError as exc:
            outcome.append(exc)
    reader = threading.Thread(target=read, daemon=True)  # left behind, blocked, on the old code
    reader.start()
    reader.join(10)
    assert not reader.is_alive(), "blocked on the FIFO"
    assert [str(e) for e in outcome] == [f"{folder / 'metrics.csv'}: unreadable (not a regular file)"]


def test_a_large_metrics_csv_is_streamed_into_bounded_memory(tmp_path: Path) -> None:
    """Every row was kept as a dict of strings: about 38 times the file's size in memory."""
    import tracemalloc

    folder = _crafted_run(tmp_path / "r", "r")
    columns = ["step", "train_loss", "val_loss", "total_bytes_sent", "seconds", "projected_seconds",
               "lr", "grad_norm", "node_0_loss", "node_1_loss"]
    rows = 60_000
    with open(folder / "metrics.csv", "w") as f:
        f.write(",".join(columns) + "\n")
        for step in range(1, rows + 1):
            val = f"{1 / step:.6f}" if step % 100 == 0 else ""
            f.write(f"{step},{1 / step:.6f},{val},{step * 4096},{step * 0.01:.3f},{step * 0.02:.3f},"
                    f"0.001,{1 / step:.5f},{1 / step:.6f},{1 / step:.6f}\n")
    size = (folder / "metrics.csv").stat().st_size
    tracemalloc.start()
    try:
        run = DashboardState().add_run_directory(folder)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert size > 4_000_000 and peak < size / 2, (size, peak)  # 25 times the size, before
    mean, val = run.mean_series, run.val_series
    assert mean is not None and val is not None
    assert mean.points[0][0] == 1 and mean.points[-1][0] == rows and len(mean.points) <= MAX_POINTS
    assert len(val.points) == rows // 100 and val.points[-1][0] == rows  # 600: all kept
    assert run.measured[-1][0] >= rows - 64 and run.projected[-1][0] >= rows - 64


def test_a_host_header_that_does_not_name_this_machine_is_refused(server: DashboardServer) -> None:
    """DNS rebinding: a page served as evil.example whose name is then rebound to 127.0.0.1
    sends "Host: evil.example:PORT"; with the token alone it got the runs."""
    import http.client

    from meshtrain.dashboard.server import host_allowed

    def status(host: str) -> int:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
        try:
            conn.request("GET", f"/api/state?token={server.token}", headers={"Host": host})
            return conn.getresponse().status
        finally:
            conn.close()
    assert status(f"evil.example:{server.port}") == 403
    assert status("evil.example") == 403
    assert status(f"127.0.0.1:{server.port}") == 200
    assert status("localhost:9999") == 200  # an SSH tunnel from another port
    assert host_allowed("[::1]:8080") and host_allowed("10.1.2.3") and host_allowed("box.localhost:1")
    assert not host_allowed(None) and not host_allowed("") and not host_allowed("127.0.0.1.evil.example")
    assert host_allowed("Studio.Lan:80", {"studio.lan"})


@pytest.mark.slow
def test_simulate_dashboard_keeps_a_failed_runs_page_until_enter(tmp_path: Path) -> None:
    """The page closed the moment a node failed, before anyone could see why."""
    term = Terminal([sys.executable, "-m", "meshtrain", "simulate", "--dashboard", "--nodes", "2",
                     "--steps", "30", "--set", "lr=1e30", "--no-progress", "--out", str(tmp_path)])
    try:
        url = term.read_until(r"dashboard: .*?(http://127\.0\.0\.1:\d+/\?token=[\w-]+)", 60).group(1)
        api = url.replace("/?token=", "/api/state?token=")
        term.read_until(r"failed run \(node \d failed: .*press Enter to close it", 120)
        run = json.loads(_get(api)[2])["runs"][0]
        assert run["status"] == "failed"
        failed = [e["text"] for e in run["events"] if e["kind"] == "failed"]
        assert any("NonFiniteLoss" in text for text in failed), run["events"]
        os.write(term.master, b"\n")
        assert term.proc.wait(timeout=30) == 1
    finally:
        term.close()
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(api, timeout=5)
