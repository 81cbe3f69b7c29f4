"""`meshtrain transcribe`: what a fine-tuned Whisper hears in some recordings."""

from __future__ import annotations

from pathlib import Path

import typer

from meshtrain.cli.console import console, fail
from meshtrain.hosts.host_output import visible


def transcribe(
    model_dir: Path = typer.Argument(..., help="A run's model/ folder (LoRA adapter or full checkpoint)."),
    audio: list[Path] = typer.Argument(..., help="Recordings: WAV, or any format ffmpeg reads."),
    language: str = typer.Option(None, "--language", help="Language code or name (multilingual models; "
                                 "default: detected per clip)."),
    task: str = typer.Option(None, "--task", help="transcribe or translate (multilingual models)."),
    batch_size: int = typer.Option(8, "--batch-size", help="Clips per generate call."),
) -> None:
    """Print one line per recording, `PATH: TEXT`, decoded greedily by a fine-tuned model
    (control characters in TEXT written out, as \\x1b).

    Example:

      meshtrain transcribe runs/<run-id>/model clips/0001.wav clips/0002.wav
    """
    if not model_dir.is_dir():
        raise fail(f"{model_dir}: no such model folder (give a run's model/ folder)")
    for path in audio:
        if not path.is_file():
            raise fail(f"{path}: no such recording" + (" (it is a folder)" if path.is_dir() else ""))
    if batch_size < 1:
        raise fail(f"--batch-size must be >= 1, got {batch_size}")
    from meshtrain.hf import DecodingError, ModelLoadError, SpeechDataError, TokenizerError
    from meshtrain.hf.transcribe import load_for_transcription, transcribe_files

    try:
        with console.status(f"loading {model_dir}"):
            model = load_for_transcription(str(model_dir), language, task)
        for path, text in transcribe_files(model, audio, batch_size):
            # One line per clip: a model may decode any token, newlines and escape sequences
            # included, so control characters are written out (``\x1e``).
            console.print(f"{path}: {visible(text)}", highlight=False, markup=False, soft_wrap=True)
    except (ModelLoadError, TokenizerError, DecodingError, SpeechDataError) as exc:
        raise fail(str(exc)) from None


def register(app: typer.Typer) -> None:
    app.command("transcribe")(transcribe)
