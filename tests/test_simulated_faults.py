"""Simulated faults: ``--fail`` (a node leaves mid-run) and ``--straggler`` (a slow node in
the projected timeline).

The references below are plain PyTorch written from the algorithms: N model replicas (or
one model fed N nodes' batches) up to the failure, and the survivors' replicas after it.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch
from helpers import MLP, regression_data
from torch.testing import assert_close
from torch.utils.data import TensorDataset
from typer.testing import CliRunner

from meshtrain import Trainer
from meshtrain.cli.main import app
from meshtrain.cluster import get_cluster
from meshtrain.strategies import DDP, DiLoCo

TOL = dict(rtol=1e-5, atol=1e-6)
runner = CliRunner()


def fit(data, strategy, tmp_path, **kwargs):
    kwargs.setdefault("shuffle", False)
    kwargs.setdefault("progress", False)
    return Trainer(MLP(), data).fit(strategy, out_dir=tmp_path, **kwargs)


def sharded_batch(data: TensorDataset, rank: int, nodes: int, step: int, batch: int):
    """Node ``rank``'s batch ``step``: samples rank, rank + nodes, ... in order."""
    rows = torch.arange(rank, len(data) - len(data) % nodes, nodes)[step * batch : (step + 1) * batch]
    return tuple(t[rows] for t in data.tensors)


def alive(nodes: int, failures: dict[int, int], step: int) -> list[int]:
    """Nodes taking 0-based step ``step``: a node failing at S takes steps 0 .. S-1."""
    return [r for r in range(nodes) if step < failures.get(r, step + 1)]


def assert_params_close(model, expected) -> None:
    for (name, p), e in zip(model.named_parameters(), expected, strict=True):
        assert_close(p.detach(), e, **TOL, msg=lambda m, n=name: f"{n}: {m}")


# ------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--fail", "node=0,step=5"], "--fail node=0,step=5: node 0 cannot fail"),
        (["--fail", "node=4,step=5"], "--fail node=4,step=5: node 4 is out of range for --nodes 4"),
        (["--fail", "node=2,step=20"], "--fail node=2,step=20: step must be from 1 to 19"),
        (["--fail", "node=2,step=0"], "--fail node=2,step=0: step must be from 1 to 19"),
        (["--fail", "node=2,when=3"], "--fail node=2,when=3: unknown key 'when'"),
        (["--fail", "node=2"], "--fail node=2: missing step=..."),
        (["--fail", "node=2,step=3", "--fail", "node=2,step=4"], "node 2 already fails at step 3"),
        (["--straggler", "node=1,slowdown=0.5"], "--straggler node=1,slowdown=0.5: slowdown must be "
                                                 "a number >= 1"),
        (["--straggler", "node=x,slowdown=2"], "--straggler node=x,slowdown=2: node must be a whole"),
        (["--fail", "node=2,step=5", "--checkpoint-every", "5"], "--fail cannot be combined with "
                                                                 "--checkpoint-every"),
        (["--set", "fail=[3]"], "--fail must be given as text like node=2,step=150, got 3"),
    ],
)
def test_bad_fault_flags_are_one_line_and_exit_2(args, message, tmp_path: Path) -> None:
    result = runner.invoke(app, ["simulate", "--steps", "20", "--no-progress", "--out", str(tmp_path),
                                 *args])
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert len(result.output.strip().splitlines()) == 1
    assert not any(tmp_path.iterdir()), "nothing may be written before the check"


def test_a_launched_rank_refuses_simulated_faults(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="use them with meshtrain simulate"):
        Trainer(MLP(), regression_data(32)).prepare(DDP(), out_dir=tmp_path, max_steps=4,
                                                     fail=["node=1,step=2"])


# ------------------------------------------------------------------- node failures
def test_ddp_with_a_failed_node_matches_the_reference(tmp_path: Path) -> None:
    """DDP: the gradient is the mean over the alive nodes; 4 nodes for S steps, then 3."""
    nodes, steps, batch, fail_at = 4, 8, 4, 3
    data = regression_data(nodes * batch * steps)
    result = fit(data, DDP(lr=0.01), tmp_path, nodes=nodes, max_steps=steps, batch_size=batch,
                 fail=[f"node=2,step={fail_at}"])
    model = MLP()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    for s in range(steps):
        members = alive(nodes, {2: fail_at}, s)
        opt.zero_grad()
        grads = []
        for r in members:
            model.zero_grad()
            model(sharded_batch(data, r, nodes, s, batch)).backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        for p, gs in zip(model.parameters(), zip(*grads, strict=True), strict=True):
            p.grad = torch.stack(gs).mean(0)
        opt.step()
    assert_params_close(result.model, [p.detach() for p in model.parameters()])
    # Without the failure the model is different: the test tells the two apart.
    plain = fit(data, DDP(lr=0.01), tmp_path, nodes=nodes, max_steps=steps, batch_size=batch)
    assert any(not torch.allclose(a, b, **TOL) for a, b in
               zip(plain.model.parameters(), result.model.parameters(), strict=True))
    assert [row["nodes"] for row in result.history] == [4] * fail_at + [3] * (steps - fail_at)
    assert result.summary["faults"]["failures"] == [{"node": 2, "step": fail_at}]


