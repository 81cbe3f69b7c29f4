"""Threads and processes runtimes give bit-identical weights; seeding is reproducible."""

from __future__ import annotations

import io
import os
import sys
import threading
import time
from collections.abc import Callable

import pytest
import torch
from helpers import (
    MLP,
    NeedsEnvironment,
    assert_states_equal,
    regression_data,
    run_jobs_as_nodes,
    unequal_factory,
)

from meshtrain import NodeFailed, Trainer
from meshtrain.comm.torch_dist import host_loopback_store
from meshtrain.engine import math_kernels
from meshtrain.engine.runtimes.processes import node_context
from meshtrain.engine.runtimes.threads import _SharedGenerator
from meshtrain.engine.trainer import NodeJob, TrainConfig
from meshtrain.strategies import (
    DDP,
    SPARTA,
    DeMo,
    DiLoCo,
    FedAvg,
    Optim,
    SparseLoCo,
    SPARTADiLoCo,
    StreamingDiLoCo,
)
from meshtrain.strategies.async_diloco import AsyncDiLoCo

NODES = 3
STEPS = 20
BATCH = 4

# Every strategy, with settings that make each one communicate several times in 20 steps.
CONFIGS = {
    "ddp": lambda: DDP("adamw", 0.01),
    "diloco": lambda: DiLoCo(H=6, lr=0.01),  # 20 % 6 != 0: the final sync runs too
    # Its all-reduces run on a side channel's thread on processes, at once on threads.
    "diloco-delay": lambda: DiLoCo(H=6, lr=0.01, delay=1),
    "streaming-diloco": lambda: StreamingDiLoCo(fragments=2, H=6, tau=2, lr=0.01),
    # An all-gather of int8 payloads, decoded and added in member order on every node.
    "diloco-int8": lambda: DiLoCo(H=6, lr=0.01, compression="int8", error_feedback=True),
    "sparseloco": lambda: SparseLoCo(H=6, lr=0.01, chunk=64, topk=8),
    "sparta-random": lambda: SPARTA(p=0.3, selector="random", lr=0.01),
    "sparta-partitioned": lambda: SPARTA(p=0.25, selector="partitioned", lr=0.01),
    "sparta-diloco": lambda: SPARTADiLoCo(p=0.2, sparse_interval=2, H=5, lr=0.01),
    "fedavg-islands": lambda: FedAvg(H=3, island_size=2, optim=Optim("sgd", momentum=0.9), lr=0.05),
    "fedavg-weighted": lambda: FedAvg(H=4, weighted=True, lr=0.05),
    "demo": lambda: DeMo(lr=0.003, compression_topk=4, compression_chunk=4),
    "ddp-dropout": lambda: DDP("sgd", 0.05),
    # Its slower nodes skip loop steps; one all-gather a round (DyLU), broadcasts as updates
    # arrive apart (every node H steps, no grace).
    "async-diloco": lambda: AsyncDiLoCo(H=6, lr=0.01, speeds=[1.0, 0.5, 1 / 3]),
    "async-diloco-drifting": lambda: AsyncDiLoCo(H=6, lr=0.01, speeds=[1.0, 0.5, 0.4], dylu=False, grace=0),
}


def _model(name: str) -> MLP:
    return MLP(dropout=0.3) if name.endswith("dropout") else MLP()


def _data(name: str):
    # 97 samples: 3 shards of 32, one left over. Weighted FedAvg gets shards of unequal size.
    return unequal_factory if name == "fedavg-weighted" else regression_data(97)


def _threads_result(name: str, tmp_path, seed: int = 0):
    return Trainer(_model(name), _data(name)).fit(
        CONFIGS[name](), nodes=NODES, max_steps=STEPS, batch_size=BATCH, seed=seed,
        runtime="threads", out_dir=tmp_path / "threads", progress=False,
    )


def _process_job(name: str, tmp_path) -> NodeJob:
    config = TrainConfig(nodes=NODES, steps=STEPS, batch_size=BATCH, runtime="processes",
                         out_dir=str(tmp_path / "processes"), progress=False)
    return NodeJob(model=_model(name), train_data=_data(name), val_data=None, collate_fn=None,
                   strategy=CONFIGS[name](), config=config, run_id=name, started=time.time())


