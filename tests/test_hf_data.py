"""Speech data and tokenizers: reading audio, the audiofolder, labels, padding, bad input."""

from __future__ import annotations

import csv
import json
import math
import shutil
import subprocess
import wave
from pathlib import Path

import numpy as np
import pytest
import torch
from speech_fixtures import (  # noqa: F401 (the fixture)
    SpeechAssets,
    require_espeak,
    speech_fixture,
    whisper_options,
)

from meshtrain.hf import (
    SpeechCollator,
    SpeechDataset,
    TokenizerError,
    build_tokenizer,
    feature_extractor_for,
    find_splits,
    load_tokenizer,
    read_audio,
)
from meshtrain.hf.speech import read_wav
from meshtrain.tasks import TaskBundle, TaskError, TaskOptions
from meshtrain.tasks.whisper import TASK


def write_wav(path: Path, audio: np.ndarray, rate: int, width: int) -> None:
    """PCM WAV of ``audio`` (frames, channels) in [-1, 1] with ``width`` bytes per sample."""
    scaled = np.round(audio * (2 ** (8 * width - 1) - 1)).astype(np.int64)
    if width == 1:
        raw = (scaled + 128).astype(np.uint8).tobytes()
    elif width == 3:
        b = scaled.astype("<i4").reshape(-1, 1).view(np.uint8)[:, :3]
        raw = b.tobytes()
    else:
        raw = scaled.astype({2: "<i2", 4: "<i4"}[width]).tobytes()
    with wave.open(str(path), "wb") as w:
        w.setnchannels(audio.shape[1])
        w.setsampwidth(width)
        w.setframerate(rate)
        w.writeframes(raw)


def write_metadata(folder: Path, rows: list[tuple[str, str]], header=("file_name", "transcription")) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    with (folder / "metadata.csv").open("w", newline="") as f:
        csv.writer(f).writerows([header, *rows])


def build_task(data: Path | str | None, model_dir: Path, **options: object) -> TaskBundle:
    return TASK.build(TaskOptions(data=None if data is None else str(data), seed=0,
                                  options=whisper_options(model_dir, **options)))


# ----------------------------------------------------------------------- audio
@pytest.mark.parametrize("width", [1, 2, 3, 4])
def test_wav_is_mixed_to_mono_and_resampled_to_16khz(tmp_path: Path, width: int) -> None:
    rate, seconds = 44_100, 0.5
    t = np.arange(int(rate * seconds)) / rate
    tone = 0.5 * np.sin(2 * np.pi * 440 * t)
    stereo = np.stack([tone, np.zeros_like(tone)], axis=1)  # the mixdown halves it
    write_wav(tmp_path / "a.wav", stereo, rate, width)
    audio = read_audio(tmp_path / "a.wav")
    assert audio.dtype == np.float32
    assert len(audio) == 8000  # 0.5 s at 16 kHz
    spectrum = np.abs(np.fft.rfft(audio))
    assert abs(np.argmax(spectrum) * 16_000 / len(audio) - 440) <= 2  # the tone survives
    assert abs(np.abs(audio[1000:-1000]).max() - 0.25) < 0.02  # mono = mean of channels


def test_espeak_recordings_are_resampled(speech: SpeechAssets) -> None:
    clip = speech.data / "clips" / "0000.wav"
    native, rate = read_wav(clip)
    assert rate == 22_050  # espeak-ng's rate: loading must resample
    audio = read_audio(clip)
    assert abs(len(audio) - len(native) * 16_000 / 22_050) <= 1
    assert np.abs(audio).max() > 0.05  # real speech, not silence


@pytest.mark.skipif(shutil.which("sox") is None, reason="sox is not installed: no FLAC to decode")
def test_non_wav_formats_decode_like_wav(speech: SpeechAssets, tmp_path: Path) -> None:
    clip = speech.data / "clips" / "0001.wav"
    subprocess.run(["sox", str(clip), str(tmp_path / "c.flac")], check=True)
    wav, flac = read_audio(clip), read_audio(tmp_path / "c.flac")
    assert abs(len(wav) - len(flac)) <= 2
    n = min(len(wav), len(flac))
    assert np.corrcoef(wav[:n], flac[:n])[0, 1] > 0.95


