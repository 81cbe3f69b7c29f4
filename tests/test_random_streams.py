"""Every node has its own reproducible random stream, whether or not the model's randomness
is visible as an nn.Dropout module: two threads runs are identical, and equal to the
processes runtime."""

from __future__ import annotations

from helpers import FunctionalDropoutMLP, assert_states_equal, regression_data

from meshtrain import Trainer
from meshtrain.strategies import DiLoCo


def _fit(runtime: str, tmp_path, name: str):
    return Trainer(FunctionalDropoutMLP(), regression_data(96)).fit(
        DiLoCo(H=3, lr=0.01), nodes=3, max_steps=9, batch_size=4, runtime=runtime,
        out_dir=tmp_path / name, progress=False)


def test_functional_dropout_is_reproducible_in_every_runtime(tmp_path) -> None:
    first, second = _fit("threads", tmp_path, "a"), _fit("threads", tmp_path, "b")
    assert_states_equal(first.model, second.model)
    assert [r["train_loss"] for r in first.history] == [r["train_loss"] for r in second.history]
    assert_states_equal(first.model, _fit("processes", tmp_path, "c").model)
