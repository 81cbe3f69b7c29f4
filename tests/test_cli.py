"""The `meshtrain` command: the default run, listings, and every kind of bad input."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import yaml
from cli_process import run_cli
from in_process import meshtrain_here
from typer.testing import CliRunner

from meshtrain.cli.main import app

runner = CliRunner()



def test_default_simulate_runs_digits_with_diloco_on_4_nodes(tmp_path: Path) -> None:
    # In this process (the entry point itself: test_bad_input_through_the_real_entry_point).
    proc = meshtrain_here("simulate", cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "run directory:" in proc.stdout
    (run_dir,) = [p for p in (tmp_path / "runs").iterdir() if not p.name.startswith(".")]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["strategy"] == "diloco"
    assert summary["nodes"] == 4
    assert summary["steps"] == 300
    assert summary["final_accuracy"] > 0.85  # real learning on real digits
    assert summary["final_val_loss"] < 0.6
    rows = list(csv.DictReader((run_dir / "metrics.csv").open()))
    assert len(rows) == 301  # a step-0 evaluation of the untrained model, then 300 steps
    assert rows[0]["step"] == "0" and rows[0]["train_loss"] == ""
    assert float(rows[0]["val_loss"]) == pytest.approx(summary["initial"]["val_loss"])
    assert summary["initial"]["val_accuracy"] < 0.3 < summary["final_accuracy"]  # before and after
    assert float(rows[-1]["train_loss"]) < float(rows[1]["train_loss"])
    # DiLoCo(H=25) on 9,610 float32 parameters, 4 nodes: 12 ring all-reduces, each
    # sending 2*(3/4)*S bytes per node on average (chunks of 2403/2403/2402/2402 values).
    assert summary["bytes_sent_per_node"] == 12 * 2 * 3 / 4 * 9610 * 4
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert config["spec"]["strategy"] == "diloco"
    assert config["strategy"]["H"] == 25
    assert (run_dir / "model.pt").is_file() and (run_dir / "loss.png").is_file()
    log = (run_dir / "log.txt").read_text()  # what the run printed, command first, table last
    assert log.startswith("$ ") and "step 300/300  loss" in log and "│ accuracy" in log


def test_config_yaml_repeats_the_run(tmp_path: Path) -> None:
    args = ["simulate", "--steps", "20", "--strategy", "sparta", "--set", "p=0.1", "--no-progress",
            "--out", str(tmp_path / "a"), "--run-id", "first"]
    assert runner.invoke(app, args).exit_code == 0
    config = tmp_path / "a" / "first" / "config.yaml"
    again = runner.invoke(app, ["simulate", "--profile", str(config), "--no-progress",
                                "--out", str(tmp_path / "a"), "--run-id", "second"])
    assert again.exit_code == 0, again.output
    first = json.loads((tmp_path / "a" / "first" / "summary.json").read_text())
    second = json.loads((tmp_path / "a" / "second" / "summary.json").read_text())
    assert first["final_train_loss"] == second["final_train_loss"]
    assert first["bytes_sent_per_node"] == second["bytes_sent_per_node"]


def test_replay_repeats_data_cluster_and_threads_from_another_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run's config.yaml repeats the run whatever the task: the data file (recorded as an
    absolute path), the cluster and the thread count come back too."""
    work, elsewhere = tmp_path / "work", tmp_path / "elsewhere"
    work.mkdir()
    elsewhere.mkdir()
    (work / "tiny.txt").write_text("to be or not to be, that is the question. " * 60)
    monkeypatch.chdir(work)
    first = runner.invoke(app, ["simulate", "--task", "gpt", "--data", "tiny.txt", "--steps", "6",
                                "--nodes", "2", "--cluster", "wifi", "--threads", "1", "--no-progress",
                                "--set", "task_options.dim=32", "--set", "task_options.block_size=16",
                                "--out", str(tmp_path / "runs"), "--run-id", "first"])
    assert first.exit_code == 0, first.output
    monkeypatch.chdir(elsewhere)
    again = runner.invoke(app, ["simulate", "--profile", str(tmp_path / "runs" / "first" / "config.yaml"),
                                "--no-progress", "--run-id", "second"])
    assert again.exit_code == 0, again.output
    one = json.loads((tmp_path / "runs" / "first" / "summary.json").read_text())
    two = json.loads((tmp_path / "runs" / "second" / "summary.json").read_text())
    assert two["projected"]["cluster"] == "wifi"
    assert one["final_train_loss"] == two["final_train_loss"]
    config = yaml.safe_load((tmp_path / "runs" / "second" / "config.yaml").read_text())
    assert config["spec"]["data"] == str(work / "tiny.txt") and config["train"]["threads"] == 1
    assert config["provenance"]["torch"] and config["provenance"]["command"]


