"""The CUDA paths outside the vmap runtime, run where torch sees a GPU (skipped here).

What they pin: every node of the threads runtime draws its dropout from its own CUDA stream
(so a run repeats, equals the processes runtime, and resumes where it stopped); bf16 and fp16
autocast on CUDA (fp16 with the loss scaler) stay within 2% of fp32; gradient checkpointing
on CUDA changes no result; Whisper with LoRA trains there with one copy of its frozen base
for all nodes; the processes runtime (nccl, the code path of launched ranks) wants a GPU per
node and its nodes report the GPU memory torch holds; the compute probes (``--strategy auto``,
``hosts bench``) time the GPU's steps; every built-in strategy sends on CUDA the bytes it sends
on the CPU, with the CPU's losses. ``benchmarks/gpu_check.sh`` runs them on a GPU machine (all
15 passed on an H200 on 2026-11-28, paramiko carried there as wheels).

GPU kernels are not deterministic in general (docs/guides/runtimes.md), so runs that are bit-identical
on CPU are compared here to a relative 1e-6: a node drawing from the wrong stream changes a
loss in the third digit.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import MLP, Clips, CrashesAt, Windows, regression_data, tiny_gpt, tiny_whisper

from meshtrain import FitResult, NodeFailed, Trainer, observers
from meshtrain.checkpoint import find_latest
from meshtrain.errors import SettingError
from meshtrain.strategies import STRATEGIES, DeMo, DiLoCo

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA GPU (benchmarks/gpu_check.sh runs these on one)")


def fit_on_cuda(tmp_path: Path, name: str, **settings: Any) -> FitResult:
    settings = {"nodes": 2, **settings}
    return Trainer(tiny_gpt(), Windows()).fit(DiLoCo(H=2, lr=3e-3), max_steps=8, batch_size=4,
                                             device="cuda", out_dir=tmp_path, run_id=name,
                                             progress=False, **settings)


def losses(result: FitResult) -> list[float]:
    return [row["train_loss"] for row in result.history]


def test_each_node_of_the_threads_runtime_draws_from_its_own_cuda_stream(tmp_path: Path) -> None:
    first, again = losses(fit_on_cuda(tmp_path, "first")), losses(fit_on_cuda(tmp_path, "again"))
    print("first", first, "\nagain", again)
    assert again == pytest.approx(first, rel=1e-6)  # not whichever node thread drew first
    # Node 0's stream is the one a process seeded for node 0 has.
    threads = losses(fit_on_cuda(tmp_path, "threads-1", nodes=1))
    processes = losses(fit_on_cuda(tmp_path, "processes-1", nodes=1, runtime="processes"))
    print("threads", threads, "\nprocesses", processes)
    assert processes == pytest.approx(threads, rel=1e-6)


def test_a_run_on_cuda_resumes_its_nodes_cuda_streams(tmp_path: Path) -> None:
    def fit(model: torch.nn.Module, out: Path, **settings: Any) -> FitResult:
        return Trainer(model, regression_data(96)).fit(DiLoCo(H=3, lr=0.01), nodes=3, max_steps=12,
                                                      batch_size=4, device="cuda", out_dir=out,
                                                      progress=False, **settings)

    reference = fit(CrashesAt(None), tmp_path / "ref")
    with pytest.raises(NodeFailed, match="interrupted at forward call 10"):
        fit(CrashesAt(10), tmp_path / "runs", checkpoint_every=4, run_id="r")
    assert find_latest(tmp_path / "runs" / "r.checkpoints").step == 6
    resumed = fit(CrashesAt(None), tmp_path / "runs", checkpoint_every=4,
                  resume=str(tmp_path / "runs" / "r.checkpoints"))
    print("reference", losses(reference), "\nresumed", losses(resumed))
    assert losses(resumed) == pytest.approx(losses(reference), rel=1e-6)


def test_whisper_with_lora_on_cuda_repeats_and_its_nodes_share_the_frozen_weights(tmp_path: Path) -> None:
    model = tiny_whisper()

    def fit(name: str) -> FitResult:
        return Trainer(model, Clips(), Clips(8)).fit(DiLoCo(H=2, lr=3e-3), nodes=2, max_steps=4,
                                                    batch_size=4, device="cuda", val_interval=2,
                                                    out_dir=tmp_path, run_id=name, progress=False)

    first = fit("first")
    # fit moved the model it was given to the GPU whole, as Hugging Face's Trainer does...
    assert {t.device.type for t in (*model.parameters(), *model.buffers())} == {"cuda"}
    # ...and the nodes' copies share its frozen weights there (under LoRA nearly all of them).
    frozen = {p.data_ptr() for p in model.parameters() if not p.requires_grad}
    assert frozen == {p.data_ptr() for p in first.model.parameters() if not p.requires_grad}
    again = fit("again")
    print("whisper first", losses(first), "\nagain", losses(again), "\nval", first.summary["final_val_loss"])
    assert losses(again) == pytest.approx(losses(first), rel=1e-6)
    assert first.summary["final_val_loss"] == pytest.approx(again.summary["final_val_loss"], rel=1e-6)


def test_bf16_and_fp16_on_cuda_stay_within_two_percent_of_fp32(tmp_path: Path) -> None:
    fp32 = losses(fit_on_cuda(tmp_path, "fp32"))
    bf16 = losses(fit_on_cuda(tmp_path, "bf16", precision="bf16"))
    fp16_run = fit_on_cuda(tmp_path, "fp16", precision="fp16")
    fp16 = losses(fp16_run)
    print("fp32", fp32, "\nbf16", bf16, "\nfp16", fp16, "skipped", fp16_run.summary["skipped_steps"])
    assert bf16 == pytest.approx(fp32, rel=0.02) and bf16 != fp32
    # fp16 scales the loss by 2^16 at first: these gradients stay finite, so no step is skipped.
    assert fp16_run.summary["skipped_steps"] == 0
    assert fp16 == pytest.approx(fp32, rel=0.02) and fp16 != fp32


def test_checkpointing_on_cuda_changes_no_result(tmp_path: Path) -> None:
    plain = losses(fit_on_cuda(tmp_path, "plain"))
    checkpointed = losses(fit_on_cuda(tmp_path, "checkpointed", gradient_checkpointing=True))
    print("plain", plain, "\ncheckpointed", checkpointed)
    # The recomputed forward is the same computation (dropout replays its CUDA stream).
    assert checkpointed == pytest.approx(plain, rel=1e-5)


def test_demo_on_the_gpt_model_on_cuda_matches_the_cpu(tmp_path: Path) -> None:
    """DeMo's DCT transforms live on the parameters' device (they were on the CPU once, and
    its first step on cuda stopped): on the gpt model, whose weights take every chunk shape
    (embeddings, attention and MLP matrices, biases), a run on CUDA sends the CPU's bytes and
    follows its losses (no dropout; top-k of near-equal values may pick apart, so 1e-3)."""
    from meshtrain.tasks.gpt import CharGPT

    def fit(device: str) -> FitResult:
        torch.manual_seed(0)
        model = CharGPT(40, block_size=32, layers=4, dim=64, dropout=0.0)
        return Trainer(model, Windows()).fit(DeMo(lr=3e-3), nodes=2, max_steps=8, batch_size=4,
                                             device=device, check_sync=True, out_dir=tmp_path,
                                             run_id=device, progress=False)

    on_cpu, on_cuda = fit("cpu"), fit("cuda")
    print("demo cpu", losses(on_cpu), "\ncuda", losses(on_cuda))
    assert on_cuda.summary["bytes_sent_per_node"] == on_cpu.summary["bytes_sent_per_node"]
    assert losses(on_cuda) == pytest.approx(losses(on_cpu), rel=1e-3)


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_every_strategy_on_cuda_sends_what_it_sends_on_the_cpu(name: str, tmp_path: Path) -> None:
    """Each built-in strategy trains on CUDA, its nodes stay in sync (``check_sync`` hashes the
    GPU's weights), and it sends the bytes it sends on the CPU: the byte count does not depend
    on the device. No dropout, so the losses match the CPU's to float error (SPARTA's picks
    and FedAvg's islands are drawn on the CPU either way)."""
    strategy = DeMo(compression_topk=4, compression_chunk=4) if name == "demo" else STRATEGIES[name]()

    def fit(device: str) -> FitResult:
        return Trainer(MLP(), regression_data(96)).fit(
            copy.deepcopy(strategy), nodes=3, max_steps=6, batch_size=4, device=device, check_sync=True,
            out_dir=tmp_path, run_id=device, progress=False)

    on_cpu, on_cuda = fit("cpu"), fit("cuda")
    print(name, "cpu", losses(on_cpu), "\ncuda", losses(on_cuda))
    assert on_cuda.summary["bytes_sent_per_node"] == on_cpu.summary["bytes_sent_per_node"]
    assert losses(on_cuda) == pytest.approx(losses(on_cpu), rel=1e-4)


class GpuMemory:
    """An observer that keeps the GPU memory each node reported."""

    def __init__(self) -> None:
        self.reported: dict[int, list[int]] = {}
        self.updates = 0

    def node_update(self, update: observers.NodeUpdate) -> None:
        self.updates += 1
        if update.gpu_bytes is not None:
            self.reported.setdefault(update.node, []).append(update.gpu_bytes)

    def __getattr__(self, name: str) -> Any:  # the observer calls it does not care about
        return lambda *args, **kwargs: None


def test_the_processes_runtime_wants_a_gpu_per_node_and_reports_gpu_memory(tmp_path: Path) -> None:
    gpus = torch.cuda.device_count()
    with pytest.raises(SettingError, match=f"runtime processes on cuda: each node process needs a GPU "
                                           f"of its own .* for {gpus + 1} nodes; use runtime threads"):
        fit_on_cuda(tmp_path, "too-many", nodes=gpus + 1, runtime="processes")
    assert not (tmp_path / "too-many").exists()  # refused before anything was written
    with observers.watching(GpuMemory()) as memory:  # type: ignore[arg-type]
        fit_on_cuda(tmp_path, "processes", nodes=1, runtime="processes")
    print("gpu bytes", memory.reported)
    # The node process reports the memory its torch holds on the GPU (the live view's column).
    assert sorted(memory.reported) == [0], f"{memory.updates} updates, none with GPU memory"
    assert min(memory.reported[0]) > 0


def test_the_compute_probe_times_the_gpus_steps() -> None:
    """``--strategy auto`` with ``--device cuda`` plans from the GPU's step time."""
    from meshtrain.planning import measure_step_times

    model = tiny_gpt()
    on_gpu = measure_step_times(model, Windows(), 32, device=torch.device("cuda"), min_steps=5, max_steps=5)
    assert {p.device.type for p in model.parameters()} == {"cuda"}
    on_cpu = measure_step_times(tiny_gpt(), Windows(), 32, min_steps=5, max_steps=5)
    print("probe seconds: cuda", on_gpu, "cpu", on_cpu)
    assert len(on_gpu) == 5 and all(t > 0 for t in on_gpu)


def test_hosts_bench_probes_the_gpu_on_a_cuda_host() -> None:
    """An inventory with ``device: cuda`` (or auto on a GPU box) times the GPU's steps."""
    from meshtrain.hosts.bench import ProbeSpec, probe_step_seconds

    median, _ = probe_step_seconds(ProbeSpec("digits", 16, 1, None, "cuda"))
    assert median > 0
