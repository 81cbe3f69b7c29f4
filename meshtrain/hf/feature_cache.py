"""Whisper features on disk instead of in RAM: one ``.npy`` file per recording and extractor.

A clip's log-mel features are 80 x 3000 float32 for real Whisper, 0.96 MB: kept in memory
they cost 9.6 GB per process for 10,000 clips. Here they are computed once, written
atomically (a temporary file renamed into place, so a crash or two processes writing
the same clip never leave a torn file) and read back per batch. The key is a SHA-256
of the recording's bytes and of every extractor setting that changes the features, so an
edited recording or another model's extractor never reads stale features, and any
number of runs, processes or hosts can share one folder.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import threading
from pathlib import Path
from typing import Any

import numpy as np

from meshtrain.hf.audio import SpeechDataError

#: Bumped when the way features are computed changes, so old entries are not reused.
FORMAT = 1

#: One ``np.load`` at a time in a process: it reads the file's header with ``ast.literal_eval``,
#: and CPython 3.11 keeps the AST constructor's recursion depth per interpreter, not per
#: thread. When a garbage collection inside one parse runs a finalizer and the node threads
#: switch, another parse moves that count and the first fails with "SystemError: AST
#: constructor recursion depth mismatch" (a clean-clone suite run, 2026-11-28, a Whisper run
#: in the threads runtime).
_LOADING = threading.Lock()


def default_cache_dir() -> Path:
    """``$MESHTRAIN_CACHE/features``, else ``$XDG_CACHE_HOME/meshtrain/features``, else
    ``~/.cache/meshtrain/features``."""
    if os.environ.get("MESHTRAIN_CACHE"):
        return Path(os.environ["MESHTRAIN_CACHE"]).expanduser() / "features"
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "meshtrain" / "features"


def extractor_fingerprint(extractor: Any) -> str:
    """The settings of a ``WhisperFeatureExtractor`` that determine its output."""
    fields = ("feature_size", "sampling_rate", "hop_length", "n_fft", "n_samples", "padding_value",
              "dither")
    settings = {f: getattr(extractor, f, None) for f in fields}
    settings["class"] = type(extractor).__name__
    settings["format"] = FORMAT
    return json.dumps(settings, sort_keys=True, default=str)


class FeatureCache:
    """A folder of features keyed by recording content and extractor settings."""

    def __init__(self, directory: str | Path, extractor: Any) -> None:
        self.directory = Path(directory).expanduser()
        self._salt = extractor_fingerprint(extractor).encode()
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise SpeechDataError(f"feature cache folder {self.directory}: {exc.strerror}") from exc
        if not os.access(self.directory, os.W_OK):
            raise SpeechDataError(f"feature cache folder {self.directory} is not writable")

    def key(self, recording: Path) -> str:
        """SHA-256 of the extractor settings and the recording's bytes."""
        digest = hashlib.sha256(self._salt)
        with recording.open("rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
        return digest.hexdigest()

    def path(self, key: str) -> Path:
        return self.directory / key[:2] / f"{key}.npy"

    def load(self, key: str) -> np.ndarray | None:
        """The cached features, or None when absent or unreadable (then they are recomputed)."""
        path = self.path(key)
        try:
            with _LOADING:
                return np.load(path, allow_pickle=False)
        except (OSError, ValueError, EOFError):
            return None

    def store(self, key: str, features: np.ndarray) -> None:
        """Write atomically: a unique temporary file in the same folder, renamed into place."""
        path = self.path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{key[:8]}-", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                np.save(f, features, allow_pickle=False)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
