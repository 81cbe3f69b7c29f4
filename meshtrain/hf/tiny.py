"""A tiny offline Whisper and a synthetic speech dataset, to try meshtrain with no hub.

    python -m meshtrain.hf.tiny dataset demo-speech          # espeak-ng recordings
    python -m meshtrain.hf.tiny model demo-whisper --data demo-speech
    meshtrain simulate --profile whisper-tiny-random-lora --data demo-speech \\
        --set task_options.model=demo-whisper

The model is a random Whisper (d_model 64, 2+2 layers) with a BPE tokenizer trained on
the dataset's transcripts; it hears 3 s (300 input frames, the demo sentences fit), or
as long as the dataset's longest recording in whole seconds (at most Whisper's 30 s),
so any espeak-ng dataset trains. A training step takes ~50 ms on a CPU at 3 s. It learns, but it
is no speech recogniser: use it to check a setting end to end.
"""

from __future__ import annotations

import argparse
import csv
import math
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from meshtrain.hf.tokenizer import END_TOKEN, START_TOKEN, build_tokenizer, whisper_tokenizer

#: Short sentences (under 3 s when spoken by espeak-ng) for the demo dataset.
SENTENCES = [
    "the cat sat on the mat",
    "open the red door",
    "turn the light on",
    "the dog runs home",
    "we like green tea",
    "close the window now",
    "a bird sings at dawn",
    "the sun is warm",
    "read the old book",
    "the train is late",
    "put the cup down",
    "she plays the drum",
    "the fish swims fast",
    "bring me the map",
    "the bell rings twice",
    "rain falls on the roof",
]

TINY_CONFIG: dict[str, Any] = dict(
    d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
    decoder_attention_heads=4, encoder_ffn_dim=256, decoder_ffn_dim=256, num_mel_bins=80,
    max_source_positions=150, max_target_positions=64,
)


