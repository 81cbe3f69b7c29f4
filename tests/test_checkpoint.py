"""Checkpoints and --resume: a run interrupted part-way and resumed ends bit-identical to
the run that never stopped, for every strategy, in both local runtimes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import MLP, CrashesAt, assert_states_equal, regression_data
from typer.testing import CliRunner

from meshtrain import NodeFailed, Trainer
from meshtrain.checkpoint import CheckpointError, find_latest
from meshtrain.cli.main import app
from meshtrain.strategies import DDP, SPARTA, DeMo, DiLoCo, FedAvg, SparseLoCo, SPARTADiLoCo, StreamingDiLoCo
from meshtrain.strategies.async_diloco import AsyncDiLoCo

STRATEGIES = {
    "ddp": lambda: DDP("adamw", 0.01),
    "diloco": lambda: DiLoCo(H=3, lr=0.01),
    "sparta": lambda: SPARTA(p=0.3, lr=0.01),
    "sparta-diloco": lambda: SPARTADiLoCo(H=3, p=0.3, lr=0.01),
    "fedavg": lambda: FedAvg(H=2, island_size=2, weighted=True, lr=0.05),
    "demo": lambda: DeMo(lr=0.01, compression_topk=4, compression_chunk=4),
    # error feedback: each node's residual is part of its checkpoint
    "diloco-int8": lambda: DiLoCo(H=3, lr=0.01, compression="int8", error_feedback=True),
    "sparseloco": lambda: SparseLoCo(H=3, lr=0.01, chunk=64, topk=8),
    # Averages on their way at a checkpoint are saved unapplied, with their records.
    "diloco-delay": lambda: DiLoCo(H=3, lr=0.01, delay=1),
    "streaming": lambda: StreamingDiLoCo(fragments=2, H=4, tau=2, lr=0.01),  # syncs in flight at 4, 8
    # Jobs in progress at a checkpoint: each node's own parameters and where its job began.
    "async-local-sgd": lambda: AsyncDiLoCo(H=4, lr=0.01, speeds=[1.0, 0.5, 0.4], dylu=False, grace=0),
}
# 3 nodes x 32 samples, batch 4: 8 steps an epoch, so 12 steps cross an epoch boundary.
RUN = dict(nodes=3, max_steps=12, batch_size=4, progress=False, val_interval=5)


def _fit(model: torch.nn.Module, strategy: str, out: Path, **settings):
    return Trainer(model, regression_data(96), regression_data(16, seed=5)).fit(
        STRATEGIES[strategy](), out_dir=out, **{**RUN, **settings})


@pytest.mark.parametrize("runtime", ["threads", "processes"])
@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_interrupted_and_resumed_equals_uninterrupted(strategy: str, runtime: str, tmp_path: Path) -> None:
    reference = _fit(CrashesAt(None), strategy, tmp_path / "ref", runtime="threads")
    # Every node raises at its 10th forward pass: the run stops during step 10.
    with pytest.raises(NodeFailed, match="interrupted at forward call 10"):
        _fit(CrashesAt(10), strategy, tmp_path / "runs", runtime=runtime, checkpoint_every=4, run_id="r")
    folder = tmp_path / "runs" / "r.checkpoints"
    found = find_latest(folder)
    # DiLoCo-like strategies checkpoint right after an outer sync: every 4 rounds up to H=3's 6.
    assert found.step == (6 if "loco" in strategy else 8)  # DiLoCo, SPARTA-DiLoCo, SparseLoCo
    assert not (tmp_path / "runs" / "r").exists()  # the failed run left no run directory...
    assert (tmp_path / "runs" / "r.error.log").is_file()  # ...but kept its checkpoints

    resumed = _fit(CrashesAt(None), strategy, tmp_path / "runs", runtime=runtime, checkpoint_every=4,
                   resume=str(folder))
    assert resumed.run_dir == tmp_path / "runs" / "r"
    assert_states_equal(resumed.model, reference.model)  # bit for bit
    for mine, theirs in zip(resumed.history, reference.history, strict=True):
        assert mine["train_loss"] == theirs["train_loss"] and mine["bytes_sent"] == theirs["bytes_sent"]
        assert mine["val_loss"] == theirs["val_loss"]
    assert resumed.summary["bytes_sent_per_node"] == reference.summary["bytes_sent_per_node"]
    assert resumed.summary["initial"] == reference.summary["initial"]
    # The finished run keeps its last checkpoints (keep_checkpoints=2 by default; none at the end).
    kept = sorted(p.name for p in (resumed.run_dir / "checkpoints").glob("step-*"))
    assert kept == (["step-000006"] if "loco" in strategy else ["step-000004", "step-000008"])
    assert not folder.exists()


def test_a_damaged_newest_checkpoint_falls_back_to_the_previous_one(tmp_path: Path) -> None:
    with pytest.raises(NodeFailed):
        _fit(CrashesAt(11), "ddp", tmp_path, checkpoint_every=3, run_id="r", keep_checkpoints=3)
    folder = tmp_path / "r.checkpoints"
    assert [p.name for p in sorted(folder.glob("step-*"))] == ["step-000003", "step-000006", "step-000009"]
    newest = folder / "step-000009" / "node-1.pt"
    newest.write_bytes(newest.read_bytes()[:100])  # truncated
    (folder / ".step-000012.partial").mkdir()  # a checkpoint that never completed is ignored
    found = find_latest(folder)
    assert found.step == 6
    assert found.skipped == ["step-000009: node-1.pt does not match its checksum (truncated or changed)"]
    reference = _fit(CrashesAt(None), "ddp", tmp_path / "ref")
    resumed = _fit(CrashesAt(None), "ddp", tmp_path, resume=str(folder), checkpoint_every=3)
    assert_states_equal(resumed.model, reference.model)


def test_checkpoints_refuse_what_they_cannot_use(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="no such folder"):
        find_latest(tmp_path / "missing")
    (tmp_path / "empty.checkpoints" / "step-000004").mkdir(parents=True)
    with pytest.raises(CheckpointError, match=r"no complete checkpoint found \(step-000004: incomplete"):
        find_latest(tmp_path / "empty.checkpoints")
    with pytest.raises(NodeFailed):
        _fit(CrashesAt(7), "ddp", tmp_path, checkpoint_every=3, run_id="r")
    with pytest.raises(ValueError, match="the checkpoint has 3 nodes, this run 4"):  # fewer: see shrink tests
        _fit(MLP(), "ddp", tmp_path, nodes=4, resume=str(tmp_path / "r.checkpoints"))
    meta = tmp_path / "r.checkpoints" / "step-000006" / "meta.json"
    meta.write_text(meta.read_text()[:-20])
    with pytest.raises(CheckpointError, match="meta.json is damaged"):
        find_latest(tmp_path / "r.checkpoints" / "step-000006")


def test_cli_prints_the_resume_command_and_resume_finishes_the_same_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from meshtrain.tasks import digits

    runner = CliRunner()
    base = ["simulate", "--steps", "60", "--nodes", "2", "--no-progress", "--checkpoint-every", "20"]
    assert runner.invoke(app, [*base, "--out", str(tmp_path / "ref"), "--run-id", "ref"]).exit_code == 0

    real = digits.DigitsMLP

    class Breaks(real):
        calls = 0

        def forward(self, batch):  # noqa: ANN001, ANN202
            type(self).calls += self.training  # class-wide: both nodes' training passes
            if type(self).calls > 2 * 57:  # during step 58
                raise RuntimeError("the laptop went to sleep")
            return super().forward(batch)

    monkeypatch.setattr(digits, "DigitsMLP", Breaks)
    broken = runner.invoke(app, [*base, "--out", str(tmp_path / "runs"), "--run-id", "r"])
    assert broken.exit_code == 1
    folder = tmp_path / "runs" / "r.checkpoints"
    assert f"resume with: meshtrain simulate --resume {folder}" in broken.output
    monkeypatch.setattr(digits, "DigitsMLP", real)
    monkeypatch.chdir(tmp_path)
    resumed = runner.invoke(app, ["simulate", "--resume", str(folder), "--no-progress"])
    assert resumed.exit_code == 0, resumed.output
    assert "resuming run r after step 50" in resumed.output  # H=25 rounds 20 up to 25: 25, 50
    one = json.loads((tmp_path / "ref" / "ref" / "summary.json").read_text())
    two = json.loads((tmp_path / "runs" / "r" / "summary.json").read_text())
    assert one["final_train_loss"] == two["final_train_loss"]
    assert one["final_val_loss"] == two["final_val_loss"]
    ref = torch.load(tmp_path / "ref" / "ref" / "model.pt", weights_only=True)
    got = torch.load(tmp_path / "runs" / "r" / "model.pt", weights_only=True)
    assert all(torch.equal(ref[k], got[k]) for k in ref)


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_run_and_checkpoint_files_follow_the_umask(umask: int, tmp_path: Path) -> None:
    """Nothing a run writes is forced private or public: every file and folder of the run
    directory and of its checkpoints gets the mode the user's umask gives (only the launch
    secret is always private: see test_launch_local_users.py)."""
    import os
    import stat

    previous = os.umask(umask)
    try:
        _fit(MLP(), "diloco", tmp_path / "runs", checkpoint_every=4, run_id="r", nodes=2)
    finally:
        os.umask(previous)
    written = [p for p in (tmp_path / "runs").rglob("*")]
    assert any(p.parent.name.startswith("step-") for p in written)  # checkpoints were written
    assert any(p.name == "summary.json" for p in written)
    for path in written:
        expected = (0o777 if path.is_dir() else 0o666) & ~umask
        assert stat.S_IMODE(path.stat().st_mode) == expected, (path, oct(path.stat().st_mode))


class _RunsCode:
    """Unpickling this would call ``Path.touch`` (pickle runs code; weights_only must not)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # noqa: ANN204 - pickle's protocol
        return (Path.touch, (self.marker,))