@pytest.mark.parametrize("strategy", ["ddp", "sparta", "sparta-diloco", "fedavg", "demo"])
def test_every_strategy_runs_from_the_cli(strategy: str, tmp_path: Path) -> None:
    result = runner.invoke(app, ["simulate", "--strategy", strategy, "--steps", "10", "--nodes", "2",
                                 "--no-progress", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    (summary,) = tmp_path.glob("*/summary.json")
    assert json.loads(summary.read_text())["strategy"] == strategy


def test_set_overrides_strategy_and_task_options(tmp_path: Path) -> None:
    result = runner.invoke(app, ["simulate", "--steps", "10", "--nodes", "2", "--no-progress",
                                 "--set", "H=5", "--set", "task_options.arch=cnn",
                                 "--set", "outer_lr=1.0", "--out", str(tmp_path), "--run-id", "x"])
    assert result.exit_code == 0, result.output
    config = yaml.safe_load((tmp_path / "x" / "config.yaml").read_text())
    assert config["strategy"]["H"] == 5 and config["strategy"]["outer_lr"] == 1.0
    assert config["model"] == "DigitsCNN"


def test_gpt_task_trains_on_a_text_file(tmp_path: Path) -> None:
    text = tmp_path / "tiny.txt"
    text.write_text("to be or not to be, that is the question. " * 60)
    result = runner.invoke(app, ["simulate", "--task", "gpt", "--data", str(text), "--steps", "30",
                                 "--nodes", "2", "--no-progress", "--out", str(tmp_path / "runs"),
                                 "--set", "task_options.dim=32", "--set", "task_options.block_size=16",
                                 "--set", "H=10", "--lr", "3e-3"])
    assert result.exit_code == 0, result.output
    (summary,) = (tmp_path / "runs").glob("*/summary.json")
    data = json.loads(summary.read_text())
    rows = list(csv.DictReader((summary.parent / "metrics.csv").open()))
    assert data["final_train_loss"] < float(rows[1]["train_loss"]) - 0.5  # rows[0]: step 0


def test_listings(tmp_path: Path) -> None:
    strategies = runner.invoke(app, ["strategies"], env={"COLUMNS": "200"})
    assert strategies.exit_code == 0
    for name in ("ddp", "diloco", "sparta", "sparta-diloco", "fedavg", "demo", "outer_lr=0.7",
                 "compression_topk=32", "island_size=None", "sparseloco", "topk=64", "decay=0.95",
                 "compression='fp32'"):
        assert name in strategies.output
    tasks = runner.invoke(app, ["tasks"], env={"COLUMNS": "200"})
    assert tasks.exit_code == 0 and "digits" in tasks.output and "gpt" in tasks.output
    assert runner.invoke(app, ["profiles"]).exit_code == 0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--strategy", "nope"], "unknown strategy 'nope'"),
        (["--task", "nope"], "unknown task 'nope'"),
        (["--nodes", "0"], "nodes must be >= 1"),
        (["--batch-size", "5000"], "batch size 5000 is larger than the shard of each node"),
        (["--set", "bogus=1"], "--set bogus: not a setting or a parameter of strategy 'diloco'"),
        (["--set", "H=abc"], "H must be int, got 'abc'"),
        (["--set", "H"], "expected key=value"),
        (["--set", "task_options.nope=1"], "task 'digits' has no option 'nope'"),
        (["--task", "gpt"], "task 'gpt' needs a text file: --data FILE"),
        (["--task", "gpt", "--data", "missing.txt"], "data file missing.txt does not exist"),
        (["--profile", "missing-profile"], "no profile named 'missing-profile'"),
        (["--device", "cuda"], "device 'cuda'"),
        (["--device", "tpu"], "unknown device 'tpu'; choose one of: auto, cpu, cuda, mps (cuda:N for GPU N)"),
        (["--runtime", "fibers"], "runtime must be one of"),
        (["--set", "H=0"], "H must be >= 1"),
        # Wrong types and out-of-range values, named where they came from.
        (["--set", "nodes=abc"], "--set nodes must be a whole number, got 'abc'"),
        (["--set", "steps=abc"], "--set steps must be a whole number, got 'abc'"),
        (["--set", "batch_size=[1,2]"], "--set batch_size must be a whole number, got [1, 2]"),
        (["--set", "task_options.hidden=-3"], "task_options.hidden must be >= 1, got -3"),
        (["--set", "task_options.hidden=abc"], "task_options.hidden must be a whole number"),
        (["--step-seconds", "-1"], "step_seconds must be > 0, got -1.0"),
        (["--set", "warmup_steps=-10"], "warmup_steps must be >= 0, got -10"),
        (["--set", "min_lr=-1"], "min_lr must be between 0 and lr"),
        (["--set", "outer_momentum=2"], "outer_momentum must be in [0, 1), got 2"),
        (["--set", "val_size=0"], "--set val_size must be >= 1, got 0"),
        (["--lr", "nan"], "lr must be a finite number, got nan"),
        (["--data", "x.txt"], "task 'digits' reads no data file"),
        (["--steps", "5", "--epochs", "1"], "give steps or epochs, not both"),
        (["--run-id", "../x"], "run id '../x'"),
        (["--run-id", "a/b"], "run id 'a/b'"),
        (["--threads", "0"], "threads must be >= 1"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args: list[str], message: str, tmp_path: Path) -> None:
    if "cuda" in args:
        import torch

        if torch.cuda.is_available():
            pytest.skip("this machine has CUDA")
    result = runner.invoke(app, ["simulate", "--no-progress", "--out", str(tmp_path), *args])
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert "Traceback" not in result.output
    assert not any(tmp_path.iterdir()), "a failed run must leave nothing behind"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('steps: "10"\n', "steps must be a whole number, got '10'"),
        ("strategy_options: 5\n", "strategy_options must be a mapping (key: value), got 5"),
        ("nodes: 2.5\n", "nodes must be a whole number, got 2.5"),
        ("shuffle: maybe\n", "shuffle must be true or false, got 'maybe'"),
    ],
)
def test_wrong_typed_profile_is_one_line(tmp_path: Path, text: str, message: str) -> None:
    profile = tmp_path / "p.yaml"
    profile.write_text(text)
    result = runner.invoke(app, ["simulate", "--profile", str(profile), "--out", str(tmp_path / "r")])
    assert result.exit_code == 2, result.output
    assert f"profile {profile}: {message}" in result.output
    assert "Traceback" not in result.output


