"""examples/whisper_lora.py runs as written on a folder of recordings."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from speech_fixtures import SpeechAssets, english_model_fixture, speech_fixture  # noqa: F401 (fixtures)

ROOT = Path(__file__).resolve().parent.parent


def example_env(tmp_path: Path) -> dict[str, str]:
    """The user's environment as a plain run sees it, with the feature cache under tmp_path."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    return {**env, "MESHTRAIN_CACHE": str(tmp_path / "cache")}


def test_whisper_lora_example_fine_tunes_and_reports_wer(speech: SpeechAssets, tmp_path: Path) -> None:
    env = example_env(tmp_path)
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


def test_whisper_lora_example_offline_hub_id_is_one_line_exit_2(speech: SpeechAssets, tmp_path: Path) -> None:
    env = example_env(tmp_path)
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "whisper_lora.py"), str(speech.data),
         "--model", "openai/whisper-tiny"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )
    if proc.returncode == 0:
        pytest.skip("this machine can reach the Hugging Face hub")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: cannot load model 'openai/whisper-tiny'"), proc.stderr
    assert not (tmp_path / "runs").exists()


def test_whisper_lora_example_english_only_model_with_language_en(
    speech: SpeechAssets, english_model: Path, tmp_path: Path,
) -> None:
    env = example_env(tmp_path)
    bad = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "whisper_lora.py"), str(speech.data),
         "--model", str(english_model), "--language", "fr"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )
    assert bad.returncode == 2 and "English-only" in bad.stderr and "Traceback" not in bad.stderr, bad.stderr
    good = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "whisper_lora.py"), str(speech.data),
         "--model", str(english_model), "--language", "en", "--steps", "4", "--H", "2", "--batch-size", "4"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )
    assert good.returncode == 0, good.stdout + good.stderr
    assert "final WER" in good.stdout