# ------------------------------------------------------------------- tokenizer
def test_offline_tokenizer_round_trips_with_whisper_framing(tmp_path: Path) -> None:
    texts = ["open the red door", "the dog runs home"]
    tok = build_tokenizer(texts, directory=tmp_path / "tok")
    loaded = load_tokenizer(str(tmp_path / "tok"))
    assert len(loaded) == len(tok) > 256
    ids = loaded("open the dog").input_ids
    assert ids[0] == loaded.convert_tokens_to_ids("<|startoftranscript|>")
    assert ids[-1] == loaded.eos_token_id == loaded.pad_token_id
    assert loaded.decode(ids, skip_special_tokens=True) == "open the dog"
    assert loaded.decode(loaded("zebra!").input_ids, skip_special_tokens=True) == "zebra!"  # unseen text


def _empty_tokenizer(directory: Path) -> Path:
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE())).save_pretrained(str(directory))
    return directory


def test_empty_tokenizer_is_an_error_not_a_silent_run(tmp_path: Path) -> None:
    empty = _empty_tokenizer(tmp_path / "empty")
    with pytest.raises(TokenizerError, match="EMPTY"):
        load_tokenizer(str(empty))


def test_whisper_task_refuses_an_empty_tokenizer(speech: SpeechAssets, tmp_path: Path) -> None:
    empty = _empty_tokenizer(tmp_path / "empty")
    with pytest.raises(TaskError, match="vocabulary size 0"):
        build_task(speech.data, speech.model, tokenizer=str(empty))


# --------------------------------------------------------------------- dataset
def test_dataset_gives_whisper_features_and_labels(speech: SpeechAssets) -> None:
    bundle = build_task(speech.data, speech.model)
    train, val = bundle.train_data, bundle.val_data
    assert len(train) == 9 and len(val) == 3  # val_fraction 0.25 of 12
    texts = {c.text for c in train.clips} | {c.text for c in val.clips}
    assert texts == set(speech.texts)
    item = train[0]
    assert item["input_features"].shape == (80, 300)  # 2 * max_source_positions frames
    assert item["input_features"].dtype == torch.float32
    tokenizer = bundle.model.tokenizer
    assert tokenizer.decode(item["labels"].tolist(), skip_special_tokens=True) == train.clips[0].text
    # The extractor reproduces the features from the resampled waveform itself.
    fe = feature_extractor_for(bundle.model.config)
    direct = fe(read_audio(train.clips[0].path), sampling_rate=16_000, return_tensors="np")
    assert np.allclose(direct["input_features"][0], item["input_features"].numpy())


def test_collator_pads_labels_with_minus_100_and_drops_the_start_token(speech: SpeechAssets) -> None:
    bundle = build_task(speech.data, speech.model)
    samples = [bundle.train_data[i] for i in range(4)]
    batch = bundle.collate_fn(samples)
    start = bundle.model.config.decoder_start_token_id
    eos = bundle.model.config.eos_token_id
    assert batch["input_features"].shape == (4, 80, 300)
    lengths = [len(s["labels"]) - 1 for s in samples]  # start token dropped
    assert batch["labels"].shape == (4, max(lengths))
    for row, sample, n in zip(batch["labels"], samples, lengths, strict=True):
        assert torch.equal(row[:n], sample["labels"][1:])
        assert row[n - 1] == eos  # end of text is a real label
        assert (row[n:] == -100).all()
        assert start not in row.tolist()
    # A row without the start token keeps its labels as they are.
    mixed = SpeechCollator(start)([samples[0], {**samples[1], "labels": samples[1]["labels"][1:]}])
    assert mixed["labels"][0, 0] == start


def test_split_folders_are_used_as_given(speech: SpeechAssets, tmp_path: Path) -> None:
    root = tmp_path / "data"
    clips = sorted((speech.data / "clips").glob("*.wav"))
    for split, chosen in (("train", clips[:5]), ("validation", clips[5:7])):
        (root / split).mkdir(parents=True)
        for c in chosen:
            shutil.copy(c, root / split / c.name)
        write_metadata(root / split, [(c.name, f"text {c.stem}") for c in chosen])
    train, val = find_splits(root)
    assert [c.path.name for c in train] == [c.name for c in clips[:5]]
    assert [c.path.name for c in val] == [c.name for c in clips[5:7]]


