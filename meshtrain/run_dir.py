"""The run directory: config.yaml, metrics.csv, summary.json, the model and a plot.

Everything is written into a hidden ``.<run-id>.partial`` folder and renamed to
``<run-id>`` once complete, and every file inside is written atomically, so a run
that fails leaves nothing half-written behind.
"""

from __future__ import annotations

import csv
import fcntl
import io
import json
import math
import os
import secrets
import shutil
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

if TYPE_CHECKING:  # only a run's end saves a model; the commands that read runs need no torch
    import torch

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


def atomic_write(path: Path, write: Callable[[Path], object]) -> None:
    """Call ``write(tmp)`` on a temporary file beside ``path``, then rename it into place.

    The file gets the mode the user's umask gives (0644 under the usual 022), like every
    other file of a run; ``mkstemp`` would make it 0600 whatever the umask says."""
    path.parent.mkdir(parents=True, exist_ok=True)
    while True:
        tmp = path.parent / f".{path.name}.{secrets.token_hex(4)}"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
            break
        except FileExistsError:
            continue
    os.close(fd)
    try:
        write(Path(tmp))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write(path, lambda tmp: tmp.write_text(text))


def new_run_id(strategy: str, nodes: int) -> str:
    """``YYYYmmdd-HHMMSS-<strategy>-<nodes>n``: :meth:`RunDirectory.reserve` makes it unique."""
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{strategy}-{nodes}n"


