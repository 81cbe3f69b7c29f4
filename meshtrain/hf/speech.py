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
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
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
from meshtrain.progress import Status

__all__ = ["SAMPLE_RATE", "Clip", "SpeechCollator", "SpeechDataError", "SpeechDataset",
           "feature_extractor_for", "find_splits", "mono", "read_audio", "read_metadata", "read_wav",
           "resample"]

SPLIT_DIRS = {"train": ("train",), "val": ("validation", "val", "valid", "dev", "test")}
#: Peak amplitude below which a clip counts as silent (about -80 dBFS).
SILENT_PEAK = 1e-4


def speech_warning(message: str) -> None:
    """A data problem that does not stop the run but likely spoils it: one line on stderr."""
    print(f"warning: {message}", file=sys.stderr, flush=True)


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
    root = folder.resolve()
    # utf-8-sig: Excel's "CSV UTF-8" starts the file with a byte-order mark, which plain
    # utf-8 would glue to the first column's name.
    try:
        with meta.open(newline="", encoding="utf-8-sig") as f:
            reader = csv.DictReader(f)
            rows = list(reader)
            columns = list(reader.fieldnames or [])
    except UnicodeDecodeError:
        raise SpeechDataError(f"{meta}: not UTF-8 text (save it as CSV UTF-8, with columns "
                              f"file_name,{text_column})") from None
    except csv.Error as exc:  # a field over csv's 128 KiB limit, say
        raise SpeechDataError(f"{meta}: not a CSV file that can be read ({exc})") from None
    for column in ("file_name", text_column):
        if column not in columns:
            raise SpeechDataError(f"{meta}: no {column!r} column (columns: {', '.join(columns)})")
    clips, untranscribed = [], []
    for line, row in enumerate(rows, start=2):
        name = (row["file_name"] or "").strip()
        path = folder / name
        # A row must name a file inside the folder: launch ships only the folder, and a
        # transcript file should not reach elsewhere on the disk.
        if name and not (folder / name).resolve().is_relative_to(root):
            raise SpeechDataError(f"{meta} line {line}: audio file {name!r} is outside {folder}; "
                                  "copy it into the folder and name it relative to it")
        if not name or not path.is_file():
            raise SpeechDataError(f"{meta} line {line}: audio file {name!r} not found in {folder}")
        text = (row[text_column] or "").strip()
        if not text:
            untranscribed.append(f"line {line} ({name})")
        clips.append(Clip(path, text))
    if not clips:
        raise SpeechDataError(f"{meta} lists no recordings")
    if untranscribed:
        speech_warning(f"{meta}: {len(untranscribed)} clip(s) with an empty transcript (they teach "
                       f"the model silence): {_listing(untranscribed)}")
    return clips


def _listing(items: list[str], most: int = 10) -> str:
    """``items`` joined, the first ``most`` of them and a count of the rest."""
    shown = ", ".join(items[:most])
    return shown if len(items) <= most else f"{shown} and {len(items) - most} more"


