"""Settings shared by the whole suite."""

from __future__ import annotations

import os

# Quiet and deterministic: no progress bars, no hub access attempts.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
