"""Audio decoding: every WAV subtype sox writes, the decoder chain, checks before training,
and features cached on disk instead of in memory."""

from __future__ import annotations

import shutil
import struct
import subprocess
import sys
import tracemalloc
import types
import wave
from pathlib import Path

import numpy as np
import pytest
import torch
from speech_fixtures import SpeechAssets, speech_fixture, whisper_options  # noqa: F401 (the fixture)

from meshtrain.hf import SpeechDataset, feature_extractor_for, find_splits, load_tokenizer, read_audio
from meshtrain.hf.audio import SpeechDataError, read_wav, wav_format
from meshtrain.tasks import TaskError, TaskOptions
from meshtrain.tasks.whisper import TASK

needs_sox = pytest.mark.skipif(shutil.which("sox") is None, reason="no sox to write test files")

#: sox options for each WAV subtype, and whether the conversion from 16-bit PCM is exact.
SUBTYPES = {
    "pcm-u8": (["-e", "unsigned", "-b", "8"], False),
    "pcm-16": (["-e", "signed", "-b", "16"], True),
    "pcm-24": (["-e", "signed", "-b", "24"], True),
    "pcm-32": (["-e", "signed", "-b", "32"], True),
    "float-32": (["-e", "floating-point", "-b", "32"], True),
    "float-64": (["-e", "floating-point", "-b", "64"], True),
}


def reference_samples(path: Path) -> tuple[np.ndarray, int]:
    """A 16-bit mono PCM WAV read independently, with the standard library's wave module."""
    with wave.open(str(path), "rb") as w:
        assert w.getsampwidth() == 2 and w.getnchannels() == 1
        return np.frombuffer(w.readframes(w.getnframes()), "<i2").astype(np.float64) / 32768, w.getframerate()


def format_tag(path: Path) -> int:
    return struct.unpack("<H", path.read_bytes()[20:22])[0]


def sox(*args: str) -> None:
    subprocess.run(["sox", "-D", *args], check=True, capture_output=True)  # -D: no dither, exact widening


@needs_sox
@pytest.mark.parametrize("subtype", sorted(SUBTYPES))
def test_every_wav_subtype_decodes_to_the_same_samples(subtype: str, speech: SpeechAssets,
                                                       tmp_path: Path) -> None:
    source = speech.data / "clips" / "0002.wav"
    expected, rate = reference_samples(source)
    options, exact = SUBTYPES[subtype]
    out = tmp_path / f"{subtype}.wav"
    sox(str(source), *options, str(out))
    if subtype in ("pcm-24", "pcm-32"):
        assert format_tag(out) == 0xFFFE  # sox writes these as WAVE_FORMAT_EXTENSIBLE
    if subtype.startswith("float"):
        assert format_tag(out) == 3
    audio, got_rate = read_wav(out)
    assert got_rate == rate and audio.dtype == np.float32 and len(audio) == len(expected)
    if exact:  # widening 16-bit samples is exact in every one of these encodings
        assert np.array_equal(audio.astype(np.float64), expected)
    else:  # 8-bit keeps the top 8 bits: off by at most one 8-bit step
        assert np.abs(audio - expected).max() <= 1 / 128 + 1e-7
        assert np.corrcoef(audio, expected)[0, 1] > 0.99


@needs_sox
def test_multichannel_extensible_float_is_mixed_down(speech: SpeechAssets, tmp_path: Path) -> None:
    source = speech.data / "clips" / "0003.wav"
    expected, _ = reference_samples(source)
    out = tmp_path / "quad.wav"
    sox(str(source), "-c", "4", "-e", "signed", "-b", "24", str(out))  # 4 equal channels, extensible
    assert format_tag(out) == 0xFFFE and wav_format(out).channels == 4
    audio, _ = read_wav(out)
    assert np.array_equal(audio.astype(np.float64), expected)


def test_streamed_wav_with_unknown_data_size_reads_to_the_end(tmp_path: Path) -> None:
    """Writers that stream (ffmpeg to a pipe) leave the data size as 0xFFFFFFFF."""
    samples = (np.sin(np.arange(1600) / 5) * 0.5).astype("<f4")
    fmt = struct.pack("<HHIIHH", 3, 1, 16_000, 64_000, 4, 32)
    body = b"WAVE" + b"fmt " + struct.pack("<I", 16) + fmt + b"LIST" + struct.pack("<I", 3) + b"abc\x00"
    body += b"data" + struct.pack("<I", 0xFFFFFFFF) + samples.tobytes()
    (tmp_path / "s.wav").write_bytes(b"RIFF" + struct.pack("<I", 0xFFFFFFFF) + body)
    audio, rate = read_wav(tmp_path / "s.wav")
    assert rate == 16_000 and np.array_equal(audio, samples)  # the odd LIST chunk's pad byte skipped too


@needs_sox
def test_a_decoder_that_refuses_hands_over_to_the_next(speech: SpeechAssets, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """soundfile refusing a file (as libsndfile refuses m4a) is not the end: the next tool decodes it."""
    source = speech.data / "clips" / "0001.wav"
    sox(str(source), str(tmp_path / "c.flac"))
    refusing = types.ModuleType("soundfile")

    def refuse(*_args: object, **_kwargs: object) -> None:
        raise RuntimeError("Error opening 'c.flac': Format not recognised.")

    refusing.read = refuse  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "soundfile", refusing)
    monkeypatch.setenv("PATH", str(Path(shutil.which("sox")).parent))  # sox, no ffmpeg
    flac = read_audio(tmp_path / "c.flac")
    wav = read_audio(source)
    assert abs(len(flac) - len(wav)) <= 2
    n = min(len(flac), len(wav))
    assert np.corrcoef(flac[:n], wav[:n])[0, 1] > 0.99


