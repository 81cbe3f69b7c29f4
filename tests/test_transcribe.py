"""`meshtrain transcribe` against a plain transformers + peft decode of the same recordings."""

from __future__ import annotations

import struct
import unicodedata
import warnings
from pathlib import Path

import numpy
import pytest
import torch
from speech_fixtures import SpeechAssets, speech_fixture  # noqa: F401 (the fixture)
from typer.testing import CliRunner

from meshtrain.cli.main import app
from meshtrain.hf import HFModel, LoRA, feature_extractor_for, load_tokenizer

runner = CliRunner()


@pytest.fixture(scope="module")
def tuned(speech: SpeechAssets, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A LoRA run's model/ folder: adapter (B made non-zero, as training would), tokenizer,
    feature extractor."""
    base = str(speech.model)
    model = HFModel.from_pretrained(base, lora=LoRA(r=4), seed=3, tokenizer=load_tokenizer(base))
    model.feature_extractor = feature_extractor_for(model.config, base)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.05)
    out = tmp_path_factory.mktemp("tuned") / "model"
    model.save_pretrained(str(out))
    return out


def reference_texts(base: Path, adapter: Path, clips: list[Path]) -> list[str]:
    """Greedy decoding with transformers and peft directly (no meshtrain in the model path)."""
    from peft import PeftModel
    from transformers import AutoTokenizer, WhisperFeatureExtractor, WhisperForConditionalGeneration

    from meshtrain.hf.audio import read_audio  # WAV reading and resampling to 16 kHz

    with warnings.catch_warnings():  # peft 0.21 reads transformers 5's deprecated is_gradient_checkpointing
        warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)
        whisper = WhisperForConditionalGeneration.from_pretrained(base)
        model = PeftModel.from_pretrained(whisper, adapter).eval()
    extractor = WhisperFeatureExtractor.from_pretrained(adapter)
    tokenizer = AutoTokenizer.from_pretrained(adapter)
    features = extractor([read_audio(c) for c in clips], sampling_rate=16_000, return_tensors="pt")
    limit = model.config.max_target_positions - 8  # what meshtrain leaves for the prefix
    with torch.no_grad():
        ids = model.generate(input_features=features.input_features, max_new_tokens=limit)
    return [t.strip() for t in tokenizer.batch_decode(ids, skip_special_tokens=True)]


def test_transcribe_prints_what_peft_decodes(speech: SpeechAssets, tuned: Path) -> None:
    clips = sorted((speech.data / "clips").glob("*.wav"))[:3]
    result = runner.invoke(app, ["transcribe", str(tuned), *map(str, clips), "--batch-size", "2"])
    assert result.exit_code == 0, result.output
    lines = result.output.rstrip("\n").split("\n")[-3:]
    expected = reference_texts(speech.model, tuned, clips)
    assert lines == [f"{c}: {written_out(t)}" for c, t in zip(clips, expected, strict=True)]


def written_out(text: str) -> str:
    """``text`` with each control character as ``\\xNN`` (what a terminal line can hold)."""
    return "".join(f"\\x{ord(c):02x}" if unicodedata.category(c) == "Cc" and c != "\t" else c for c in text)


def test_transcribe_prints_one_line_per_clip_whatever_the_model_decodes(
        speech: SpeechAssets, tuned: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    clips = sorted((speech.data / "clips").glob("*.wav"))[:2]
    decoded = ["two\nlines \x1b[31mred", "record\x1eseparator"]
    monkeypatch.setattr("meshtrain.hf.transcribe.transcribe_files",
                        lambda model, paths, batch: list(zip(paths, decoded, strict=True)))
    result = runner.invoke(app, ["transcribe", str(tuned), *map(str, clips)])
    assert result.exit_code == 0, result.output
    assert result.output.rstrip("\n").split("\n")[-2:] == [
        f"{clips[0]}: two\\x0alines \\x1b[31mred", f"{clips[1]}: record\\x1eseparator"]


def test_transcribe_refuses_what_it_cannot_read(speech: SpeechAssets, tuned: Path, tmp_path: Path) -> None:
    clip = next((speech.data / "clips").glob("*.wav"))
    missing = runner.invoke(app, ["transcribe", str(tmp_path / "nope"), str(clip)])
    assert missing.exit_code == 2 and "no such model folder" in missing.output
    # A folder that holds no model (a run directory, say): transformers' ValueError was a traceback.
    (tmp_path / "not-a-model").mkdir()
    (tmp_path / "not-a-model" / "config.json").write_text("{}")
    other = runner.invoke(app, ["transcribe", str(tmp_path / "not-a-model"), str(clip)])
    assert other.exit_code == 2, other.output
    assert other.output.startswith(f"error: cannot load model '{tmp_path / 'not-a-model'}' as a folder: "
                                   "Unrecognized model"), other.output
    folder = runner.invoke(app, ["transcribe", str(tuned), str(tmp_path)])
    assert folder.exit_code == 2 and "it is a folder" in folder.output
    broken = tmp_path / "broken.wav"
    broken.write_bytes(b"RIFF0000WAVEjunk")
    bad = runner.invoke(app, ["transcribe", str(tuned), str(broken)])
    assert bad.exit_code == 2 and "broken.wav" in bad.output


def test_a_recording_longer_than_the_window_is_heard_whole(speech: SpeechAssets, tuned: Path,
                                                            tmp_path: Path) -> None:
    """Three clips, each padded with silence to the model's window (3 s for the tiny model,
    30 s for Whisper) and joined into one recording, are transcribed window by window: the text
    is what the three clips give one by one (the features of each window are those
    of its clip, padded as the extractor pads), not the first window's words alone."""
    from meshtrain.hf.audio import read_audio
    from meshtrain.hf.transcribe import load_for_transcription, transcribe_files

    clips = sorted((speech.data / "clips").glob("*.wav"))[:3]
    model = load_for_transcription(str(tuned), max_new_tokens=6)  # cheap: the words need not be right
    window = model.feature_extractor.n_samples
    audio = [read_audio(c) for c in clips]
    assert all(len(a) < window for a in audio)
    joined = numpy.concatenate([numpy.pad(a, (0, window - len(a))) for a in audio])
    long = tmp_path / "long.wav"
    write_wav(long, joined)
    alone = [text for _, text in transcribe_files(model, clips)]
    assert all(alone)
    assert list(transcribe_files(model, [long])) == [(long, " ".join(alone))]


