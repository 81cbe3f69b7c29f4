"""Comparison plots of finished runs: validation loss against steps, bytes and time.

Three figures, each saved as PNG and SVG, one line per run labelled by its strategy and
key parameters (``DiLoCo H=25``):

- ``val_loss_vs_steps``: what each strategy learns per step;
- ``val_loss_vs_bytes``: against bytes sent per node (log scale), the communication bill;
- ``val_loss_vs_time``: against the projected wall-clock on the run's cluster.
"""

from __future__ import annotations

from pathlib import Path

from meshtrain.progress import human_bytes
from meshtrain.runs import FinishedRun


def plot_runs(runs: list[FinishedRun], out_dir: str | Path, target_loss: float | None = None) -> list[Path]:
    """Draw the three comparison figures of ``runs`` into ``out_dir``; return the files written.

    ``target_loss``, if given, is drawn as a dotted horizontal line on every figure.
    """
    import matplotlib

    matplotlib.use("Agg")  # no display needed, and no window when run from a terminal
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    plain = FuncFormatter(lambda v, _: f"{v:g}")  # 0.2, not 2 x 10^-1
    # Between powers of ten, label only 2, 3 and 5 (x 10^k): every minor tick crowds the axis.
    sparse = FuncFormatter(lambda v, _: f"{v:g}" if f"{v:e}"[0] in "235" else "")
    in_bytes = FuncFormatter(lambda v, _: human_bytes(v).replace(".00", ""))

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    clusters = sorted({run.cluster for run in runs})
    axes_spec = {
        "val_loss_vs_steps": ("step", "validation loss against training steps", False),
        "val_loss_vs_bytes": ("bytes sent per node (log scale)",
                              "validation loss against communication", True),
        "val_loss_vs_time": (f"projected wall-clock on {', '.join(clusters)} (s)",
                             "validation loss against projected time", False),
    }
    written: list[Path] = []
    labels = _unique_labels(runs)
    for name, (xlabel, title, log_x) in axes_spec.items():
        fig, ax = plt.subplots(figsize=(8.5, 4.5))
        for run, label in zip(runs, labels, strict=True):
            xs, ys = _series(run, name)
            ax.plot(xs, ys, "o-", markersize=3, linewidth=1.6, label=label)
        if target_loss is not None:
            ax.axhline(target_loss, color="grey", linestyle=":", linewidth=1.2,
                       label=f"target {target_loss:.4g}")
        if log_x:
            ax.set_xscale("log")
            ax.xaxis.set_major_formatter(in_bytes)
        ax.set_yscale("log")  # losses fall over orders of magnitude; late differences stay visible
        ax.yaxis.set_major_formatter(plain)
        ax.yaxis.set_minor_formatter(sparse)
        ax.set(xlabel=xlabel, ylabel="validation loss (global model, log scale)", title=title)
        ax.grid(True, which="major", alpha=0.3)
        # Beside the axes, never over a curve (the bytes figure's curves fill every corner).
        ax.legend(title=f"{runs[0].summary.get('nodes', '?')} nodes" if _same_nodes(runs) else None,
                  loc="upper left", bbox_to_anchor=(1.02, 1), borderaxespad=0)
        fig.tight_layout()
        for suffix in ("png", "svg"):
            path = out / f"{name}.{suffix}"
            fig.savefig(path, format=suffix, dpi=120)
            written.append(path)
        plt.close(fig)
    return written


def _series(run: FinishedRun, name: str) -> tuple[list[float], list[float]]:
    """The x and y values of one run's validations for figure ``name``."""
    xs: list[float] = []
    ys: list[float] = []
    for row in run.validation():
        step = row.get("step") or 0.0
        if name == "val_loss_vs_steps":
            x = step
        elif name == "val_loss_vs_bytes":
            x = row.get("total_bytes_sent") or 0.0
            if x <= 0:
                continue  # nothing sent yet (step 0, or before DiLoCo's first sync): not on a log axis
        else:
            x = 0.0 if step == 0 else row.get("projected_seconds") or 0.0
        xs.append(float(x))
        ys.append(float(row["val_loss"]))  # type: ignore[arg-type]
    return xs, ys


def _unique_labels(runs: list[FinishedRun]) -> list[str]:
    """Legend labels; runs sharing a label get their folder name added to tell them apart."""
    labels = [run.label for run in runs]
    return [f"{label} ({run.path.name})" if labels.count(label) > 1 else label
            for run, label in zip(runs, labels, strict=True)]


def _same_nodes(runs: list[FinishedRun]) -> bool:
    return len({run.summary.get("nodes") for run in runs}) == 1
