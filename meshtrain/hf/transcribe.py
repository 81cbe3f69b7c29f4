"""Transcribe recordings with a fine-tuned model folder (a run's ``model/``).

The folder is what a whisper run saves: a LoRA adapter (peft format) or a full
checkpoint, with its tokenizer and feature extractor. Decoding uses the same prefix
rules as training (:func:`meshtrain.hf.decoding.resolve_decoding`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import torch

from meshtrain.engine.math_kernels import resolve_math_kernels
from meshtrain.hf.audio import SAMPLE_RATE, SpeechDataError, read_audio
from meshtrain.hf.decoding import resolve_decoding
from meshtrain.hf.model import HFModel
from meshtrain.hf.speech import feature_extractor_for
from meshtrain.hf.tokenizer import load_tokenizer


def load_for_transcription(model_dir: str, language: str | None = None, task: str | None = None,
                           max_new_tokens: int = 128) -> HFModel:
    """The model in ``model_dir`` with its tokenizer, feature extractor and decoding prefix."""
    resolve_math_kernels()  # before the model's first exp or tanh on several threads (engine/math_kernels.py)
    model = HFModel.from_pretrained(model_dir)
    model.tokenizer = load_tokenizer(model_dir)
    model.feature_extractor = feature_extractor_for(model.config, model_dir)
    decoding = resolve_decoding(model.base, language, task, model_dir)
    model.generate_kwargs = {"max_new_tokens": max_new_tokens, **decoding.generate_kwargs()}
    return model.eval()


def transcribe_files(model: HFModel, paths: Sequence[Path],
                     batch_size: int = 8) -> Iterator[tuple[Path, str | SpeechDataError]]:
    """(path, text) for every recording, in order, ``batch_size`` windows per ``generate``;
    (path, the error) for a recording no decoder reads, and the others go on.

    A recording longer than the model's window (30 s for Whisper) is cut into consecutive
    windows, each transcribed alone, and their texts are joined: the model never hears
    more than one window, and a word that straddles a boundary may be lost or split.
    """
    extractor = model.feature_extractor
    window = int(extractor.n_samples)
    device = next(model.parameters()).device
    for start in range(0, len(paths), batch_size):
        chunk = list(paths[start:start + batch_size])
        heard: list[str | SpeechDataError] = []
        pieces: list[tuple[int, np.ndarray]] = []  # (index in chunk, one window's samples)
        for index, path in enumerate(chunk):
            try:
                audio = read_audio(path)
            except SpeechDataError as exc:
                heard.append(exc)
                continue
            heard.append("")
            pieces += [(index, audio[at:at + window]) for at in range(0, max(len(audio), 1), window)]
        texts: dict[int, list[str]] = {}
        for at in range(0, len(pieces), batch_size):
            batch = pieces[at:at + batch_size]
            features = extractor([a for _, a in batch], sampling_rate=SAMPLE_RATE,
                                 return_tensors="pt").input_features
            with torch.no_grad():
                decoded = model.transcribe({"input_features": features.to(device)})
            for (index, _), text in zip(batch, decoded, strict=True):
                texts.setdefault(index, []).append(text.strip())
        for index, path in enumerate(chunk):
            got = heard[index]
            yield path, got if isinstance(got, SpeechDataError) else " ".join(t for t in texts[index] if t)