def write_wav(path: Path, audio: numpy.ndarray) -> None:
    """16 kHz mono float32 samples as a 32-bit float WAV."""
    data = audio.astype("<f4").tobytes()
    header = (b"RIFF" + struct.pack("<I", 36 + len(data)) + b"WAVEfmt "
              + struct.pack("<IHHIIHH", 16, 3, 1, 16_000, 64_000, 4, 32)
              + b"data" + struct.pack("<I", len(data)))
    path.write_bytes(header + data)


def test_an_unreadable_recording_is_reported_and_the_others_are_transcribed(
        speech: SpeechAssets, tuned: Path, tmp_path: Path) -> None:
    clips = sorted((speech.data / "clips").glob("*.wav"))[:2]
    broken = tmp_path / "broken.wav"
    broken.write_bytes(b"RIFF0000WAVEjunk")
    also = tmp_path / "also-broken.mp3"
    also.write_bytes(b"not audio at all")
    result = runner.invoke(app, ["transcribe", str(tuned), str(broken), str(clips[0]), str(also),
                                 str(clips[1]), "--batch-size", "4"])
    assert result.exit_code == 2, result.output
    out = result.stdout.rstrip("\n").split("\n")
    assert [line.partition(": ")[0] for line in out[-2:]] == [str(c) for c in clips]
    assert f"{broken}:" in result.stderr and f"{also}:" in result.stderr
    assert result.stderr.rstrip("\n").split("\n")[-1] == (
        f"error: 2 of 4 recordings could not be read: {broken}, {also}")
