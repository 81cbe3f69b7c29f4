"""Speech data: a folder of recordings with a transcript file, as Whisper batches.

The folder follows Hugging Face's *audiofolder* convention::

    DIR/metadata.csv          file_name,transcription
    DIR/clips/0001.wav        (file_name is relative to DIR)

or one such folder per split: ``DIR/train/`` plus ``DIR/validation/`` (or ``val/``,
``test/``). Audio is read as 16 kHz mono (mixed down and resampled as needed), turned
into log-mel features by ``WhisperFeatureExtractor`` and transcripts into labels by the
model's tokenizer. WAV is read with the standard library; other formats (flac, mp3,
m4a...) need ``soundfile``, ``ffmpeg`` or ``sox``.
"""

from __future__ import annotations

import csv
import math
import random
import shutil
import subprocess
import wave
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

SAMPLE_RATE = 16_000
SPLIT_DIRS = {"train": ("train",), "val": ("validation", "val", "valid", "dev", "test")}


class SpeechDataError(ValueError):
    """Bad speech data: missing folder, transcript file, column or recording (one line)."""


# --------------------------------------------------------------------------- audio
def read_audio(path: str | Path, sample_rate: int = SAMPLE_RATE) -> np.ndarray:
    """A recording as float32 mono at ``sample_rate``, in [-1, 1]."""
    path = Path(path)
    if path.suffix.lower() == ".wav":
        audio, rate = read_wav(path)
    else:
        audio, rate = _read_other(path)
    return resample(audio, rate, sample_rate)


def read_wav(path: str | Path) -> tuple[np.ndarray, int]:
    """PCM WAV (8, 16, 24 or 32 bit, any channel count) as float32 mono and its rate."""
    try:
        with wave.open(str(path), "rb") as w:
            channels, width, rate = w.getnchannels(), w.getsampwidth(), w.getframerate()
            raw = w.readframes(w.getnframes())
    except (wave.Error, EOFError) as exc:
        raise SpeechDataError(f"{path}: not a PCM WAV file ({exc})") from exc
    if width == 1:  # 8-bit WAV is unsigned
        samples = (np.frombuffer(raw, np.uint8).astype(np.float32) - 128.0) / 128.0
    elif width == 3:  # 24-bit: widen each little-endian triple to int32
        b = np.frombuffer(raw, np.uint8).reshape(-1, 3).astype(np.int32)
        ints = (b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16)) << 8
        samples = ints.astype(np.float32) / 2**31
    elif width in (2, 4):
        dtype = np.int16 if width == 2 else np.int32
        samples = np.frombuffer(raw, dtype).astype(np.float32) / float(2 ** (8 * width - 1))
    else:
        raise SpeechDataError(f"{path}: unsupported WAV sample width {width} bytes")
    return mono(samples.reshape(-1, channels)), rate


def mono(frames: np.ndarray) -> np.ndarray:
    """Average the channels of a (frames, channels) array."""
    return frames.mean(axis=1).astype(np.float32) if frames.ndim == 2 else frames.astype(np.float32)


def resample(audio: np.ndarray, rate: int, target: int = SAMPLE_RATE) -> np.ndarray:
    """Polyphase resampling (scipy) from ``rate`` to ``target`` Hz."""
    if rate == target:
        return audio.astype(np.float32)
    from scipy.signal import resample_poly

    ratio = Fraction(target, rate)
    return resample_poly(audio, ratio.numerator, ratio.denominator).astype(np.float32)


