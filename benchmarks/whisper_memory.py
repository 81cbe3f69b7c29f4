"""Peak memory of Whisper + LoRA on N simulated nodes, against a plain transformers + peft loop.

Each row runs in a fresh process and reports that process's peak resident memory
(``ru_maxrss``): model, activations, optimizer state and torch itself. The model is
whisper-tiny's architecture (39 M parameters; 3000 input frames = 30 s) with random
weights (no hub here), LoRA r=8 on q_proj/v_proj, DiLoCo, batch 8 per node, a few steps
in the threads runtime. "unshared" gives every node its own copy of the frozen base
weights, as meshtrain did before nodes shared them. "glibc's arenas" runs meshtrain with
``MALLOC_ARENA_MAX`` at glibc's own default (8 per core) instead of the one arena
meshtrain sets (meshtrain/allocator.py), as it ran before: every node thread then kept
the memory it freed.

    python benchmarks/whisper_memory.py                   # whisper-tiny, 1, 2, 4 nodes
    python benchmarks/whisper_memory.py --size test --nodes 2,4  # the tests' tiny Whisper (3 s)
    python benchmarks/whisper_memory.py --size base --batch 4 --microbatch 2
    python benchmarks/whisper_memory.py --savers --nodes 2  # checkpointing, bf16, both
    python benchmarks/whisper_memory.py --device cuda      # on a GPU: peak GPU memory too

``--savers`` measures meshtrain alone, with and without gradient checkpointing and bf16
autocast (the ``gradient_checkpointing`` and ``precision`` settings), at each ``--nodes``.
``--device cuda`` trains on the GPU and adds its peak (``torch.cuda.max_memory_allocated``:
what torch's tensors held at most, the allocator's cache aside).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

SIZES = {  # d_model, layers (encoder = decoder), heads, ffn: the hub checkpoints' configs
    "test": (64, 2, 4, 256),  # meshtrain.hf.tiny's (it hears 3 s: 300 frames)
    "tiny": (384, 4, 6, 1536),
    "base": (512, 6, 8, 2048),
    "small": (768, 12, 12, 3072),
}


def build(size: str, seed: int = 0):  # noqa: ANN201 - returns an HFModel
    from transformers import WhisperConfig

    from meshtrain.hf import HFModel, LoRA

    d, layers, heads, ffn = SIZES[size]
    config = WhisperConfig(d_model=d, encoder_layers=layers, decoder_layers=layers,
                           encoder_attention_heads=heads, decoder_attention_heads=heads,
                           encoder_ffn_dim=ffn, decoder_ffn_dim=ffn, num_mel_bins=80,
                           max_source_positions=frames(size) // 2, max_target_positions=448,
                           vocab_size=51865)
    lora = LoRA(r=8, alpha=32, dropout=0.1, target_modules=["q_proj", "v_proj"])
    return HFModel.from_config(config, lora=lora, seed=seed)


def frames(size: str) -> int:
    """Input frames the encoder takes: 30 s, or 3 s for the tests' tiny model."""
    return 300 if size == "test" else 3000


def data(samples: int, size: str):  # noqa: ANN201 - a TensorDataset-like Dataset of dicts
    import torch
    from torch.utils.data import Dataset

    g = torch.Generator().manual_seed(0)
    features = torch.randn(samples, 80, frames(size), generator=g)
    labels = torch.randint(0, 51000, (samples, 24), generator=g)

    class Clips(Dataset):
        def __len__(self) -> int:
            return samples

        def __getitem__(self, i: int) -> dict:
            return {"input_features": features[i], "labels": labels[i]}

    return Clips()


