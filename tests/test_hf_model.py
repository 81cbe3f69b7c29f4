"""The Hugging Face adapter: loading by path, the loss contract, LoRA, saving, WER."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from speech_fixtures import SpeechAssets, speech_fixture, whisper_options  # noqa: F401 (the fixture)

from meshtrain.hf import HFModel, LoRA, ModelLoadError, word_error_rate
from meshtrain.hf.model import normalize_text, raw_word_error_rate
from meshtrain.tasks import TaskOptions
from meshtrain.tasks.whisper import TASK

TINY_ADAPTER = 12 * 8 * (64 + 64)  # 12 q/v projections (enc self, dec self, dec cross) x r*(in+out)


def batch_of(speech: SpeechAssets, n: int = 4) -> tuple[HFModel, dict[str, torch.Tensor]]:
    bundle = TASK.build(TaskOptions(data=str(speech.data), options=whisper_options(speech.model)))
    return bundle.model, bundle.collate_fn([bundle.train_data[i] for i in range(n)])


@torch.no_grad()
def eval_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> float:
    model.eval()
    return float(model(batch))


def test_loaded_by_path_equals_the_model_that_was_saved(speech: SpeechAssets) -> None:
    from transformers import WhisperConfig

    loaded = HFModel.from_pretrained(str(speech.model))
    rebuilt = HFModel.from_config(WhisperConfig.from_pretrained(str(speech.model)), seed=0)
    for (name, a), (_, b) in zip(loaded.named_parameters(), rebuilt.named_parameters(), strict=True):
        assert torch.equal(a, b), name
    assert all(p.dtype == torch.float32 for p in loaded.parameters())


def test_forward_returns_the_scalar_loss(speech: SpeechAssets) -> None:
    model, batch = batch_of(speech)
    loss = model(batch)
    assert loss.ndim == 0 and loss.requires_grad
    direct = model.model(**batch).loss
    assert torch.equal(loss, direct)
    with pytest.raises(ValueError, match="needs 'labels'"):
        model({"input_features": batch["input_features"],
               "decoder_input_ids": torch.ones(4, 2, dtype=torch.long)})


def test_lora_leaves_only_the_adapters_trainable(speech: SpeechAssets) -> None:
    model = HFModel.from_pretrained(str(speech.model), lora=LoRA(r=8, target_modules=["q_proj", "v_proj"]))
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert model.trainable_parameters() == TINY_ADAPTER
    assert sum(p.numel() for p in model.parameters()) > 20 * TINY_ADAPTER
    # Same seed, same adapter on every host (A is random, B starts at zero).
    again = HFModel.from_pretrained(str(speech.model), lora=LoRA(r=8), seed=0)
    for a, b in zip(model.parameters(), again.parameters(), strict=True):
        assert torch.equal(a, b)


def test_lora_settings_by_name_and_their_errors(speech: SpeechAssets) -> None:
    assert LoRA.from_options(None) is None and LoRA.from_options(False) is None
    lora = LoRA.from_options({"r": 4, "target_modules": "q_proj"})
    assert lora == LoRA(r=4, alpha=32, dropout=0.1, target_modules=["q_proj"])
    with pytest.raises(ModelLoadError, match="no setting 'rank'"):
        LoRA.from_options({"rank": 4})
    with pytest.raises(ModelLoadError, match="target_modules"):
        HFModel.from_pretrained(str(speech.model), lora=LoRA(target_modules=["no_such_proj"]))
    with pytest.raises(ModelLoadError, match="cannot load model"):
        HFModel.from_pretrained(str(speech.model / "missing"))


def test_lora_checkpoint_saves_adapter_and_merged_model(speech: SpeechAssets, tmp_path: Path) -> None:
    model, batch = batch_of(speech)
    model = HFModel.from_pretrained(str(speech.model), lora=LoRA(r=8), tokenizer=model.tokenizer,
                                    feature_extractor=model.feature_extractor, save_merged=True)
    with torch.no_grad():  # a trained adapter: B no longer zero
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    expected = eval_loss(model, batch)
    assert expected != pytest.approx(eval_loss(HFModel.from_pretrained(str(speech.model)), batch))
    model.save_pretrained(str(tmp_path / "out"))
    files = {p.name for p in (tmp_path / "out").iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json",
            "preprocessor_config.json"} <= files
    assert "model.safetensors" not in files  # the adapter folder holds no base weights

    from safetensors.torch import load_file

    saved = load_file(str(tmp_path / "out" / "adapter_model.safetensors"))
    assert sum(t.numel() for t in saved.values()) == TINY_ADAPTER

    reloaded = HFModel.from_pretrained(str(tmp_path / "out"))  # base from adapter_config + adapter
    assert reloaded.is_lora and reloaded.trainable_parameters() == TINY_ADAPTER
    assert eval_loss(reloaded, batch) == pytest.approx(expected, abs=1e-6)
    merged = HFModel.from_pretrained(str(tmp_path / "out" / "merged"))
    assert not merged.is_lora
    assert eval_loss(merged, batch) == pytest.approx(expected, abs=1e-5)


def test_whisper_task_continues_a_saved_lora_run(speech: SpeechAssets, tmp_path: Path) -> None:
    model, _ = batch_of(speech)
    tuned = HFModel.from_pretrained(str(speech.model), lora=LoRA(r=4), tokenizer=model.tokenizer,
                                    feature_extractor=model.feature_extractor, seed=7)
    tuned.save_pretrained(str(tmp_path / "run-model"))
    bundle = TASK.build(TaskOptions(data=str(speech.data),
                                    options=whisper_options(tmp_path / "run-model")))  # lora option ignored
    again = dict(bundle.model.named_parameters())
    for name, p in tuned.named_parameters():
        assert torch.equal(p, again[name]) and p.requires_grad == again[name].requires_grad, name
    assert bundle.model.trainable_parameters() == tuned.trainable_parameters() == TINY_ADAPTER // 2


def test_wer_is_normalised_corpus_word_error_rate() -> None:
    assert word_error_rate(["Hello, world."], ["hello world"]) == 0.0
    assert word_error_rate(["a b c d", "e f"], ["a x c", ""]) == pytest.approx(4 / 6)
    assert word_error_rate(["the cat"], ["the cat sat on it"]) == pytest.approx(3 / 2)  # can exceed 1


def test_wer_normalises_as_whisper_does_and_raw_wer_does_not() -> None:
    curly = "I don\u2019t know."
    assert word_error_rate(["I don't know."], [curly]) == 0.0
    assert raw_word_error_rate(["I don't know."], [curly]) == pytest.approx(1 / 3)  # one word of 3
    assert word_error_rate(["I have five apples"], ["i have 5 apples"]) == 0.0  # numerals
    assert word_error_rate(["\u201cHello,\u201d she said"], ['"hello" she said']) == 0.0
    assert word_error_rate(["um I think so"], ["I think so"]) == 0.0  # fillers
    assert normalize_text("  Mr.  Smith\u2019s   car ") == "mister smith is car"  # as Whisper's does
    # Other languages: lower case and punctuation only (no English number words or contractions).
    assert normalize_text("Ik heb VIJF appels!", english=False) == "ik heb vijf appels"


def test_validation_metrics_transcribe_with_the_models_tokenizer(speech: SpeechAssets) -> None:
    model, batch = batch_of(speech)
    refs = model.references(batch)
    assert refs == [speech.texts[i] for i in _train_indices(speech, 4)]
    model.eval()
    hyps = model.transcribe(batch)
    assert len(hyps) == 4 and all(isinstance(h, str) for h in hyps)
    metrics = model.validation_metrics([batch])
    assert set(metrics) == {"wer", "wer_raw"} and metrics["wer"] == pytest.approx(word_error_rate(refs, hyps))
    assert metrics["wer_raw"] == pytest.approx(raw_word_error_rate(refs, hyps))


def _train_indices(speech: SpeechAssets, n: int) -> list[int]:
    from meshtrain.hf import find_splits

    train, _ = find_splits(speech.data, 0.25, seed=0)
    return [speech.texts.index(c.text) for c in train[:n]]


def test_causal_lm_with_lora_fits_the_same_contract() -> None:
    """GPT-2's attention is a transformers Conv1D (weights stored (in, out)): the LoRA
    config says so itself (fan_in_fan_out), so peft has nothing to correct or warn about."""
    import warnings

    from transformers import GPT2Config

    config = GPT2Config(vocab_size=50, n_positions=16, n_embd=32, n_layer=2, n_head=2)
    config.architectures = ["GPT2LMHeadModel"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # peft's "fan_in_fan_out is set to False ..." fails here
        model = HFModel.from_config(config, lora=LoRA(r=4, target_modules=["c_attn"]), seed=1)
    assert model.model.peft_config["default"].fan_in_fan_out is True
    ids = torch.randint(0, 50, (3, 16), generator=torch.Generator().manual_seed(0))
    loss = model({"input_ids": ids, "labels": ids})
    assert loss.ndim == 0 and loss.item() > 0
    assert model.validation_metrics([{"input_ids": ids, "labels": ids}]) == {}  # no WER for an LM
    assert model.trainable_parameters() == 2 * 4 * (32 + 96)  # r * (in + out) per layer's c_attn
    assert copy.deepcopy(model).trainable_parameters() == model.trainable_parameters()


def test_bare_whisper_config_builds_the_speech_seq2seq_model() -> None:
    from transformers import WhisperConfig

    config = WhisperConfig(d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                           decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64,
                           vocab_size=100, max_source_positions=50, max_target_positions=32,
                           pad_token_id=0, eos_token_id=0, bos_token_id=1, decoder_start_token_id=1)
    assert not getattr(config, "architectures", None)
    model = HFModel.from_config(config)
    assert type(model.base).__name__ == "WhisperForConditionalGeneration"


def test_saved_adapter_reloads_from_any_directory(speech: SpeechAssets, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A base model given by a relative path is recorded absolute; a hub id stays an id."""
    import json

    from meshtrain.hf.model import model_reference

    model, batch = batch_of(speech)
    monkeypatch.chdir(speech.model.parent)
    tuned = HFModel.from_pretrained(speech.model.name, lora=LoRA(r=4), seed=3)  # relative, as typed
    with torch.no_grad():
        for name, p in tuned.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    saved = tmp_path / "adapter"
    tuned.save_pretrained(str(saved))
    recorded = json.loads((saved / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert recorded == str(speech.model.resolve())
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    reloaded = HFModel.from_pretrained(str(saved))
    assert eval_loss(reloaded, batch) == pytest.approx(eval_loss(tuned, batch), abs=1e-6)
    assert model_reference("openai/whisper-tiny.en") == "openai/whisper-tiny.en"


def test_naming_the_base_of_a_copied_back_adapter_reads_only_a_small_json_object(tmp_path: Path) -> None:
    """The launcher rewrites the base that rank 0's adapter_config.json names: the file came
    from a host, so only a small JSON object is taken; other keys are kept as they were."""
    import json

    from meshtrain.hf.model import ADAPTER_CONFIG_LIMIT, name_base_model

    model_dir = tmp_path / "model"
    model_dir.mkdir()
    assert not name_base_model(model_dir, "openai/whisper-tiny")  # a full model names no base
    config = model_dir / "adapter_config.json"
    config.write_text(json.dumps({"base_model_name_or_path": "/w/.meshtrain/data/ab/tiny", "r": 8}))
    assert name_base_model(model_dir, "/home/me/tiny")
    assert json.loads(config.read_text()) == {"base_model_name_or_path": "/home/me/tiny", "r": 8}
    for hostile in ("[1, 2]", "{not json", " " * (ADAPTER_CONFIG_LIMIT + 1)):
        config.write_text(hostile)
        with pytest.raises(ModelLoadError, match="adapter_config.json"):
            name_base_model(model_dir, "/home/me/tiny")
