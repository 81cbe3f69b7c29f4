"""The optional loggers (TensorBoard, Weights & Biases) see the numbers of metrics.csv.

Each test runs real training on digits and reads back what the real package wrote:
TensorBoard's event files with its own EventAccumulator, and the offline W&B run's
transaction log (a LevelDB-style record log of wandb's protobuf records).
"""

from __future__ import annotations

import csv
import json
import math
import struct
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from typer.testing import CliRunner

from meshtrain import NodeFailed, Trainer
from meshtrain.cli.main import app
from meshtrain.strategies import DiLoCo
from meshtrain.tasks import TaskOptions
from meshtrain.tasks.digits import TASK

STEPS, VAL_EVERY = 40, 10
NO_TENSORBOARD = "TensorBoard logging needs pip install 'meshtrain[tensorboard]'"


def digits() -> Any:
    return TASK.build(TaskOptions(options=TASK.options))


def train(tmp_path: Path, **settings: Any) -> Any:
    task = digits()
    return Trainer(task.model, task.train_data, task.val_data).fit(
        strategy=DiLoCo(H=10), nodes=4, max_steps=STEPS, batch_size=16, val_interval=VAL_EVERY,
        progress=False, out_dir=tmp_path / "runs", **settings)


def csv_rows(run_dir: Path) -> dict[int, dict[str, str]]:
    with open(run_dir / "metrics.csv") as f:
        return {int(row["step"]): row for row in csv.DictReader(f)}


def expected_rows(result: Any) -> dict[int, dict[str, float]]:
    """metrics.csv's rows as numbers, step 0 included (its node_val_loss is the val loss)."""
    initial = result.summary["initial"]
    rows = {0: {"node_val_loss": initial["val_loss"], **initial}}
    rows.update({row["step"]: row for row in result.history})
    return rows


def check_logged(logged: dict[str, dict[int, float]], result: Any, rel: float) -> None:
    """Every logged value equals metrics.csv's at that step, on the documented schedule."""
    rows, table = expected_rows(result), csv_rows(result.run_dir)
    # 40 steps: the progress schedule is every step; validation every 10 steps and at step 0.
    assert sorted(logged["train_loss"]) == list(range(1, STEPS + 1))
    assert sorted(logged["total_bytes_sent"]) == list(range(1, STEPS + 1))
    for name in ("val_loss", "node_val_loss", "val_accuracy"):
        assert sorted(logged[name]) == list(range(0, STEPS + 1, VAL_EVERY)), name
    for name, by_step in logged.items():
        for step, value in by_step.items():
            assert value == pytest.approx(rows[step][name], rel=rel), (name, step)
            assert value == pytest.approx(float(table[step][name]), rel=1e-5), (name, step)  # 6 digits
    assert logged["total_bytes_sent"][STEPS] == result.summary["bytes_sent_per_node"] > 0
    assert logged["val_loss"][STEPS] < logged["val_loss"][0]  # it trained


def test_tensorboard_scalars_equal_metrics_csv(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard", reason=NO_TENSORBOARD)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    result = train(tmp_path, tensorboard=True)
    folder = result.run_dir / "tensorboard"
    assert len(list(folder.glob("events.out.tfevents.*"))) == 1
    events = EventAccumulator(str(folder))
    events.Reload()
    logged = {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}
    assert set(logged) == {"train_loss", "total_bytes_sent", "val_loss", "node_val_loss", "val_accuracy"}
    check_logged(logged, result, rel=1e-6)  # event files hold float32
    texts = {tag: events.Tensors(tag) for tag in events.Tags()["tensors"]}
    summary_text = texts["summary/text_summary"][0].tensor_proto.string_val[0].decode()
    logged_summary, written = json.loads(summary_text), json.loads(json.dumps(result.summary))
    # wall_seconds is taken before the run directory is written, summary.json's after.
    assert 0 < logged_summary.pop("wall_seconds") <= written.pop("wall_seconds")
    assert logged_summary == written
    assert texts["summary/text_summary"][0].step == STEPS
    assert '"name": "diloco"' in texts["config/text_summary"][0].tensor_proto.string_val[0].decode()


def wandb_records(run_file: Path) -> list[Any]:
    """The protobuf records of an offline run's ``run-*.wandb`` file.

    The file is a 7-byte header (":W&B", magic, version), then LevelDB's log format:
    32 KiB blocks of chunks, each with a 7-byte header (crc32, length, type: 1 full,
    2 first, 3 middle, 4 last); a block's tail shorter than a header is padding.
    """
    from wandb.proto import wandb_internal_pb2

    data = run_file.read_bytes()
    assert data[:4] == b":W&B"
    records, pieces, pos, block = [], b"", 7, 32768
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0:  # zero padding to the end of the block
            pos += block - pos % block
            continue
        pieces += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pieces)
            records.append(record)
            pieces = b""
    return records


def item_key(item: Any) -> str:
    return item.key or "/".join(item.nested_key)


