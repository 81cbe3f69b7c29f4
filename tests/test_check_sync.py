"""--check-sync: what a strategy promises is identical across nodes is verified after every
sync by a hash all-gather, and a node that drifts stops the run, named."""

from __future__ import annotations

import pytest
import torch
from helpers import MLP, regression_data
from typer.testing import CliRunner

from meshtrain import NodeFailed, Trainer
from meshtrain.cli.main import app
from meshtrain.engine.callbacks import digest
from meshtrain.strategies import DDP, DeMo, DiLoCo, FedAvg

RUN = dict(nodes=4, max_steps=6, batch_size=4, progress=False, check_sync=True)


@pytest.mark.parametrize(
    ("strategy", "runtime"),
    [(DDP("sgd", 0.1), "threads"), (DiLoCo(H=2), "threads"), (FedAvg(H=2), "threads"),
     (FedAvg(H=2, island_size=2, weighted=True), "threads"),
     (DeMo(lr=0.01, compression_topk=4, compression_chunk=4), "threads"), (DiLoCo(H=2), "processes")],
    ids=["ddp", "diloco", "fedavg", "fedavg-islands", "demo", "diloco-processes"],
)
def test_strategies_keep_their_promise(strategy, runtime, tmp_path) -> None:
    result = Trainer(MLP(), regression_data(96)).fit(strategy, out_dir=tmp_path, runtime=runtime, **RUN)
    assert result.summary["steps"] == 6


class ScaledMLP(MLP):
    """An MLP with a learnable scalar (0-dim) parameter, as CLIP's logit scale is."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.tensor(1.0))

    def forward(self, batch):  # noqa: ANN001, ANN201 - a test model
        return super().forward(batch) * self.scale


def test_a_model_with_a_scalar_parameter_is_hashed_and_checked(tmp_path) -> None:
    """The hash behind --check-sync and launch's check that every host holds the same
    weights read a tensor's bytes through a byte view, which a 0-dim tensor refused."""
    assert not torch.equal(digest([torch.tensor(1.0)]), digest([torch.tensor(2.0)]))
    assert torch.equal(digest([torch.tensor(1.0)]), digest([torch.tensor([1.0])]))  # the same bytes
    result = Trainer(ScaledMLP(), regression_data(96)).fit(DDP("sgd", 0.1), out_dir=tmp_path, **RUN)
    assert result.summary["steps"] == 6
    assert result.model.scale.item() != 1.0  # it trained


class DriftingDDP(DDP):
    """DDP whose node 2 silently nudges one weight after step 3 (a bug, or bad hardware)."""

    def after_optimizer_step(self, step: int) -> None:
        super().after_optimizer_step(step)
        if self.comm.rank == 2 and step == 2:
            with torch.no_grad():
                self.params[0].view(-1)[0] += 1e-6


def test_a_drifting_node_is_named(tmp_path) -> None:
    with pytest.raises(NodeFailed, match=r"ReplicaDrift: after step 3, node\(s\) 2 hold parameters "
                                         r"that differ from node 0's, although ddp keeps them identical"):
        Trainer(MLP(), regression_data(96)).fit(DriftingDDP("sgd", 0.1), out_dir=tmp_path, **RUN)
    # Without the check the same run "succeeds" with silently different replicas.
    unchecked = {**RUN, "check_sync": False}
    Trainer(MLP(), regression_data(96)).fit(DriftingDDP("sgd", 0.1), out_dir=tmp_path, **unchecked)


def test_cli_flag(tmp_path) -> None:
    result = CliRunner().invoke(app, ["simulate", "--check-sync", "--steps", "30", "--no-progress",
                                      "--out", str(tmp_path), "--run-id", "c"])
    assert result.exit_code == 0, result.output
    assert "check_sync: true" in (tmp_path / "c" / "config.yaml").read_text()


class SpikesOnNode1(MLP):
    """Node 1's loss is NaN on its 3rd and 5th training batches (a bad sample, an overflow)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, batch):  # noqa: ANN001, ANN201
        loss = super().forward(batch)
        if self.training and int(batch[2][0]) == 1:
            self.calls += 1
            if self.calls in (3, 5):
                return loss * float("nan")
        return loss


def test_non_finite_loss_stops_or_is_skipped_on_every_node(tmp_path) -> None:
    from helpers import ranked_factory

    with pytest.raises(NodeFailed, match=r"node 1 failed: NonFiniteLoss: loss is nan at step 3 on node 1"):
        Trainer(SpikesOnNode1(), ranked_factory).fit(DDP("sgd", 0.1), out_dir=tmp_path / "a", **RUN)
    result = Trainer(SpikesOnNode1(), ranked_factory).fit(
        DDP("sgd", 0.1), out_dir=tmp_path / "b", skip_nonfinite=True, **RUN)
    assert result.summary["skipped_steps"] == 2
    assert [row["step"] for row in result.history if row["skipped"]] == [3, 5]
    assert all(p.isfinite().all() for p in result.model.parameters())
    # Skipped steps send nothing (DDP's all-reduce is not run) and replicas stay identical
    # (check_sync is on in RUN).
    assert [row["bytes_sent"] for row in result.history if row["skipped"]] == [0, 0]