@pytest.fixture(scope="module")
def process_states(tmp_path_factory):
    """Run every configuration on NODES node processes (started once for all, as the runtime
    starts its nodes)."""
    tmp_path = tmp_path_factory.mktemp("procs")
    names = list(CONFIGS)
    jobs = [_process_job(n, tmp_path) for n in names]
    # The parent hosts each job's rendezvous store on loopback, as run_processes does.
    stores = [host_loopback_store(timeout_s=120) for _ in names]
    ports = [port for _, port in stores]
    ctx = node_context()
    results = ctx.Queue()
    procs = [ctx.Process(target=run_jobs_as_nodes, args=(jobs, ports, r, results), daemon=True)
             for r in range(NODES)]
    for p in procs:
        p.start()
    states: dict[str, dict[str, torch.Tensor]] = {}
    try:
        for _ in range(NODES * len(names)):
            rank, status, payload = results.get(timeout=120)
            assert status == "done", payload
            if rank == 0:
                job_name = payload["summary"]["run_id"]
                states[job_name] = torch.load(io.BytesIO(payload["state_dict"]), weights_only=True)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return states


@pytest.mark.parametrize("name", list(CONFIGS))
def test_threads_and_processes_bit_identical(name, process_states, tmp_path):
    threads = _threads_result(name, tmp_path).model.state_dict()
    procs = process_states[name]
    assert threads.keys() == procs.keys()
    for key in threads:
        assert torch.equal(threads[key], procs[key]), f"{name}: {key} differs between runtimes"
    # The run changed the weights (a no-op strategy would pass the comparison trivially).
    assert not torch.equal(threads["fc1.weight"], _model(name).state_dict()["fc1.weight"])


