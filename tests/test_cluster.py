"""Projected wall-clock on a named cluster: the alpha-beta model, checked by hand."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from meshtrain import Trainer
from meshtrain.cluster import (
    CLUSTERS,
    Cluster,
    collective_seconds,
    communication_by_step,
    expected_slowest,
    get_cluster,
    project,
    sync_wait_seconds,
)
from meshtrain.comm import CommRecord
from meshtrain.strategies import DDP, DiLoCo

LINK = Cluster("test", "a test link", bandwidth=1e6, latency=1e-3)


def test_ring_all_reduce_cost_is_latency_hops_plus_bytes_over_bandwidth() -> None:
    # 4 nodes all-reduce S = 4 MB: each sends 2*(3/4)*S = 6 MB over 2*3 = 6 hops.
    record = CommRecord(step=0, kind="all_reduce", bytes_sent=6_000_000, bytes_received=6_000_000,
                        group_size=4)
    assert collective_seconds(record, LINK) == pytest.approx(6 * 1e-3 + 6.0)


def test_all_gather_broadcast_and_single_node_costs() -> None:
    gather = CommRecord(0, "all_gather", 3_000, 3_000, 4)
    assert collective_seconds(gather, LINK) == pytest.approx(3 * 1e-3 + 3e-3)
    bcast = CommRecord(0, "broadcast", 0, 1_000_000, 8)
    assert collective_seconds(bcast, LINK) == pytest.approx(math.ceil(math.log2(8)) * 1e-3 + 1.0)
    assert collective_seconds(CommRecord(0, "all_reduce", 0, 0, 1), LINK) == 0.0


def test_shared_medium_divides_bandwidth_among_the_group() -> None:
    wifi = Cluster("w", "shared", bandwidth=1e6, latency=0.0, shared_medium=True)
    record = CommRecord(0, "all_reduce", 1_000_000, 1_000_000, 4)
    assert collective_seconds(record, wifi) == pytest.approx(4.0)


def test_project_adds_compute_and_ignores_startup_traffic() -> None:
    records = [CommRecord(-1, "broadcast", 0, 10**9, 2), CommRecord(3, "all_reduce", 10**6, 10**6, 2)]
    out = project(records, LINK, steps=10, step_seconds=0.5)
    assert out["compute_seconds"] == pytest.approx(5.0)
    assert out["communication_seconds"] == pytest.approx(2 * 1e-3 + 1.0)
    assert out["total_seconds"] == pytest.approx(out["compute_seconds"] + out["communication_seconds"])


def test_ddp_buckets_sent_during_backward_hide_behind_it() -> None:
    # Two buckets leave during the backward pass, 1 s each on the link; the last after it.
    early = [CommRecord(0, "all_reduce", 10**6, 10**6, 2, during_backward=True)] * 2
    records = [*early, CommRecord(0, "all_reduce", 10**6, 10**6, 2)]
    link = Cluster("l", "a link", bandwidth=1e6, latency=0.0)
    # A 3 s backward: ready at 1 s and 2 s (an even pace over the step's bytes), through at
    # 2 s and 3 s: hidden; the last bucket adds its 1 s.
    assert communication_by_step(records, link, backward_seconds=3.0) == {0: pytest.approx(1.0)}
    # 1.5 s: ready at 0.5 and 1.0 s, through at 1.5 and 2.5 s: 1 s runs past the backward pass.
    assert communication_by_step(records, link, backward_seconds=1.5) == {0: pytest.approx(2.0)}
    assert communication_by_step(records, link, backward_seconds=0.0) == {0: pytest.approx(3.0)}
    out = project(records, link, steps=1, step_seconds=4.5)  # a backward pass of 2/3 of it: 3 s
    assert out["communication_seconds"] == pytest.approx(1.0)
    assert out["overlapped_seconds"] == pytest.approx(2.0)
    assert out["total_seconds"] == pytest.approx(5.5)


def test_a_noisy_host_costs_every_sync_a_wait_for_the_slowest() -> None:
    """With a probed spread sigma, a sync among g hosts waits sigma * E[max of g standard
    normals], however many steps since the last (measured: hosts catch up between syncs):
    DDP every step, DiLoCo every H."""
    noisy = dataclasses.replace(LINK, step_jitter=0.01)
    assert expected_slowest(1) == 0 and expected_slowest(2) == pytest.approx(1 / math.sqrt(math.pi))
    assert expected_slowest(4) == pytest.approx(1.0294, abs=1e-4)
    assert sync_wait_seconds(1, 2, noisy) == pytest.approx(0.01 * expected_slowest(2))
    assert sync_wait_seconds(16, 2, noisy) == pytest.approx(sync_wait_seconds(1, 2, noisy))
    assert sync_wait_seconds(1, 2, LINK) == 0  # no probe, no spread: no wait modelled
    ddp = [CommRecord(s, "all_reduce", 10**3, 10**3, 2) for s in range(16)]
    diloco = [CommRecord(s, "all_reduce", 10**3, 10**3, 2) for s in (3, 7, 11, 15)]
    waits = {name: project(records, noisy, steps=16, step_seconds=0.1) for name, records in
             (("ddp", ddp), ("diloco", diloco))}
    assert waits["ddp"]["sync_wait_seconds"] == pytest.approx(16 * sync_wait_seconds(1, 2, noisy))
    assert waits["diloco"]["sync_wait_seconds"] == pytest.approx(4 * sync_wait_seconds(4, 2, noisy))
    for out in waits.values():
        assert out["total_seconds"] == pytest.approx(
            out["compute_seconds"] + out["communication_seconds"] + out["sync_wait_seconds"])
    assert "sync_wait_seconds" not in project(ddp, LINK, steps=16, step_seconds=0.1)


class Linear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(31, 8)  # 256 parameters: 1 KiB in float32

    def forward(self, batch):
        x, y = batch
        return nn.functional.cross_entropy(self.fc(x), y)


# DDP's bucket holds the 256 gradients plus one has-gradient flag for each of its 2 tensors.
@pytest.mark.parametrize(("strategy", "syncs", "payload"),
                         [(DDP(optim="sgd", lr=0.1), 20, 1024 + 8), (DiLoCo(H=5), 4, 1024)])
def test_summary_projects_the_runs_own_collectives(
    strategy, syncs: int, payload: int, tmp_path: Path
) -> None:
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(320, 31, generator=g), torch.randint(0, 8, (320,), generator=g))
    torch.manual_seed(0)
    result = Trainer(Linear(), data).fit(strategy=strategy, nodes=4, max_steps=20, batch_size=8,
                                         out_dir=tmp_path, progress=False, cluster="internet",
                                         step_seconds=0.25)
    projected = result.summary["projected"]
    internet = get_cluster("internet")
    per_sync = 2 * 3 * internet.latency + 2 * 3 / 4 * payload / internet.bandwidth
    assert projected["cluster"] == "internet"
    assert projected["compute_seconds"] == pytest.approx(20 * 0.25)
    assert projected["communication_seconds"] == pytest.approx(syncs * per_sync)
    # Beside the projection: the time rank 0 spent inside its collectives here (> 0, and
    # less than the whole run's wall-clock).
    assert 0 < projected["measured_communication_seconds"] < result.summary["wall_seconds"]


def test_unknown_cluster_is_rejected(tmp_path: Path) -> None:
    data = TensorDataset(torch.randn(16, 31), torch.zeros(16, dtype=torch.long))
    with pytest.raises(ValueError, match="unknown cluster 'moon'"):
        Trainer(Linear(), data).fit(nodes=1, max_steps=1, batch_size=4, cluster="moon", out_dir=tmp_path)
    assert set(CLUSTERS) >= {"wifi", "gbe", "10gbe", "internet", "infiniband"}


def test_a_collective_beside_the_next_steps_adds_only_what_runs_past_their_compute() -> None:
    # A 2 s all-reduce (2 MB each way between 2 nodes at 1 MB/s) waited for 1 step later:
    # a 1.5 s step hides 1.5 s of it, two such steps hide it all (streaming DiLoCo's tau,
    # delayed DiLoCo's round).
    link = Cluster("l", "a link", bandwidth=1e6, latency=0.0)
    one = [CommRecord(4, "all_reduce", 2 * 10**6, 2 * 10**6, 2, overlap_steps=1)]
    two = [dataclasses.replace(one[0], overlap_steps=2)]
    backward = 1.0  # 2/3 of a 1.5 s step
    assert communication_by_step(one, link, backward) == {4: pytest.approx(0.5)}
    assert communication_by_step(two, link, backward) == {4: pytest.approx(0.0)}
    assert communication_by_step([dataclasses.replace(one[0], overlap_steps=0)], link,
                                 backward) == {4: pytest.approx(2.0)}
    out = project(one, link, steps=10, step_seconds=1.5)
    assert out["communication_seconds"] == pytest.approx(0.5)
    assert out["overlapped_seconds"] == pytest.approx(1.5)


def test_a_collective_beside_steps_the_run_never_takes_hides_behind_those_it_takes() -> None:
    # Delayed DiLoCo's last round and streaming DiLoCo's last fragment start an all-reduce at
    # the last step (or near it) and wait for it when training ends: the steps it was meant
    # to overlap are never taken. A 2 s all-reduce with 3 steps of overlap started at step 8
    # of 10 (0-based) has one 1.5 s step left to hide behind; at step 9, none.
    link = Cluster("l", "a link", bandwidth=1e6, latency=0.0)
    late = CommRecord(8, "all_reduce", 2 * 10**6, 2 * 10**6, 2, overlap_steps=3)
    last = dataclasses.replace(late, step=9)
    assert communication_by_step([late], link, 1.0, steps=10) == {8: pytest.approx(0.5)}
    assert communication_by_step([last], link, 1.0, steps=10) == {9: pytest.approx(2.0)}
    assert communication_by_step([late], link, 1.0) == {8: pytest.approx(0.0)}  # steps unknown
    assert project([late, last], link, steps=10, step_seconds=1.5)["communication_seconds"] == \
        pytest.approx(2.5)