def _read_other(path: Path) -> tuple[np.ndarray, int]:
    """Non-WAV formats through soundfile, ffmpeg or sox, whichever is installed."""
    try:
        import soundfile

        data, rate = soundfile.read(str(path), dtype="float32", always_2d=True)
        return mono(data), int(rate)
    except ImportError:
        pass
    if shutil.which("ffmpeg"):
        cmd = ["ffmpeg", "-nostdin", "-v", "error", "-i", str(path), "-f", "f32le", "-ac", "1",
               "-ar", str(SAMPLE_RATE), "-"]
    elif shutil.which("sox"):
        cmd = ["sox", str(path), "-t", "raw", "-e", "floating-point", "-b", "32", "-c", "1",
               "-r", str(SAMPLE_RATE), "-"]
    else:
        raise SpeechDataError(
            f"{path}: only WAV can be read without soundfile, ffmpeg or sox; install one "
            "or convert the recordings to WAV"
        )
    done = subprocess.run(cmd, capture_output=True, check=False)
    if done.returncode != 0:
        raise SpeechDataError(f"{path}: {cmd[0]} could not decode it: {done.stderr.decode()[:200]}")
    return np.frombuffer(done.stdout, np.float32).copy(), SAMPLE_RATE


def wav_seconds(path: Path) -> float | None:
    """Duration from a WAV header (cheap), or None for other formats."""
    if path.suffix.lower() != ".wav":
        return None
    try:
        with wave.open(str(path), "rb") as w:
            return w.getnframes() / w.getframerate()
    except (wave.Error, EOFError) as exc:
        raise SpeechDataError(f"{path}: not a PCM WAV file ({exc})") from exc


# ------------------------------------------------------------------------ metadata
@dataclass(frozen=True)
class Clip:
    """One recording and its transcript."""

    path: Path
    text: str


def read_metadata(folder: Path, text_column: str = "transcription") -> list[Clip]:
    """The clips listed in ``folder/metadata.csv``; every named file must exist."""
    meta = folder / "metadata.csv"
    if not meta.is_file():
        raise SpeechDataError(f"{meta} not found: a speech folder needs metadata.csv "
                              f"with columns file_name,{text_column}")
    with meta.open(newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        columns = reader.fieldnames or []
        for column in ("file_name", text_column):
            if column not in columns:
                raise SpeechDataError(f"{meta}: no {column!r} column (columns: {', '.join(columns)})")
        clips = []
        for line, row in enumerate(reader, start=2):
            name = (row["file_name"] or "").strip()
            path = folder / name
            if not name or not path.is_file():
                raise SpeechDataError(f"{meta} line {line}: audio file {name!r} not found in {folder}")
            clips.append(Clip(path, (row[text_column] or "").strip()))
    if not clips:
        raise SpeechDataError(f"{meta} lists no recordings")
    return clips


def find_splits(
    directory: str | Path, val_fraction: float = 0.1, seed: int = 0, text_column: str = "transcription"
) -> tuple[list[Clip], list[Clip]]:
    """(train, validation) clips of a speech folder.

    With split folders (``train/`` and ``validation/``...) they are used as given;
    with one ``metadata.csv`` a seeded ``val_fraction`` of the clips is held out.
    """
    root = Path(directory)
    if not root.is_dir():
        raise SpeechDataError(f"speech data folder {root} does not exist")
    train_dir = root / "train"
    if (train_dir / "metadata.csv").is_file():
        train = read_metadata(train_dir, text_column)
        for name in SPLIT_DIRS["val"]:
            if (root / name / "metadata.csv").is_file():
                return train, read_metadata(root / name, text_column)
        return train, []
    clips = read_metadata(root, text_column)
    if not 0 <= val_fraction < 1:
        raise SpeechDataError(f"val_fraction must be in [0, 1), got {val_fraction}")
    n_val = math.ceil(len(clips) * val_fraction) if val_fraction > 0 and len(clips) > 1 else 0
    order = list(range(len(clips)))
    random.Random(seed).shuffle(order)  # seeded: every host holds out the same clips
    held = set(order[:n_val])
    return [c for i, c in enumerate(clips) if i not in held], [c for i, c in enumerate(clips) if i in held]


# ------------------------------------------------------------------------- dataset
class SpeechDataset(Dataset):
    """Clips as ``{"input_features": (mels, frames) float, "labels": (tokens,) long}``.

    Features are computed on first access and kept (a clip's features are a few
    hundred KB); labels are tokenized up front so over-long transcripts fail at once.

    Args:
        clips: recordings and transcripts (see :func:`find_splits`).
        feature_extractor: a ``WhisperFeatureExtractor``; it pads or cuts every clip to
            its ``n_samples`` (30 s for real Whisper), which the encoder requires.
        tokenizer: the model's tokenizer.
        max_label_tokens: the decoder's length limit (``max_target_positions``).
    """

    def __init__(self, clips: list[Clip], feature_extractor: Any, tokenizer: Any,
                 max_label_tokens: int | None = None) -> None:
        self.clips = clips
        self.feature_extractor = feature_extractor
        self.max_seconds = feature_extractor.n_samples / feature_extractor.sampling_rate
        self.labels = [tokenizer(c.text).input_ids for c in clips]
        for clip, ids in zip(clips, self.labels, strict=True):
            if max_label_tokens is not None and len(ids) > max_label_tokens:
                raise SpeechDataError(f"{clip.path}: transcript is {len(ids)} tokens; the model "
                                      f"decodes at most {max_label_tokens}")
            seconds = wav_seconds(clip.path)
            if seconds is not None and seconds > self.max_seconds + 1e-3:
                raise SpeechDataError(f"{clip.path}: {seconds:.1f} s long; the model hears at most "
                                      f"{self.max_seconds:.1f} s (split or drop it)")
        self._features: dict[int, torch.Tensor] = {}

    def __len__(self) -> int:
        return len(self.clips)

    def features(self, index: int) -> torch.Tensor:
        cached = self._features.get(index)
        if cached is None:
            clip = self.clips[index]
            audio = read_audio(clip.path, self.feature_extractor.sampling_rate)
            if len(audio) > self.feature_extractor.n_samples:
                raise SpeechDataError(f"{clip.path}: {len(audio) / SAMPLE_RATE:.1f} s long; the model "
                                      f"hears at most {self.max_seconds:.1f} s (split or drop it)")
            out = self.feature_extractor(audio, sampling_rate=self.feature_extractor.sampling_rate,
                                         return_tensors="np")
            cached = torch.from_numpy(out["input_features"][0])
            self._features[index] = cached
        return cached

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_features": self.features(index),
                "labels": torch.tensor(self.labels[index], dtype=torch.long)}