def make_speech_dataset(
    directory: str | Path, sentences: Sequence[str] = SENTENCES, voice: str = "en-us",
) -> Path:
    """Speak ``sentences`` with espeak-ng into ``directory`` (22.05 kHz WAVs under
    ``clips/`` plus ``metadata.csv``), an audiofolder meshtrain's whisper task reads."""
    espeak = shutil.which("espeak-ng")
    if espeak is None:
        raise RuntimeError("espeak-ng is not installed (Debian/Ubuntu: apt-get install espeak-ng; "
                           "macOS: brew install espeak-ng)")
    out = Path(directory)
    (out / "clips").mkdir(parents=True, exist_ok=True)
    rows = []
    for i, text in enumerate(sentences):
        name = f"clips/{i:04d}.wav"
        subprocess.run([espeak, "-v", voice, "-w", str(out / name), text], check=True,
                       capture_output=True)
        rows.append((name, text))
    with (out / "metadata.csv").open("w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(["file_name", "transcription"])
        writer.writerows(rows)
    return out


#: What :func:`make_tiny_whisper` can imitate: ``plain`` (a BPE tokenizer, no language
#: tokens), ``english`` (like ``whisper-tiny.en``: Whisper's tokenizer, a generation config
#: with ``is_multilingual: false`` and no ``lang_to_id``) or ``multilingual`` (like
#: ``whisper-tiny``: ``lang_to_id`` and ``task_to_id`` for every Whisper language).
KINDS = ("plain", "english", "multilingual")


#: Whisper's window: a tiny model never hears more.
MAX_SECONDS = 30
#: What a tiny model hears at least (TINY_CONFIG's 300 frames): the demo sentences fit.
DEFAULT_SECONDS = 3


def make_tiny_whisper(
    directory: str | Path, texts: Sequence[str], seed: int = 0, vocab_size: int = 512, kind: str = "plain",
    seconds: float | None = None,
) -> Path:
    """Save a tiny random Whisper, its tokenizer (trained on ``texts``) and its feature
    extractor to ``directory``, loadable with ``from_pretrained`` like a hub checkpoint.
    ``kind`` (see :data:`KINDS`) picks which real checkpoint's tokens it imitates;
    ``seconds`` how long a recording it hears (rounded up to whole seconds, at most 30;
    default 3)."""
    from transformers import WhisperConfig

    from meshtrain.hf.model import HFModel
    from meshtrain.hf.speech import feature_extractor_for

    if kind not in KINDS:
        raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {kind!r}")
    tokenizer = (build_tokenizer(texts, vocab_size=vocab_size) if kind == "plain"
                 else whisper_tokenizer(texts, vocab_size=vocab_size))
    start, end = tokenizer.convert_tokens_to_ids([START_TOKEN, END_TOKEN])
    shape = dict(TINY_CONFIG)
    if seconds is not None:
        if not 0 < seconds <= MAX_SECONDS:
            raise ValueError(f"a tiny Whisper hears between 0 and {MAX_SECONDS} s, not {seconds:.1f} s")
        # 100 feature frames a second (hop 160 at 16 kHz); the encoder halves them.
        shape["max_source_positions"] = 50 * math.ceil(seconds)
    config = WhisperConfig(
        vocab_size=len(tokenizer), decoder_start_token_id=start, bos_token_id=start,
        eos_token_id=end, pad_token_id=end, begin_suppress_tokens=None, suppress_tokens=None,
        **shape,
    )
    config.architectures = ["WhisperForConditionalGeneration"]
    model = HFModel.from_config(config, seed=seed, tokenizer=tokenizer,
                                feature_extractor=feature_extractor_for(config))
    if kind != "plain":
        multilingual = kind == "multilingual"
        _whisper_generation_config(model.base.generation_config, tokenizer, multilingual=multilingual)
    model.save_pretrained(str(directory))
    return Path(directory)


def _whisper_generation_config(generation: Any, tokenizer: Any, multilingual: bool) -> None:
    """Set the fields a hub Whisper's generation_config.json carries."""
    from transformers.models.whisper.tokenization_whisper import LANGUAGES

    ids = tokenizer.convert_tokens_to_ids
    # A config marked as derived from the model config is rebuilt from it on loading,
    # which would drop every field below.
    generation._from_model_config = False
    generation.no_timestamps_token_id = ids("<|notimestamps|>")
    generation.return_timestamps = False
    generation.is_multilingual = multilingual
    if multilingual:
        generation.lang_to_id = {f"<|{c}|>": ids(f"<|{c}|>") for c in LANGUAGES}
        generation.task_to_id = {t: ids(f"<|{t}|>") for t in ("transcribe", "translate")}


def read_transcripts(data: str | Path) -> list[str]:
    """Every transcript of a speech folder (both splits)."""
    from meshtrain.hf.speech import find_splits

    train, val = find_splits(data, val_fraction=0.0)
    return [c.text for c in train + val]


def longest_recording(data: str | Path) -> float:
    """Seconds of the longest recording in a speech folder (both splits); a recording no
    decoder reads raises :class:`~meshtrain.hf.audio.SpeechDataError` naming it."""
    from meshtrain.hf.audio import SAMPLE_RATE, UnsupportedWav, read_audio, wav_format
    from meshtrain.hf.speech import find_splits

    train, val = find_splits(data, val_fraction=0.0)
    longest = 0.0
    for clip in train + val:
        try:
            seconds = wav_format(clip.path).seconds  # the header says it: no decoding
        except (UnsupportedWav, OSError):
            seconds = len(read_audio(clip.path)) / SAMPLE_RATE
        longest = max(longest, seconds)
    return longest


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m meshtrain.hf.tiny", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    data = sub.add_parser("dataset", help="speak the demo sentences with espeak-ng")
    data.add_argument("directory")
    data.add_argument("--voice", default="en-us")
    model = sub.add_parser("model", help="a tiny random Whisper with a tokenizer for --data")
    model.add_argument("directory")
    model.add_argument("--data", required=True, help="speech folder whose transcripts train the tokenizer")
    model.add_argument("--seed", type=int, default=0)
    model.add_argument("--kind", choices=KINDS, default="plain",
                       help="plain BPE; or like whisper-tiny.en (english), whisper-tiny (multilingual)")
    args = parser.parse_args(argv)
    if args.what == "dataset":
        print(make_speech_dataset(args.directory, voice=args.voice))
    else:
        from meshtrain.hf.audio import SpeechDataError

        try:
            seconds = longest_recording(args.data)
        except SpeechDataError as exc:
            parser.exit(2, f"error: {exc}\n")
        if seconds > MAX_SECONDS:
            parser.exit(2, f"error: {args.data}: its longest recording is {seconds:.1f} s; Whisper hears "
                           f"at most {MAX_SECONDS} s (split it)\n")
        hears = math.ceil(max(seconds, DEFAULT_SECONDS))
        made = make_tiny_whisper(args.directory, read_transcripts(args.data), seed=args.seed, kind=args.kind,
                                 seconds=hears)
        print(f"{made} (hears {hears} s; the longest recording in {args.data} is {seconds:.1f} s)")


if __name__ == "__main__":
    main()