def test_held_out_split_is_seeded_and_disjoint(speech: SpeechAssets) -> None:
    a_train, a_val = find_splits(speech.data, 0.25, seed=3)
    b_train, b_val = find_splits(speech.data, 0.25, seed=3)
    _, c_val = find_splits(speech.data, 0.25, seed=4)
    assert a_val == b_val and a_train == b_train  # every host holds out the same clips
    assert not {c.path for c in a_val} & {c.path for c in a_train}
    assert {c.path for c in a_val} != {c.path for c in c_val}


# ------------------------------------------------------------------- bad input
def test_bad_speech_folders_fail_with_one_clear_line(speech: SpeechAssets, tmp_path: Path) -> None:
    with pytest.raises(TaskError, match="needs --data"):
        build_task(None, speech.model)
    with pytest.raises(TaskError, match="does not exist"):
        build_task(tmp_path / "nowhere", speech.model)
    (tmp_path / "empty").mkdir()
    with pytest.raises(TaskError, match="metadata.csv not found"):
        build_task(tmp_path / "empty", speech.model)
    write_metadata(tmp_path / "cols", [("a.wav", "x")], header=("path", "text"))
    with pytest.raises(TaskError, match="no 'file_name' column"):
        build_task(tmp_path / "cols", speech.model)
    write_metadata(tmp_path / "missing", [("gone.wav", "hello")])
    with pytest.raises(TaskError, match=r"line 2: audio file 'gone.wav' not found"):
        build_task(tmp_path / "missing", speech.model)


