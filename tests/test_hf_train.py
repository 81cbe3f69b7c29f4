"""Fine-tuning Hugging Face models on simulated nodes: LoRA sends only adapters, base
weights never move, Whisper learns from real (espeak-ng) speech and reports WER."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from speech_fixtures import SpeechAssets, speech_fixture, whisper_options  # noqa: F401 (the fixture)

from meshtrain import Trainer
from meshtrain.hf import HFModel, LoRA
from meshtrain.strategies import STRATEGIES, DiLoCo, Optim, Strategy
from meshtrain.tasks import TaskBundle, TaskOptions
from meshtrain.tasks.whisper import TASK

#: Every node's parameters after training, by rank (written by the recording strategies).
FINAL: dict[int, dict[str, torch.Tensor]] = {}


class RecordingDiLoCo(DiLoCo):
    """DiLoCo that keeps each node's final parameters in FINAL (threads share the module)."""

    def finish(self, step: int) -> None:
        super().finish(step)
        FINAL[self.comm.rank] = {n: p.detach().clone() for n, p in self.model.named_parameters()}


def whisper_bundle(speech: SpeechAssets, **options: Any) -> TaskBundle:
    options = whisper_options(speech.model, **options)
    return TASK.build(TaskOptions(data=str(speech.data), seed=0, options=options))


def fit(bundle: TaskBundle, strategy: Strategy, tmp_path: Path, steps: int, **kwargs: Any) -> Any:
    trainer = Trainer(bundle.model, bundle.train_data, bundle.val_data, bundle.collate_fn)
    return trainer.fit(strategy=strategy, nodes=2, max_steps=steps, batch_size=4, out_dir=tmp_path,
                       progress=False, **kwargs)


def test_lora_diloco_moves_only_adapters_and_sends_their_bytes(speech: SpeechAssets, tmp_path: Path) -> None:
    bundle = whisper_bundle(speech)
    before = {n: p.detach().clone() for n, p in bundle.model.named_parameters()}
    adapter = [n for n, p in bundle.model.named_parameters() if p.requires_grad]
    adapter_bytes = 4 * sum(before[n].numel() for n in adapter)
    FINAL.clear()
    result = fit(bundle, RecordingDiLoCo(H=5, lr=3e-3), tmp_path, steps=20, val_interval=10)

    assert sorted(FINAL) == [0, 1]
    for rank, params in FINAL.items():
        for name, value in params.items():
            if name in adapter:
                assert torch.equal(value, FINAL[0][name]), (rank, name)  # the global adapter
            else:
                assert torch.equal(value, before[name]), (rank, name)  # frozen base never moves
    assert all(not torch.equal(FINAL[0][n], before[n]) for n in adapter if "lora_B" in n)

    # A 2-node ring all-reduce sends 2 * (1/2) * S = S bytes per node: exactly the adapter.
    syncs = [row for row in result.history if row["bytes_sent"] > 0]
    assert [row["step"] for row in syncs] == [5, 10, 15, 20]
    assert all(row["bytes_sent"] == adapter_bytes for row in syncs)
    summary = result.summary
    assert summary["bytes_sent_per_node"] == 4 * adapter_bytes
    assert summary["startup_bytes_sent_per_node"] == 0  # frozen weights are never sent
    assert summary["trainable_parameters"] * 4 == adapter_bytes
    assert 0 <= summary["final_wer"] < float("inf")
    assert result.history[9]["val_wer"] is not None  # val_interval=10 measured WER mid-run

    run = result.run_dir
    assert json.loads((run / "summary.json").read_text())["final_wer"] == summary["final_wer"]
    assert "val_wer" in (run / "metrics.csv").read_text().splitlines()[0]
    from safetensors.torch import load_file

    saved = load_file(str(run / "model" / "adapter_model.safetensors"))
    assert 4 * sum(t.numel() for t in saved.values()) == adapter_bytes
    reloaded = HFModel.from_pretrained(str(run / "model"))  # the global model, loadable
    for name, value in reloaded.named_parameters():
        if "lora_" in name:
            assert torch.equal(value, FINAL[0][name]), name


def test_full_fine_tune_sends_the_whole_model_and_learns(speech: SpeechAssets, tmp_path: Path) -> None:
    bundle = whisper_bundle(speech, lora=None)
    total = sum(p.numel() for p in bundle.model.parameters())
    assert bundle.model.trainable_parameters() == total
    strategy = DiLoCo(H=10, lr=2e-3, outer_lr=1.0, outer_momentum=0.0,
                      optim=Optim("adamw", weight_decay=0.0))
    result = fit(bundle, strategy, tmp_path, steps=30)
    syncs = [row["bytes_sent"] for row in result.history if row["bytes_sent"] > 0]
    assert syncs == [4 * total] * 3
    losses = [row["train_loss"] for row in result.history]
    assert sum(losses[-5:]) / 5 < 0.7 * sum(losses[:5]) / 5  # it learns the transcripts
    assert result.summary["final_val_loss"] < losses[0]
    assert (result.run_dir / "model" / "model.safetensors").is_file()


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_every_strategy_communicates_only_trainable_parameters(name: str, tmp_path: Path) -> None:
    """A LoRA causal LM: no strategy sends more per step than the adapter, the base stays put."""
    from transformers import GPT2Config

    config = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2)
    config.architectures = ["GPT2LMHeadModel"]
    model = HFModel.from_config(config, lora=LoRA(r=4, dropout=0.0, target_modules=["c_attn"]), seed=0)
    ids = torch.randint(0, 64, (32, 16), generator=torch.Generator().manual_seed(0))
    data = torch.utils.data.TensorDataset(ids)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    adapter_bytes = 4 * model.trainable_parameters()
    cls = STRATEGIES[name]
    kwargs: dict[str, int] = {"H": 2} if "H" in cls.parameters() else {}
    if "fragments" in cls.parameters():
        kwargs["fragments"] = 2  # streaming: each fragment syncs at its own step of the H
    result = Trainer(model, data, collate_fn=lm_batch).fit(
        strategy=cls(**kwargs), nodes=2, max_steps=4, batch_size=4, out_dir=tmp_path, progress=False)
    assert result.summary["bytes_sent_per_node"] > 0
    # A step sends at most two adapter-sized payloads (SPARTA's sparse exchange plus an outer
    # sync or the final average), never anything the size of the frozen model.
    assert all(row["bytes_sent"] <= 2 * adapter_bytes for row in result.history)
    assert 4 * sum(p.numel() for p in model.parameters()) > 20 * adapter_bytes  # the model is far bigger
    for n, p in result.model.named_parameters():
        if "lora_" not in n:
            assert torch.equal(p, before[n]), n
    if name in ("diloco", "fedavg"):  # dense syncs: exactly the adapter each time
        assert {row["bytes_sent"] for row in result.history} <= {0, adapter_bytes}
    if name == "ddp":  # the adapter's gradients plus one has-gradient flag per tensor
        tensors = sum(1 for p in model.parameters() if p.requires_grad)
        assert {row["bytes_sent"] for row in result.history} == {adapter_bytes + 4 * tensors}