class SpeechCollator:
    """Stacks features and pads labels with -100 (ignored by the loss).

    The model prepends ``decoder_start_token_id`` itself when it shifts labels right,
    so a leading start token that every row carries is dropped (the tokenizer added it).
    """

    def __init__(self, decoder_start_token_id: int | None) -> None:
        self.decoder_start_token_id = decoder_start_token_id

    def __call__(self, samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        features = torch.stack([s["input_features"] for s in samples])
        rows = [s["labels"] for s in samples]
        start = self.decoder_start_token_id
        if start is not None and all(len(r) > 1 and int(r[0]) == start for r in rows):
            rows = [r[1:] for r in rows]
        labels = torch.full((len(rows), max(len(r) for r in rows)), -100, dtype=torch.long)
        for i, r in enumerate(rows):
            labels[i, : len(r)] = r
        return {"input_features": features, "labels": labels}


def feature_extractor_for(config: Any, name_or_path: str | None = None) -> Any:
    """The model's ``WhisperFeatureExtractor``: the one saved with it, else built from its config.

    The encoder accepts exactly ``2 * max_source_positions`` frames (hop 160 at 16 kHz),
    so an extractor whose window does not match the config is rebuilt to match it.
    """
    from transformers import WhisperFeatureExtractor

    frames = 2 * config.max_source_positions
    extractor = None
    if name_or_path is not None:
        try:
            extractor = WhisperFeatureExtractor.from_pretrained(name_or_path)
        except (OSError, ValueError):
            extractor = None  # no preprocessor_config.json: build one below
    if (extractor is None or extractor.nb_max_frames != frames
            or extractor.feature_size != config.num_mel_bins):
        hop = extractor.hop_length if extractor is not None else 160
        extractor = WhisperFeatureExtractor(
            feature_size=config.num_mel_bins, sampling_rate=SAMPLE_RATE, hop_length=hop,
            chunk_length=frames * hop // SAMPLE_RATE,
        )
    return extractor
