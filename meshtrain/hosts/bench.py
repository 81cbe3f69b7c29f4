"""Latency and bandwidth between real hosts, from timed all-reduces, and the alpha-beta fit.

``meshtrain hosts bench INVENTORY`` launches this module on every host, as a rank of a
normal launch (same SSH checks, same authenticated rendezvous)::

    python -m meshtrain.hosts.bench --sizes 4096,65536,1048576 --repeats 5 --out runs/ID/bench.json

Every rank all-reduces float32 buffers of each size through meshtrain's own
communicator (the ring the strategies use, over gloo), timing each one; the slowest
rank's time counts. Rank 0 writes the median per size as JSON (never pickle), which the
launcher copies back. :func:`fit_alpha_beta` then fits the model of
:mod:`meshtrain.cluster`,

    all-reduce seconds = 2(g-1) alpha + bytes_moved / B,

with the bandwidth from the large sizes (the sustained rate a training step's megabytes
meet) and the latency from the small ones.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import math
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from meshtrain.cluster import (
    MAX_BANDWIDTH,
    MAX_LATENCY,
    MAX_STEP_SECONDS,
    MIN_BANDWIDTH,
    Cluster,
    collective_seconds,
)
from meshtrain.comm import CommRecord, Communicator, ring_all_reduce_bytes
from meshtrain.comm.sealing import bind_gloo_to_advertise
from meshtrain.comm.torch_dist import TorchDistCommunicator, init_process_group, leave_in_order
from meshtrain.config.environment import (
    RankEnvironmentError,
    launched_rank,
    resolve_threads,
)
from meshtrain.devices import DEVICES, resolve_device
from meshtrain.errors import InputError
from meshtrain.heartbeat import start_heartbeat
from meshtrain.hosts.host_output import host_json
from meshtrain.run_dir import atomic_write_text

ELEMENT_BYTES = 4  # the buffers are float32, like gradients
BENCH_FILE = "bench.json"  # what rank 0 writes into the launch's run directory


class BenchError(InputError):
    """Measurements that cannot give a cluster (too few sizes, times that do not grow)."""


@dataclass(frozen=True)
class Sample:
    """The median time of one all-reduce of ``payload_bytes`` over ``group_size`` ranks."""

    payload_bytes: int  # the buffer each rank reduces (S)
    group_size: int
    seconds: float

    @property
    def record(self) -> CommRecord:
        """The collective as meshtrain records it (rank 0's bytes, like the trainer's projection)."""
        sent, received = ring_all_reduce_bytes(self.payload_bytes // ELEMENT_BYTES, ELEMENT_BYTES,
                                               0, self.group_size)
        return CommRecord(0, "all_reduce", sent, received, self.group_size)

    @property
    def hops(self) -> int:
        """Messages in a row on the ring: the latency term's multiplier."""
        return 2 * (self.group_size - 1)

    @property
    def moved_bytes(self) -> int:
        """Bytes the bandwidth term divides, as :func:`collective_seconds` counts them."""
        return max(self.record.bytes_sent, self.record.bytes_received)


@dataclass(frozen=True)
class Fit:
    """The fitted alpha-beta model of one group of hosts."""

    latency: float  # seconds per message (alpha)
    bandwidth: float  # bytes per second one link carried during the all-reduces (B)
    group_size: int


# --------------------------------------------------------------------------- sizes
UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_size(text: str) -> int:
    """``"64KB"``, ``"16MiB"``, ``"4096"`` as bytes; raises :class:`BenchError`."""
    number = text.strip().lower()
    unit = next((u for u in sorted(UNITS, key=len, reverse=True) if number.endswith(u)), "b")
    digits = number[: len(number) - len(unit)] if number.endswith(unit) else number
    try:
        value = float(digits) * UNITS[unit]
    except ValueError:
        raise BenchError(f"{text!r} is not a size (e.g. 4096, 64KB, 16MiB)") from None
    if not (value >= 1 and math.isfinite(value)):
        raise BenchError(f"{text!r}: a size must be at least 1 byte")
    return int(value)


