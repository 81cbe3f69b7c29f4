"""Projected wall-clock of a run on a named cluster (the alpha-beta model).

Every collective a node made is recorded with its kind, bytes and group size. On a
cluster with link bandwidth B (bytes/s) and latency alpha (s) a ring collective costs

    all-reduce   2(g-1) alpha + bytes_sent / B      (bytes_sent = 2(g-1)/g S)
    all-gather    (g-1) alpha + bytes_sent / B      (bytes_sent = (g-1) S)
    broadcast    ceil(log2 g) alpha + S / B

On a shared medium (Wi-Fi) the g nodes talking at once share B. Compute per step is
what one node needed here (or ``step_seconds`` if you know your machines' figure),
scaled by the cluster's relative speed. Communication adds to compute, except DDP's
gradient buckets that leave while the backward pass runs (records ``during_backward``):
those hide behind the backward pass, taken as :data:`BACKWARD_SHARE` of a step's compute
(:func:`communication_by_step`). A cluster whose compute probe measured how much a step
varies (``step_jitter``) also costs every sync the wait for the slowest host.

Besides the named clusters, ``get_cluster`` takes the path of a cluster file (YAML with
the fields of :class:`Cluster`), such as ``meshtrain hosts bench`` writes from a
measurement of real hosts.
"""

from __future__ import annotations

import functools
import math
import statistics
from collections.abc import Iterable
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from meshtrain import yaml12
from meshtrain.errors import InputError

if TYPE_CHECKING:  # only named in annotations: the cluster tables load without torch
    from meshtrain.comm import CommRecord


@dataclass(frozen=True)
class Cluster:
    name: str
    description: str
    bandwidth: float  # bytes per second per link
    latency: float  # seconds per message
    shared_medium: bool = False  # Wi-Fi: nodes talking at once share the bandwidth
    speed: float = 1.0  # compute speed relative to one core of this machine
    # The compute probe of `hosts bench --task`: one optimizer step on the slowest host
    # (every sync waits for it), and what was timed (:func:`probe_label`).
    step_seconds: float | None = None
    probe: str | None = None
    # The probe's spread of one step's compute on the least steady host (its standard
    # deviation for normal times; hosts/bench.py step_spread). A sync ends when the slowest
    # host arrives, so every sync costs the others a wait.
    step_jitter: float | None = None


def probe_label(task: str, batch_size: int, threads: int | None) -> str:
    """What a compute probe timed, as a cluster file records it: a run with the same task,
    batch size and threads may take its ``step_seconds`` for its own."""
    return f"task {task}, batch {batch_size}, threads {threads if threads is not None else 'all'}"


CLUSTERS: dict[str, Cluster] = {
    c.name: c
    for c in (
        Cluster("wifi", "Macs on one Wi-Fi 6 network (~60 MB/s shared, 3 ms)", 60e6, 3e-3, True),
        Cluster("gbe", "machines on a 1 Gb Ethernet switch (~117 MB/s, 0.2 ms)", 117e6, 2e-4),
        Cluster("10gbe", "machines on 10 Gb Ethernet (~1.17 GB/s, 50 us)", 1.17e9, 5e-5),
        # Two Macs joined by a Thunderbolt cable (macOS "Thunderbolt Bridge", self-assigned
        # 169.254/16 addresses): a point-to-point link, not a shared medium. Published iperf3
        # TCP figures over a Thunderbolt 4/USB4 20 Gbit/s link between a MacBook Pro M2 and a
        # PC: 16.4 Gbit/s one way, 5.3 Gbit/s the other at the default 1500-byte MTU
        # (jiribrejcha.net, "Direct 20 Gbps connection between Mac and Windows 11 machine");
        # an MLX user's job took 11 s over Thunderbolt against 274 s over Wi-Fi
        # (ml-explore/mlx#1210). 10 Gbit/s (~1.25 GB/s) sits between the two directions; the
        # latency is a 10 GbE-like 50 us (a direct cable, no switch).
        Cluster("thunderbolt", "two Macs on a Thunderbolt bridge cable (~1.25 GB/s, 50 us)",
                1.25e9, 5e-5),
        Cluster("internet", "machines in different places over the internet (~12.5 MB/s, 40 ms)",
                12.5e6, 4e-2),
        Cluster("infiniband", "a datacenter with InfiniBand NDR (~50 GB/s, 5 us)", 50e9, 5e-6),
    )
}


# What a network and a host can physically be. A cluster file (written by `hosts bench` from
# what the hosts reported, or downloaded) is refused outside these, so no projection is
# built on numbers no machine measured (a host once reported 425 s a message).
#: Bytes per second per link: 1 kB/s is no link to train over; 10 TB/s is ~200 times InfiniBand NDR.
MIN_BANDWIDTH, MAX_BANDWIDTH = 1e3, 1e13
#: Seconds per message: a geostationary satellite hop is ~0.6 s.
MAX_LATENCY = 10.0
#: Seconds of one optimizer step (and of its spread) on the slowest host.
MAX_STEP_SECONDS = 3600.0
#: Compute speed relative to one core of this machine.
MIN_SPEED, MAX_SPEED = 1e-3, 1e4