def test_recordings_longer_than_the_encoder_window_are_listed_or_skipped(
    speech: SpeechAssets, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "long"
    folder.mkdir()
    for name, seconds in (("long-a.wav", 4), ("long-b.wav", 5)):  # > the tiny model's 3 s
        write_wav(folder / name, np.full((16_000 * seconds, 1), 0.1), 16_000, 2)
    clips = sorted((speech.data / "clips").glob("*.wav"))[:6]
    for c in clips:
        shutil.copy(c, folder / c.name)
    write_metadata(folder, [("long-a.wav", "one"), *[(c.name, "text") for c in clips[:3]],
                            ("long-b.wav", "two"), *[(c.name, "text") for c in clips[3:]]])
    with pytest.raises(TaskError) as refused:
        build_task(folder, speech.model, val_fraction=0)
    message = str(refused.value)
    assert message.startswith("2 clip(s) longer than the 3 s the model hears: ")
    # Every one, not only the first.
    assert f"{folder / 'long-a.wav'} (4.0 s), {folder / 'long-b.wav'} (5.0 s)" in message
    assert "split them" in message and "--set task_options.skip_long_clips=true" in message
    bundle = build_task(folder, speech.model, val_fraction=0, skip_long_clips=True)
    assert [c.path.name for c in bundle.train_data.clips] == [c.name for c in clips]
    assert len(bundle.train_data.labels) == len(clips)
    assert "warning: skipped 2 clip(s) longer than 3 s" in capsys.readouterr().err


def test_what_excel_and_finder_leave_behind(speech: SpeechAssets, tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    clips = sorted((speech.data / "clips").glob("*.wav"))[:4]
    folder = tmp_path / "excel"
    folder.mkdir()
    for c in clips:
        shutil.copy(c, folder / c.name)
    rows = "".join(f"{c.name},{t}\r\n" for c, t in zip(clips, ["hello", "yes", "", "no"], strict=True))
    (folder / "metadata.csv").write_bytes(b"\xef\xbb\xbf" + f"file_name,transcription\r\n{rows}".encode())
    train, _ = find_splits(folder, val_fraction=0)  # Excel's byte-order mark is not a column name
    assert [c.text for c in train] == ["hello", "yes", "", "no"]
    warned = capsys.readouterr().err
    assert f"warning: {folder / 'metadata.csv'}: 1 clip(s) with an empty transcript" in warned

    (folder / "metadata.csv").write_bytes(b"\x00\xff\xfe binary \x81\x82")
    with pytest.raises(TaskError, match=r"metadata.csv: not UTF-8 text \(save it as CSV UTF-8"):
        build_task(folder, speech.model)
    (folder / "metadata.csv").write_text(f"file_name,transcription\n{clips[0].name},{'a' * 200_000}\n")
    with pytest.raises(TaskError, match=r"metadata.csv: not a CSV file that can be read \(field larger"):
        build_task(folder, speech.model)

    (tmp_path / "outside.wav").write_bytes(clips[0].read_bytes())
    write_metadata(folder, [(clips[0].name, "a"), ("../outside.wav", "b")])
    with pytest.raises(TaskError, match=r"metadata.csv line 3: audio file '../outside.wav' is outside"):
        build_task(folder, speech.model)

    with wave.open(str(folder / "empty.wav"), "wb") as w:  # a header and no samples
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16_000)
    write_metadata(folder, [(c.name, "a") for c in clips] + [("empty.wav", "b")])
    with pytest.raises(TaskError, match=r"empty.wav: the recording holds no audio \(0 samples\)"):
        build_task(folder, speech.model)

    write_wav(folder / "quiet.wav", np.zeros((16_000, 1)), 16_000, 2)
    write_metadata(folder, [(c.name, "a") for c in clips] + [("quiet.wav", "b")])
    build_task(folder, speech.model, val_fraction=0)
    assert f"warning: 1 silent clip(s) (peak below 0.0001): {folder / 'quiet.wav'}" in capsys.readouterr().err

    with pytest.raises(TaskError, match=r"is a file, not a folder: --data takes a folder"):
        build_task(folder / "metadata.csv", speech.model)


def test_a_validation_folder_with_another_name_is_pointed_out(
    speech: SpeechAssets, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    clips = sorted((speech.data / "clips").glob("*.wav"))
    for split, chosen in (("train", clips[:4]), ("eval", clips[4:6])):
        (tmp_path / split).mkdir()
        for c in chosen:
            shutil.copy(c, tmp_path / split / c.name)
        write_metadata(tmp_path / split, [(c.name, "text") for c in chosen])
    train, val = find_splits(tmp_path)
    assert len(train) == 4 and val == []
    assert (f"warning: {tmp_path}: folder eval/ is not used as validation data; name it one of "
            "validation, val, valid, dev, test") in capsys.readouterr().err
    (tmp_path / "eval").rename(tmp_path / "dev")
    assert len(find_splits(tmp_path)[1]) == 2


def test_unknown_model_is_a_clear_error_offline(speech: SpeechAssets) -> None:
    with pytest.raises(TaskError, match="cannot load model 'openai/whisper-nonexistent' as a hub id"):
        build_task(speech.data, speech.model, model="openai/whisper-nonexistent", tokenizer=str(speech.model))


def test_dataset_labels_fit_the_decoder(speech: SpeechAssets) -> None:
    bundle = build_task(speech.data, speech.model)
    tokenizer = bundle.model.tokenizer
    with pytest.raises(ValueError, match="tokens; the model decodes at most 5"):
        SpeechDataset(bundle.train_data.clips, bundle.model.feature_extractor, tokenizer, max_label_tokens=5)


def test_the_tiny_model_hears_as_long_as_its_datas_longest_clip(tmp_path: Path) -> None:
    """`python -m meshtrain.hf.tiny model --data DIR` sizes the encoder's window to the
    longest recording (whole seconds, at most Whisper's 30): a dataset spoken with longer
    sentences than the demo's 3 s trains instead of being refused clip by clip."""
    from meshtrain.hf.audio import read_audio
    from meshtrain.hf.tiny import main, make_speech_dataset
    require_espeak()
    long = "the quick brown fox jumps over the lazy dog and then runs far away into the woods"
    data = make_speech_dataset(tmp_path / "speech", [long, "open the red door", "turn the light on"])
    seconds = len(read_audio(data / "clips" / "0000.wav")) / 16_000
    assert seconds > 3
    main(["model", str(tmp_path / "tiny"), "--data", str(data)])
    config = json.loads((tmp_path / "tiny" / "config.json").read_text())
    assert 2 * config["max_source_positions"] == 100 * math.ceil(seconds)
    options = whisper_options(tmp_path / "tiny", val_fraction=0.0)
    bundle = TASK.build(TaskOptions(data=str(data), seed=0, options=options))
    assert len(bundle.train_data) == 3  # none refused as too long
