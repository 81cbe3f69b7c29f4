"""Projected wall-clock of a run on a named cluster (the alpha-beta model).

Every collective a node made is recorded with its kind, bytes and group size. On a
cluster with link bandwidth B (bytes/s) and latency alpha (s) a ring collective costs

    all-reduce   2(g-1) alpha + bytes_sent / B      (bytes_sent = 2(g-1)/g S)
    all-gather    (g-1) alpha + bytes_sent / B      (bytes_sent = (g-1) S)
    broadcast    ceil(log2 g) alpha + S / B

On a shared medium (Wi-Fi) the g nodes talking at once share B. Compute per step is
what one node needed here (or ``step_seconds`` if you know your machines' figure),
scaled by the cluster's relative speed. Communication is not overlapped with compute.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable
from dataclasses import asdict, dataclass

from meshtrain.comm import CommRecord


@dataclass(frozen=True)
class Cluster:
    name: str
    description: str
    bandwidth: float  # bytes per second per link
    latency: float  # seconds per message
    shared_medium: bool = False  # Wi-Fi: nodes talking at once share the bandwidth
    speed: float = 1.0  # compute speed relative to one core of this machine


CLUSTERS: dict[str, Cluster] = {
    c.name: c
    for c in (
        Cluster("wifi", "Macs on one Wi-Fi 6 network (~60 MB/s shared, 3 ms)", 60e6, 3e-3, True),
        Cluster("gbe", "machines on a 1 Gb Ethernet switch (~117 MB/s, 0.2 ms)", 117e6, 2e-4),
        Cluster("10gbe", "machines on 10 Gb Ethernet (~1.17 GB/s, 50 us)", 1.17e9, 5e-5),
        Cluster("internet", "machines in different places over the internet (~12.5 MB/s, 40 ms)",
                12.5e6, 4e-2),
        Cluster("infiniband", "a datacenter with InfiniBand NDR (~50 GB/s, 5 us)", 50e9, 5e-6),
    )
}


def get_cluster(name: str) -> Cluster:
    if name not in CLUSTERS:
        raise ValueError(f"unknown cluster {name!r}; choose one of: {', '.join(CLUSTERS)}")
    return CLUSTERS[name]


def collective_seconds(record: CommRecord, cluster: Cluster) -> float:
    """Time one recorded collective would take on ``cluster``."""
    g = record.group_size
    if g <= 1:
        return 0.0
    bandwidth = cluster.bandwidth / g if cluster.shared_medium else cluster.bandwidth
    moved = max(record.bytes_sent, record.bytes_received)
    if record.kind == "all_reduce":
        hops = 2 * (g - 1)
    elif record.kind == "all_gather":
        hops = g - 1
    else:  # broadcast
        hops = math.ceil(math.log2(g))
    return hops * cluster.latency + moved / bandwidth


def measured_step_seconds(wall_seconds: float, comm_seconds: float, steps: int, nodes: int) -> float:
    """One node's compute per step here: simulated nodes share this machine's cores."""
    cores = min(nodes, os.cpu_count() or 1)
    return max(0.0, wall_seconds - comm_seconds) * cores / nodes / max(1, steps)


def project(
    records: Iterable[CommRecord],
    cluster: Cluster,
    steps: int,
    step_seconds: float,
) -> dict[str, float | str]:
    """Projected seconds of compute, communication and their sum for a whole run."""
    comm = sum(collective_seconds(r, cluster) for r in records if r.step >= 0)
    compute = steps * step_seconds / cluster.speed
    return {
        "cluster": cluster.name,
        "compute_seconds": compute,
        "communication_seconds": comm,
        "total_seconds": compute + comm,
    }


def cluster_table() -> list[dict[str, object]]:
    """The named clusters as rows (for `meshtrain clusters`)."""
    return [asdict(c) for c in CLUSTERS.values()]