class ClusterFileError(InputError):
    """A cluster file that cannot be used: one line naming the file and the key at fault."""


def get_cluster(name: str) -> Cluster:
    """A named cluster (``meshtrain clusters``), or the cluster in a ``.yaml``/``.yml`` file."""
    if name in CLUSTERS:
        return CLUSTERS[name]
    if name.endswith((".yaml", ".yml")):
        return load_cluster_file(Path(name))
    raise ValueError(f"unknown cluster {name!r}; choose one of: {', '.join(CLUSTERS)}, "
                     "or give a cluster file (PATH.yaml, e.g. from `meshtrain hosts bench`)")


def load_cluster_file(path: Path) -> Cluster:
    """Read a cluster file: ``bandwidth`` (bytes/s) and ``latency`` (s) are required;
    ``name`` (default: the file's stem), ``description``, ``shared_medium``, ``speed``
    and the compute probe's ``step_seconds``, ``step_jitter`` and ``probe`` are optional. Raises
    :class:`ClusterFileError`."""
    try:
        data = yaml12.read(path)
    except OSError as exc:
        raise ClusterFileError(f"{path}: cannot read the cluster file ({exc.strerror or exc})") from None
    except yaml.YAMLError as exc:
        raise ClusterFileError(f"{path}: {yaml12.problem(exc)}") from None
    if not isinstance(data, dict):
        raise ClusterFileError(f"{path}: expected a mapping of cluster keys, got "
                               f"{type(data).__name__}")
    known = {f.name for f in fields(Cluster)}
    unknown = sorted(str(k) for k in data if k not in known)
    if unknown:
        raise ClusterFileError(f"{path}: unknown key {unknown[0]!r}; expected: {', '.join(sorted(known))}")
    for key in ("bandwidth", "latency"):
        if key not in data:
            raise ClusterFileError(f"{path}: missing key {key!r}")
    return Cluster(
        name=_text(path, data, "name", path.stem),
        description=_text(path, data, "description", f"measured cluster from {path.name}"),
        bandwidth=_number(path, data, "bandwidth",
                          f"bytes per second from {MIN_BANDWIDTH:g} to {MAX_BANDWIDTH:g}",
                          low=MIN_BANDWIDTH, high=MAX_BANDWIDTH),
        latency=_number(path, data, "latency", f"seconds from 0 to {MAX_LATENCY:g}", allow_zero=True,
                        high=MAX_LATENCY),
        shared_medium=_flag(path, data, "shared_medium"),
        speed=_number(path, data, "speed", f"relative compute speed from {MIN_SPEED:g} to {MAX_SPEED:g}",
                      default=1.0, low=MIN_SPEED, high=MAX_SPEED),
        step_seconds=_number(path, data, "step_seconds", f"seconds > 0 and at most {MAX_STEP_SECONDS:g}",
                             high=MAX_STEP_SECONDS)
        if data.get("step_seconds") is not None else None,
        probe=_text(path, data, "probe", "") if data.get("probe") is not None else None,
        step_jitter=_number(path, data, "step_jitter", f"seconds from 0 to {MAX_STEP_SECONDS:g}",
                            allow_zero=True, high=MAX_STEP_SECONDS)
        if data.get("step_jitter") is not None else None,
    )


def _text(path: Path, data: dict[str, Any], key: str, default: str) -> str:
    value = data.get(key, default)
    if not isinstance(value, str) or not value.strip():
        raise ClusterFileError(f"{path}: {key}: expected text, got {value!r}")
    return value


def _number(path: Path, data: dict[str, Any], key: str, expected: str, *, allow_zero: bool = False,
            default: float | None = None, low: float = 0.0, high: float = math.inf) -> float:
    value = data.get(key, default)
    # bool is an int in Python: `bandwidth: yes` is a mistake, not 1 byte per second.
    if (isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
            and low <= value <= high and (value > 0 or allow_zero)):
        return float(value)
    raise ClusterFileError(f"{path}: {key}: expected {expected}, got {value!r}")


def _flag(path: Path, data: dict[str, Any], key: str) -> bool:
    value = data.get(key, False)
    if not isinstance(value, bool):
        raise ClusterFileError(f"{path}: {key}: expected true or false, got {value!r}")
    return value


def cluster_file_text(cluster: Cluster, comment: str = "") -> str:
    """The YAML of a cluster file that :func:`load_cluster_file` reads back as ``cluster``,
    after ``comment`` lines (each prefixed with ``#``) and a line giving the units."""
    lines = [*comment.splitlines(), "bandwidth: bytes per second per link; latency: seconds per message"]
    header = "".join(f"# {line}\n" for line in lines)
    values = {k: v for k, v in asdict(cluster).items() if v is not None}  # no probe: no keys
    return header + yaml.safe_dump(values, sort_keys=False)


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


#: The backward pass's share of a step's compute: twice the forward pass's work, the
#: optimizer's small beside both.
BACKWARD_SHARE = 2 / 3


