"""The run directory: runs/<id>/ with config, metrics, summary and model; nothing on failure."""

from __future__ import annotations

import csv
import json

import pytest
import torch
import yaml
from helpers import MLP, FailOnRank, ranked_factory, regression_data

from meshtrain import NodeFailed, Trainer
from meshtrain.run_dir import RunDirectory, new_run_id
from meshtrain.strategies import DiLoCo

METRIC_COLUMNS = ["step", "train_loss", "val_loss", "node_val_loss", "lr", "bytes_sent", "bytes_received",
                  "examples", "seconds"]
SUMMARY_KEYS = ["strategy", "nodes", "steps", "final_train_loss", "final_val_loss", "bytes_sent_per_node",
                "wall_seconds"]


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    out = tmp_path_factory.mktemp("runs")
    result = Trainer(MLP(), regression_data(96), regression_data(16, seed=5)).fit(
        DiLoCo(H=3, lr=0.01), nodes=3, max_steps=7, batch_size=4, val_interval=2, out_dir=out,
        progress=False, run_id="my-run")
    return out, result


def test_run_directory_layout(finished):
    out, result = finished
    assert result.run_dir == out / "my-run"
    names = {p.name for p in result.run_dir.iterdir()}
    assert {"config.yaml", "metrics.csv", "summary.json", "model.pt"} <= names
    assert not [n for n in names if n.startswith(".")]  # no temporary files left
    assert [p.name for p in out.iterdir()] == ["my-run"]  # no .partial folder either


def test_config_yaml(finished):
    _, result = finished
    config = yaml.safe_load((result.run_dir / "config.yaml").read_text())
    assert config["strategy"]["name"] == "diloco" and config["strategy"]["H"] == 3
    assert config["strategy"]["lr"] == 0.01
    train = config["train"]
    assert (train["nodes"], train["steps"], train["batch_size"], train["seed"]) == (3, 7, 4, 0)
    assert config["model"] == "MLP"


def test_metrics_csv(finished):
    _, result = finished
    with (result.run_dir / "metrics.csv").open() as f:
        reader = csv.DictReader(f)
        rows = list(reader)
    assert reader.fieldnames[: len(METRIC_COLUMNS)] != [] and set(METRIC_COLUMNS) <= set(reader.fieldnames)
    # Step 0 is the untrained global model's evaluation; then one row per step.
    assert [int(r["step"]) for r in rows] == list(range(0, 8))
    assert rows[0]["train_loss"] == "" and rows[0]["bytes_sent"] == ""
    assert float(rows[0]["val_loss"]) == pytest.approx(result.summary["initial"]["val_loss"], rel=1e-5)
    assert result.summary["initial"]["val_loss"] != pytest.approx(result.summary["final_val_loss"])
    rows = rows[1:]
    for row, hist in zip(rows, result.history, strict=True):
        assert float(row["train_loss"]) == pytest.approx(hist["train_loss"], rel=1e-5)
        assert float(row["bytes_sent"]) == hist["bytes_sent"]
        assert int(row["examples"]) == hist["step"] * 4 * 3
        assert float(row["lr"]) == pytest.approx(0.01)
        assert float(row["seconds"]) >= 0
    # Validation every 2 steps and at the end; empty cells elsewhere.
    assert [r["step"] for r in rows if r["val_loss"]] == ["2", "4", "6", "7"]
    assert all(r["node_val_loss"] for r in rows if r["val_loss"])
    assert float(rows[-1]["val_loss"]) == pytest.approx(result.summary["final_val_loss"], rel=1e-5)


def test_summary_json(finished):
    _, result = finished
    summary = json.loads((result.run_dir / "summary.json").read_text())
    assert set(SUMMARY_KEYS) <= set(summary)
    assert (summary["strategy"], summary["nodes"], summary["steps"]) == ("diloco", 3, 7)
    assert summary["final_train_loss"] == pytest.approx(result.history[-1]["train_loss"])
    assert summary["bytes_sent_per_node"] == sum(r["bytes_sent"] for r in result.history) > 0
    assert summary["wall_seconds"] > 0
    assert summary["final_val_loss"] == pytest.approx(result.summary["final_val_loss"])


def test_model_pt_is_the_returned_global_model(finished):
    _, result = finished
    saved = torch.load(result.run_dir / "model.pt", weights_only=True)
    state = result.model.state_dict()
    assert saved.keys() == state.keys()
    assert all(torch.equal(saved[k], state[k]) for k in state)
    reloaded = MLP()
    reloaded.load_state_dict(saved)
    x, y = regression_data(16, seed=5).tensors
    with torch.no_grad():
        assert float(reloaded((x, y))) == pytest.approx(result.summary["final_val_loss"], rel=1e-5)


def test_run_ids_do_not_collide(tmp_path):
    kw = dict(nodes=2, max_steps=2, batch_size=4, out_dir=tmp_path, progress=False)
    first = Trainer(MLP(), regression_data(32)).fit(DiLoCo(H=1), **kw)
    second = Trainer(MLP(), regression_data(32)).fit(DiLoCo(H=1), **kw)
    assert first.run_dir != second.run_dir and first.run_dir.exists() and second.run_dir.exists()
    assert first.run_dir.name.endswith("-diloco-2n")
    assert new_run_id("ddp", 4).endswith("-ddp-4n")


