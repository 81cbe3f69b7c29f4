"""Which strategy to run on a cluster: the projected cost of each, and why one wins.

Given what one optimizer step costs on one host (compute seconds, trainable bytes) and a
cluster (bandwidth, latency; a named one or a ``hosts bench`` file), every candidate's
communication per step comes from the same alpha-beta model as the run projection
(:func:`meshtrain.cluster.collective_seconds`). Communication adds to compute, except
what DDP hides behind the backward pass, counted as the run projection counts it
(:func:`meshtrain.cluster.communication_by_step`):

    DDP            one all-reduce of the gradients every step, in buckets of about
                   256 KiB; all but the last go on the wire during the backward pass
    DiLoCo(H)      one all-reduce of the outer gradient every H steps
    SPARTA(p)      one all-reduce of a fraction p of the parameters every step
    DeMo           one all-gather of top-k DCT coefficients (fp32 value + int16 index)
    DiLoCo int8    one all-gather of the int8 outer gradient (1 byte per value + a float32
                   scale per 128) every H steps, plus the compute of encoding it and
                   decoding every host's (meshtrain/comm/compression.py)
    SparseLoCo     one all-gather of 116 bytes per 4,096 values every 30 steps, plus its
                   top-k and 2-bit encoding
    Streaming      F = 4 fragments, each one all-reduce of 1/F of the model every H steps
    DiLoCo(H)      (peak bytes per sync 1/F of DiLoCo's), each hidden behind the tau = 5
                   steps it overlaps: only what runs past their compute adds
    DiLoCo(H)      one all-reduce of the outer gradient every H steps, hidden behind the
    delay=1        whole next round (H steps of compute): only what runs past it adds

Each host processes its own batch, so the throughput on n hosts over one host is
``n * compute / (compute + communication)``. The rule:

1. DDP when it spends at most ``budget`` (10%) of its step communicating: it computes
   exactly what one host with an n-times larger batch would, so it costs no quality.
2. Otherwise DiLoCo with the smallest H (from :data:`DILOCO_H`) that keeps communication
   within the budget: fewer inner steps between syncs stay closer to DDP.
3. Otherwise int8 DiLoCo with the smallest H within the budget (int8 outer gradients
   matched fp32 in INTELLECT-1 and OpenDiLoCo), then SparseLoCo (H=30).
4. Otherwise streaming DiLoCo with the smallest H within the budget (its fragments'
   outer updates merge tau steps stale), then DiLoCo with delay=1 (a whole round stale):
   they trade staleness, not precision, for hiding the sync behind compute.
5. If none does, whichever of them communicates least, and the table shows the share.

The ``quality`` column summarises what the papers report; it is advice, not a measurement.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from meshtrain.cluster import (
    BACKWARD_SHARE,
    Cluster,
    collective_seconds,
    communication_by_step,
    sync_wait_seconds,
)
from meshtrain.comm import CommRecord, ring_all_reduce_bytes
from meshtrain.comm.buckets import BUCKET_BYTES
from meshtrain.comm.compression import Codec, SparseCodec
from meshtrain.config.plan import COMM_BUDGET
from meshtrain.data import Collate, DataFactory, fetch, resolve_dataset, to_device
from meshtrain.engine.math_kernels import resolve_math_kernels
from meshtrain.strategies.base import Optim

#: Inner steps between DiLoCo syncs that the planner considers (the paper uses 500).
DILOCO_H = (5, 10, 20, 50, 100, 200, 500)
SPARTA_P = 0.005
DEMO_TOPK, DEMO_CHUNK = 32, 64
FLOAT_BYTES, INDEX_BYTES = 4, 2
SPARSELOCO_H = 30
#: Streaming DiLoCo as the planner weighs it: the paper's overlap of up to 5 steps.
STREAMING_FRAGMENTS, STREAMING_TAU = 4, 5
#: Seconds per value to encode one host's outer gradient and to decode one payload at one
#: torch thread: `python benchmarks/outer_compression.py --codec-timing` on the 2-core
#: development machine (load 4.6-4.9, two runs, 2026-12-03) printed int8 5.4-6.0e-9 and
#: 0.85-0.87e-9, SparseLoCo 1.0-1.7e-8 and 1.05-1.16e-9; the slower of each pair is kept.
CODEC_SECONDS = {"int8": (6e-9, 0.9e-9), "sparseloco": (17e-9, 1.2e-9)}

#: What the papers report about each strategy's effect on quality (short; sources below).
QUALITY = {
    "ddp": "exact: one n-times larger batch",
    "diloco": "near DDP up to H=500 [1]",
    "sparta": "near DDP at p=0.005 [2]",
    "demo": "matched AdamW at 1B params [3]",
    "diloco int8": "int8 outer gradients matched fp32 [4]",
    "sparseloco": "beat fp32 DiLoCo at 1-3% density [5]",
    "streaming-diloco": "near DiLoCo at F fragments, tau <= 5 [6]",
    "diloco delay=1": "one round stale; near DiLoCo [7]",
    "async-diloco": "DiLoCo's loss per update; uneven hosts wait no more [8]",
}
SOURCES = ("[1] DiLoCo, arXiv 2311.08105: 8 workers, H=500, C4 perplexity of DDP at 500x less traffic; "
           "larger H needs more steps for the same loss. [2] SPARTA (exo labs): p=0.005 close to DDP on "
           "small models; replicas drift more as p shrinks. [3] DeMo, arXiv 2411.19870: top-32 of 64x64 "
           "DCT chunks, sign updates with their own learning rate. [4] INTELLECT-1 and OpenDiLoCo: int8 "
           "pseudo-gradients without loss degradation. [5] SparseLoCo, arXiv 2508.15706: top-64 of "
           "4,096, 2-bit values, error feedback; 512M parameters. [6] Streaming DiLoCo, arXiv 2501.18512: "
           "fragments synced in turn, overlapped 1-5 inner steps, quality of DiLoCo at a fraction of "
           "the peak bandwidth. [7] Eager updates, arXiv 2502.12996: the outer step overlapped with "
           "the next round; the plain delayed step trails DiLoCo a little, eager updates close the gap. "
           "[8] Asynchronous Local-SGD, arXiv 2401.09135: dynamic local updates and delayed Nesterov "
           "matched synchronous DiLoCo's perplexity per update on heterogeneous workers, in less wall "
           "time. The planner's hosts are equal: it lists async-diloco for hosts of uneven speed.")


@dataclass(frozen=True)
class Workload:
    """One optimizer step on one host: what it computes and what a sync would move."""

    trainable_parameters: int
    step_seconds: float  # compute of one step on one host of the cluster
    hosts: int

    @property
    def trainable_bytes(self) -> int:
        return self.trainable_parameters * FLOAT_BYTES


@dataclass(frozen=True)
class Candidate:
    strategy: str
    options: dict[str, Any]
    comm_seconds: float  # per optimizer step, averaged over a sync period
    step_seconds: float  # compute + communication, per step
    speedup: float  # samples per second on the cluster over one host
    quality: str
    peak_bytes: float = 0.0  # the most one host sends in one sync

    @property
    def comm_share(self) -> float:
        return self.comm_seconds / self.step_seconds if self.step_seconds > 0 else 0.0

    @property
    def label(self) -> str:
        short = {"compression_topk": "topk", "compression_chunk": "chunk"}
        opts = ", ".join(f"{short.get(k, k)}={v:g}" if isinstance(v, (int, float)) else
                         f"{short.get(k, k)}={v}" for k, v in self.options.items())
        return f"{self.strategy} ({opts})" if opts else self.strategy


@dataclass(frozen=True)
class Plan:
    workload: Workload
    cluster: Cluster
    choice: Candidate
    candidates: list[Candidate]
    reasons: list[str] = field(default_factory=list)

    def as_config(self) -> dict[str, Any]:
        """What ``--strategy auto`` records in config.yaml."""
        return {
            "strategy": self.choice.strategy,
            "strategy_options": dict(self.choice.options),
            "cluster": self.cluster.name,
            "hosts": self.workload.hosts,
            "trainable_parameters": self.workload.trainable_parameters,
            "step_seconds": self.workload.step_seconds,
            "projected_speedup": round(self.choice.speedup, 3),
            "communication_share": round(self.choice.comm_share, 4),
            "reasons": list(self.reasons),
        }


def all_reduce_seconds(payload_bytes: float, hosts: int, cluster: Cluster) -> float:
    """One ring all-reduce of ``payload_bytes`` among ``hosts`` on ``cluster``."""
    numel = max(1, math.ceil(payload_bytes / FLOAT_BYTES))
    sent, received = ring_all_reduce_bytes(numel, FLOAT_BYTES, 0, hosts)
    return collective_seconds(CommRecord(0, "all_reduce", sent, received, hosts), cluster)


def ddp_all_reduce_seconds(payload_bytes: float, hosts: int, cluster: Cluster, step_seconds: float) -> float:
    """What DDP's all-reduce of ``payload_bytes`` of gradients adds to a step of
    ``step_seconds`` compute on ``cluster``, sent as a launched run sends it: buckets of
    :data:`BUCKET_BYTES` (the last one holding the rest), each leaving while the backward
    pass (:data:`BACKWARD_SHARE` of the step) still runs, but the last, which waits for it.
    The tensors' sizes are not known here, so the buckets are taken as full."""
    full, rest = divmod(max(1, math.ceil(payload_bytes / FLOAT_BYTES)), BUCKET_BYTES // FLOAT_BYTES)
    sizes = [BUCKET_BYTES // FLOAT_BYTES] * full + ([rest] if rest else [])
    records = [CommRecord(0, "all_reduce", *ring_all_reduce_bytes(numel, FLOAT_BYTES, 0, hosts), hosts,
                          during_backward=i < len(sizes) - 1) for i, numel in enumerate(sizes)]
    return communication_by_step(records, cluster, BACKWARD_SHARE * step_seconds)[0]


def all_gather_seconds(per_host_bytes: float, hosts: int, cluster: Cluster) -> float:
    """One all-gather where every host contributes ``per_host_bytes``."""
    moved = int(per_host_bytes) * (hosts - 1)
    return collective_seconds(CommRecord(0, "all_gather", moved, moved, hosts), cluster)


def demo_bytes_per_step(parameters: int) -> float:
    """What DeMo sends per host per step: top-k of every chunk^2 block, value and index."""
    return parameters * DEMO_TOPK / DEMO_CHUNK**2 * (FLOAT_BYTES + INDEX_BYTES)


def _ring_sent(payload_bytes: float, hosts: int) -> float:
    """Bytes one host sends in a ring all-reduce of ``payload_bytes``."""
    return 2 * (hosts - 1) / hosts * payload_bytes if hosts > 1 else 0.0


def codec_seconds(codec: str, parameters: int, hosts: int) -> float:
    """Compute of one compressed sync: encode this host's vector, decode every host's."""
    encode, decode = CODEC_SECONDS[codec]
    return parameters * (encode + hosts * decode)


def _candidate(strategy: str, options: dict[str, Any], comm: float, work: Workload,
               peak_bytes: float = 0.0) -> Candidate:
    step = work.step_seconds + comm
    speedup = work.hosts * work.step_seconds / step if step > 0 else float(work.hosts)
    quality = QUALITY["diloco int8"] if options.get("compression") == "int8" else \
        QUALITY["diloco delay=1"] if options.get("delay") else QUALITY[strategy]
    return Candidate(strategy, options, comm, step, speedup, quality, peak_bytes)


def hidden_behind(seconds: float, steps: int, work: Workload) -> float:
    """What a sync of ``seconds`` adds when it runs beside ``steps`` steps of compute."""
    return max(0.0, seconds - steps * work.step_seconds)


def candidates(work: Workload, cluster: Cluster) -> list[Candidate]:
    """Every strategy the planner weighs, with its projected cost per step (communication
    plus, on a cluster whose probe measured a ``step_jitter``, the wait for the slowest host
    at every sync: every step for DDP, SPARTA and DeMo, every H steps for DiLoCo)."""
    n, size = work.hosts, work.trainable_bytes
    full_sync = all_reduce_seconds(size, n, cluster)
    every_step = sync_wait_seconds(1, n, cluster)
    ddp = ddp_all_reduce_seconds(size, n, cluster, work.step_seconds)
    found = [_candidate("ddp", {}, ddp + every_step, work)]
    found += [_candidate("diloco", {"H": h}, (full_sync + sync_wait_seconds(h, n, cluster)) / h, work,
                         _ring_sent(size, n)) for h in DILOCO_H]
    int8 = all_gather_seconds(Codec("int8").payload_bytes(work.trainable_parameters), n, cluster) \
        + codec_seconds("int8", work.trainable_parameters, n)
    found += [_candidate("diloco", {"H": h, "compression": "int8"},
                         (int8 + sync_wait_seconds(h, n, cluster)) / h, work) for h in DILOCO_H]
    sparse = all_gather_seconds(SparseCodec().payload_bytes(work.trainable_parameters), n, cluster) \
        + codec_seconds("sparseloco", work.trainable_parameters, n)
    found.append(_candidate("sparseloco", {"H": SPARSELOCO_H},
                            (sparse + sync_wait_seconds(SPARSELOCO_H, n, cluster)) / SPARSELOCO_H, work))
    fragment_bytes = size / STREAMING_FRAGMENTS
    fragment = all_reduce_seconds(fragment_bytes, n, cluster)
    found += [_candidate("streaming-diloco", {"H": h, "fragments": STREAMING_FRAGMENTS, "tau": STREAMING_TAU},
                         STREAMING_FRAGMENTS * hidden_behind(fragment + sync_wait_seconds(h, n, cluster),
                                                             STREAMING_TAU, work) / h, work,
                         _ring_sent(fragment_bytes, n))
              for h in DILOCO_H if h > STREAMING_TAU]
    found += [_candidate("diloco", {"H": h, "delay": 1},
                         hidden_behind(full_sync + sync_wait_seconds(h, n, cluster), h, work) / h, work,
                         _ring_sent(size, n)) for h in DILOCO_H]
    # Every host's update reaches every host, one all-gather a round; what it saves (no host
    # waits for a slower one's H steps) needs hosts of uneven speed, which a Workload has not.
    found += [_candidate("async-diloco", {"H": h},
                         (all_gather_seconds(size, n, cluster) + sync_wait_seconds(h, n, cluster)) / h, work,
                         size * (n - 1)) for h in DILOCO_H]
    found.append(_candidate("sparta", {"p": SPARTA_P},
                            all_reduce_seconds(size * SPARTA_P, n, cluster) + every_step, work))
    demo = all_gather_seconds(demo_bytes_per_step(work.trainable_parameters), n, cluster)
    found.append(_candidate("demo", {"compression_topk": DEMO_TOPK, "compression_chunk": DEMO_CHUNK},
                            demo + every_step, work))
    return found


def recommend(work: Workload, cluster: Cluster, budget: float = COMM_BUDGET) -> Plan:
    """The strategy to run on ``cluster`` and the reasons, by the rule in the module text."""
    if work.hosts < 1 or work.trainable_parameters < 1 or not work.step_seconds > 0:
        raise ValueError("a plan needs hosts >= 1, trainable parameters >= 1 and step seconds > 0")
    found = candidates(work, cluster)
    ddp = found[0]
    diloco = [c for c in found if c.strategy == "diloco" and not {"compression", "delay"} & set(c.options)]
    overlapped = [c for c in found if c.strategy == "streaming-diloco"] + \
        [c for c in found if c.strategy == "diloco" and "delay" in c.options]
    compressed = [c for c in found if c.strategy == "diloco" and "compression" in c.options]
    sparseloco = [c for c in found if c.strategy == "sparseloco"]
    if work.hosts == 1:
        return Plan(work, cluster, ddp, found, ["one host: nothing to communicate, plain training"])
    share = f"{ddp.comm_share:.0%}"
    wait = sync_wait_seconds(1, work.hosts, cluster)
    # On a probed cluster the share includes the wait for the slowest host: say how much.
    waiting = [f"of which {wait * 1e3:.1f} ms waiting for the slowest host at each sync (the "
               f"probe's step varied by {cluster.step_jitter * 1e3:.1f} ms)"] if wait > 0 and \
        cluster.step_jitter else []
    if ddp.comm_share <= budget:
        reasons = [f"DDP spends {share} of each step communicating on {cluster.name} "
                   f"(budget {budget:.0%}), and it is exact: no quality cost", *waiting,
                   f"projected {ddp.speedup:.2f}x the samples per second of one host"]
        return Plan(work, cluster, ddp, found, reasons)
    reasons = [f"DDP would spend {share} of each step communicating on {cluster.name} "
               f"({ddp.speedup:.2f}x one host)", *waiting]
    fitting = [c for c in diloco if c.comm_share <= budget]
    if fitting:
        choice = fitting[0]
        reasons.append(f"DiLoCo H={choice.options['H']} is the smallest H that keeps communication "
                       f"within {budget:.0%} ({choice.comm_share:.1%}): {choice.speedup:.2f}x one host")
        return Plan(work, cluster, choice, found, reasons)
    largest = diloco[-1]
    reasons.append(f"even DiLoCo H={largest.options['H']} spends {largest.comm_share:.0%} "
                   f"communicating: {largest.speedup:.2f}x one host")
    # Then the fewer bytes of compression, then the overlap that hides the syncs: the first
    # candidate of each kind that keeps within the budget.
    for kind, how in (([*compressed, *sparseloco], ", its compute of encoding included"),
                      (overlapped, " by hiding its syncs behind compute")):
        fitting = [c for c in kind if c.comm_share <= budget]
        if fitting:
            choice = fitting[0]
            reasons.append(f"{choice.label} keeps communication within {budget:.0%} "
                           f"({choice.comm_share:.1%}){how}: {choice.speedup:.2f}x one host")
            return Plan(work, cluster, choice, found, reasons)
    choice = min([*diloco, *compressed, *sparseloco, *overlapped], key=lambda c: c.comm_seconds)
    reasons.append(f"none keeps within {budget:.0%}; {choice.label} communicates least "
                   f"({choice.comm_share:.0%}): {choice.speedup:.2f}x one host; a faster link would pay off")
    return Plan(work, cluster, choice, found, reasons)


def trainable_parameters(model: nn.Module) -> int:
    """Parameters a sync moves (frozen base weights under LoRA move nothing)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


#: Rounds of the compute probe: their medians' spread tells a steady machine from a busy one.
PROBE_ROUNDS = 3
#: A probe whose rounds' medians differ by more than this share of its estimate is noisy.
NOISY_SPREAD = 0.25


@dataclass(frozen=True)
class ComputeProbe:
    """One step's compute as a node of the run computes it, timed in :data:`PROBE_ROUNDS`
    rounds: the estimate, how much the rounds disagree, and with how many threads."""

    seconds: float  # the median of every timed step
    round_seconds: tuple[float, ...]  # each round's median
    threads: int  # torch intra-op threads the steps ran with (the run's per node)

    @property
    def spread(self) -> float:
        """(slowest round's median - fastest round's) / the estimate."""
        return (max(self.round_seconds) - min(self.round_seconds)) / self.seconds if self.seconds > 0 else 0.0

    @property
    def noisy(self) -> bool:
        # Decided on the whole percent the user is shown, so "spread 25%" is never called noisy.
        return round(self.spread * 100) > round(NOISY_SPREAD * 100)

    def warning(self) -> str | None:
        """One line when the probe is noisy (the machine was busy while it timed), else None."""
        if not self.noisy:
            return None
        rounds = "/".join(f"{t * 1e3:.3g}" for t in self.round_seconds)
        return (f"the compute probe is noisy: its {len(self.round_seconds)} rounds took {rounds} ms a step "
                f"(spread {self.spread:.0%}, more than {NOISY_SPREAD:.0%}); something else is using this "
                "machine's cores: plan when it is idle, or give the step's compute with --step-seconds")

    def as_config(self) -> dict[str, Any]:
        return {"seconds": self.seconds, "round_seconds": list(self.round_seconds), "threads": self.threads,
                "spread": round(self.spread, 4)}


def probe_compute(model: nn.Module, data: Dataset[Any] | DataFactory, batch_size: int,
                  collate_fn: Collate | None = None, *, threads: int, device: torch.device | None = None,
                  rounds: int = PROBE_ROUNDS, seconds: float = 2.0) -> ComputeProbe:
    """Time one forward, backward and AdamW step of ``model`` as a node of the run will run
    it: with ``threads`` torch intra-op threads (a simulated node's 1 by default, not every
    core: on a loaded machine every core's estimate was 252x the run's step), in ``rounds``
    rounds of :func:`measure_step_times` sharing ``seconds``. ``model`` is trained: pass a copy."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        timed = [measure_step_times(model, data, batch_size, collate_fn, warmup=3 if i == 0 else 0,
                                    seconds=seconds / rounds, device=device) for i in range(rounds)]
    finally:
        torch.set_num_threads(before)
    return ComputeProbe(statistics.median(t for times in timed for t in times),
                        tuple(statistics.median(times) for times in timed), threads)