def test_no_decoder_is_one_line_naming_the_file_and_what_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    (tmp_path / "clip.m4a").write_bytes(b"\x00\x00\x00\x20ftypM4A " + bytes(64))
    monkeypatch.setitem(sys.modules, "soundfile", None)  # import soundfile fails
    monkeypatch.setenv("PATH", str(tmp_path))  # no ffmpeg, no sox
    with pytest.raises(SpeechDataError) as caught:
        read_audio(tmp_path / "clip.m4a")
    message = str(caught.value)
    assert "\n" not in message and message.startswith(f"{tmp_path / 'clip.m4a'}: no audio decoder")
    assert "install ffmpeg" in message and "pip install soundfile" in message


# ------------------------------------------------------------ checked before training
def build(data: Path, speech: SpeechAssets) -> None:
    TASK.build(TaskOptions(data=str(data), seed=0, options=whisper_options(speech.model)))


def audio_folder(folder: Path, speech: SpeechAssets, extra: str, text: str = "odd clip") -> Path:
    folder.mkdir()
    clips = sorted((speech.data / "clips").glob("*.wav"))[:4]
    for c in clips:
        shutil.copy(c, folder / c.name)
    rows = [f"{c.name},text {c.stem}" for c in clips] + [f"{extra},{text}"]
    (folder / "metadata.csv").write_text("file_name,transcription\n" + "\n".join(rows) + "\n")
    return folder


@needs_sox
def test_long_non_wav_clip_fails_before_training(speech: SpeechAssets, tmp_path: Path) -> None:
    folder = audio_folder(tmp_path / "data", speech, "long.flac")
    sox(str(speech.data / "clips" / "0000.wav"), str(folder / "long.flac"), "repeat", "3")  # > 3 s
    with pytest.raises(TaskError, match=r"clip\(s\) longer than the 3 s the model hears: .*long.flac \(\d"):
        build(folder, speech)


def test_undecodable_clip_fails_before_training(speech: SpeechAssets, tmp_path: Path) -> None:
    folder = audio_folder(tmp_path / "data", speech, "broken.ogg")
    (folder / "broken.ogg").write_bytes(b"not audio at all")
    with pytest.raises(TaskError, match=r"broken.ogg: no (audio )?decoder") as caught:
        build(folder, speech)
    assert "\n" not in str(caught.value)


@needs_sox
def test_long_wav_of_any_subtype_fails_before_training(speech: SpeechAssets, tmp_path: Path) -> None:
    folder = audio_folder(tmp_path / "data", speech, "long.wav")
    sox(str(speech.data / "clips" / "0000.wav"), "-e", "floating-point", "-b", "32", str(folder / "long.wav"),
        "repeat", "3")
    with pytest.raises(TaskError, match=r"longer than the 3 s the model hears: .*long.wav \(\d+\.\d s\)"):
        build(folder, speech)


# ------------------------------------------------------------------- feature cache
def dataset(speech: SpeechAssets, cache: Path | None) -> SpeechDataset:
    from meshtrain.hf import HFModel

    model = HFModel.from_pretrained(str(speech.model))
    train, _ = find_splits(speech.data, 0.25)
    return SpeechDataset(train, feature_extractor_for(model.config, str(speech.model)),
                         load_tokenizer(str(speech.model)), cache_dir=cache)


def test_features_are_cached_on_disk_and_equal_fresh_ones(speech: SpeechAssets, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    fresh = dataset(speech, None)
    cached = dataset(speech, tmp_path / "cache")
    first = [cached[i]["input_features"] for i in range(len(cached))]
    files = sorted((tmp_path / "cache").rglob("*.npy"))
    assert len(files) == len(cached) and not list((tmp_path / "cache").rglob("*.tmp"))
    for i, f in enumerate(first):
        assert torch.equal(f, fresh[i]["input_features"])
    # A second dataset (another process or run) reads them back without decoding anything.
    monkeypatch.setattr("meshtrain.hf.speech.read_audio", lambda *a, **k: pytest.fail("decoded again"))
    again = dataset(speech, tmp_path / "cache")
    for i, f in enumerate(first):
        assert torch.equal(again[i]["input_features"], f)


def test_cache_key_follows_content_and_a_torn_file_is_recomputed(speech: SpeechAssets,
                                                                  tmp_path: Path) -> None:
    data = tmp_path / "data"
    shutil.copytree(speech.data, data)
    local = SpeechAssets(data, speech.model, speech.texts)
    ds = dataset(local, tmp_path / "cache")
    before = ds[0]["input_features"]
    key = ds.cache.key(ds.clips[0].path)
    ds.cache.path(key).write_bytes(b"\x93NUMPY torn")  # a crash mid-write by an older writer
    assert torch.equal(dataset(local, tmp_path / "cache")[0]["input_features"], before)
    # Re-recording the clip changes its key: the old features are not reused.
    other = read_wav(ds.clips[1].path)[0]
    with wave.open(str(ds.clips[0].path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16_000)
        w.writeframes((other * 32767).astype("<i2").tobytes())
    changed = dataset(local, tmp_path / "cache")
    assert changed.cache.key(changed.clips[0].path) != key
    assert not torch.equal(changed[0]["input_features"], before)


def test_features_are_not_kept_in_memory(speech: SpeechAssets, tmp_path: Path) -> None:
    """Reading every clip twice leaves no per-clip arrays behind (it used to keep all of them)."""
    ds = dataset(speech, tmp_path / "cache")
    one_clip = ds[0]["input_features"].numel() * 4
    for _ in range(2):
        for i in range(len(ds)):
            ds[i]
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        for i in range(len(ds)):
            ds[i]
        kept = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    assert kept < one_clip, f"{kept} bytes kept after reading {len(ds)} clips of {one_clip} bytes"
