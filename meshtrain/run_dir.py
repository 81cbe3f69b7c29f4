"""The run directory: config.yaml, metrics.csv, summary.json, the model and a plot.

Everything is written into a hidden ``.<run-id>.partial`` folder and renamed to
``<run-id>`` once complete, and every file inside is written atomically, so a run
that fails leaves nothing half-written behind.
"""

from __future__ import annotations

import csv
import io
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import yaml

METRIC_COLUMNS = [
    "step",
    "train_loss",
    "val_loss",
    "node_val_loss",
    "lr",
    "bytes_sent",
    "bytes_received",
    "total_bytes_sent",
    "total_bytes_received",
    "examples",
    "seconds",
]


def atomic_write(path: Path, write: Callable[[Path], None]) -> None:
    """Call ``write(tmp)`` on a temporary file beside ``path``, then rename it into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.close(fd)
    try:
        write(Path(tmp))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write(path, lambda tmp: tmp.write_text(text))


def new_run_id(strategy: str, nodes: int, out_dir: Path) -> str:
    """``YYYYmmdd-HHMMSS-<strategy>-<nodes>n``, with a suffix if that name is taken."""
    base = f"{time.strftime('%Y%m%d-%H%M%S')}-{strategy}-{nodes}n"
    run_id, n = base, 1
    while (out_dir / run_id).exists() or (out_dir / f".{run_id}.partial").exists():
        n += 1
        run_id = f"{base}-{n}"
    return run_id


class RunDirectory:
    """Writes one run's outputs; :meth:`commit` makes them visible all at once."""

    def __init__(self, out_dir: Path, run_id: str) -> None:
        self.final = out_dir / run_id
        if self.final.exists():
            raise FileExistsError(f"run directory {self.final} already exists")
        self.partial = out_dir / f".{run_id}.partial"
        shutil.rmtree(self.partial, ignore_errors=True)
        self.partial.mkdir(parents=True)

    def write_config(self, config: dict[str, Any]) -> None:
        atomic_write_text(self.partial / "config.yaml", yaml.safe_dump(config, sort_keys=False))

    def write_metrics(self, history: list[dict[str, Any]]) -> None:
        extra = sorted({k for row in history for k in row} - set(METRIC_COLUMNS))
        buf = io.StringIO()
        writer = csv.DictWriter(buf, fieldnames=METRIC_COLUMNS + extra, extrasaction="ignore")
        writer.writeheader()
        for row in history:
            writer.writerow({k: _csv_value(row.get(k), k) for k in METRIC_COLUMNS + extra})
        atomic_write_text(self.partial / "metrics.csv", buf.getvalue())

    def write_summary(self, summary: dict[str, Any]) -> None:
        atomic_write_text(self.partial / "summary.json", json.dumps(summary, indent=2) + "\n")

    def write_model(self, model: torch.nn.Module) -> None:
        """``save_pretrained`` models (Hugging Face) save a folder; others a state dict."""
        if hasattr(model, "save_pretrained"):
            target = self.partial / "model"
            model.save_pretrained(str(target))
        else:
            atomic_write(self.partial / "model.pt", lambda tmp: torch.save(model.state_dict(), tmp))

    def write_plot(self, history: list[dict[str, Any]], title: str) -> None:
        """loss.png: training and validation loss against steps and against bytes sent."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        steps = [r["step"] for r in history]
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
        ax1.plot(steps, [r["train_loss"] for r in history], label="train (mean of nodes)")
        ax2.plot([r["total_bytes_sent"] / 1e6 for r in history], [r["train_loss"] for r in history])
        val = [(r["step"], r["total_bytes_sent"] / 1e6, r["val_loss"]) for r in history
               if r.get("val_loss") is not None]
        if val:
            ax1.plot([v[0] for v in val], [v[2] for v in val], "o-", label="val (global model)")
            ax2.plot([v[1] for v in val], [v[2] for v in val], "o-")
        ax1.set(xlabel="step", ylabel="loss", title=title)
        ax2.set(xlabel="MB sent per node", ylabel="loss", title="loss against communication")
        ax1.legend()
        fig.tight_layout()
        atomic_write(self.partial / "loss.png", lambda tmp: fig.savefig(tmp, format="png", dpi=100))
        plt.close(fig)

    def commit(self) -> Path:
        os.replace(self.partial, self.final)
        return self.final

    def discard(self) -> None:
        shutil.rmtree(self.partial, ignore_errors=True)


def _csv_value(v: Any, column: str = "") -> Any:
    """Losses and rates to 6 significant digits; byte counts exactly (never 1.23457e+09)."""
    if v is None:
        return ""
    if isinstance(v, float):
        if "bytes" in column:
            return int(v) if v.is_integer() else repr(v)
        return f"{v:.6g}"
    return v