def find_splits(
    directory: str | Path, val_fraction: float = 0.1, seed: int = 0, text_column: str = "transcription"
) -> tuple[list[Clip], list[Clip]]:
    """(train, validation) clips of a speech folder.

    With split folders (``train/`` and ``validation/``...) they are used as given;
    with one ``metadata.csv`` a seeded ``val_fraction`` of the clips is held out.
    """
    root = Path(directory)
    if root.exists() and not root.is_dir():
        raise SpeechDataError(f"speech data {root} is a file, not a folder: --data takes a folder "
                              "holding metadata.csv and the recordings")
    if not root.is_dir():
        raise SpeechDataError(f"speech data folder {root} does not exist")
    train_dir = root / "train"
    if (train_dir / "metadata.csv").is_file():
        train = read_metadata(train_dir, text_column)
        for name in SPLIT_DIRS["val"]:
            if (root / name / "metadata.csv").is_file():
                return train, read_metadata(root / name, text_column)
        others = sorted(p.name for p in root.iterdir() if p.is_dir() and p.name != "train"
                        and (p / "metadata.csv").is_file())
        if others:
            speech_warning(f"{root}: folder {others[0]}/ is not used as validation data; name it "
                           f"one of {', '.join(SPLIT_DIRS['val'])} (no WER is measured without one)")
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
class SpeechDataset(Dataset[dict[str, Any]]):
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
            With a cache, the check also computes every clip's missing features, so the
            first epoch does not.
        status: announces the check (a bar over the clips); ``split`` names them in it.
    """

    def __init__(self, clips: list[Clip], feature_extractor: Any, tokenizer: Any,
                 max_label_tokens: int | None = None, cache_dir: str | Path | None = None,
                 skip_long_clips: bool = False, *, status: Status | None = None,
                 split: str = "") -> None:
        self.feature_extractor = feature_extractor
        self.max_seconds = feature_extractor.n_samples / feature_extractor.sampling_rate
        self.cache = FeatureCache(cache_dir, feature_extractor) if cache_dir is not None else None
        self._keys: dict[int, str] = {}  # cache keys (64 characters a clip), so files are hashed once
        labels = [tokenizer(c.text).input_ids for c in clips]
        for clip, ids in zip(clips, labels, strict=True):
            if max_label_tokens is not None and len(ids) > max_label_tokens:
                raise SpeechDataError(f"{clip.path}: transcript is {len(ids)} tokens; the model "
                                      f"decodes at most {max_label_tokens}")
        # Every clip is checked before the first is refused, so one message lists them all.
        self.clips, self.labels = clips, labels
        status = status or Status(enabled=False)
        others = sum(1 for c in clips if c.path.suffix.lower() != ".wav")
        doing = ["checking"] + (["decoding non-WAV"] if others else []) + \
            (["computing features of"] if self.cache is not None else [])
        label = f"{', '.join(doing[:-1])} and {doing[-1]}" if len(doing) > 1 else doing[0]
        seconds = []
        with status.items(f"{label} {len(clips)} {split} clips".replace("  ", " "), len(clips),
                          "clips") as advance:
            for index in range(len(clips)):
                seconds.append(self._check_recording(index))
                advance()
        long = [(c, s) for c, s in zip(clips, seconds, strict=True) if s > self.max_seconds + 1e-3]
        silent = [c for c, s in zip(clips, seconds, strict=True) if s < 0]
        if long and not skip_long_clips:
            raise SpeechDataError(
                f"{len(long)} clip(s) longer than the {self.max_seconds:.0f} s the model hears: "
                + _listing([f"{c.path} ({s:.1f} s)" for c, s in long])
                + f"; split them into pieces of at most {self.max_seconds:.0f} s (e.g. sox IN.wav "
                  f"OUT.wav trim 0 {self.max_seconds:.0f} : newfile : restart, with a transcript per "
                  "piece), or skip them with --set task_options.skip_long_clips=true")
        if long:
            speech_warning(f"skipped {len(long)} clip(s) longer than {self.max_seconds:.0f} s "
                           f"(task_options.skip_long_clips): {_listing([str(c.path) for c, _ in long])}")
            kept = [i for i, s in enumerate(seconds) if s <= self.max_seconds + 1e-3]
            self.clips, self.labels = [clips[i] for i in kept], [labels[i] for i in kept]
            self._keys = {}  # indices changed
            if not self.clips:
                raise SpeechDataError("every clip is longer than the model hears: nothing left to train on")
        if silent:
            speech_warning(f"{len(silent)} silent clip(s) (peak below {SILENT_PEAK:g}): "
                           + _listing([str(c.path) for c in silent]))

    def _check_recording(self, index: int) -> float:
        """The clip's length in seconds, negative when it is silent; raises for a clip
        without a single sample."""
        path = self.clips[index].path
        try:
            fmt = wav_format(path)
        except UnsupportedWav:
            if self._cached(index):  # decoded and checked by an earlier run
                return 0.0
            # Not a WAV the header tells about: decode it now (its features are cached).
            audio = read_audio(path, self.feature_extractor.sampling_rate)
            seconds = len(audio) / self.feature_extractor.sampling_rate
            self._check_empty(path, len(audio))
            if seconds <= self.max_seconds + 1e-3:
                self.features(index, audio)
            return -seconds if float(abs(audio).max()) < SILENT_PEAK else seconds
        self._check_empty(path, fmt.frames)
        if fmt.seconds > self.max_seconds + 1e-3:
            return fmt.seconds
        audio, rate = read_wav(path)
        if self.cache is not None and not self._cached(index):  # now, not in the first epoch
            self.features(index, resample(audio, rate, self.feature_extractor.sampling_rate))
        return -fmt.seconds if float(abs(audio).max()) < SILENT_PEAK else fmt.seconds

    def _cached(self, index: int) -> bool:
        if self.cache is None:
            return False
        key = self._keys.get(index)
        if key is None:
            key = self._keys[index] = self.cache.key(self.clips[index].path)
        return self.cache.path(key).is_file()

    @staticmethod
    def _check_empty(path: Path, frames: int) -> None:
        if frames == 0:
            raise SpeechDataError(f"{path}: the recording holds no audio (0 samples); re-export it "
                                  "or remove its row from metadata.csv")

    def _check_length(self, path: Path, seconds: float) -> None:
        if seconds > self.max_seconds + 1e-3:
            raise SpeechDataError(f"{path}: {seconds:.1f} s long; the model hears at most "
                                  f"{self.max_seconds:.1f} s (split or drop it)")

    def __len__(self) -> int:
        return len(self.clips)

    def features(self, index: int, audio: np.ndarray | None = None) -> torch.Tensor:
        """Log-mel features of clip ``index``: from the disk cache, else computed (and cached)
        from ``audio`` when the caller has decoded it already."""
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
        if audio is None:
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
