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


def test_a_nodes_stream_state_is_what_manual_seed_gives_and_restores_from_old_checkpoints() -> None:
    import torch

    from meshtrain import seeding

    cpu = torch.device("cpu")
    torch.manual_seed(41)
    assert torch.equal(seeding.seeded_state(41, cpu)["cpu"], seeding.current_state(cpu)["cpu"])
    saved = seeding.current_state(cpu)
    expected = torch.rand(3)
    seeding.restore_state(saved, cpu)
    assert torch.equal(torch.rand(3), expected)
    seeding.restore_state(saved["cpu"], cpu)  # a checkpoint written before the GPU's part was kept
    assert torch.equal(torch.rand(3), expected)


def test_the_processes_runtime_on_cuda_is_refused_without_a_gpu_per_node(tmp_path) -> None:
    """nccl refuses two ranks on one GPU: one line before training, naming what to use."""
    import pytest
    import torch

    from meshtrain.devices import check_gpus_for_processes
    from meshtrain.errors import SettingError

    gpus = torch.cuda.device_count()
    with pytest.raises(SettingError) as refused:
        check_gpus_for_processes("processes", gpus + 1, torch.device("cuda"))
    assert str(refused.value) == (
        f"runtime processes on cuda: each node process needs a GPU of its own (nccl cannot put two "
        f"on one), and torch sees {gpus} GPU{'s' if gpus != 1 else ''} here for {gpus + 1} nodes; "
        "use runtime threads or vmap (their nodes share a GPU)")
    with pytest.raises(SettingError, match="puts node N on GPU N: give device cuda, not cuda:1"):
        check_gpus_for_processes("processes", 1, torch.device("cuda:1"))
    check_gpus_for_processes("threads", gpus + 1, torch.device("cuda"))  # threads share a GPU