def test_a_checkpoint_is_read_without_running_code(tmp_path: Path) -> None:
    """Checkpoints are loaded with ``torch.load(weights_only=True)``: a node file that would
    run code when unpickled (its hash in meta.json made to match) is refused, the code never runs."""
    import hashlib
    import pickle

    from meshtrain.checkpoint import Found, find_latest, load_node

    with pytest.raises(NodeFailed):  # a run that stops keeps its checkpoints
        _fit(CrashesAt(7), "ddp", tmp_path, checkpoint_every=3, run_id="r")
    folder = tmp_path / "r.checkpoints" / "step-000006"
    marker = tmp_path / "code-ran"
    torch.save({"run_id": "r", "step": 6, "evil": _RunsCode(marker)}, folder / "node-0.pt")
    meta = json.loads((folder / "meta.json").read_text())
    meta["files"]["node-0.pt"] = hashlib.sha256((folder / "node-0.pt").read_bytes()).hexdigest()
    (folder / "meta.json").write_text(json.dumps(meta))
    # Refused when the checkpoint is checked, before a resume is announced: one line.
    with pytest.raises(CheckpointError, match="node-0.pt cannot be read as a checkpoint .*Weights only"):
        find_latest(folder)
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):  # and by a node
        load_node(Found(folder, 6, "r", 1, [], (0,)), 0)
    assert not marker.exists()