class RunDirectory:
    """Writes one run's outputs; :meth:`commit` makes them visible all at once.

    :meth:`reserve` claims the name before training starts (the hidden
    ``.<run-id>.partial`` folder, made and then locked), so two runs started in the same
    second get different ids and an unwritable ``--out`` is reported before the first step.
    The claim is an exclusive ``flock`` on that folder, held open for the run's life: the
    kernel drops it with the process, however it ends (SIGKILL, the OOM killer, a power
    cut), so the folder of a dead run is a stale claim that the next run of its id takes over.
    """

    def __init__(self, out_dir: Path, run_id: str) -> None:
        self.out_dir = out_dir
        self.run_id = run_id
        self.final = out_dir / run_id
        self.partial = out_dir / f".{run_id}.partial"
        self._claim: int | None = None  # the locked folder's descriptor while the run holds it

    @classmethod
    def reserve(cls, out_dir: Path, run_id: str | None, strategy: str, nodes: int) -> RunDirectory:
        """Claim ``run_id`` (or a fresh id) under ``out_dir``.

        Raises ``FileExistsError`` for a taken ``run_id`` and ``ValueError`` for an output
        folder that cannot be written.
        """
        try:
            out_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ValueError(f"output folder {out_dir}: cannot create it ({exc.strerror})") from None
        if not os.access(out_dir, os.W_OK | os.X_OK) or not out_dir.is_dir():
            raise ValueError(f"output folder {out_dir}: not a writable folder")
        base = run_id or new_run_id(strategy, nodes)
        for n in range(1, 1000):
            candidate = base if n == 1 else f"{base}-{n}"
            run = cls(out_dir, candidate)
            if run.final.exists():
                if run_id is not None:
                    raise FileExistsError(f"run directory {run.final} already exists; "
                                          "pick another --run-id")
                continue
            if run._claim_folder():
                return run
            if run_id is not None:
                raise FileExistsError(f"run id {run_id!r} is in use by a run still going in {out_dir}")
        raise ValueError(f"output folder {out_dir}: no free run id starting {base!r}")

    def _claim_folder(self) -> bool:
        """Make and lock the hidden folder, or take over one no live process holds (its
        half-written files are cleared); False if a run still going holds it."""
        try:
            self.partial.mkdir()
        except FileExistsError:
            pass
        try:
            fd = os.open(self.partial, os.O_RDONLY | os.O_DIRECTORY)
        except (FileNotFoundError, NotADirectoryError):
            return False  # committed or discarded meanwhile, or not a folder: not ours to take
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        self._claim = fd
        for stale in self.partial.iterdir():  # a dead run's leftovers (none in a new folder)
            if stale.is_dir() and not stale.is_symlink():
                shutil.rmtree(stale, ignore_errors=True)
            else:
                stale.unlink(missing_ok=True)
        return True

    def release(self) -> None:
        """Drop the claim (the run has committed, discarded or kept its folder)."""
        if self._claim is not None:
            os.close(self._claim)
            self._claim = None

    def __getstate__(self) -> dict[str, Any]:
        # The claim is a descriptor of this process: a node process that receives a copy
        # (processes runtime) must not close its own descriptor of that number (a socket
        # of its process group, say). The process that reserved the name releases it.
        return {**self.__dict__, "_claim": None}

    def write_config(self, config: dict[str, Any]) -> None:
        atomic_write_text(self.partial / "config.yaml", yaml.safe_dump(config, sort_keys=False))

    def write_metrics(self, history: list[dict[str, Any]], initial: dict[str, Any] | None = None) -> None:
        """metrics.csv: one row per step, after a step-0 row holding the evaluation before
        training (when there is validation data)."""
        if initial:
            history = [{"step": 0, "node_val_loss": initial.get("val_loss"), **initial}, *history]
        extra = sorted({k for row in history for k in row} - set(METRIC_COLUMNS))
        buf = io.StringIO()
        writer = csv.DictWriter(buf, fieldnames=METRIC_COLUMNS + extra, extrasaction="ignore")
        writer.writeheader()
        for row in history:
            writer.writerow({k: _csv_value(row.get(k), k) for k in METRIC_COLUMNS + extra})
        atomic_write_text(self.partial / "metrics.csv", buf.getvalue())

    def write_log(self, lines: list[str]) -> None:
        """log.txt: what the run printed (the command, progress lines; the CLI adds its table)."""
        atomic_write_text(self.partial / "log.txt", "".join(f"{line}\n" for line in lines))

    def write_summary(self, summary: dict[str, Any]) -> None:
        """summary.json, strict JSON: a non-finite number is written as null."""
        text = json.dumps(_finite_or_none(summary), indent=2, allow_nan=False)
        atomic_write_text(self.partial / "summary.json", text + "\n")

    def write_model(self, model: torch.nn.Module) -> None:
        """``save_pretrained`` models (Hugging Face) save a folder; others a state dict."""
        save_pretrained = getattr(model, "save_pretrained", None)
        if callable(save_pretrained):
            save_pretrained(str(self.partial / "model"))
        else:
            import torch

            atomic_write(self.partial / "model.pt", lambda tmp: torch.save(model.state_dict(), tmp))

    def write_plot(self, history: list[dict[str, Any]], title: str,
                   initial: dict[str, Any] | None = None) -> None:
        """loss.png: training and validation loss against steps and against bytes sent."""
        # A Figure of its own, not pyplot's: no global state shared with other threads (rank 0
        # may be one of many node threads) and nothing to close; Figure.savefig renders with Agg.
        from matplotlib.figure import Figure

        steps = [r["step"] for r in history]
        fig = Figure(figsize=(10, 4))
        ax1, ax2 = fig.subplots(1, 2)
        ax1.plot(steps, [r["train_loss"] for r in history], label="train (mean of nodes)")
        ax2.plot([r["total_bytes_sent"] / 1e6 for r in history], [r["train_loss"] for r in history])
        val = [(r["step"], r["total_bytes_sent"] / 1e6, r["val_loss"]) for r in history
               if r.get("val_loss") is not None]
        if initial and initial.get("val_loss") is not None:
            val.insert(0, (0, 0.0, initial["val_loss"]))
        if val:
            ax1.plot([v[0] for v in val], [v[2] for v in val], "o-", label="val (global model)")
            ax2.plot([v[1] for v in val], [v[2] for v in val], "o-")
        ax1.set(xlabel="step", ylabel="loss")
        ax2.set(xlabel="MB sent per node", ylabel="loss")
        for ax in (ax1, ax2):
            # At most 6 intervals per axis (matplotlib picks up to 9 here): every tick is a few
            # artists and a text layout; a quarter of the figure's ~100 ms went to them.
            ax.locator_params(nbins=6)
        # A fixed title height: placing it automatically measures every tick label again.
        ax1.set_title(title, y=1.01)
        ax2.set_title("loss against communication", y=1.01)
        ax1.legend()
        # Fixed margins: tight_layout measures every tick label, ~40 ms of a short run's fit.
        fig.subplots_adjust(left=0.08, right=0.98, bottom=0.13, top=0.91, wspace=0.25)
        atomic_write(self.partial / "loss.png", lambda tmp: fig.savefig(tmp, format="png", dpi=100))

    def commit(self) -> Path:
        os.replace(self.partial, self.final)
        self.release()
        return self.final

    def discard(self) -> None:
        shutil.rmtree(self.partial, ignore_errors=True)
        self.release()

    def keep_incomplete(self) -> Path:
        """Writing failed part-way (a full disk): keep what was written, visibly marked."""
        target = self.out_dir / f"{self.run_id}.incomplete"
        os.replace(self.partial, target)
        self.release()
        return target

    @property
    def error_log(self) -> Path:
        return self.out_dir / f"{self.run_id}.error.log"

    def write_error_log(self, error: BaseException) -> None:
        """``<out>/<run-id>.error.log``: the error and every traceback known (best effort)."""
        text = f"{type(error).__name__}: {error}\n\n"
        node_traceback = getattr(error, "traceback", None)
        if node_traceback:
            text += f"traceback of the failing node:\n{node_traceback}\n"
        text += "traceback here:\n" + "".join(
            traceback.format_exception(type(error), error, error.__traceback__))
        try:
            atomic_write_text(self.error_log, text)
        except OSError:
            pass  # the error itself is still raised; a full disk must not hide it


def _finite_or_none(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite_or_none(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite_or_none(v) for v in value]
    return value


def _csv_value(v: Any, column: str = "") -> Any:
    """Losses and rates to 6 significant digits; byte counts exactly (never 1.23457e+09)."""
    if v is None:
        return ""
    if isinstance(v, float):
        if "bytes" in column:
            return int(v) if v.is_integer() else repr(v)
        return f"{v:.6g}"
    return v