def test_binary_file_is_not_gpt_text(tmp_path: Path) -> None:
    blob = tmp_path / "blob.bin"
    blob.write_bytes(bytes(range(256)) * 100)
    result = runner.invoke(app, ["simulate", "--task", "gpt", "--data", str(blob), "--out", str(tmp_path)])
    assert result.exit_code == 2 and "is not UTF-8 text" in result.output


def test_epochs_from_set_or_profile_replace_the_task_step_count(tmp_path: Path) -> None:
    """digits suggests steps: 300; epochs given later in the layers wins instead of clashing."""
    result = runner.invoke(app, ["simulate", "--set", "epochs=0.5", "--nodes", "2", "--no-progress",
                                 "--out", str(tmp_path), "--run-id", "e"])
    assert result.exit_code == 0, result.output
    summary = json.loads((tmp_path / "e" / "summary.json").read_text())
    # 1500 training digits over 2 nodes: 750 per node, 23 full batches of 32 per epoch.
    assert summary["steps"] == 12  # ceil(0.5 * 23)


def test_a_value_error_during_training_is_a_failure_not_bad_input(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Exit 2 means nothing ran; an error raised mid-run (whatever its type) is exit 1."""
    from meshtrain.tasks import digits

    class Breaks(digits.DigitsMLP):
        calls = 0

        def forward(self, batch):  # noqa: ANN001, ANN202
            type(self).calls += 1
            if type(self).calls > 6:
                raise ValueError("shape mismatch deep inside the model")
            return super().forward(batch)

    monkeypatch.setattr(digits, "DigitsMLP", Breaks)
    result = runner.invoke(app, ["simulate", "--no-progress", "--out", str(tmp_path), "--run-id", "v"])
    assert result.exit_code == 1, result.output
    assert "failed: ValueError: shape mismatch deep inside the model" in result.output
    assert "Traceback" not in result.output  # the one-line report...
    log = (tmp_path / "v.error.log").read_text()  # ...and the full traceback in the error log
    assert "Traceback" in log and "in forward" in log
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v.error.log"]
    verbose = runner.invoke(app, ["simulate", "--no-progress", "--out", str(tmp_path), "--verbose"])
    assert verbose.exit_code == 1 and "in forward" in verbose.output


def test_non_finite_loss_stops_the_run_naming_step_and_node(tmp_path: Path) -> None:
    result = runner.invoke(app, ["simulate", "--strategy", "ddp", "--set", "optim=sgd", "--lr", "1e30",
                                 "--no-progress", "--out", str(tmp_path)])
    assert result.exit_code == 1, result.output
    assert "NonFiniteLoss: loss is" in result.output and "at step" in result.output
    assert "on node" in result.output


def test_version_and_plain_strategy_descriptions() -> None:
    from meshtrain import __version__

    version = runner.invoke(app, ["--version"])
    assert version.exit_code == 0 and version.output.strip() == f"meshtrain {__version__}"
    strategies = runner.invoke(app, ["strategies"], env={"COLUMNS": "200"})
    assert "`" not in strategies.output  # docstrings' RST markup is not shown raw
    listed = runner.invoke(app, ["settings"], env={"COLUMNS": "200"})
    assert listed.exit_code == 0 and "threads" in listed.output and "batch_size" in listed.output


def test_bad_input_through_the_real_entry_point(tmp_path: Path) -> None:
    proc = run_cli("simulate", "--strategy", "nope", cwd=tmp_path)
    assert proc.returncode == 2
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "unknown strategy 'nope'" in lines[0]


def test_bad_profile_names_the_file_and_key(tmp_path: Path) -> None:
    profile = tmp_path / "p.yaml"
    profile.write_text("strategy: diloco\nstepz: 10\n")
    result = runner.invoke(app, ["simulate", "--profile", str(profile), "--out", str(tmp_path / "r")])
    assert result.exit_code == 2
    assert str(profile) in result.output and "'stepz'" in result.output
    base = tmp_path / "child.yaml"
    base.write_text(f"base: {tmp_path / 'loop.yaml'}\n")
    (tmp_path / "loop.yaml").write_text(f"base: {base}\n")
    looped = runner.invoke(app, ["simulate", "--profile", str(base), "--out", str(tmp_path / "r")])
    assert looped.exit_code == 2 and "loops" in looped.output


def test_profile_base_and_set_layering(tmp_path: Path) -> None:
    (tmp_path / "base.yaml").write_text("description: b\nstrategy: fedavg\nsteps: 7\nnodes: 2\n"
                                        "strategy_options: {H: 2, lr: 0.1}\n")
    (tmp_path / "child.yaml").write_text(f"base: {tmp_path / 'base.yaml'}\nstrategy_options: {{H: 3}}\n")
    result = runner.invoke(app, ["simulate", "--profile", str(tmp_path / "child.yaml"), "--no-progress",
                                 "--set", "island_size=2", "--out", str(tmp_path / "r"), "--run-id", "x"])
    assert result.exit_code == 0, result.output
    config = yaml.safe_load((tmp_path / "r" / "x" / "config.yaml").read_text())
    assert config["strategy"] == {**config["strategy"], "name": "fedavg", "H": 3, "lr": 0.1,
                                  "island_size": 2}
    assert config["spec"]["steps"] == 7 and config["spec"]["nodes"] == 2
