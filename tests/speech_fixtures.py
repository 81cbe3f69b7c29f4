"""Real speech for the Hugging Face tests: espeak-ng recordings and a tiny random Whisper.

The dataset is spoken by Debian's espeak-ng (22.05 kHz, so loading resamples it), and the
model is a tiny Whisper with a BPE tokenizer trained on the transcripts, saved with
``save_pretrained`` so tests load it back by path through the real loading code. Both are
built once per test run: under xdist the first worker that needs them builds them in the
run's shared temporary folder (the workers' parent) while holding a lock, and the others
wait for it and load the same files (~10 s of espeak-ng and tokenizer training each, which
three workers did three times). Test modules import the fixture with
``from speech_fixtures import speech_fixture  # noqa: F401`` and take ``speech``.
Without espeak-ng the tests skip, except in CI (CI=1) where
.ci/run installs it and its absence is a failure.
"""

from __future__ import annotations

import fcntl
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


def _shared_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where this test run keeps its speech: the workers' common parent under xdist (each
    worker's basetemp is ``popen-gwN`` inside the run's own ``pytest-N``), else the basetemp."""
    base = tmp_path_factory.getbasetemp()
    return (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "hf-speech"


def _once(folder: Path, build: functools.partial[object]) -> None:
    """Run ``build`` unless another process of this test run already has: under an exclusive
    lock beside ``folder``, and marked done only once it returned (a worker that failed half
    way leaves no mark, so the next one builds again)."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    done = folder.with_name(folder.name + ".done")
    with open(folder.with_name(folder.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not done.exists():
            if folder.exists():
                shutil.rmtree(folder)
            build()
            done.touch()


@functools.cache
def _build(root: Path) -> SpeechAssets:
    data, model = root / "speech", root / "tiny-whisper"
    _once(data, functools.partial(make_speech_dataset, data, SPOKEN))
    _once(model, functools.partial(make_tiny_whisper, model, SPOKEN, seed=0))
    return SpeechAssets(data, model, tuple(SPOKEN))


@pytest.fixture(scope="session", name="speech")
def speech_fixture(tmp_path_factory: pytest.TempPathFactory) -> SpeechAssets:
    """The test run's speech folder and tiny Whisper (built on first use)."""
    require_espeak()
    return _build(_shared_root(tmp_path_factory))


@functools.cache
def _build_kind(root: Path, kind: str) -> Path:
    model = root / f"tiny-whisper-{kind}"
    _once(model, functools.partial(make_tiny_whisper, model, SPOKEN, seed=0, kind=kind))
    return model


@pytest.fixture(scope="session", name="english_model")
def english_model_fixture(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Whisper saved like ``whisper-tiny.en``: Whisper's tokenizer (language tokens
    included) but a generation config with ``is_multilingual: false`` and no ``lang_to_id``."""
    return _build_kind(_shared_root(tmp_path_factory), "english")


@pytest.fixture(scope="session", name="multilingual_model")
def multilingual_model_fixture(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Whisper saved like ``whisper-tiny``: ``lang_to_id`` and ``task_to_id`` for every language."""
    return _build_kind(_shared_root(tmp_path_factory), "multilingual")


def whisper_options(model_dir: Path, **overrides: object) -> dict[str, object]:
    """Whisper task options for the tiny model (checked against the task's option names)."""
    from meshtrain.tasks import check_options
    from meshtrain.tasks.whisper import TASK

    # The session's own feature cache, beside the models (not the user's ~/.cache).
    cache = str(Path(model_dir).parent / "feature-cache")
    return check_options(TASK, {"model": str(model_dir), "language": None, "val_fraction": 0.25,
                                "feature_cache": cache, **overrides})