def test_run_ids_started_together_do_not_collide(tmp_path):
    """Two runs reserving in the same second (the same generated name) get distinct ids,
    and each sees its own folder claimed before training."""
    first = RunDirectory.reserve(tmp_path, None, "ddp", 2)
    second = RunDirectory.reserve(tmp_path, None, "ddp", 2)
    assert first.run_id != second.run_id
    assert first.partial.is_dir() and second.partial.is_dir()
    with pytest.raises(FileExistsError, match="still going"):
        RunDirectory.reserve(tmp_path, first.run_id, "ddp", 2)


@pytest.mark.parametrize("bad", ["../x", "a/b", ".hidden", "-dash", "x" * 129])
def test_run_ids_are_validated_before_training(tmp_path, bad):
    with pytest.raises(ValueError, match="run id"):
        Trainer(MLP(), regression_data(32)).fit(DiLoCo(H=1), nodes=2, max_steps=2, batch_size=4,
                                                out_dir=tmp_path / "runs", progress=False, run_id=bad)
    assert not (tmp_path / "x").exists() and not (tmp_path / "runs").exists()


def test_unwritable_out_is_reported_before_training(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    model = CountingMLP()
    with pytest.raises(ValueError, match="output folder"):
        Trainer(model, regression_data(32)).fit(DiLoCo(H=1), nodes=2, max_steps=2, batch_size=4,
                                                out_dir=blocker / "runs", progress=False)
    assert model.calls == 0  # nothing trained


class CountingMLP(MLP):
    calls = 0

    def forward(self, batch):
        type(self).calls += 1
        return super().forward(batch)


def test_failed_training_leaves_no_run_directory(tmp_path):
    with pytest.raises(NodeFailed):
        Trainer(FailOnRank(rank=0, at_call=2), ranked_factory).fit(
            DiLoCo(H=2), nodes=2, max_steps=5, batch_size=4, out_dir=tmp_path, progress=False)
    # No run directory (nor its hidden .partial folder): only the error report.
    (log,) = list(tmp_path.iterdir())
    assert log.name.endswith(".error.log")
    assert "node 0" in log.read_text() and "Traceback" in log.read_text()


class SaveFails(MLP):
    """Training works; saving the model (save_pretrained) fails half-way through the run dir."""

    def save_pretrained(self, path: str) -> None:
        raise OSError("disk full")


def test_failure_while_writing_keeps_what_was_written_marked_incomplete(tmp_path):
    """A full disk at the end must not delete what training produced: the files written
    so far stay in <run-id>.incomplete/, and the error names that folder."""
    with pytest.raises(NodeFailed, match=r"disk full.*kept in .*r\.incomplete"):
        Trainer(SaveFails(), regression_data(32)).fit(DiLoCo(H=2), nodes=2, max_steps=2, batch_size=4,
                                                      out_dir=tmp_path, progress=False, run_id="r")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.error.log", "r.incomplete"]
    assert {"config.yaml", "metrics.csv"} <= {p.name for p in (tmp_path / "r.incomplete").iterdir()}


def test_run_directory_commit_and_discard(tmp_path):
    run = RunDirectory.reserve(tmp_path, "a", "ddp", 1)
    run.write_summary({"x": 1, "nan": float("nan")})
    assert not (tmp_path / "a").exists()  # invisible until committed
    assert run.commit() == tmp_path / "a"
    # Strict JSON: a non-finite number is written as null, never as a NaN literal.
    assert json.loads((tmp_path / "a" / "summary.json").read_text()) == {"x": 1, "nan": None}
    with pytest.raises(FileExistsError):
        RunDirectory.reserve(tmp_path, "a", "ddp", 1)
    other = RunDirectory.reserve(tmp_path, "b", "ddp", 1)
    other.write_summary({})
    other.discard()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a"]


def test_metrics_keep_byte_counts_exact(tmp_path):
    run = RunDirectory.reserve(tmp_path, "big", "ddp", 1)
    row = {"step": 1, "train_loss": 0.123456789, "bytes_sent": 1234567891.0,
           "bytes_received": 394.6666666666667, "total_bytes_sent": 1234567891.0,
           "total_bytes_received": 2.0**40 + 3}
    run.write_metrics([row])
    with (run.commit() / "metrics.csv").open() as f:
        (written,) = list(csv.DictReader(f))
    assert written["bytes_sent"] == "1234567891" and written["total_bytes_received"] == str(2**40 + 3)
    assert float(written["bytes_received"]) == row["bytes_received"]
    assert written["train_loss"] == "0.123457"


def test_existing_run_id_is_refused_before_training(tmp_path):
    (tmp_path / "taken").mkdir()
    with pytest.raises(FileExistsError):
        Trainer(MLP(), regression_data(32)).fit(DiLoCo(H=1), nodes=2, max_steps=2, batch_size=4,
                                                out_dir=tmp_path, progress=False, run_id="taken")
