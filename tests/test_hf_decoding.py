"""Language and task tokens: English-only checkpoints drop them, a language the model
cannot decode in fails before the first step, and labels match what generate produces."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from in_process import meshtrain_here
from speech_fixtures import (  # noqa: F401 (the fixtures)
    SpeechAssets,
    english_model_fixture,
    multilingual_model_fixture,
    speech_fixture,
    whisper_options,
)

from meshtrain import Trainer
from meshtrain.hf.decoding import is_english_only
from meshtrain.strategies import DiLoCo
from meshtrain.tasks import TaskBundle, TaskError, TaskOptions
from meshtrain.tasks.whisper import TASK

ROOT = Path(__file__).resolve().parent.parent


def build(speech: SpeechAssets, model: Path, **options: object) -> TaskBundle:
    return TASK.build(TaskOptions(data=str(speech.data), seed=0, options=whisper_options(model, **options)))


def label_prefix(bundle: TaskBundle) -> list[str]:
    """The special tokens that open the first training label (before the text)."""
    tokenizer = bundle.model.tokenizer
    tokens = tokenizer.convert_ids_to_tokens(bundle.train_data[0]["labels"].tolist())
    return [t for t in tokens[:5] if t.startswith("<|")]


def generated_prefix(bundle: TaskBundle) -> list[str]:
    """The prompt tokens ``generate`` feeds the decoder first, for the run's settings
    (captured at the decoder: generate's output leaves the prompt out)."""
    model = bundle.model
    model.eval()
    seen: list[torch.Tensor] = []

    def capture(_module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        if not seen:
            seen.append(kwargs.get("input_ids", args[0] if args else None))

    handle = model.base.get_decoder().register_forward_pre_hook(capture, with_kwargs=True)
    try:
        model.transcribe({"input_features": bundle.train_data[0]["input_features"].unsqueeze(0)},
                         max_new_tokens=1)
    finally:
        handle.remove()
    return model.tokenizer.convert_ids_to_tokens(seen[0][0].tolist())


def test_english_only_model_is_detected(english_model: Path, multilingual_model: Path,
                                        speech: SpeechAssets) -> None:
    from meshtrain.hf import HFModel

    assert is_english_only(HFModel.from_pretrained(str(english_model)).base)
    assert not is_english_only(HFModel.from_pretrained(str(multilingual_model)).base)
    assert is_english_only(HFModel.from_pretrained(str(speech.model)).base)  # no lang_to_id at all
    multi = HFModel.from_pretrained(str(multilingual_model)).base
    assert is_english_only(multi, "openai/whisper-tiny.en")  # the hub's naming says so too


def test_english_only_checkpoint_with_language_en_trains_validates_and_saves(
    english_model: Path, speech: SpeechAssets, tmp_path: Path,
) -> None:
    bundle = build(speech, english_model, language="en", task="transcribe")
    assert "language" not in bundle.model.generate_kwargs and "task" not in bundle.model.generate_kwargs
    assert label_prefix(bundle) == ["<|startoftranscript|>", "<|notimestamps|>"]
    assert generated_prefix(bundle) == label_prefix(bundle)  # training and decoding agree
    trainer = Trainer(bundle.model, bundle.train_data, bundle.val_data, bundle.collate_fn)
    result = trainer.fit(strategy=DiLoCo(H=2, lr=3e-3), nodes=2, max_steps=4, batch_size=4,
                         out_dir=tmp_path, progress=False)
    assert 0 <= result.summary["final_wer"] < float("inf")
    assert (result.run_dir / "model" / "adapter_config.json").is_file()


def test_multilingual_checkpoint_takes_a_language_by_code_or_name(
    multilingual_model: Path, speech: SpeechAssets,
) -> None:
    for language in ("nl", "Dutch"):
        bundle = build(speech, multilingual_model, language=language, task="transcribe")
        assert bundle.model.generate_kwargs["language"] == "nl"
        expected = ["<|startoftranscript|>", "<|nl|>", "<|transcribe|>", "<|notimestamps|>"]
        assert label_prefix(bundle) == expected
        assert generated_prefix(bundle) == label_prefix(bundle)


@pytest.mark.parametrize(("which", "options", "message"), [
    ("english", {"language": "nl"}, r"-only \(no language tokens\): it cannot transcribe language 'nl'"),
    ("english", {"language": "en", "task": "translate"}, r"is English-only: it has no 'translate' task"),
    ("multilingual", {"language": "xx"}, r"has no language 'xx' \(task_options.language\); it knows 100: af"),
    ("multilingual", {"language": "en", "task": "summarise"}, r"has no task 'summarise'"),
    ("plain", {"language": "de"}, r"is English-only"),
])
def test_a_language_the_model_cannot_decode_fails_at_build(
    which: str, options: dict[str, str], message: str, english_model: Path, multilingual_model: Path,
    speech: SpeechAssets,
) -> None:
    model = {"english": english_model, "multilingual": multilingual_model, "plain": speech.model}[which]
    with pytest.raises(TaskError, match=message) as caught:
        build(speech, model, **options)
    assert "\n" not in str(caught.value)


def test_a_generate_setting_transformers_refuses_fails_before_training(
    multilingual_model: Path, speech: SpeechAssets, tmp_path: Path,
) -> None:
    """Whatever generate refuses is found by decoding one clip at build time, not after
    training: here a checkpoint whose generation config asks for timestamps without the
    token that turns them off."""
    broken = tmp_path / "broken"
    shutil.copytree(multilingual_model, broken)
    generation = json.loads((broken / "generation_config.json").read_text())
    generation["return_timestamps"] = True
    del generation["no_timestamps_token_id"]
    (broken / "generation_config.json").write_text(json.dumps(generation))
    with pytest.raises(TaskError, match=r"cannot decode with \{.*'language': 'en'.*to return timestamps"):
        build(speech, broken, language="en")


def test_cli_bad_language_is_one_line_exit_2_before_any_run(
    english_model: Path, speech: SpeechAssets, tmp_path: Path,
) -> None:
    proc = meshtrain_here("simulate", "--profile", "whisper-tiny-random-lora", "--data", str(speech.data),
                          "--set", f"task_options.model={english_model}", "--set", "task_options.language=fr",
                          "--out", str(tmp_path / "runs"), "--no-progress", cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "English-only" in proc.stderr and "'fr'" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


def test_cli_english_only_with_profile_language_en_finishes(
    english_model: Path, speech: SpeechAssets, tmp_path: Path,
) -> None:
    proc = meshtrain_here("simulate", "--profile", "whisper-tiny-random-lora", "--data", str(speech.data),
                          "--set", f"task_options.model={english_model}",
                          "--set", "task_options.language=en", "--set", "steps=4",
                          "--out", str(tmp_path / "runs"), "--run-id", "en", "--no-progress", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads((tmp_path / "runs" / "en" / "summary.json").read_text())
    assert 0 <= summary["final_wer"] < float("inf")
    assert (tmp_path / "runs" / "en" / "model" / "adapter_config.json").is_file()
