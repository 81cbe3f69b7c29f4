"""An 8 GB Mac: gradient checkpointing and mixed precision keep fewer bytes for the
backward pass, and change the results only within the stated tolerances.

What runs here (CPU): gradient checkpointing of Hugging Face Whisper (LoRA) and of the gpt
task's model; bf16 autocast; fp16 refused on cpu. fp16 and bf16 on CUDA or MPS are not
run here (no such device): their code path is torch's autocast with the device's type.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import Clips, Windows, tiny_gpt, tiny_whisper
from in_process import meshtrain_here

from meshtrain import Trainer
from meshtrain.engine.memory import LossScaler, autocast
from meshtrain.errors import SettingError
from meshtrain.hf import HFModel
from meshtrain.strategies import DiLoCo
from meshtrain.tasks.gpt import CharGPT


def saved_bytes(model: torch.nn.Module, batch: Any, precision: str = "fp32") -> int:
    """Bytes of activations the autograd graph keeps for the backward pass after one
    forward (tensors sharing a parameter's storage are not counted: they cost nothing)."""
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    model.train()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
            autocast(precision, torch.device("cpu")):
        loss = model(batch)
    loss.backward()
    return sum(seen.values())


def train(model: torch.nn.Module, data: torch.utils.data.Dataset, tmp_path: Path, name: str,
          **settings: Any) -> list[float]:
    result = Trainer(model, data).fit(DiLoCo(H=2, lr=3e-3), nodes=2, max_steps=4, batch_size=4,
                                      out_dir=tmp_path, run_id=name, progress=False, **settings)
    return [row["train_loss"] for row in result.history]


def whisper_batch() -> dict[str, torch.Tensor]:
    clips = Clips(4)
    return {"input_features": clips.features, "labels": clips.labels}


@pytest.mark.parametrize("build, batch", [
    (tiny_whisper, whisper_batch),
    (lambda: tiny_gpt(), lambda: (Windows(4).ids[:, :-1], Windows(4).ids[:, 1:])),
], ids=["whisper-lora", "gpt"])
def test_checkpointing_keeps_fewer_activations_and_changes_no_result(
        build: Callable[[], torch.nn.Module], batch: Callable[[], Any], tmp_path: Path) -> None:
    plain, checkpointed = build(), build()
    checkpointed.gradient_checkpointing_enable()
    kept, kept_checkpointed = saved_bytes(plain, batch()), saved_bytes(checkpointed, batch())
    assert kept_checkpointed < 0.5 * kept, (kept, kept_checkpointed)
    # The recomputed forward is the same computation (dropout replays its random stream):
    # gradients and so the whole run agree to float rounding.
    data = Clips() if isinstance(plain, HFModel) else Windows()
    losses = train(build(), data, tmp_path, "plain")
    losses_checkpointed = train(build(), data, tmp_path, "checkpointed", gradient_checkpointing=True)
    assert losses_checkpointed == pytest.approx(losses, rel=1e-5)


class _Messages(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_checkpointed_whisper_trains_without_transformers_use_cache_warning(tmp_path: Path) -> None:
    """A checkpointed model keeps no cache. Passing ``use_cache=False`` to the model's forward
    no longer reached Whisper's encoder (transformers 5 fills it from the config there), so
    every run printed transformers' "use_cache=True is incompatible with gradient
    checkpointing" once a process; the config now says so."""
    model = tiny_whisper()  # imports transformers, which gives Logger its warning_once
    logging.Logger.warning_once.cache_clear()  # type: ignore[attr-defined] - its memory of warnings given
    caught = _Messages()
    logging.getLogger("transformers").addHandler(caught)
    try:
        train(model, Clips(), tmp_path, "checkpointed", gradient_checkpointing=True)
    finally:
        logging.getLogger("transformers").removeHandler(caught)
    assert not [m for m in caught.messages if "use_cache" in m], caught.messages
    # generate() still decodes from its cache (generation_config's setting): one new token a step.
    checkpointed = tiny_whisper()
    checkpointed.gradient_checkpointing_enable()
    assert checkpointed.base.config.use_cache is False
    decoder = checkpointed.base.model.decoder
    lengths: list[int] = []
    decode = decoder.forward

    def recording(*args: Any, **kwargs: Any) -> Any:
        lengths.append(kwargs["input_ids"].shape[-1])
        return decode(*args, **kwargs)

    decoder.forward = recording
    checkpointed.eval()
    with torch.no_grad():
        checkpointed.base.generate(input_features=Clips(1).features, max_new_tokens=4, min_new_tokens=4)
    assert lengths == [1, 1, 1, 1], lengths


def test_bf16_autocast_on_cpu_keeps_fewer_bytes_and_stays_within_two_percent(tmp_path: Path) -> None:
    model = tiny_whisper()
    assert saved_bytes(model, whisper_batch(), "bf16") < 0.75 * saved_bytes(model, whisper_batch())
    losses = train(tiny_whisper(), Clips(), tmp_path, "fp32")
    losses_bf16 = train(tiny_whisper(), Clips(), tmp_path, "bf16", precision="bf16")
    # bf16 keeps 8 bits of mantissa: the losses of a short run differ by well under 2%.
    assert losses_bf16 == pytest.approx(losses, rel=0.02)
    assert losses_bf16 != losses  # it did run in bf16


def test_fp16_on_cpu_and_checkpointing_a_model_without_it_are_refused(tmp_path: Path) -> None:
    with pytest.raises(SettingError, match="precision fp16 needs a GPU"):
        Trainer(tiny_whisper(), Clips()).fit(nodes=2, max_steps=1, batch_size=4, precision="fp16",
                                             out_dir=tmp_path, progress=False)
    with pytest.raises(SettingError, match="gradient_checkpointing: model Sequential has no"):
        Trainer(torch.nn.Sequential(torch.nn.Linear(2, 1)), Clips()).fit(
            nodes=2, max_steps=1, batch_size=4, gradient_checkpointing=True, out_dir=tmp_path)
    proc = meshtrain_here("simulate", "--steps", "2", "--set", "precision=fp16", "--out", str(tmp_path),
                          cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: precision fp16 needs a GPU (device cuda or mps): CPUs have no fast fp16; use "
        "precision bf16 (or fp32) on cpu"]
    assert not list(tmp_path.iterdir())  # nothing written


def test_the_fp16_loss_scaler_halves_on_overflow_and_grows_after_good_steps() -> None:
    scaler = LossScaler(scale=8.0, growth_interval=2)
    p = torch.nn.Parameter(torch.ones(2))
    p.grad = torch.tensor([8.0, 16.0])
    assert scaler.unscale([p]) and p.grad.tolist() == [1.0, 2.0]
    p.grad = torch.tensor([float("inf"), 1.0])
    assert not scaler.unscale([p])
    scaler.update(True)
    assert scaler.scale == 4.0
    scaler.update(False)
    scaler.update(False)
    assert scaler.scale == 8.0


def test_an_fp16_overflow_skips_the_step_on_every_node_and_lowers_the_scale(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # fp16 is refused on cpu for speed, not correctness: let it through to run the loop's
    # loss-scaling path here, starting at a scale that overflows fp16 activation gradients.
    import meshtrain.engine.memory as memory

    scalers: list[LossScaler] = []

    def huge_scaler() -> LossScaler:
        scalers.append(LossScaler(scale=2.0**30))
        return scalers[-1]

    monkeypatch.setattr(memory, "check_precision", lambda precision, device: None)
    monkeypatch.setattr(memory, "LossScaler", huge_scaler)
    torch.manual_seed(0)
    model = CharGPT(40, block_size=32, layers=1, dim=32)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    result = Trainer(model, Windows()).fit(DiLoCo(H=2, lr=1e-2), nodes=2, max_steps=16, batch_size=4,
                                          out_dir=tmp_path, progress=False, precision="fp16",
                                          check_sync=True)
    skipped = result.summary["skipped_steps"]
    assert 0 < skipped < 14  # skipped until the scale came down, then trained
    assert len(scalers) == 2 and scalers[0].scale == scalers[1].scale < 2.0**30  # every node alike
    trained = [not torch.equal(p, before[n]) for n, p in result.model.named_parameters()]
    assert all(trained)  # the steps after the skipped ones updated every weight


def test_a_resumed_run_may_change_precision_and_checkpointing_but_not_its_learning_rate() -> None:
    from dataclasses import replace

    from meshtrain.config.resume import resume_conflict
    from meshtrain.config.spec import RunSpec

    saved = RunSpec(steps=100, lr=1e-3).to_dict()
    assert resume_conflict(saved, RunSpec(steps=200, lr=1e-3, precision="bf16",
                                          gradient_checkpointing=True), 50) is None
    assert "lr was 0.001" in resume_conflict(saved, replace(RunSpec(steps=200), lr=2e-3), 50)