def measure_step_seconds(model: nn.Module, data: Dataset[Any] | DataFactory, batch_size: int,
                         collate_fn: Collate | None = None, *, warmup: int = 3, min_steps: int = 5,
                         max_steps: int = 50, seconds: float = 2.0,
                         device: torch.device | None = None) -> float:
    """Median seconds of one forward, backward and AdamW step of ``model`` here, on
    ``device`` (default cpu; ``model`` moves there).

    This is the compute probe: what one host spends per step before any communication.
    It times at least ``min_steps`` steps and keeps going up to ``max_steps`` for about
    ``seconds`` (a median over more steps shrugs off a busy moment). A cluster file's
    ``speed`` scales the result to other machines.
    """
    return statistics.median(measure_step_times(model, data, batch_size, collate_fn, warmup=warmup,
                                                min_steps=min_steps, max_steps=max_steps, seconds=seconds,
                                                device=device))


def measure_step_times(model: nn.Module, data: Dataset[Any] | DataFactory, batch_size: int,
                       collate_fn: Collate | None = None, *, warmup: int = 3, min_steps: int = 5,
                       max_steps: int = 50, seconds: float = 2.0,
                       device: torch.device | None = None) -> list[float]:
    """The seconds of each timed step of :func:`measure_step_seconds` (their spread is how
    much a host's step varies: what a sync waits for). On a GPU each step is timed to its
    kernels' end (the device is synchronised): they run after the Python call returns."""
    resolve_math_kernels()  # the steps timed are the run's: with its kernels (engine/math_kernels.py)
    device = device or torch.device("cpu")
    dataset, _ = resolve_dataset(data, 0, 1, "train")
    size = len(dataset)  # type: ignore[arg-type]
    if size < 1:
        raise ValueError("the training data is empty: nothing to time")
    model.to(device)
    # Built as a node builds its optimizer (torch's list kernels on CPU): the step it times.
    optimizer = Optim("adamw").build([p for p in model.parameters() if p.requires_grad], lr=1e-6)
    model.train()
    times: list[float] = []
    step = 0
    deadline = None
    while len(times) < min_steps or (len(times) < max_steps and time.perf_counter() < (deadline or 0)):
        batch = to_device(fetch(dataset, [(step * batch_size + j) % size for j in range(batch_size)],
                                collate_fn), device)
        _synchronize(device)
        started = time.perf_counter()
        model(batch).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        _synchronize(device)
        if step >= warmup:
            times.append(time.perf_counter() - started)
            deadline = deadline or started + seconds
        step += 1
    return times


def _synchronize(device: torch.device) -> None:
    """Wait for the device's queued kernels (a GPU runs them after the Python call returns)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()
