"""examples/whisper_lora.py runs as written on a folder of recordings."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from speech_fixtures import SpeechAssets, speech_fixture  # noqa: F401 (the fixture)

ROOT = Path(__file__).resolve().parent.parent


def test_whisper_lora_example_fine_tunes_and_reports_wer(speech: SpeechAssets, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "whisper_lora.py"), str(speech.data),
         "--model", str(speech.model), "--steps", "10", "--H", "5", "--batch-size", "4"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "final WER" in proc.stdout
    (run,) = (tmp_path / "runs").iterdir()
    summary = json.loads((run / "summary.json").read_text())
    assert summary["nodes"] == 2 and 0 <= summary["final_wer"] < float("inf")
    assert summary["trainable_parameters"] == 12 * 8 * (64 + 64)  # LoRA r=8 on q_proj/v_proj
    assert (run / "model" / "adapter_config.json").is_file()