def lm_batch(samples: list[tuple[torch.Tensor]]) -> dict[str, torch.Tensor]:
    ids = torch.stack([s[0] for s in samples])
    return {"input_ids": ids, "labels": ids}


def test_processes_runtime_matches_threads_bit_for_bit(speech: SpeechAssets, tmp_path: Path) -> None:
    """The model, tokenizer and data pickle; LoRA dropout is reproducible across runtimes."""
    bundle = whisper_bundle(speech)
    runs = {rt: fit(bundle, DiLoCo(H=3, lr=3e-3), tmp_path / rt, steps=6, runtime=rt)
            for rt in ("threads", "processes")}
    a, b = (dict(runs[rt].model.named_parameters()) for rt in ("threads", "processes"))
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert runs["threads"].summary["final_wer"] == runs["processes"].summary["final_wer"]
    losses = {rt: [r["train_loss"] for r in run.history] for rt, run in runs.items()}
    assert losses["threads"] == losses["processes"]


@pytest.mark.slow
def test_tiny_whisper_learns_to_transcribe_its_recordings(speech: SpeechAssets, tmp_path: Path) -> None:
    """WER through generate + decode is real: trained on 9 spoken clips, the tiny model
    transcribes them (evaluated on the same clips; it is far too small to generalise)."""
    from meshtrain.strategies import DDP

    bundle = whisper_bundle(speech, lora=None)
    trainer = Trainer(bundle.model, bundle.train_data, bundle.train_data, bundle.collate_fn)
    # Validated once, at the end: the run also measures the untrained model (summary's
    # "initial"), which is the "before". (Every 20 steps it decoded nine clips ten times, the
    # early ones up to 128 tokens of garbage each, for two numbers it now reads directly.)
    result = trainer.fit(strategy=DDP(lr=1e-3), nodes=2, max_steps=200, batch_size=4, out_dir=tmp_path,
                         progress=False, val_interval=200)
    assert result.summary["initial"]["val_wer"] > 0.8  # untrained, it cannot transcribe
    assert [row["step"] for row in result.history if row.get("val_wer") is not None] == [200]
    assert result.summary["final_wer"] <= 0.2


def lora_lm(seed: int) -> HFModel:
    from transformers import GPT2Config

    config = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2)
    config.architectures = ["GPT2LMHeadModel"]
    return HFModel.from_config(config, lora=LoRA(r=4, dropout=0.0, target_modules=["c_attn"]), seed=seed)


def test_lora_checkpoints_hold_the_adapter_and_the_base_identity_only(tmp_path: Path) -> None:
    """A checkpoint of a LoRA run stores what trains (plus the frozen base's SHA-256), not
    the frozen base on every node; resuming on the same base continues exactly, and a
    resume on another base is refused before training."""
    from meshtrain.checkpoint import CheckpointError, find_latest

    ids = torch.randint(0, 64, (32, 16), generator=torch.Generator().manual_seed(0))
    data = torch.utils.data.TensorDataset(ids)

    def run(model: HFModel, run_id: str, **kwargs: Any) -> Any:
        return Trainer(model, data, collate_fn=lm_batch).fit(
            strategy=DiLoCo(H=2, lr=3e-3), nodes=2, max_steps=6, batch_size=4, out_dir=tmp_path,
            progress=False, run_id=run_id, **kwargs)

    whole = run(lora_lm(0), "whole", checkpoint_every=2)
    found = find_latest(whole.run_dir)
    state = torch.load(found.folder / "node-1.pt", weights_only=True)
    model = lora_lm(0)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert set(state["model"]) == trainable  # GPT-2 has no buffers in its state dict
    frozen_bytes = sum(4 * p.numel() for p in model.parameters() if not p.requires_grad)
    assert (found.folder / "node-1.pt").stat().st_size < frozen_bytes / 2  # it held them all

    resumed = run(lora_lm(0), "again", resume=str(found.folder))
    for (name, a), b in zip(whole.model.named_parameters(), resumed.model.parameters(), strict=True):
        assert torch.equal(a, b), name
    with pytest.raises(CheckpointError, match="frozen base"):
        run(lora_lm(1), "other", resume=str(found.folder))
