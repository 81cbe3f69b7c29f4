"""Transcribe recordings with a fine-tuned model folder (a run's ``model/``).

The folder is what a whisper run saves: a LoRA adapter (peft format) or a full
checkpoint, with its tokenizer and feature extractor. Decoding uses the same prefix
rules as training (:func:`meshtrain.hf.decoding.resolve_decoding`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

from meshtrain.hf.audio import SAMPLE_RATE, read_audio
from meshtrain.hf.decoding import resolve_decoding
from meshtrain.hf.model import HFModel
from meshtrain.hf.speech import feature_extractor_for
from meshtrain.hf.tokenizer import load_tokenizer


def load_for_transcription(model_dir: str, language: str | None = None, task: str | None = None,
                           max_new_tokens: int = 128) -> HFModel:
    """The model in ``model_dir`` with its tokenizer, feature extractor and decoding prefix."""
    model = HFModel.from_pretrained(model_dir)
    model.tokenizer = load_tokenizer(model_dir)
    model.feature_extractor = feature_extractor_for(model.config, model_dir)
    decoding = resolve_decoding(model.base, language, task, model_dir)
    model.generate_kwargs = {"max_new_tokens": max_new_tokens, **decoding.generate_kwargs()}
    return model.eval()


def transcribe_files(model: HFModel, paths: Sequence[Path],
                     batch_size: int = 8) -> Iterator[tuple[Path, str]]:
    """(path, text) for every recording, in order, ``batch_size`` clips per ``generate``.

    A clip longer than the model's window is cut to it (Whisper hears 30 s at most).
    """
    extractor = model.feature_extractor
    for start in range(0, len(paths), batch_size):
        chunk = list(paths[start:start + batch_size])
        audio = [read_audio(p) for p in chunk]
        features = extractor(audio, sampling_rate=SAMPLE_RATE, return_tensors="pt").input_features
        device = next(model.parameters()).device
        with torch.no_grad():
            texts = model.transcribe({"input_features": features.to(device)})
        yield from zip(chunk, (t.strip() for t in texts), strict=True)