def reference_diloco(data, nodes, steps, batch, failures, *, H, inner_lr) -> list[torch.Tensor]:
    """DiLoCo (Douillard et al. 2023) where nodes leave: every H steps and after the last,
    delta = theta - mean over ALIVE nodes of theta_i, one outer Nesterov step (lr 0.7,
    momentum 0.9), the alive nodes restart from theta. A node's inner steps after its last
    sync are lost with it."""
    models = [MLP() for _ in range(nodes)]
    inner = [torch.optim.AdamW(m.parameters(), lr=inner_lr, weight_decay=0.1, betas=(0.9, 0.95))
             for m in models]
    theta = [p.detach().clone().requires_grad_(True) for p in MLP().parameters()]
    outer = torch.optim.SGD(theta, lr=0.7, momentum=0.9, nesterov=True)
    for s in range(steps):
        members = alive(nodes, failures, s)
        for r in members:
            inner[r].zero_grad()
            models[r](sharded_batch(data, r, nodes, s, batch)).backward()
            inner[r].step()
        if (s + 1) % H == 0 or s == steps - 1:
            with torch.no_grad():
                for i, t in enumerate(theta):
                    t.grad = t - torch.stack([list(models[r].parameters())[i].detach()
                                              for r in members]).mean(0)
            outer.step()
            with torch.no_grad():
                for r in members:
                    for p, t in zip(models[r].parameters(), theta, strict=True):
                        p.copy_(t)
    return [t.detach() for t in theta]


def test_diloco_averages_over_the_survivors(tmp_path: Path) -> None:
    # Node 2 syncs at step 3, takes step 4 alone, and is gone before the sync at step 6;
    # node 3 leaves after step 7, so the final sync (after step 10) is among 0 and 1.
    nodes, steps, batch, H = 4, 10, 4, 3
    failures = {2: 4, 3: 7}
    data = regression_data(nodes * batch * steps)
    result = fit(data, DiLoCo(H=H, lr=0.01), tmp_path, nodes=nodes, max_steps=steps, batch_size=batch,
                 fail=[f"node={r},step={s}" for r, s in failures.items()])
    expected = reference_diloco(data, nodes, steps, batch, failures, H=H, inner_lr=0.01)
    assert_params_close(result.model, expected)
    assert [row["nodes"] for row in result.history] == [4] * 4 + [3] * 3 + [2] * 3


def test_threads_and_processes_agree_bit_for_bit_with_a_failure(tmp_path: Path) -> None:
    nodes, steps, batch = 3, 6, 4
    data = regression_data(nodes * batch * steps)
    runs = {runtime: fit(data, DDP(lr=0.01), tmp_path / runtime, nodes=nodes, max_steps=steps,
                         batch_size=batch, runtime=runtime, fail=["node=2,step=2"])
            for runtime in ("threads", "processes")}
    a, b = runs["threads"], runs["processes"]
    for p, q in zip(a.model.parameters(), b.model.parameters(), strict=True):
        assert torch.equal(p, q)
    assert [r["train_loss"] for r in a.history] == [r["train_loss"] for r in b.history]
    assert [r["bytes_sent"] for r in a.history] == [r["bytes_sent"] for r in b.history]
    assert [r["nodes"] for r in b.history] == [3, 3, 2, 2, 2, 2]


def test_bytes_after_a_failure_are_the_survivors_traffic(tmp_path: Path) -> None:
    """After node 2 leaves, each step's bytes per node are those of a 3-node run (the ring
    over nodes 0, 1, 3 has the 3-node run's positions); before, those of a 4-node run."""
    steps, batch, fail_at = 6, 4, 2
    data = regression_data(4 * batch * steps)
    failed = fit(data, DDP(lr=0.01), tmp_path / "f", nodes=4, max_steps=steps, batch_size=batch,
                 fail=[f"node=2,step={fail_at}"])
    four = fit(data, DDP(lr=0.01), tmp_path / "4", nodes=4, max_steps=steps, batch_size=batch)
    three = fit(data, DDP(lr=0.01), tmp_path / "3", nodes=3, max_steps=steps, batch_size=batch)
    sent = [r["bytes_sent"] for r in failed.history]
    assert sent[:fail_at] == [r["bytes_sent"] for r in four.history][:fail_at]
    assert sent[fail_at:] == [r["bytes_sent"] for r in three.history][fail_at:]
    assert sent[0] != sent[-1]  # 2(g-1)/g differs between 4 and 3 nodes
    assert failed.summary["bytes_sent_per_node"] == pytest.approx(sum(sent))
    assert [r["examples"] for r in failed.history] == [batch * (4 * min(s, fail_at) + 3 * max(0, s - fail_at))
                                                       for s in range(1, steps + 1)]
    # The loss of a step is the mean over the nodes that took it.
    assert failed.history[0]["train_loss"] == pytest.approx(four.history[0]["train_loss"])


