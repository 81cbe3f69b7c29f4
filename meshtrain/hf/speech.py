"""Speech data: a folder of recordings with a transcript file, as Whisper batches.

The folder follows Hugging Face's *audiofolder* convention::

    DIR/metadata.csv          file_name,transcription
    DIR/clips/0001.wav        (file_name is relative to DIR)

or one such folder per split: ``DIR/train/`` plus ``DIR/validation/`` (or ``val/``,
``test/``). Audio is read as 16 kHz mono (mixed down and resampled as needed), turned
into log-mel features by ``WhisperFeatureExtractor`` and transcripts into labels by the
model's tokenizer. Audio decoding (WAV built in; other formats through soundfile,
ffmpeg or sox) is :mod:`meshtrain.hf.audio`; features are cached on disk by
:mod:`meshtrain.hf.feature_cache`, not in memory.
"""

from __future__ import annotations

import csv
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from meshtrain.hf.audio import (
    SAMPLE_RATE,
    SpeechDataError,
    UnsupportedWav,
    mono,
    read_audio,
    read_wav,
    resample,
    wav_format,
)
from meshtrain.hf.feature_cache import FeatureCache

__all__ = ["SAMPLE_RATE", "Clip", "SpeechCollator", "SpeechDataError", "SpeechDataset",
           "feature_extractor_for", "find_splits", "mono", "read_audio", "read_metadata", "read_wav",
           "resample"]

SPLIT_DIRS = {"train": ("train",), "val": ("validation", "val", "valid", "dev", "test")}


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

    Everything that can be wrong with a clip is found here, before training: transcripts
    too long for the decoder, and recordings too long for the encoder or that no decoder
    reads (WAV durations come from the header; other formats are decoded now, and with a
    cache their features are kept). Features are never held in memory: with
    ``cache_dir`` they are computed once and read back from disk, without it computed
    on every access.

    Args:
        clips: recordings and transcripts (see :func:`find_splits`).
        feature_extractor: a ``WhisperFeatureExtractor``; it pads or cuts every clip to
            its ``n_samples`` (30 s for real Whisper), which the encoder requires.
        tokenizer: the model's tokenizer.
        max_label_tokens: the decoder's length limit (``max_target_positions``).
        cache_dir: folder for the on-disk feature cache (see
            :func:`~meshtrain.hf.feature_cache.default_cache_dir`); None computes on the fly.
    """

    def __init__(self, clips: list[Clip], feature_extractor: Any, tokenizer: Any,
                 max_label_tokens: int | None = None, cache_dir: str | Path | None = None) -> None:
        self.clips = clips
        self.feature_extractor = feature_extractor
        self.max_seconds = feature_extractor.n_samples / feature_extractor.sampling_rate
        self.cache = FeatureCache(cache_dir, feature_extractor) if cache_dir is not None else None
        self._keys: dict[int, str] = {}  # cache keys (64 characters a clip), so files are hashed once
        self.labels = [tokenizer(c.text).input_ids for c in clips]
        for index, (clip, ids) in enumerate(zip(clips, self.labels, strict=True)):
            if max_label_tokens is not None and len(ids) > max_label_tokens:
                raise SpeechDataError(f"{clip.path}: transcript is {len(ids)} tokens; the model "
                                      f"decodes at most {max_label_tokens}")
            self._check_recording(index)

    def _check_recording(self, index: int) -> None:
        path = self.clips[index].path
        try:
            seconds = wav_format(path).seconds
        except UnsupportedWav:
            self.features(index)  # not a WAV the header tells about: decode it now
            return
        self._check_length(path, seconds)

    def _check_length(self, path: Path, seconds: float) -> None:
        if seconds > self.max_seconds + 1e-3:
            raise SpeechDataError(f"{path}: {seconds:.1f} s long; the model hears at most "
                                  f"{self.max_seconds:.1f} s (split or drop it)")

    def __len__(self) -> int:
        return len(self.clips)

    def features(self, index: int) -> torch.Tensor:
        """Log-mel features of clip ``index``: from the disk cache, else computed (and cached)."""
        clip = self.clips[index]
        key = None
        if self.cache is not None:
            key = self._keys.get(index)
            if key is None:
                key = self._keys[index] = self.cache.key(clip.path)
            cached = self.cache.load(key)
            if cached is not None:
                return torch.from_numpy(cached)
        rate = self.feature_extractor.sampling_rate
        audio = read_audio(clip.path, rate)
        self._check_length(clip.path, len(audio) / rate)
        features = self.feature_extractor(audio, sampling_rate=rate, return_tensors="np")["input_features"][0]
        if self.cache is not None and key is not None:
            self.cache.store(key, features)
        return torch.from_numpy(features)

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