@pytest.fixture(scope="module")
def wandb_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """W&B offline, its files in one temporary folder: wandb reads its environment once per
    process, so every test of this module shares it and finds its run by name."""
    pytest.importorskip("wandb", reason="W&B logging needs pip install 'meshtrain[wandb]'")
    folder = tmp_path_factory.mktemp("wandb-dir")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("WANDB_MODE", "offline")  # no account, no network
        env.setenv("WANDB_DIR", str(folder))
        env.setenv("WANDB_SILENT", "true")
        yield folder


def offline_run(folder: Path, name: str) -> list[Any]:
    """The records of the one offline W&B run called ``name``."""
    import wandb

    # W&B's service process writes the run file and may still hold its records when
    # run.finish() has returned (seen: a file of its 7-byte header alone, 1 run in 6 here);
    # teardown waits until the service has written everything and stopped.
    wandb.teardown()
    found = []
    for run_file in folder.glob("wandb/offline-run-*/run-*.wandb"):
        records = wandb_records(run_file)
        if any(r.run.display_name == name for r in records if r.WhichOneof("record_type") == "run"):
            found.append(records)
    assert len(found) == 1, f"{len(found)} offline W&B runs named {name}"
    return found[0]


def test_wandb_offline_logs_the_numbers_of_metrics_csv(tmp_path: Path, wandb_dir: Path) -> None:
    result = train(tmp_path, wandb="meshtrain-test")
    records = offline_run(wandb_dir, result.run_dir.name)
    run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    assert (run.project, run.display_name) == ("meshtrain-test", result.run_dir.name)
    config = {item_key(i): json.loads(i.value_json) for i in run.config.update}
    assert config["strategy"]["H"] == 10 and config["train"]["nodes"] == 4
    logged: dict[str, dict[int, float]] = {}
    for r in records:
        if r.WhichOneof("record_type") == "history":
            for item in r.history.item:
                if not item_key(item).startswith("_"):  # wandb's own _step, _runtime, _timestamp
                    logged.setdefault(item_key(item), {})[r.history.step.num] = json.loads(item.value_json)
    assert set(logged) == {"train_loss", "total_bytes_sent", "val_loss", "node_val_loss", "val_accuracy"}
    # Doubles, exact but for the mean over nodes, summed in the ring's order live.
    check_logged(logged, result, rel=1e-12)
    summary = {item_key(i): json.loads(i.value_json) for r in records
               if r.WhichOneof("record_type") == "summary" for i in r.summary.update}
    for key in ("final_val_loss", "final_accuracy", "bytes_sent_per_node", "steps", "run_id"):
        assert summary[key] == result.summary[key], key
    exits = [r.exit.exit_code for r in records if r.WhichOneof("record_type") == "exit"]
    assert exits == [0]


class ExplodesAtStep3(nn.Module):
    """Digits' MLP whose loss becomes NaN at its third forward pass on every node."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = digits().model
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, batch: Any) -> torch.Tensor:
        if self.training:
            self.calls += 1
        loss = self.inner(batch)
        return loss * math.nan if self.calls.item() >= 3 else loss


def test_a_failed_run_closes_the_wandb_run_as_failed_and_leaves_no_event_files(
    tmp_path: Path, wandb_dir: Path
) -> None:
    pytest.importorskip("tensorboard", reason=NO_TENSORBOARD)
    task = digits()
    with pytest.raises(NodeFailed, match="loss is nan at step 3"):
        Trainer(ExplodesAtStep3(), task.train_data, task.val_data).fit(
            nodes=2, max_steps=10, batch_size=16, progress=False, out_dir=tmp_path / "runs",
            wandb="meshtrain-test", tensorboard=True, run_id="explodes")
    assert not list((tmp_path / "runs").glob("**/events.out.tfevents.*"))  # gone with the run dir
    exits = [r.exit.exit_code for r in offline_run(wandb_dir, "explodes")
             if r.WhichOneof("record_type") == "exit"]
    assert exits == [1]


@pytest.mark.parametrize("flag, package", [(["--wandb", "my-project"], "wandb"),
                                           (["--tensorboard"], "tensorboard")])
def test_missing_package_is_one_line_naming_the_extra_and_nothing_trains(
    flag: list[str], package: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, package, None)  # Python's way to make a package not importable
    out = tmp_path / "runs"
    result = CliRunner().invoke(app, ["simulate", "--steps", "5", "--out", str(out), *flag])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1
    assert f"pip install 'meshtrain[{package}]'" in lines[0] and flag[0] in lines[0]
    assert not out.exists() or not any(out.iterdir())  # no run directory, not even a reserved one


def test_settings_reach_profiles_and_set(tmp_path: Path) -> None:
    from meshtrain.config.layers import parse_set, resolve_spec
    from meshtrain.config.settings import SettingError

    spec = resolve_spec([("--set ", parse_set(["wandb=proj", "tensorboard=true"], "diloco"))])
    assert (spec.wandb, spec.tensorboard) == ("proj", True)
    assert spec.train_config().tensorboard is True
    with pytest.raises(SettingError, match="tensorboard must be true or false"):
        resolve_spec([("--set ", parse_set(["tensorboard=3"], "diloco"))])
