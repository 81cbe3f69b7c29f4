"""--resume refuses, before any node starts, what it cannot continue: another strategy or
task, a checkpoint folder without its settings, steps not above the checkpoint's, a finished
run. What may change (steps upward, logging, threads) still resumes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from meshtrain.cli.main import app

runner = CliRunner()


@pytest.fixture(scope="module")
def stopped(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A digits run of 8 steps that checkpointed after step 4 and finished, plus a copy of
    its checkpoints as a run stopped after step 4 would have left them."""
    root = tmp_path_factory.mktemp("resume")
    result = runner.invoke(app, ["simulate", "--nodes", "2", "--steps", "8", "--set", "H=2",
                                 "--checkpoint-every", "4", "--no-progress", "--out", str(root / "runs"),
                                 "--run-id", "r"])
    assert result.exit_code == 0, result.output
    # The same run stopped after step 4: its checkpoints beside the (absent) run directory.
    stopped = root / "stopped" / "r.checkpoints"
    shutil.copytree(root / "runs" / "r" / "checkpoints", stopped)
    return root


def refused(args: list[str], message: str) -> None:
    result = runner.invoke(app, ["simulate", "--no-progress", *args])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert lines[-1].startswith("error: --resume ") and message in lines[-1], result.output
    assert not any(line.startswith("step ") for line in lines)  # nothing trained


def test_another_strategy_or_task_is_refused(stopped: Path) -> None:
    folder = str(stopped / "stopped" / "r.checkpoints")
    refused(["--resume", folder, "--strategy", "ddp"],
            "strategy was 'diloco' in the checkpointed run, now 'ddp'; a resumed run keeps its settings")
    text = stopped / "input.txt"
    text.write_text("hello world " * 200)
    refused(["--resume", folder, "--task", "gpt", "--data", str(text)], "task was 'digits'")
    refused(["--resume", folder, "--set", "H=3"], "strategy_options was ")
    refused(["--resume", folder, "--lr", "0.5"], "lr was ")


def test_steps_not_above_the_checkpoint_and_finished_runs_are_refused(stopped: Path) -> None:
    folder = str(stopped / "stopped" / "r.checkpoints")
    refused(["--resume", folder, "--steps", "3"],
            "the checkpoint is at step 4, past steps 3; give --steps of at least 4")
    refused(["--resume", str(stopped / "runs" / "r")],
            f"run r already finished ({stopped / 'runs' / 'r'}); to train it further, give --steps")
    refused(["--resume", str(stopped / "runs" / "r"), "--run-id", "r", "--steps", "12"],
            "run r already finished")
    refused(["--resume", str(stopped / "runs" / "r"), "--run-id", "more", "--steps", "2"],
            "the checkpoint is at step 4, past steps 2")


def test_a_checkpoint_folder_without_its_spec_is_refused(stopped: Path, tmp_path: Path) -> None:
    bare = tmp_path / "r.checkpoints"
    shutil.copytree(stopped / "stopped" / "r.checkpoints", bare)
    (bare / "spec.yaml").unlink()
    refused(["--resume", str(bare)], f"{bare / 'spec.yaml'} is missing, so the run's settings are unknown")
    # A damaged one is named the same way (YAML's ParserError was a traceback; other bytes
    # than UTF-8 a line that named no file).
    (bare / "spec.yaml").write_text("lr: [0.1\n")
    refused(["--resume", str(bare)],
            f"{bare / 'spec.yaml'}: not valid YAML (line 2), so the run's settings are unknown")
    (bare / "spec.yaml").write_bytes(b"\xff\xfe")
    refused(["--resume", str(bare)],
            f"{bare / 'spec.yaml'}: not UTF-8 text (byte 0: a binary file?), so the run's settings "
            "are unknown")


def test_what_may_change_still_resumes(stopped: Path, tmp_path: Path) -> None:
    folder = tmp_path / "r.checkpoints"
    shutil.copytree(stopped / "stopped" / "r.checkpoints", folder)
    result = runner.invoke(app, ["simulate", "--resume", str(folder), "--steps", "10", "--threads", "2",
                                 "--val-interval", "5", "--no-progress"])
    assert result.exit_code == 0, result.output
    assert "resuming run r after step 4" in result.output
    assert json.loads((tmp_path / "r" / "summary.json").read_text())["steps"] == 10


def test_resuming_into_another_run_id_leaves_the_checkpoints_where_they_were(stopped: Path,
                                                                             tmp_path: Path) -> None:
    """Resuming run A as run B must not take A's checkpoints: A can be resumed again after,
    and B's run directory keeps checkpoints of its own."""
    folder = tmp_path / "r.checkpoints"
    shutil.copytree(stopped / "stopped" / "r.checkpoints", folder)
    before = sorted(p.relative_to(folder) for p in folder.rglob("*"))
    result = runner.invoke(app, ["simulate", "--resume", str(folder), "--run-id", "b", "--steps", "10",
                                 "--no-progress"])
    assert result.exit_code == 0, result.output
    assert sorted(p.relative_to(folder) for p in folder.rglob("*")) == before
    assert sorted(p.name for p in (tmp_path / "b" / "checkpoints").glob("step-*")) == \
        ["step-000004", "step-000008"]
    again = runner.invoke(app, ["simulate", "--resume", str(folder), "--steps", "10", "--no-progress"])
    assert again.exit_code == 0, again.output
    assert "resuming run r after step 4" in again.output
    # Both continuations of the same checkpoint end alike.
    one = json.loads((tmp_path / "b" / "summary.json").read_text())
    two = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert one["final_train_loss"] == two["final_train_loss"]


def test_a_finished_run_trained_further_under_a_new_id_keeps_its_checkpoints(stopped: Path,
                                                                            tmp_path: Path) -> None:
    finished = tmp_path / "r"
    shutil.copytree(stopped / "runs" / "r", finished)
    result = runner.invoke(app, ["simulate", "--resume", str(finished), "--run-id", "more", "--steps", "10",
                                 "--no-progress"])
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in (finished / "checkpoints").glob("step-*")) == ["step-000004"]
    assert (tmp_path / "more" / "summary.json").is_file()


def test_how_it_runs_may_change_concurrent_nodes_too(stopped: Path, tmp_path: Path) -> None:
    folder = tmp_path / "r.checkpoints"
    shutil.copytree(stopped / "stopped" / "r.checkpoints", folder)
    result = runner.invoke(app, ["simulate", "--resume", str(folder), "--steps", "6",
                                 "--concurrent-nodes", "1", "--runtime", "threads", "--no-progress"])
    assert result.exit_code == 0, result.output
    assert "resuming run r after step 4" in result.output


def test_a_meta_json_that_lies_about_its_step_is_refused_before_resuming(stopped: Path,
                                                                         tmp_path: Path) -> None:
    """meta.json is checked against the checkpoint it describes (the folder's name, the node
    files' own step and run) before "resuming run r after step N" is said."""
    folder = tmp_path / "r.checkpoints"
    shutil.copytree(stopped / "stopped" / "r.checkpoints", folder)
    meta_file = folder / "step-000004" / "meta.json"
    meta = json.loads(meta_file.read_text())
    meta_file.write_text(json.dumps({**meta, "step": 27}))
    refused(["--resume", str(folder)], "no complete checkpoint found (step-000004: meta.json says step 27, "
                                       "the folder's name step 4)")
    # Renamed to match, the node files still say step 4.
    (folder / "step-000004").rename(folder / "step-000027")
    refused(["--resume", str(folder)], "no complete checkpoint found (step-000027: meta.json says run r "
                                       "step 27, but node-0.pt holds run 'r' step 4)")
