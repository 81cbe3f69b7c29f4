"""Handwritten digits (scikit-learn's load_digits): real data that ships with a dependency.

1797 grey 8x8 images of the digits 0-9. A fixed seeded split keeps 297 for validation.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import TensorDataset

from meshtrain.tasks import Task, TaskBundle, TaskError, TaskOptions, require_positive

VAL_SAMPLES = 297


class DigitsMLP(nn.Module):
    """64 -> hidden -> 10, returning the cross-entropy of a (pixels, labels) batch."""

    def __init__(self, hidden: int = 128) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, 10))

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def forward(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.logits(x), y)

    @torch.no_grad()
    def validation_metrics(self, batches: list[Any]) -> dict[str, float]:
        """Classification accuracy over the validation batches."""
        correct = total = 0
        for x, y in batches:
            correct += int((self.logits(x).argmax(dim=1) == y).sum())
            total += len(y)
        return {"accuracy": correct / max(1, total)}


class DigitsCNN(DigitsMLP):
    """Two small convolutions, then a linear classifier."""

    def __init__(self, hidden: int = 32) -> None:
        nn.Module.__init__(self)
        self.net = nn.Sequential(
            nn.Unflatten(1, (1, 8, 8)),
            nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(),
            nn.Conv2d(16, hidden, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Linear(hidden * 16, 10),
        )


def load_digits_split(seed: int = 0) -> tuple[TensorDataset, TensorDataset]:
    """(train, val) tensors: pixels scaled to [0, 1], split by a fixed seeded permutation."""
    pixels, labels = digits_arrays()
    x = torch.tensor(pixels, dtype=torch.float32) / 16.0
    y = torch.tensor(labels, dtype=torch.long)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(1234 + seed))
    val, train = order[:VAL_SAMPLES], order[VAL_SAMPLES:]
    return TensorDataset(x[train], y[train]), TensorDataset(x[val], y[val])


def digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """The pixels (1797 x 64, 0-16) and labels of ``sklearn.datasets.load_digits``, read
    from the data file scikit-learn ships, without importing it: ``import sklearn`` (scipy
    with it) costs 1.6 s of CPU, more than a default ``meshtrain simulate`` spends training.
    A layout this does not know falls back to ``load_digits`` itself."""
    spec = importlib.util.find_spec("sklearn")  # finds the package without running it
    folders = spec.submodule_search_locations if spec is not None else None
    for folder in folders or []:
        data_file = Path(folder) / "datasets" / "data" / "digits.csv.gz"
        if data_file.is_file():
            table = np.loadtxt(data_file, delimiter=",")  # 64 pixels, then the label, per row
            return table[:, :-1], table[:, -1].astype(np.int64)
    from sklearn.datasets import load_digits

    digits = load_digits()
    return digits.data, digits.target


def build(opts: TaskOptions) -> TaskBundle:
    arch, hidden = opts.options["arch"], opts.options["hidden"]
    if arch not in ("mlp", "cnn"):
        raise TaskError(f"task 'digits': option arch must be 'mlp' or 'cnn', got {arch!r}")
    require_positive("digits", opts.options, "hidden")
    train, val = load_digits_split()
    torch.manual_seed(opts.seed)  # the same initial weights for the same seed
    model = DigitsMLP(hidden) if arch == "mlp" else DigitsCNN(hidden)
    return TaskBundle(model=model, train_data=train, val_data=val)


TASK = Task(
    name="digits",
    description="scikit-learn's 8x8 handwritten digits (1797 images), MLP or CNN",
    build=build,
    defaults={"steps": 300, "batch_size": 32, "val_interval": 50},
    strategy_defaults={
        "diloco": {"H": 25, "lr": 2e-3},
        "sparta-diloco": {"H": 25, "lr": 2e-3},
        "streaming-diloco": {"H": 25, "lr": 2e-3},
        "async-diloco": {"H": 25, "lr": 2e-3},
        "sparseloco": {"H": 25, "lr": 2e-3},  # DiLoCo's inner loop: the same H and inner lr
        "fedavg": {"lr": 0.1},
    },
    options={"arch": "mlp", "hidden": 128},
    takes_data=False,
)