def communication_by_step(records: Iterable[CommRecord], cluster: Cluster,
                          backward_seconds: float, steps: int | None = None) -> dict[int, float]:
    """The seconds each step's collectives add to its compute on ``cluster``.

    A step's buckets sent during a backward pass of ``backward_seconds`` go one after the
    other, each once the backward pass has produced its gradients (taken to come at an even
    pace over the step's bytes, the first bucket's first) and the one before it is through;
    only what runs past the end of the backward pass adds. A collective that runs beside
    the next ``overlap_steps`` steps (streaming DiLoCo's fragment sync, delayed DiLoCo's
    outer step) adds only what runs past their compute (``backward_seconds`` is
    :data:`BACKWARD_SHARE` of a step's), as many of them as the run's ``steps`` still take
    after it (one started at the last step is waited for when training ends and hides behind
    none). Every other collective adds all of its time.
    """
    by_step: dict[int, list[CommRecord]] = {}
    for r in records:
        if r.step >= 0:
            by_step.setdefault(r.step, []).append(r)
    seconds = {}
    for step, rs in by_step.items():
        total_bytes = sum(r.bytes_sent for r in rs) or 1
        ready = done = 0.0  # bytes whose gradients are ready; when the link is free
        added = 0.0
        for r in rs:
            cost = collective_seconds(r, cluster)
            if r.during_backward:
                ready += r.bytes_sent
                done = max(done, backward_seconds * ready / total_bytes) + cost
            elif r.overlap_steps:
                beside = r.overlap_steps if steps is None else min(r.overlap_steps, steps - 1 - step)
                added += max(0.0, cost - max(0, beside) * backward_seconds / BACKWARD_SHARE)
            else:
                added += cost
        seconds[step] = added + max(0.0, done - backward_seconds)
    return seconds


@functools.cache
def expected_slowest(hosts: int) -> float:
    """How far, in standard deviations, the slowest of ``hosts`` equally noisy hosts lags
    their mean: the expected maximum of ``hosts`` standard normals (0 for one host, 0.564
    for two, 1.029 for four), integrated numerically."""
    if hosts <= 1:
        return 0.0
    normal = statistics.NormalDist()
    dx = 0.004
    xs = [-8 + i * dx for i in range(int(16 / dx) + 1)]
    return sum(x * hosts * normal.pdf(x) * normal.cdf(x) ** (hosts - 1) for x in xs) * dx


def sync_wait_seconds(steps_since_sync: int, hosts: int, cluster: Cluster) -> float:
    """What a sync among ``hosts`` costs in waiting for the slowest one, on ``cluster``:
    ``step_jitter * E[max of hosts standard normals]``, once per sync. So DDP pays it every
    step and DiLoCo once per H steps.

    Independent noise would make hosts drift apart by ``sqrt(steps_since_sync)`` steps'
    spread, but measured on namespace hosts (benchmarks/scaling.py) a DiLoCo sync after 20
    steps waited 0.05-0.08 s, a DDP step's sync 0.02-0.04 s, not sqrt(20) = 4.5x more: what
    slows a host (other processes, the OS) comes and goes, and hosts catch up between syncs.
    So one step's spread per sync.
    """
    if not cluster.step_jitter or hosts <= 1 or steps_since_sync < 1:
        return 0.0
    return cluster.step_jitter * expected_slowest(hosts) / cluster.speed


def sync_waits(records: Iterable[CommRecord], cluster: Cluster) -> dict[int, float]:
    """The modelled waiting (:func:`sync_wait_seconds`) at each step that ends in a sync."""
    groups: dict[int, int] = {}
    for r in records:
        if r.step >= 0:
            groups[r.step] = max(groups.get(r.step, 1), r.group_size)
    waits, last = {}, -1
    for step in sorted(groups):
        waits[step] = sync_wait_seconds(step - last, groups[step], cluster)
        last = step
    return waits


def project(
    records: Iterable[CommRecord],
    cluster: Cluster,
    steps: int,
    step_seconds: float,
) -> dict[str, float | str]:
    """Projected seconds of compute, communication and their sum for a whole run; on a
    cluster whose compute probe measured its spread (``step_jitter``), also the waiting for
    the slowest host at every sync (``sync_wait_seconds``, in the total).
    ``communication_seconds`` is what communication adds to compute; ``overlapped_seconds``
    what hides behind backward passes or the steps a collective runs beside
    (:func:`communication_by_step`)."""
    records = list(records)
    backward = BACKWARD_SHARE * step_seconds / cluster.speed
    comm = sum(communication_by_step(records, cluster, backward, steps).values())
    every = sum(collective_seconds(r, cluster) for r in records if r.step >= 0)
    compute = steps * step_seconds / cluster.speed
    out: dict[str, float | str] = {
        "cluster": cluster.name,
        "compute_seconds": compute,
        "communication_seconds": comm,
        "total_seconds": compute + comm,
    }
    if any(r.during_backward or r.overlap_steps for r in records):
        out["overlapped_seconds"] = every - comm
    if cluster.step_jitter is not None:
        wait = sum(sync_waits(records, cluster).values())
        out["sync_wait_seconds"] = wait
        out["total_seconds"] = compute + comm + wait
    return out