# --------------------------------------------------------------------- stragglers
def test_straggler_projection_is_the_slowest_alive_node(tmp_path: Path) -> None:
    steps, batch, step_seconds = 10, 4, 0.25
    data = regression_data(4 * batch * steps)
    common = dict(nodes=4, max_steps=steps, batch_size=batch, step_seconds=step_seconds, cluster="wifi")
    plain = fit(data, DDP(lr=0.01), tmp_path / "p", **common)
    slow = fit(data, DDP(lr=0.01), tmp_path / "s", **common,
               straggler=["node=2,slowdown=3", "node=1,slowdown=1.5"], fail=["node=2,step=4"])
    p, s = plain.summary["projected"], slow.summary["projected"]
    # Without faults: compute is steps x step_seconds, and no idle time is reported.
    assert p["compute_seconds"] == pytest.approx(steps * step_seconds)
    assert "idle_seconds" not in p
    # Steps 1-4: node 2 (x3) is slowest, the other three wait 2 + 1.5 + 2 steps' time.
    # Steps 5-10: node 2 has left; node 1 (x1.5) is slowest, nodes 0 and 3 wait 0.5 each.
    assert s["compute_seconds"] == pytest.approx((4 * 3 + 6 * 1.5) * step_seconds)
    assert s["idle_seconds"] == pytest.approx((4 * (2 + 1.5 + 2) + 6 * (0.5 + 0.5)) * step_seconds)
    assert s["total_seconds"] == pytest.approx(s["compute_seconds"] + s["communication_seconds"])
    assert slow.history[-1]["projected_seconds"] == pytest.approx(s["total_seconds"])
    # Communication is the survivors' real traffic on the cluster, compute aside.
    cluster = get_cluster("wifi")
    assert p["communication_seconds"] > s["communication_seconds"] > 0
    assert cluster.name == p["cluster"] == s["cluster"]


def test_a_straggler_at_slowdown_1_changes_no_projected_number(tmp_path: Path) -> None:
    steps, batch = 6, 4
    data = regression_data(4 * batch * steps)
    common = dict(nodes=4, max_steps=steps, batch_size=batch, step_seconds=0.1)
    plain = fit(data, DDP(lr=0.01), tmp_path / "p", **common)
    same = fit(data, DDP(lr=0.01), tmp_path / "s", **common, straggler=["node=3,slowdown=1"])
    def projected_numbers(summary: dict) -> dict:  # what was measured here differs run to run
        return {k: v for k, v in summary["projected"].items() if k != "measured_communication_seconds"}

    expected = {**projected_numbers(plain.summary), "idle_seconds": 0.0}
    assert projected_numbers(same.summary) == expected
    assert [r["projected_seconds"] for r in same.history] == [r["projected_seconds"] for r in plain.history]


def test_cli_reports_the_faults(tmp_path: Path) -> None:
    result = runner.invoke(app, ["simulate", "--strategy", "ddp", "--steps", "12", "--fail",
                                 "node=3,step=5", "--straggler", "node=1,slowdown=2", "--progress",
                                 "--out", str(tmp_path), "--run-id", "f"])
    assert result.exit_code == 0, result.output
    assert "step 5/12  node 3 left (--fail); 3 nodes go on" in result.output
    assert "left after step 5 (--fail)" in result.output
    assert "waiting for stragglers" in result.output and "(node 1 x2)" in result.output
    run = tmp_path / "f"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["faults"] == {"failures": [{"node": 3, "step": 5}],
                                 "stragglers": [{"node": 1, "slowdown": 2.0}]}
    assert summary["projected"]["idle_seconds"] > 0
    rows = list(csv.DictReader((run / "metrics.csv").open()))[1:]  # after the step-0 evaluation
    assert [int(r["nodes"]) for r in rows] == [4] * 5 + [3] * 7
    assert "node 3 left" in (run / "log.txt").read_text()
