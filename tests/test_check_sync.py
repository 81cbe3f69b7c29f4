"""--check-sync: what a strategy promises is identical across nodes is verified after every
sync by a hash all-gather, and a node that drifts stops the run, named."""

from __future__ import annotations

import pytest
import torch
from helpers import MLP, regression_data
from typer.testing import CliRunner

from meshtrain import NodeFailed, Trainer
from meshtrain.cli.main import app
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