def run_one(mode: str, nodes: int, size: str, batch: int, microbatch: int | None, steps: int,
            precision: str = "fp32", checkpointing: bool = False, device: str = "cpu") -> dict:
    import torch

    torch.set_num_threads(1)
    model = build(size)
    started = time.perf_counter()
    if mode == "plain":  # one replica: the floor a Mac owner compares against
        assert precision == "fp32" and not checkpointing, "--savers measures meshtrain only"
        model.to(device)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
        samples = data(batch * steps, size)
        for s in range(steps):
            chunk = [samples[i] for i in range(s * batch, (s + 1) * batch)]
            out = model.model(input_features=torch.stack([c["input_features"] for c in chunk]).to(device),
                              labels=torch.stack([c["labels"] for c in chunk]).to(device))
            out.loss.backward()
            opt.step()
            opt.zero_grad()
    else:
        import meshtrain.engine.loop
        from meshtrain import Trainer
        from meshtrain.strategies import DiLoCo

        if mode == "unshared":  # every node copies the whole model
            meshtrain.engine.loop.node_replica = lambda m, on=None: copy.deepcopy(m).to(on or "cpu")
        with tempfile.TemporaryDirectory() as out:
            Trainer(model, data(batch * steps * nodes, size)).fit(
                DiLoCo(H=2), nodes=nodes, max_steps=steps, batch_size=batch, microbatch_size=microbatch,
                progress=False, out_dir=out, threads=1, precision=precision,
                gradient_checkpointing=checkpointing, device=device)
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    gpu = torch.cuda.max_memory_allocated() / 1e9 if device == "cuda" else None
    return {"peak_gb": peak_kib * 1024 / 1e9, "gpu_gb": gpu, "seconds": time.perf_counter() - started}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=SIZES, default="tiny")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--microbatch", type=int, default=None)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--nodes", default="1,2,4")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--savers", action="store_true",
                        help="meshtrain with gradient checkpointing and/or bf16 against fp32")
    parser.add_argument("--one", nargs=4, metavar=("MODE", "NODES", "PRECISION", "CHECKPOINTING"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        mode, nodes, precision, checkpointing = args.one
        print(json.dumps(run_one(mode, int(nodes), args.size, args.batch, args.microbatch, args.steps,
                                 precision, checkpointing == "1", args.device)))
        return
    from rich.console import Console
    from rich.table import Table

    from meshtrain.tables import print_fitted

    console = Console()
    if args.savers:
        rows = [(m, int(n)) for n in args.nodes.split(",")
                for m in ("meshtrain", "checkpointing", "bf16", "checkpointing+bf16")]
    else:
        rows = [("plain", 1)] + [(m, int(n)) for n in args.nodes.split(",")
                                 for m in ("meshtrain", "arenas", "unshared")]
    micro = f" (microbatch {args.microbatch})" if args.microbatch else ""
    gpu = args.device == "cuda"
    table = Table(title=f"whisper-{args.size} + LoRA r=8, batch {args.batch}{micro}, on {args.device}: "
                        f"peak resident memory{' and peak GPU memory' if gpu else ''}")
    columns = ["run", "nodes", "peak GB", "per extra node GB"]
    columns += ["peak GPU GB", "per extra node GPU GB"] if gpu else []
    for column in (*columns, "seconds"):
        table.add_column(column, justify="left" if column == "run" else "right")
    first: dict[str, float] = {}
    first_gpu: dict[str, float] = {}
    for mode, nodes in rows:
        console.print(f"measuring {mode} with {nodes} node(s) ...", style="dim")
        precision = "bf16" if "bf16" in mode else "fp32"
        checkpointing = "1" if "checkpointing" in mode else "0"
        runs_as = "meshtrain" if mode in ("checkpointing", "bf16", "checkpointing+bf16", "arenas") else mode
        # meshtrain keeps a MALLOC_ARENA_MAX it is given: glibc's default (8 per core) is "before".
        env = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"}
        if mode == "arenas":
            env["MALLOC_ARENA_MAX"] = str(8 * (os.cpu_count() or 1))
        command = [sys.executable, __file__, "--size", args.size, "--batch", str(args.batch),
                   "--steps", str(args.steps), "--device", args.device,
                   "--one", runs_as, str(nodes), precision, checkpointing]
        if args.microbatch:
            command += ["--microbatch", str(args.microbatch)]
        result = json.loads(subprocess.run(command, check=True, capture_output=True, text=True,
                                           env=env).stdout
                            .strip().splitlines()[-1])
        first.setdefault(mode, result["peak_gb"]) if nodes == 1 else None
        extra = (result["peak_gb"] - first[mode]) / (nodes - 1) if nodes > 1 and mode in first else None
        if gpu:
            first_gpu.setdefault(mode, result["gpu_gb"]) if nodes == 1 else None
            extra_gpu = (result["gpu_gb"] - first_gpu[mode]) / (nodes - 1) \
                if nodes > 1 and mode in first_gpu else None
        label = {"plain": "plain transformers + peft", "meshtrain": "meshtrain (frozen base shared)",
                 "unshared": "meshtrain, base copied per node",
                 "arenas": "meshtrain, glibc's arenas (before)",
                 "checkpointing": "meshtrain, gradient_checkpointing: true",
                 "bf16": "meshtrain, precision: bf16",
                 "checkpointing+bf16": "meshtrain, both"}[mode]
        cells = [label, str(nodes), f"{result['peak_gb']:.2f}", "" if extra is None else f"{extra:.2f}"]
        if gpu:
            cells += [f"{result['gpu_gb']:.2f}", "" if extra_gpu is None else f"{extra_gpu:.2f}"]
        table.add_row(*cells, f"{result['seconds']:.0f}")
    print_fitted(table)


if __name__ == "__main__":
    main()
