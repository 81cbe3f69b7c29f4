"""Strategies own their metadata, and a user's own strategy runs from the CLI by
``package.module:Class``."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from meshtrain import Trainer
from meshtrain.checkpoint import fewer_nodes_refusal
from meshtrain.cli.main import app
from meshtrain.runs import strategy_label
from meshtrain.strategies import DDP, STRATEGIES, DeMo, FedAvg, Strategy
from meshtrain.tasks import TaskOptions
from meshtrain.tasks.digits import TASK as DIGITS

ROOT = Path(__file__).resolve().parent.parent
CUSTOM = "examples.custom_strategy:Int8DDP"
runner = CliRunner()


def test_each_strategy_declares_its_name_label_and_whether_it_continues_on_fewer_nodes() -> None:
    assert all(cls.display_name for cls in STRATEGIES.values())
    assert [n for n, cls in STRATEGIES.items() if cls.continues_on_fewer_nodes] == \
        ["ddp", "diloco", "sparta-diloco", "fedavg", "sparseloco"]
    assert strategy_label("sparta-diloco", {"p": 0.005, "H": 100}) == "SPARTA+DiLoCo p=0.005 H=100"
    assert strategy_label("fedavg", {"H": 5, "island_size": 2}) == "FedAvg H=5 islands=2"
    assert strategy_label("demo", {"compression_topk": 32}) == "DeMo topk=32"
    assert strategy_label("int8-ddp", {"lr": 0.1}) == "int8-ddp"  # not registered: its name alone
    assert fewer_nodes_refusal(DDP()) is None
    assert "island_size=2" in (fewer_nodes_refusal(FedAvg(island_size=2)) or "")
    assert fewer_nodes_refusal(DeMo()) == ("strategy demo: a checkpoint cannot continue on fewer nodes "
                                           "(only ddp, diloco, sparta-diloco, fedavg, sparseloco hold "
                                           "the whole global state on every node)")


class EveryFour(Strategy):
    name = "every-four"

    def sync_interval(self) -> int | None:
        return 4


def test_checkpoints_round_up_to_the_strategys_own_sync_interval(tmp_path: Path) -> None:
    digits = DIGITS.build(TaskOptions(options=DIGITS.options))
    job = Trainer(digits.model, digits.train_data).prepare(
        EveryFour(), nodes=2, max_steps=8, checkpoint_every=3, out_dir=tmp_path, progress=False)
    assert job.config.checkpoint_every == 4
    job.run_dir.discard()


def test_a_custom_strategy_runs_from_simulate(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)  # examples/ is importable from the working directory, as with python -m
    result = runner.invoke(app, ["simulate", "--strategy", CUSTOM, "--nodes", "2", "--steps", "3",
                                 "--no-progress", "--out", str(tmp_path), "--run-id", "mine"])
    assert result.exit_code == 0, result.output
    summary = json.loads((tmp_path / "mine" / "summary.json").read_text())
    assert summary["strategy"] == "int8-ddp" and summary["steps"] == 3 and summary["nodes"] == 2
    assert summary["bytes_sent_per_node"] > 0
    config = yaml.safe_load((tmp_path / "mine" / "config.yaml").read_text())
    assert config["spec"]["strategy"] == CUSTOM  # replaying config.yaml runs it again


def test_a_custom_strategy_takes_part_in_a_comparison(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    result = runner.invoke(app, ["compare", "--strategies", f"ddp,{CUSTOM}", "--nodes", "2", "--steps", "4",
                                 "--set", "val_interval=2", "--no-progress", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    (folder,) = tmp_path.iterdir()
    rows = json.loads((folder / "comparison.json").read_text())["runs"]
    assert [r["strategy"] for r in rows] == ["ddp", "int8-ddp"]


@pytest.mark.parametrize(("path", "message"), [
    ("examples.custom_strategy:Nope", "module examples.custom_strategy has no 'Nope'"),
    ("no_such_module_here:Thing", "no module named 'no_such_module_here'"),
    ("meshtrain.config.spec:RunSpec", "RunSpec is not a subclass of meshtrain.strategies.Strategy"),
    ("examples.custom_strategy:", "expected package.module:Class"),
])
def test_a_bad_strategy_path_is_one_line_exit_2(path: str, message: str, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    result = runner.invoke(app, ["simulate", "--strategy", path, "--out", str(tmp_path)])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: strategy ") and message in lines[0], lines
    assert not any(tmp_path.iterdir())


def test_the_extension_guides_snippet_is_the_example() -> None:
    section = (ROOT / "docs" / "guides" / "custom-strategy.md").read_text()
    snippet = re.search(r"```python\n(.*?)```", section, re.S).group(1)  # type: ignore[union-attr]
    assert snippet.startswith("class Int8DDP(Strategy):")
    assert snippet in (ROOT / "examples" / "custom_strategy.py").read_text()
