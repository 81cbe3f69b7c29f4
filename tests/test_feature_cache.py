"""The Whisper feature cache read from many node threads at once (the threads runtime)."""

from __future__ import annotations

import gc
import sys
import threading
from pathlib import Path

import numpy as np

from meshtrain.hf.feature_cache import FeatureCache


class Extractor:
    feature_size = 80


class Cycle:
    """Garbage only a collection frees, whose finalizer runs Python (and so may switch threads)."""

    def __init__(self) -> None:
        self.me = self

    def __del__(self) -> None:
        sum(range(100))


def test_node_threads_read_cached_features_at_once(tmp_path: Path) -> None:
    """np.load parses each file's header with ast.literal_eval, whose recursion count CPython
    3.11 shares between threads. Collections inside a parse that run finalizers, and a thread
    switch at every chance, made the old unguarded load fail at once here with "SystemError:
    AST constructor recursion depth mismatch"."""
    cache = FeatureCache(tmp_path, Extractor())
    key = "ab" * 32
    features = np.arange(80 * 30, dtype=np.float32).reshape(80, 30)
    cache.store(key, features)
    failures: list[BaseException] = []

    def node() -> None:
        for _ in range(300):
            garbage = [Cycle() for _ in range(20)]
            del garbage
            try:
                loaded = cache.load(key)
                if loaded is None or not np.array_equal(loaded, features):
                    raise AssertionError(f"read back {loaded!r}")
            except BaseException as exc:  # noqa: BLE001 - a thread's failure, asserted below
                failures.append(exc)
                return

    thresholds, interval = gc.get_threshold(), sys.getswitchinterval()
    gc.set_threshold(20, 5, 5)
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=node) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        gc.set_threshold(*thresholds)
        sys.setswitchinterval(interval)
    assert failures == []
