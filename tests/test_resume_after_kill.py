"""A run killed outright (SIGKILL: the OOM killer, a power cut) can be resumed: its claim on
the run id is a lock the kernel drops with the process, not the mere presence of its hidden
``.<run-id>.partial`` folder; a live run's claim still holds."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from meshtrain.cli.main import app
from meshtrain.run_dir import RunDirectory

runner = CliRunner()


def _wait_for(path_glob: tuple[Path, str], proc: subprocess.Popen[str], timeout: float = 120) -> None:
    folder, pattern = path_glob
    deadline = time.monotonic() + timeout
    while not list(folder.glob(pattern)):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, f"nothing matched {pattern} in {folder} after {timeout} s"
        time.sleep(0.05)


def test_a_run_killed_with_sigkill_resumes(tmp_path: Path) -> None:
    out = tmp_path / "runs"
    env = {**os.environ, "COLUMNS": "200"}
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    # Long enough that it is still training when killed; a checkpoint every 2 steps (H=2).
    proc = subprocess.Popen([sys.executable, "-m", "meshtrain", "simulate", "--nodes", "2", "--steps",
                             "100000", "--set", "H=2", "--checkpoint-every", "2", "--no-progress",
                             "--threads", "1", "--out", str(out), "--run-id", "r"],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for((out / "r.checkpoints", "step-*/meta.json"), proc)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        proc.kill()
    assert (out / ".r.partial").is_dir()  # what the killed run left behind
    step = max(int(p.name[len("step-"):]) for p in (out / "r.checkpoints").glob("step-*"))
    resumed = runner.invoke(app, ["simulate", "--resume", str(out / "r.checkpoints"), "--steps",
                                  str(step + 2), "--no-progress"])
    assert resumed.exit_code == 0, resumed.output
    assert f"resuming run r after step {step}" in resumed.output
    assert json.loads((out / "r" / "summary.json").read_text())["steps"] == step + 2
    assert not (out / ".r.partial").exists()


def test_a_live_claim_is_still_refused_and_a_dead_one_taken_over(tmp_path: Path) -> None:
    live = RunDirectory.reserve(tmp_path, "a", "ddp", 1)
    with pytest.raises(FileExistsError, match="in use by a run still going"):
        RunDirectory.reserve(tmp_path, "a", "ddp", 1)
    # Another process holding the claim (alive) is refused the same way; once it is killed
    # the claim is stale and taken over, the dead run's half-written files cleared.
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, pathlib; from meshtrain.run_dir import RunDirectory\n"
        "run = RunDirectory.reserve(pathlib.Path(sys.argv[1]), 'b', 'ddp', 1)\n"
        "(run.partial / 'metrics.csv').write_text('half')\n"
        "print('claimed', flush=True); sys.stdin.read()"), str(tmp_path)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "claimed\n"
        with pytest.raises(FileExistsError, match="in use by a run still going"):
            RunDirectory.reserve(tmp_path, "b", "ddp", 1)
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait(timeout=30)
    finally:
        holder.kill()
    taken = RunDirectory.reserve(tmp_path, "b", "ddp", 1)
    assert taken.partial.is_dir() and not any(taken.partial.iterdir())
    live.discard()
    taken.discard()


def test_a_copy_of_the_run_directory_never_closes_the_claim(tmp_path: Path) -> None:
    """Node processes receive a copy of the run directory (processes runtime); the claim's
    descriptor number means something else there (a socket of the process group), so a copy
    holds no claim and its release closes nothing. The process that reserved it releases it."""
    import pickle

    run = RunDirectory.reserve(tmp_path, "c", "ddp", 1)
    fd = run._claim
    assert fd is not None
    copy = pickle.loads(pickle.dumps(run))
    copy.commit()  # a node process committing the run: renames the folder, closes nothing
    os.fstat(fd)  # still open in this process
    run.release()
    with pytest.raises(OSError):
        os.fstat(fd)