def bench_sizes(smallest: int, largest: int, count: int) -> list[int]:
    """``count`` buffer sizes in bytes from ``smallest`` to ``largest``, evenly spaced on a
    log scale, each a whole number of float32 values."""
    if not 0 < smallest <= largest:
        raise BenchError(f"sizes: expected 0 < smallest <= largest, got {smallest} and {largest}")
    if count < 2:
        raise BenchError(f"sizes: the fit needs at least 2 sizes, got {count}")
    ratio = (largest / smallest) ** (1 / (count - 1))
    sizes = [max(ELEMENT_BYTES, round(smallest * ratio**i / ELEMENT_BYTES) * ELEMENT_BYTES)
             for i in range(count)]
    return sorted(set(sizes))


# --------------------------------------------------------------------------- measuring
def measure(comm: Communicator, sizes: Sequence[int], repeats: int, *,
            report: Any = None) -> list[Sample]:
    """Time ``repeats`` all-reduces of each size on every rank; every rank returns the same
    samples (median over repeats of the slowest rank's time). Call it on every rank.

    ``report(sample)`` is called after each size (progress lines on rank 0).
    """
    times = torch.zeros(len(sizes), repeats, dtype=torch.float64)
    ready = torch.zeros(1)
    for i, size in enumerate(sizes):
        buffer = torch.ones(size // ELEMENT_BYTES)
        comm.all_reduce(buffer, op="sum", record=False)  # warm-up: connections, allocations
        for r in range(repeats):
            # A tiny all-reduce lines the ranks up, so each timing starts together.
            comm.all_reduce(ready, op="sum", record=False)
            started = time.perf_counter()
            comm.all_reduce(buffer, op="sum", record=False)
            times[i, r] = time.perf_counter() - started
        if report is not None:
            report(Sample(size, comm.world_size, statistics.median(times[i].tolist())))
    comm.all_reduce(times, op="max", record=False)  # an all-reduce ends when its slowest rank does
    return [Sample(size, comm.world_size, statistics.median(row.tolist()))
            for size, row in zip(sizes, times, strict=True)]


# --------------------------------------------------------------------------- the fit
#: Sizes that move at least this fraction of the largest size's bytes set the bandwidth.
BANDWIDTH_SIZES_FRACTION = 1 / 16


def fit_alpha_beta(samples: Sequence[Sample]) -> Fit:
    """Fit ``seconds = hops * alpha + moved_bytes / B`` to the samples, in two parts.

    ``B``: the slope of a least-squares line (relative residuals) through the large sizes,
    those moving at least 1/16 of the largest's bytes (at least the two largest). One line
    through every size let the small ones set ``B`` where a link moves short bursts faster
    than its sustained rate: two hosts behind a 1 Gbit/s token bucket (``tc tbf``, a 512 KB
    bucket) moved 457 KB in 0.4 ms and 16 MB in 134 ms, and that fit said 1.6 GB/s, 13 times
    the rate a training step's megabytes meet. ``alpha``: the median over the other sizes of
    what their time leaves per message once the bytes are paid (the line's intercept when
    every size is large), never below 0. Where the large sizes alone do not grow with size
    (noise), one line through every size gives both. Raises :class:`BenchError` when the
    samples cannot determine them.
    """
    if len({s.payload_bytes for s in samples}) < 2:
        raise BenchError("the fit needs timings of at least 2 different sizes")
    groups = {s.group_size for s in samples}
    if len(groups) != 1 or min(groups) < 2:
        raise BenchError("the fit needs samples of one group of >= 2 hosts, "
                         f"got group sizes {sorted(groups)}")
    bad = [s for s in samples if not (s.seconds > 0 and math.isfinite(s.seconds))]
    if bad:
        raise BenchError(f"size {bad[0].payload_bytes} B: time {bad[0].seconds!r} s is not a positive number")
    by_size = sorted(samples, key=lambda s: s.moved_bytes)
    sizes = sorted({s.moved_bytes for s in samples})
    threshold = min(sizes[-1] * BANDWIDTH_SIZES_FRACTION, sizes[-2])  # the two largest at least
    split = next(i for i, s in enumerate(by_size) if s.moved_bytes >= threshold)
    small, large = by_size[:split], by_size[split:]
    intercept, beta = _relative_line(large)
    if not beta > 0 and small:
        # Two or three large sizes out of order: a busy host's noise on a link fast enough
        # that they take milliseconds. The line through every size still has a slope.
        small = []
        intercept, beta = _relative_line(by_size)
    if not beta > 0:
        raise BenchError("all-reduce times do not grow with size: use larger sizes (--max-size)")
    hops = by_size[0].hops  # one group size: every sample's
    per_message = ([(s.seconds - s.moved_bytes * beta) / hops for s in small] if small
                   else [intercept / hops])
    fit = Fit(latency=max(0.0, statistics.median(per_message)), bandwidth=1 / beta,
              group_size=groups.pop())
    # What the times say must be a network: anything else is a host's invention or a clock
    # gone wrong, and would be written into a cluster file that every projection reads.
    if not MIN_BANDWIDTH <= fit.bandwidth <= MAX_BANDWIDTH:
        raise BenchError(f"bandwidth: the times give {fit.bandwidth:.3g} bytes/s, outside what a link "
                         f"carries ({MIN_BANDWIDTH:g} to {MAX_BANDWIDTH:g})")
    if not fit.latency <= MAX_LATENCY:
        raise BenchError(f"latency: the times give {fit.latency:.3g} s per message, more than any "
                         f"network to train over ({MAX_LATENCY:g} s)")
    return fit


def _relative_line(samples: Sequence[Sample]) -> tuple[float, float]:
    """(intercept, slope) of the line ``seconds = a + moved_bytes * b`` fitted to ``samples``
    by least squares on relative residuals (weights ``1 / seconds^2``)."""
    x = [float(s.moved_bytes) for s in samples]
    t = [s.seconds for s in samples]
    w = [1 / ti**2 for ti in t]
    sw = sum(w)
    sx = sum(wi * xi for wi, xi in zip(w, x, strict=True))
    sxx = sum(wi * xi * xi for wi, xi in zip(w, x, strict=True))
    st = sum(wi * ti for wi, ti in zip(w, t, strict=True))
    sxt = sum(wi * xi * ti for wi, xi, ti in zip(w, x, t, strict=True))
    det = sw * sxx - sx * sx
    if not det > 0:  # sizes too close for floats to tell apart: no line
        raise BenchError("the sizes' timings do not determine a line: use a wider size range")
    slope = (sw * sxt - sx * st) / det
    return (st - slope * sx) / sw, slope


def fitted_cluster(fit: Fit, name: str, description: str, *, shared_medium: bool = False,
                   speed: float = 1.0) -> Cluster:
    """The cluster whose model reproduces the fit.

    On a shared medium the model divides B among the g hosts talking at once, so the
    medium's bandwidth is g times what one link carried during the measurement.
    """
    bandwidth = fit.bandwidth * fit.group_size if shared_medium else fit.bandwidth
    return Cluster(name, description, bandwidth, fit.latency, shared_medium, speed)


def model_seconds(sample: Sample, cluster: Cluster) -> float:
    """What ``cluster`` predicts for ``sample``'s all-reduce (the projection's own formula)."""
    return collective_seconds(sample.record, cluster)


#: A fitted model that misses a measured size by more than this is not trusted silently.
FIT_TOLERANCE = 0.5


def fit_warning(samples: Sequence[Sample], cluster: Cluster, tolerance: float = FIT_TOLERANCE) -> str | None:
    """One line when ``cluster`` misses some measured size by more than ``tolerance``
    (relative): projections from it would be off by as much. None when it fits."""
    worst = max(samples, key=lambda s: abs(model_seconds(s, cluster) - s.seconds) / s.seconds)
    error = (model_seconds(worst, cluster) - worst.seconds) / worst.seconds
    if abs(error) <= tolerance:
        return None
    return (f"the fitted model misses the {worst.payload_bytes:,}-byte all-reduce by {error:+.0%}: "
            "the link was busy, carries short bursts faster than its sustained rate (a traffic "
            "shaper, Wi-Fi; the model keeps the rate of the largest sizes), or the sizes do not "
            "separate latency from bandwidth; measure again (more --repeats, a wider size range) "
            "before trusting projections from this cluster")


# --------------------------------------------------------------------------- JSON
def samples_to_json(samples: Sequence[Sample]) -> str:
    """The samples as JSON text (what rank 0 writes)."""
    return json.dumps({"samples": [{"payload_bytes": s.payload_bytes, "group_size": s.group_size,
                                    "seconds": s.seconds} for s in samples]}, indent=1)


MAX_RESULT_BYTES = 1 << 20  # bench.json as rank 0's host sends it back: a few KiB when honest
MAX_SAMPLES = 1000
#: One timed all-reduce: a gloo message between processes takes tens of microseconds, so
#: less than one is no measurement (and 1e-200 s once divided by zero in the fit); an hour
#: is longer than any launch waits.
MIN_SAMPLE_SECONDS, MAX_SAMPLE_SECONDS = 1e-6, 3600.0


def result_text(path: Path, source: str) -> str:
    """The text of a benchmark result copied back from rank 0's host (``source`` names it):
    its size is checked before it is read, and its bytes must be UTF-8; :class:`BenchError`
    otherwise."""
    if path.stat().st_size > MAX_RESULT_BYTES:
        raise BenchError(f"{source}: not a benchmark result (larger than {MAX_RESULT_BYTES} bytes)")
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BenchError(f"{source}: not a benchmark result (not UTF-8 text at byte {exc.start})") from None


def samples_from_json(text: str, source: str, world_size: int | None = None,
                      sizes: Sequence[int] | None = None) -> list[Sample]:
    """Read what :func:`samples_to_json` wrote; raises :class:`BenchError` naming ``source``
    and the field at fault.

    The file comes from rank 0's host, so it is parsed strictly: bounded size and count,
    whole positive numbers for sizes and group, a time from :data:`MIN_SAMPLE_SECONDS` to
    :data:`MAX_SAMPLE_SECONDS`, no NaN/Infinity; with ``world_size`` the group must be the
    hosts launched (a host once said 2**52, and the fit built a list that long), with
    ``sizes`` every buffer one that was asked for.
    """
    if len(text) > MAX_RESULT_BYTES:
        raise BenchError(f"{source}: not a benchmark result (larger than {MAX_RESULT_BYTES} bytes)")

    def whole(row: dict[str, Any], key: str) -> int:
        value = row[key]
        if isinstance(value, bool) or not isinstance(value, int) or not 0 < value < 2**53:
            raise ValueError(f"{key} {value!r} is not a whole number > 0")
        return value

    try:
        rows = host_json(text)["samples"]
        if not isinstance(rows, list) or len(rows) > MAX_SAMPLES:
            raise ValueError(f"'samples' must be a list of at most {MAX_SAMPLES}")
        samples = []
        for r in rows:
            seconds = r["seconds"]
            if (isinstance(seconds, bool) or not isinstance(seconds, (int, float))
                    or not MIN_SAMPLE_SECONDS <= seconds <= MAX_SAMPLE_SECONDS):
                raise ValueError(f"seconds {seconds!r} is not a time from {MIN_SAMPLE_SECONDS:g} "
                                 f"to {MAX_SAMPLE_SECONDS:g} s")
            payload, group = whole(r, "payload_bytes"), whole(r, "group_size")
            if world_size is not None and group != world_size:
                raise ValueError(f"group_size {group} is not the number of hosts ({world_size})")
            if sizes is not None and payload not in sizes:
                raise ValueError(f"payload_bytes {payload} is not a size that was measured")
            samples.append(Sample(payload, group, float(seconds)))
        return samples
    except (ValueError, KeyError, TypeError) as exc:
        raise BenchError(f"{source}: not a benchmark result ({type(exc).__name__}: {exc})") from None


# --------------------------------------------------------------------------- compute probe
@dataclass(frozen=True)
class ProbeSpec:
    """What the compute probe times on every host: a few optimizer steps of a task's model."""

    task: str
    batch_size: int
    threads: int | None = None  # torch intra-op threads (None: torch's default, every core)
    data: str | None = None  # the task's data file, at the same path on every host
    device: str = "cpu"  # what each host times on: cpu, cuda, mps, or auto (resolved there)

    def argv(self) -> list[str]:
        """The rank's arguments that ask for this probe."""
        words = ["--probe-task", self.task, "--probe-batch", str(self.batch_size)]
        if self.threads is not None:
            words += ["--probe-threads", str(self.threads)]
        if self.data is not None:
            words += ["--probe-data", self.data]
        if self.device != "cpu":
            words += ["--probe-device", self.device]
        return words


def probe_step_seconds(spec: ProbeSpec) -> tuple[float, float]:
    """This host's median seconds of one forward, backward and AdamW step of ``spec.task``'s
    model at ``spec.batch_size``, and their spread (:func:`step_spread`; the planner's compute
    probe, run here)."""
    from meshtrain.planning import measure_step_times
    from meshtrain.tasks import TaskOptions, check_options, get_task

    task = get_task(spec.task)
    bundle = task.build(TaskOptions(spec.data, 0, check_options(task, {})))
    threads_before = torch.get_num_threads()
    # As a launched rank would train: the given threads, else the inventory's (the launcher
    # sets MESHTRAIN_THREADS, already checked), else the cores, shared by the host's ranks.
    torch.set_num_threads(resolve_threads(spec.threads, "launched"))
    try:
        # 20 timed steps at least: enough for a spread, a few seconds for a small model.
        times = measure_step_times(bundle.model, bundle.train_data, spec.batch_size, bundle.collate_fn,
                                   min_steps=20, device=resolve_device(spec.device))
        return statistics.median(times), step_spread(times)
    finally:
        torch.set_num_threads(threads_before)


def step_spread(times: Sequence[float]) -> float:
    """How much one step varies: ``sqrt(pi)/2`` times the mean difference between two steps,
    the standard deviation for normally distributed times. Two hosts' sync waits half the
    mean difference, which this keeps exact, and a few very slow steps sway it less than
    the standard deviation."""
    ordered = sorted(times)
    n = len(ordered)
    if n < 2:
        return 0.0
    # sum over pairs i<j of x_j - x_i, from the sorted times in one pass
    total = sum((2 * i - n + 1) * x for i, x in enumerate(ordered))
    return math.sqrt(math.pi) / 2 * total / (n * (n - 1) / 2)


def probe_to_json(spec: ProbeSpec, seconds: Sequence[float], jitter: Sequence[float]) -> dict[str, Any]:
    """The probe as rank 0 writes it into bench.json: what was timed, each rank's median
    step and its spread."""
    return {"task": spec.task, "batch_size": spec.batch_size, "threads": spec.threads,
            "step_seconds": [float(x) for x in seconds], "step_jitter": [float(x) for x in jitter]}


def probe_from_json(text: str, source: str, world_size: int) -> dict[str, Any] | None:
    """The ``probe`` of bench.json (None if it has none), checked strictly like the samples:
    a task name, whole batch and threads, one finite positive time per rank."""
    try:
        probe = host_json(text).get("probe")
        if probe is None:
            return None
        task, batch, threads = probe["task"], probe["batch_size"], probe["threads"]
        times, jitter = probe["step_seconds"], probe["step_jitter"]
        if not isinstance(task, str) or not task.isidentifier():
            raise ValueError(f"task {task!r} is not a task name")
        for key, value in (("batch_size", batch), ("threads", threads)):
            whole = isinstance(value, int) and not isinstance(value, bool) and 0 < value < 2**31
            if value is not None and not whole:
                raise ValueError(f"{key} {value!r} is not a whole number > 0")
        if not isinstance(times, list) or len(times) != world_size or not all(
                isinstance(t, (int, float)) and not isinstance(t, bool) and 0 < t <= MAX_STEP_SECONDS
                for t in times):
            raise ValueError(f"step_seconds must hold one time > 0 and <= {MAX_STEP_SECONDS:g} s per "
                             f"host ({world_size})")
        if not isinstance(jitter, list) or len(jitter) != world_size or not all(
                isinstance(t, (int, float)) and not isinstance(t, bool) and 0 <= t <= MAX_STEP_SECONDS
                for t in jitter):
            raise ValueError(f"step_jitter must hold one time from 0 to {MAX_STEP_SECONDS:g} s per "
                             f"host ({world_size})")
        return {"task": task, "batch_size": batch, "threads": threads,
                "step_seconds": [float(t) for t in times], "step_jitter": [float(t) for t in jitter]}
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise BenchError(f"{source}: not a benchmark result (probe: {type(exc).__name__}: {exc})") from None


# --------------------------------------------------------------------------- one rank
def run_rank(sizes: Sequence[int], repeats: int, out: Path, timeout_s: float,
             probe: ProbeSpec | None = None) -> None:
    """Join the launched group (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), measure, and on
    rank 0 write the samples to ``out``; with ``probe`` every host also times a few steps of
    a task's model (one host at a time: on a shared machine they would slow each other)."""
    start_heartbeat()  # the launcher stops a rank that goes silent
    # One thread: summing the chunks takes well under a millisecond per MB, while idle
    # OpenMP workers spinning on shared cores can add tens of ms to every message.
    torch.set_num_threads(1)
    place = launched_rank()
    if place is None:
        raise RankEnvironmentError("a benchmark rank needs RANK and WORLD_SIZE "
                                   "(set by `meshtrain hosts bench`)")
    rank, world = place.rank, place.world_size
    # As a training rank does: without an inventory iface, gloo would listen where the host
    # name resolves (often 127.0.0.1), and the other hosts could not connect.
    bind_gloo_to_advertise()
    # Always gloo on CPU: the network between hosts is what is measured, as the strategies
    # use it on CPU and Apple hosts.
    init_process_group(rank, world, *place.rendezvous(), torch.device("cpu"), timeout_s)
    try:
        comm = TorchDistCommunicator()

        def report(sample: Sample) -> None:
            if rank == 0:
                print(f"{sample.payload_bytes} B: {sample.seconds * 1e3:.3f} ms (this rank, median)")

        samples = measure(comm, sizes, repeats, report=report)
        probed: list[float] = []
        jitter: list[float] = []
        if probe is not None:
            probe_device = resolve_device(probe.device)  # auto: what this host has
            for turn in range(world):
                mine = torch.zeros(2, dtype=torch.float64)
                if turn == rank:
                    mine[0], mine[1] = probe_step_seconds(probe)
                    print(f"compute probe: {probe.task}, batch {probe.batch_size}, on {probe_device}: "
                          f"{mine[0].item() * 1e3:.1f} ms per step (median), "
                          f"{mine[1].item() * 1e3:.1f} ms spread")
                comm.all_reduce(mine, op="sum", record=False)  # also: the next host's turn
                probed.append(float(mine[0]))
                jitter.append(float(mine[1]))
        dist.barrier()
    except BaseException:
        dist.destroy_process_group()
        raise
    leave_in_order(rank, world, timeout_s)  # the same exit order as training ranks
    if rank == 0:
        result = json.loads(samples_to_json(samples))
        if probe is not None:
            result["probe"] = probe_to_json(probe, probed, jitter)
        atomic_write_text(out, json.dumps(result, indent=1))


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of one rank: ``python -m meshtrain.hosts.bench --sizes ... --out FILE``."""
    # A native abort (SIGABRT from torch's C++ side) then prints every thread's Python stack
    # to the rank's output, which the launcher shows: where the rank was, not only that it died.
    faulthandler.enable(all_threads=True)
    parser = argparse.ArgumentParser(prog="python -m meshtrain.hosts.bench",
                                     description="One rank of `meshtrain hosts bench`.")
    parser.add_argument("--sizes", required=True, help="Buffer sizes in bytes, comma-separated.")
    parser.add_argument("--repeats", type=int, default=5, help="Timed all-reduces per size.")
    parser.add_argument("--out", type=Path, required=True, help="Where rank 0 writes the JSON timings.")
    parser.add_argument("--probe-task", help="Also time a few steps of this task's model on every host.")
    parser.add_argument("--probe-batch", type=int, default=32, help="The probe's batch size.")
    parser.add_argument("--probe-threads", type=int, help="The probe's torch threads.")
    parser.add_argument("--probe-data", help="The probe task's data file (same path on every host).")
    parser.add_argument("--probe-device", default="cpu", choices=DEVICES,
                        help="The device the probe times on (auto: what this host has).")
    args = parser.parse_args(argv)
    try:
        place = launched_rank()
        if place is not None:
            place.rendezvous()
    except RankEnvironmentError as exc:
        sys.exit(f"error: {exc} (run by `meshtrain hosts bench`)")
    if place is None:
        sys.exit("error: run by `meshtrain hosts bench`, which sets RANK, WORLD_SIZE, MASTER_ADDR, "
                 "MASTER_PORT")
    sizes = [int(s) for s in args.sizes.split(",")]
    probe = ProbeSpec(args.probe_task, args.probe_batch, args.probe_threads, args.probe_data,
                      args.probe_device) if args.probe_task else None
    run_rank(sizes, args.repeats, args.out, place.timeout_s if place.timeout_s is not None else 60.0, probe)


if __name__ == "__main__":
    main()