def test_processes_runtime_end_to_end_with_dropout(tmp_path):
    """fit(runtime="processes") itself: 4 spawned nodes, dropout, bit-identical to threads."""
    kwargs = dict(nodes=4, max_steps=8, batch_size=BATCH, seed=3, progress=False)
    by_threads = Trainer(MLP(dropout=0.5), regression_data()).fit(
        DiLoCo(H=3, lr=0.01), runtime="threads", out_dir=tmp_path / "t", **kwargs)
    by_procs = Trainer(MLP(dropout=0.5), regression_data()).fit(
        DiLoCo(H=3, lr=0.01), runtime="processes", out_dir=tmp_path / "p", **kwargs)
    assert_states_equal(by_threads.model, by_procs.model)
    assert by_procs.run_dir is not None and (by_procs.run_dir / "model.pt").exists()
    assert by_procs.summary["runtime"] == "processes"
    assert [r["train_loss"] for r in by_threads.history] == [r["train_loss"] for r in by_procs.history]
    assert by_threads.summary["bytes_sent_per_node"] == by_procs.summary["bytes_sent_per_node"]
    # Dropout really drew different masks per node and step: without it the losses differ.
    plain = Trainer(MLP(dropout=0.0), regression_data()).fit(
        DiLoCo(H=3, lr=0.01), runtime="threads", out_dir=tmp_path / "n", **kwargs)
    assert plain.history[0]["train_loss"] != by_threads.history[0]["train_loss"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the forkserver is used on Linux only")
def test_nodes_fork_from_a_preloaded_server_and_see_the_callers_environment(tmp_path, monkeypatch):
    """The forkserver imported torch once; its environment is the caller's of when it started,
    yet every node sees the caller's environment of now, as a spawned node would."""
    import multiprocessing.forkserver

    assert node_context().get_start_method() == "forkserver"
    multiprocessing.forkserver.ensure_running()  # started before the variable below is set
    monkeypatch.setenv(NeedsEnvironment.VARIABLE, "set after the server started")
    kwargs = dict(nodes=2, max_steps=2, batch_size=BATCH, progress=False, runtime="processes")
    result = Trainer(NeedsEnvironment(), regression_data()).fit(DDP("sgd", 0.1), out_dir=tmp_path, **kwargs)
    assert result.summary["steps"] == 2
    monkeypatch.delenv(NeedsEnvironment.VARIABLE)
    with pytest.raises(NodeFailed, match="not set in this node"):
        Trainer(NeedsEnvironment(), regression_data()).fit(DDP("sgd", 0.1), out_dir=tmp_path, **kwargs)


@pytest.mark.parametrize("name", ["sparta-random", "ddp-dropout"])
def test_same_seed_same_weights_different_seed_different(name, tmp_path):
    a = _threads_result(name, tmp_path / "a", seed=5).model
    b = _threads_result(name, tmp_path / "b", seed=5).model
    c = _threads_result(name, tmp_path / "c", seed=6).model
    assert_states_equal(a, b)
    assert not torch.equal(a.state_dict()["fc1.weight"], c.state_dict()["fc1.weight"])


class _GradRecorder(FedAvg):
    """FedAvg that records every node's first local gradient (before any averaging)."""

    grads: dict[int, torch.Tensor] = {}

    def before_optimizer_step(self, step):
        if step == 0:
            _GradRecorder.grads[self.comm.rank] = self.params[0].grad.clone()
        super().before_optimizer_step(step)


def _same_data(rank, nodes, split):
    return regression_data(8)


def test_dropout_masks_differ_between_nodes(tmp_path):
    """Same weights and same samples on two nodes: only their own dropout streams differ."""
    for dropout, expect_equal in ((0.5, False), (0.0, True)):
        _GradRecorder.grads.clear()
        Trainer(MLP(dropout=dropout), _same_data).fit(
            _GradRecorder(H=100, lr=0.01), nodes=2, max_steps=1, batch_size=8, shuffle=False,
            out_dir=tmp_path / str(dropout), progress=False)
        assert torch.equal(_GradRecorder.grads[0], _GradRecorder.grads[1]) == expect_equal


class _Recorder(DDP):
    """DDP that records every node's starting weights (a picklable module-level class)."""

    seen: dict[int, list[torch.Tensor]] = {}

    def setup(self, model, comm, **kwargs):
        _Recorder.seen[comm.rank] = [p.detach().clone() for p in model.parameters()]
        super().setup(model, comm, **kwargs)


def test_every_node_starts_from_identical_weights(tmp_path):
    _Recorder.seen.clear()
    model = MLP()
    Trainer(model, regression_data()).fit(_Recorder("sgd", 0.1), nodes=4, max_steps=1, batch_size=4,
                                          out_dir=tmp_path, progress=False)
    assert sorted(_Recorder.seen) == [0, 1, 2, 3]
    for rank in range(4):
        for got, want in zip(_Recorder.seen[rank], model.parameters(), strict=True):
            assert torch.equal(got, want.detach())


def test_no_node_thread_is_left_when_fit_returns(tmp_path, monkeypatch):
    """A node thread still freeing what it held when the caller's interpreter exits aborts the
    process (a `simulate` ended with "terminate called without an active exception" in CI).
    Each node's random-stream guard, let go by its thread as the thread ends, is made slow to
    free (0.3 s): fit returns only once every node thread is gone."""
    freed = []

    class SlowToFree:
        def __init__(self, guard: Callable[[], object]) -> None:
            self.guard = guard

        def __call__(self) -> object:
            return self.guard()

        def __del__(self) -> None:
            time.sleep(0.3)
            freed.append(threading.current_thread().name)

    guard_for = _SharedGenerator.guard_for
    monkeypatch.setattr(_SharedGenerator, "guard_for", lambda self, *args: SlowToFree(guard_for(self, *args)))
    Trainer(MLP(), regression_data()).fit(DDP(), nodes=3, max_steps=2, batch_size=4, out_dir=tmp_path,
                                          progress=False, runtime="threads")
    assert not [t.name for t in threading.enumerate() if t.name.startswith("meshtrain-node-")]
    assert sorted(freed) == ["meshtrain-node-0", "meshtrain-node-1", "meshtrain-node-2"]


class _Wide(torch.nn.Module):
    """A model with a reduction over 131,072 activations: torch splits a reduction that
    large across intra-op threads, so 1 and 2 threads round differently."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.hidden = torch.nn.Linear(8, 2048)
        self.out = torch.nn.Linear(2048, 1)

    def forward(self, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        h = torch.tanh(self.hidden(batch[0]))
        h = h / h.square().mean().sqrt()  # one RMS over the whole batch: it reaches the gradients
        return torch.nn.functional.mse_loss(self.out(h).squeeze(-1), batch[1])


def test_same_thread_count_same_weights_in_both_runtimes(tmp_path):
    """docs/guides/runtimes.md's promise: bit-identical across runtimes at the same ``threads`` setting
    (and this model is one where the count matters, else the test would prove nothing)."""
    data = torch.utils.data.TensorDataset(torch.randn(256, 8, generator=torch.Generator().manual_seed(1)),
                                          torch.randn(256, generator=torch.Generator().manual_seed(2)))

    def final_state(runtime: str, threads: int) -> torch.nn.Module:
        return Trainer(_Wide(), data).fit(
            DiLoCo(H=3, lr=0.01), nodes=2, max_steps=6, batch_size=64, seed=0, runtime=runtime,
            threads=threads, out_dir=tmp_path / f"{runtime}-{threads}", progress=False).model

    one, two = final_state("threads", 1), final_state("threads", 2)
    pairs = zip(one.state_dict().values(), two.state_dict().values(), strict=True)
    assert not all(torch.equal(a, b) for a, b in pairs)
    assert_states_equal(one, final_state("processes", 1))
    assert_states_equal(two, final_state("processes", 2))


class _NeedsResolvedMathKernels(torch.nn.Module):
    """Trains only where MKL's kernels were chosen before the step (engine/math_kernels.py)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 1)

    def forward(self, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        if not math_kernels.math_kernels_resolved():
            raise RuntimeError("a node trained before resolve_math_kernels() ran in its process")
        return torch.nn.functional.mse_loss(self.linear(batch[0]).squeeze(-1), batch[1])


def test_a_node_process_resolves_math_kernels_before_it_trains(tmp_path):
    """A fresh process's first ``tanh`` on two threads can be wrong on one thread's chunk
    (oneMKL 2024.2, pytorch/pytorch#188792; benchmarks/vml_race.py). Importing
    meshtrain's engine resolves the kernels, so a node process has them chosen before its first step."""
    data = torch.utils.data.TensorDataset(torch.randn(32, 8), torch.randn(32))
    Trainer(_NeedsResolvedMathKernels(), data).fit(
        DiLoCo(H=2, lr=0.01), nodes=2, max_steps=2, batch_size=4, runtime="processes",
        out_dir=tmp_path, progress=False)


class _ChecksItsCores(torch.nn.Module):
    """Trains only where every thread of its node process runs on the cores the rule gives:
    a run that fills the caller's cores binds node r to ``threads`` of them from
    r * threads on (round-robin); otherwise every node runs on all of the caller's cores."""

    def __init__(self, nodes: int, threads: int) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 1)
        self.nodes, self.threads = nodes, threads
        self.allowed = sorted(os.sched_getaffinity(0))  # the caller's, handed out to the nodes

    def forward(self, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        import torch.distributed as dist

        rank, n = dist.get_rank(), len(self.allowed)
        fills = self.threads < n <= self.nodes * self.threads
        want = {self.allowed[(rank * self.threads + i) % n] for i in range(self.threads)} if fills \
            else set(self.allowed)
        bound = {int(tid): os.sched_getaffinity(int(tid)) for tid in os.listdir("/proc/self/task")}
        if any(cores != want for cores in bound.values()):
            raise RuntimeError(f"node {rank}: threads bound to {bound}, not {want}")
        return torch.nn.functional.mse_loss(self.linear(batch[0]).squeeze(-1), batch[1])


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="binding to cores is Linux only")
@pytest.mark.parametrize("nodes,threads", [(3, 1), (3, 2), (1, 1)],
                         ids=["fills-the-cores", "a-node-per-core-pair", "cores-to-spare"])
def test_node_processes_run_on_the_callers_cores_bound_when_they_fill_them(tmp_path, nodes, threads):
    """With the caller on 2 cores: 3 nodes of 1 thread fill them, so each node process, and
    every thread it starts (gloo's, the gradient buckets' worker), is bound to its own core,
    round-robin (benchmarks/runtimes.py: DDP on 4 processes took 1.8-2.1 s bound, 2.2-2.4 s
    not). 2 threads per node, or 1 node, leave the scheduler free, on the caller's cores:
    runs with cores to spare, side by side, must not crowd onto the same ones."""
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2:
        pytest.skip("needs 2 cores to hand out")
    os.sched_setaffinity(0, allowed[:2])  # this thread: the nodes are to see the caller's cores of now
    try:
        data = torch.utils.data.TensorDataset(torch.randn(32, 8), torch.randn(32))
        result = Trainer(_ChecksItsCores(nodes, threads), data).fit(
            DDP("sgd", 0.01), nodes=nodes, max_steps=2, batch_size=4, runtime="processes",
            threads=threads, out_dir=tmp_path, progress=False)
    finally:
        os.sched_setaffinity(0, allowed)
    assert result.summary["steps"] == 2
