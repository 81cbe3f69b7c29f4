"""Settings shared by the whole suite."""

from __future__ import annotations

import os

# Quiet and deterministic: no progress bars, no hub access attempts.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def pytest_configure(config) -> None:  # noqa: ANN001 - pytest's hook signature
    """Whisper features are cached on disk (~/.cache/meshtrain by default): the suite's go
    to a folder of its own, removed at the end, so tests leave nothing in the user's home."""
    import atexit
    import shutil
    import tempfile

    if "MESHTRAIN_CACHE" not in os.environ:
        cache = tempfile.mkdtemp(prefix="meshtrain-test-cache-")
        os.environ["MESHTRAIN_CACHE"] = cache
        atexit.register(shutil.rmtree, cache, ignore_errors=True)
