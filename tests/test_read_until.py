"""The launch tests' output reader (ssh_fixtures.read_until) sees lines that arrive together."""

from __future__ import annotations

import subprocess
import sys

from ssh_fixtures import read_until

# Two lines in one write, then the process stays alive with its output open: what two ranks'
# "ready" lines look like when the launcher prints them within a moment of each other.
TWO_LINES_AT_ONCE = ("import os, time; "
                     "os.write(1, b'alpha r0 | rank 0 ready\\nbeta r1 | rank 1 ready\\n'); time.sleep(60)")


def test_two_lines_that_arrive_in_one_chunk_are_both_seen() -> None:
    """A buffered readline after select pulled both lines out of the pipe and returned one;
    select never reported the other, and the wait timed out (a launch test's 'did not see
    rank 1 ready', twice in CI-like runs, while both ranks were up)."""
    proc = subprocess.Popen([sys.executable, "-c", TWO_LINES_AT_ONCE], text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        seen = read_until(proc, ["rank 0 ready", "rank 1 ready"], timeout=10)
    finally:
        proc.kill()
        proc.wait()
    assert seen == "alpha r0 | rank 0 ready\nbeta r1 | rank 1 ready\n"


def test_a_line_is_read_to_its_end() -> None:
    """A needle found mid-line waits for the rest of its line (a URL after 'dashboard: ')."""
    code = ("import os, time; os.write(1, b'dashboard: http://127.0.0.1:'); time.sleep(0.3); "
            "os.write(1, b'8080/?token=abc\\n'); time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", code], text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        seen = read_until(proc, ["dashboard: http://127.0.0.1:"], timeout=10)
    finally:
        proc.kill()
        proc.wait()
    assert seen == "dashboard: http://127.0.0.1:8080/?token=abc\n"
