"""Real speech for the Hugging Face tests: espeak-ng recordings and a tiny random Whisper.

The dataset is spoken by Debian's espeak-ng (22.05 kHz, so loading resamples it), and the
model is a tiny Whisper with a BPE tokenizer trained on the transcripts, saved with
``save_pretrained`` so tests load it back by path through the real loading code. Both are
built once per session. Test modules import the fixture with
``from speech_fixtures import speech_fixture  # noqa: F401`` and take ``speech``.
Without espeak-ng the tests skip, except in CI (CI=1) where
.ci/run installs it and its absence is a failure.
"""

from __future__ import annotations

import functools
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest

from meshtrain.hf.tiny import SENTENCES, make_speech_dataset, make_tiny_whisper

#: Spoken sentences (12): 3 held out for validation by the tasks' val_fraction=0.25.
SPOKEN = SENTENCES[:12]


@dataclass(frozen=True)
class SpeechAssets:
    data: Path  # audiofolder: clips/*.wav + metadata.csv
    model: Path  # tiny Whisper + tokenizer + feature extractor
    texts: tuple[str, ...]


def require_espeak() -> None:
    if shutil.which("espeak-ng") is None:
        reason = "espeak-ng is not installed (apt-get install espeak-ng): speech tests need real recordings"
        if os.environ.get("CI"):
            pytest.fail(reason + " and CI must run them")
        pytest.skip(reason)


@functools.cache
def _build(root: Path) -> SpeechAssets:
    data = make_speech_dataset(root / "speech", SPOKEN)
    model = make_tiny_whisper(root / "tiny-whisper", SPOKEN, seed=0)
    return SpeechAssets(data, model, tuple(SPOKEN))


@pytest.fixture(scope="session", name="speech")
def speech_fixture(tmp_path_factory: pytest.TempPathFactory) -> SpeechAssets:
    """The session's speech folder and tiny Whisper (built on first use)."""
    require_espeak()
    return _build(tmp_path_factory.getbasetemp() / "hf-speech")


@functools.cache
def _build_kind(root: Path, kind: str) -> Path:
    return make_tiny_whisper(root / f"tiny-whisper-{kind}", SPOKEN, seed=0, kind=kind)


@pytest.fixture(scope="session", name="english_model")
def english_model_fixture(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Whisper saved like ``whisper-tiny.en``: Whisper's tokenizer (language tokens
    included) but a generation config with ``is_multilingual: false`` and no ``lang_to_id``."""
    return _build_kind(tmp_path_factory.getbasetemp() / "hf-speech", "english")


@pytest.fixture(scope="session", name="multilingual_model")
def multilingual_model_fixture(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Whisper saved like ``whisper-tiny``: ``lang_to_id`` and ``task_to_id`` for every language."""
    return _build_kind(tmp_path_factory.getbasetemp() / "hf-speech", "multilingual")


def whisper_options(model_dir: Path, **overrides: object) -> dict[str, object]:
    """Whisper task options for the tiny model (checked against the task's option names)."""
    from meshtrain.tasks import check_options
    from meshtrain.tasks.whisper import TASK

    # The session's own feature cache, beside the models (not the user's ~/.cache).
    cache = str(Path(model_dir).parent / "feature-cache")
    return check_options(TASK, {"model": str(model_dir), "language": None, "val_fraction": 0.25,
                                "feature_cache": cache, **overrides})
