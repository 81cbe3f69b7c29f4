"""The progress numbers' schedule: what a step pays to show progress; and the slow phases
that say so."""

from __future__ import annotations

import os
import re
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers import MLP, regression_data
from terminal import ANSI, run_on_a_terminal

from meshtrain import Trainer
from meshtrain.comm.threads import ThreadCommunicator, ThreadHub
from meshtrain.engine import loop
from meshtrain.engine.callbacks import ProgressNumbers
from meshtrain.progress import Progress, Status
from meshtrain.strategies import DDP


def _printed_lines(steps: int, due: Callable[[int], bool]) -> list[str]:
    """The plain lines rank 0 prints when the numbers are collected after the ``due`` steps
    (and once more after the last, as the trainer does)."""
    progress = Progress(steps, enabled=True, title="ddp")
    for step in range(steps):
        if due(step):
            progress.update(step + 1, 0.5, 100.0)
    progress.update(steps, 0.5, 100.0)
    return [re.sub(r"  [\d.]+ steps/s.*$", "", line) for line in progress.lines]  # timings vary


@pytest.mark.parametrize("steps", [1, 7, 10, 100, 199, 250, 1000])
def test_a_launched_run_collects_progress_only_for_the_lines_it_prints(steps: int) -> None:
    numbers = ProgressNumbers(comm=None, startup_sent=0, steps=steps, lines_only=True)  # type: ignore[arg-type]
    collected = [s for s in range(steps) if numbers.due(s)]
    # The same lines as collecting after every step, for at most eleven all-reduces a run
    # (not one per step: each is a round trip over a real link).
    assert _printed_lines(steps, numbers.due) == _printed_lines(steps, lambda s: s + 1 < steps)
    assert len(collected) <= 11


def test_a_phase_is_announced_once_it_outlasts_its_wait_and_a_quick_one_never() -> None:
    said: list[str] = []
    announced = threading.Event()

    def say(line: str) -> None:
        said.append(line)
        announced.set()

    status = Status(say=say)
    with status.phase("quick", after=60.0):
        pass
    assert said == []  # finished long before its wait: not a word
    with status.phase("hashing", after=0.01):
        assert announced.wait(30), "the phase was never announced"
    assert said[0] == "hashing ..."
    assert all(line.startswith("hashing: done in ") for line in said[1:]), said


@pytest.mark.parametrize("wait, announced", [(0.0, True), (60.0, False)])
def test_a_launched_rank_announces_the_replica_check_when_it_takes_a_while(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path,
        wait: float, announced: bool) -> None:
    # A launched rank trains with verify_replicas=True; a 0 s wait stands in for a model
    # large enough that hashing it takes over the real wait (a second).
    monkeypatch.setattr(loop, "HASH_NOTICE_AFTER_S", wait)
    job = Trainer(MLP(), regression_data(48)).prepare(DDP(), nodes=1, max_steps=2, batch_size=4,
                                                      out_dir=tmp_path, progress=True)
    loop.train_node(job, ThreadCommunicator(ThreadHub(1), 0), verify_replicas=True)
    out = capsys.readouterr().out
    line = "checking that every host holds the same weights (hashing them) ..."
    assert (line in out.splitlines()) is announced, out
    if announced:  # before the first step's line
        assert out.index(line) < out.index("step 1/2")


def _bar_frames_on_a_terminal(columns: int, args: list[str], cwd: Path) -> list[str]:
    """Run ``meshtrain simulate ARGS`` on a pty ``columns`` wide; every line it drew."""
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    code, shown = run_on_a_terminal([sys.executable, "-m", "meshtrain", "simulate", *args], cwd,
                                    {**env, "TERM": "xterm-256color"}, columns=columns)
    assert code == 0, shown[-2000:]
    return [line for line in re.split(r"[\r\n]", ANSI.sub("", shown)) if line.strip()]


@pytest.mark.parametrize("args, columns, shows_rate", [
    (["--steps", "300"], 80, True),
    (["--steps", "300", "--strategy", "sparta-diloco", "--set", "H=100"], 80, False),
    (["--steps", "300"], 120, True),
])
def test_the_bar_is_one_whole_line_on_a_narrow_terminal(args: list[str], columns: int, shows_rate: bool,
                                                        tmp_path: Path) -> None:
    """At 80 columns the bar had wrapped "steps/s" onto a line of its own and cut
    "2000/2000" to "2000/…" and the clocks to "0:00:…"; now the optional columns (the time
    since the start, then the rate) make room and every frame is one line, numbers whole."""
    frames = _bar_frames_on_a_terminal(columns, [*args, "--out", str(tmp_path)], tmp_path)
    bars = [f for f in frames if " loss " in f and "│" not in f]
    assert bars, frames
    assert all(len(f.rstrip()) <= columns and "…" not in f for f in bars), bars[-3:]
    assert not [f for f in frames if "steps/s" in f and " loss " not in f], frames
    steps = args[1]
    last = bars[-1]
    assert f"{steps}/{steps} loss " in last and " sent " in last and " left 0:00:00" in last, last
    assert ("steps/s" in last) == shows_rate, last
    assert (re.search(r"steps/s \d+:\d\d:\d\d left", last) is not None) == (columns >= 120), last


ITEMS_PROGRAM = """
import time
from meshtrain.progress import Status

with Status().items("checking and computing features of 12 training clips", 12, "clips") as advance:
    for _ in range(12):
        time.sleep(0.05)
        advance()
"""


@pytest.mark.parametrize("columns", [80, 160])
def test_a_phase_over_items_shows_its_message_and_bar_whole(columns: int, tmp_path: Path) -> None:
    """At 80 columns a Whisper run's "checking and computing features of 12 training clips"
    bar had been cut to "0…", "clips…", "le…": there the message is a line of its own and
    the bar is under it; where there is room, they share the line as before."""
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    code, shown = run_on_a_terminal([sys.executable, "-c", ITEMS_PROGRAM], tmp_path,
                                    {**env, "TERM": "xterm-256color"}, columns=columns, timeout=120)
    assert code == 0, shown
    frames = [line for line in re.split(r"[\r\n]", ANSI.sub("", shown)) if line.strip()]
    assert all(len(f.rstrip()) <= columns and "…" not in f for f in frames), frames
    bars = [f for f in frames if "/12" in f]
    assert bars and " 12/12 " in bars[-1] and "clips/s" in bars[-1] and "left 0:00:00" in bars[-1], bars
    message = "checking and computing features of 12 training clips"
    assert (message in frames) == (columns == 80), frames  # its own line only where narrow
    assert all(message in f for f in bars) == (columns == 160), bars
