"""`meshtrain transcribe`: what a fine-tuned Whisper hears in some recordings."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer
from rich.text import Text

from meshtrain.cli.console import console, errors, fail
from meshtrain.cli.flags import checked_options, takes_options
from meshtrain.config.transcribe import TRANSCRIBE, TranscribeSettings
from meshtrain.hosts.host_output import visible


@takes_options(TranscribeSettings, TRANSCRIBE)
def transcribe(
    model_dir: Path = typer.Argument(..., metavar="MODEL_DIR",
                                     help="A run's model/ folder (LoRA adapter or full checkpoint)."),
    audio: list[Path] = typer.Argument(..., metavar="AUDIO",
                                       help="Recordings: WAV, or any format ffmpeg reads."),
    **options: Any,
) -> None:
    """Print one line per recording, `PATH: TEXT`, decoded greedily by a fine-tuned model
    (control characters in TEXT written out, as \\x1b). A recording longer than the model
    hears (30 s for Whisper) is transcribed window by window. A recording that cannot be
    read is reported and the others are still transcribed; the exit status is then 2.

    Example:

      meshtrain transcribe runs/<run-id>/model clips/0001.wav clips/0002.wav
    """
    how = checked_options(TranscribeSettings, options)
    if not model_dir.is_dir():
        raise fail(f"{model_dir}: no such model folder (give a run's model/ folder)")
    for path in audio:
        if not path.is_file():
            raise fail(f"{path}: no such recording" + (" (it is a folder)" if path.is_dir() else ""))
    from meshtrain.hf import DecodingError, ModelLoadError, SpeechDataError, TokenizerError
    from meshtrain.hf.transcribe import load_for_transcription, transcribe_files

    unreadable: list[Path] = []
    try:
        with console.status(f"loading {model_dir}"):
            model = load_for_transcription(str(model_dir), how.language, how.task)
        for path, text in transcribe_files(model, audio, how.batch_size):
            if isinstance(text, SpeechDataError):  # said now; the other recordings still count
                errors.print(Text.assemble(("error: ", "bold red"), str(text)), soft_wrap=True)
                unreadable.append(path)
                continue
            # One line per clip: a model may decode any token, newlines and escape sequences
            # included, so control characters are written out (``\x1e``).
            console.print(f"{path}: {visible(text)}", highlight=False, markup=False, soft_wrap=True)
    except (ModelLoadError, TokenizerError, DecodingError, SpeechDataError) as exc:
        raise fail(str(exc)) from None
    if unreadable:
        raise fail(f"{len(unreadable)} of {len(audio)} recordings could not be read: "
                   f"{', '.join(map(str, unreadable))}")

def register(app: typer.Typer) -> None:
    app.command("transcribe")(transcribe)
