"""The per-node memory figure of `benchmarks/runtimes.py --scale` (once quoted in the README)
counts what a simulated node owns: its parameters, gradients and strategy state."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import torch

from meshtrain.tasks.gpt import CharGPT

BENCHMARK = Path(__file__).resolve().parent.parent / "benchmarks" / "runtimes.py"


def _benchmark() -> ModuleType:
    spec = importlib.util.spec_from_file_location("runtimes_benchmark", BENCHMARK)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_node_state_is_parameters_gradients_and_optimizer_moments() -> None:
    bench = _benchmark()
    torch.manual_seed(0)
    model = CharGPT(65, 64, 2, 4, 128, 0.0)
    params = sum(p.numel() * p.element_size() for p in model.parameters())  # tied head counted once
    batch = (torch.randint(0, 65, (2, 64)), torch.randint(0, 65, (2, 64)))
    ddp = bench.node_state_bytes(model, "ddp", batch)
    diloco = bench.node_state_bytes(model, "diloco", batch)
    # DDP: parameters, gradients and AdamW's two moments, plus AdamW's per-tensor step
    # counters (a few bytes each). The model has no buffers (attention is causal by flag).
    assert 4 * params <= ddp <= 4 * params + 1024
    # DiLoCo adds the global parameters and the outer optimizer's momentum.
    assert 6 * params <= diloco <= 6 * params + 1024
