"""examples/whisper_lora.py runs as written on a folder of recordings.

The training runs execute the script file as ``__main__`` inside the test process (the
imports of torch and transformers, most of a fresh interpreter's run, are paid once); the
offline hub id check runs it as a fresh ``python`` process, whose whole stderr must be one
line."""

from __future__ import annotations

import contextlib
import io
import json
import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
from speech_fixtures import SpeechAssets, english_model_fixture, speech_fixture  # noqa: F401 (fixtures)

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "whisper_lora.py"


def example_env(tmp_path: Path) -> dict[str, str]:
    """The user's environment as a plain run sees it, with the feature cache under tmp_path."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    return {**env, "MESHTRAIN_CACHE": str(tmp_path / "cache")}


def run_example(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                *args: str) -> subprocess.CompletedProcess[str]:
    """``python examples/whisper_lora.py ARGS`` from ``tmp_path``, run as ``__main__`` in this
    process (torch and transformers are imported once, not per run), with the environment of
    :func:`example_env`; its exit status, stdout and stderr. An exception the script lets out
    fails the test here, as its traceback would in a subprocess."""
    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MESHTRAIN_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", [str(EXAMPLE), *args])
    out, err, status = io.StringIO(), io.StringIO(), 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            runpy.run_path(str(EXAMPLE), run_name="__main__")
        except SystemExit as exc:
            status = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
    return subprocess.CompletedProcess([str(EXAMPLE), *args], status, out.getvalue(), err.getvalue())


def test_whisper_lora_example_fine_tunes_and_reports_wer(speech: SpeechAssets, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    proc = run_example(tmp_path, monkeypatch, str(speech.data), "--model", str(speech.model),
                       "--steps", "10", "--H", "5", "--batch-size", "4")
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
        [sys.executable, str(EXAMPLE), str(speech.data),
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
    speech: SpeechAssets, english_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = str(english_model)
    bad = run_example(tmp_path, monkeypatch, str(speech.data), "--model", model, "--language", "fr")
    assert bad.returncode == 2 and "English-only" in bad.stderr and "Traceback" not in bad.stderr, bad.stderr
    good = run_example(tmp_path, monkeypatch, str(speech.data), "--model", model, "--language", "en",
                       "--steps", "4", "--H", "2", "--batch-size", "4")
    assert good.returncode == 0, good.stdout + good.stderr
    assert "final WER" in good.stdout
