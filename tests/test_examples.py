"""The shipped examples work as documented."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import TensorDataset

from meshtrain import Trainer
from meshtrain.strategies import DDP

ROOT = Path(__file__).resolve().parent.parent


def load_example(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Linear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 4)

    def forward(self, batch):
        x, y = batch
        return nn.functional.cross_entropy(self.fc(x), y)


def test_int8_custom_strategy_matches_ddp_within_quantisation(tmp_path: Path) -> None:
    Int8DDP = load_example("custom_strategy").Int8DDP
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(256, 16, generator=g), torch.randint(0, 4, (256,), generator=g))
    torch.manual_seed(0)
    model = Linear()
    kwargs = dict(nodes=4, max_steps=1, batch_size=8, shuffle=False, out_dir=tmp_path, progress=False)
    quant = Trainer(model, data).fit(strategy=Int8DDP(optim="sgd", lr=1.0), **kwargs)
    exact = Trainer(model, data).fit(strategy=DDP(optim="sgd", lr=1.0), **kwargs)
    # One SGD step with lr 1 moves weights by the averaged gradient: error <= scale/127/2 per value.
    for q, e in zip(quant.model.parameters(), exact.model.parameters(), strict=True):
        diff = (q - e).abs().max().item()
        assert 0 < diff < 0.01
    # Bytes per node (mean over the 4): the max all-reduce of the scale and one has-gradient
    # flag per tensor (3 floats) costs 2*(3/4)*4*3 = 18 bytes, the int8 all-gather of 68
    # values (n-1)*68 = 204 bytes. DDP's bucket holds the 68 gradients plus 2 flags.
    numel = sum(p.numel() for p in model.parameters())
    assert numel == 68
    assert quant.summary["bytes_sent_per_node"] == 18 + 3 * numel
    assert exact.summary["bytes_sent_per_node"] == 2 * 3 / 4 * 4 * (numel + 2)


def test_the_python_api_pages_example_runs_as_written(tmp_path: Path, monkeypatch) -> None:
    """The first code a reader of the Python API page's "In Python" copies: whole, and it trains."""
    page = (ROOT / "docs" / "reference" / "python-api.md").read_text()
    section = page[page.index("## In Python"):]
    snippet = re.search(r"```python\n(.*?)```", section, re.S).group(1)  # type: ignore[union-attr]
    monkeypatch.chdir(tmp_path)
    scope: dict[str, object] = {"__name__": "__readme__"}
    exec(compile(snippet, "docs/reference/python-api.md: In Python", "exec"), scope)
    result = scope["result"]
    losses = [row["train_loss"] for row in result.history]
    assert len(losses) == 200 and result.history[-1]["total_bytes_sent"] > 0
    assert sum(losses[-20:]) / 20 < 0.7 * sum(losses[:20]) / 20, (losses[:3], losses[-3:])
    assert (tmp_path / result.run_dir / "metrics.csv").is_file()
