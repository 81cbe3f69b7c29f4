"""Reading recordings as 16 kHz mono float32, whatever their format.

Decoders are tried in order, each only if installed:

1. meshtrain's own WAV reader: PCM 8/16/24/32-bit integer, 32/64-bit float, plain or
   ``WAVE_FORMAT_EXTENSIBLE`` headers, any channel count and rate (needs nothing);
2. ``soundfile`` (``pip install soundfile``: FLAC, OGG/Vorbis, Opus, MP3, other WAV codecs);
3. ``ffmpeg`` on PATH (everything, M4A/AAC included);
4. ``sox`` on PATH (FLAC, OGG and WAV codecs; MP3 only with its mp3 plugin).

A recording none of them reads is one line naming the file, what was tried and what to install.
"""

from __future__ import annotations

import shutil
import struct
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import numpy as np

from meshtrain.errors import InputError

SAMPLE_RATE = 16_000

# WAVE format tags (mmreg.h): what the fmt chunk says the samples are.
PCM, IEEE_FLOAT, EXTENSIBLE = 0x0001, 0x0003, 0xFFFE
INSTALL_HINT = ("install ffmpeg (reads every common format, m4a included) or `pip install soundfile` "
                "(flac, ogg, mp3), or convert the recordings to WAV")


class SpeechDataError(InputError):
    """Bad speech data: missing folder, transcript file, column or recording (one line)."""


class UnsupportedWav(SpeechDataError):
    """A file the built-in WAV reader does not handle (not RIFF/WAVE, or another codec):
    the next decoder in the chain gets it."""


# ----------------------------------------------------------------------- the WAV reader
@dataclass(frozen=True)
class WavFormat:
    """What a WAV header says: sample ``kind`` (``int`` or ``float``), bytes per sample
    in the container, and where the samples are."""

    kind: str
    channels: int
    rate: int
    sample_bytes: int
    data_offset: int
    data_bytes: int

    @property
    def frames(self) -> int:
        return self.data_bytes // (self.sample_bytes * self.channels)

    @property
    def seconds(self) -> float:
        return self.frames / self.rate


def wav_format(path: str | Path) -> WavFormat:
    """Parse a WAV file's chunks up to the samples; :class:`UnsupportedWav` if it is not a
    RIFF/WAVE file of PCM integer or IEEE float samples."""
    path = Path(path)
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(12)
        if len(head) < 12 or head[:4] != b"RIFF" or head[8:12] != b"WAVE":
            raise UnsupportedWav(f"{path}: not a RIFF/WAVE file")
        fmt: tuple[int, int, int, int, int] | None = None
        while True:
            chunk = f.read(8)
            if len(chunk) < 8:
                raise UnsupportedWav(f"{path}: WAV file has no data chunk")
            name, length = chunk[:4], struct.unpack("<I", chunk[4:])[0]
            if name == b"fmt ":
                fmt = _parse_fmt(path, f.read(length))
                f.seek(length & 1, 1)  # chunks are padded to an even length
            elif name == b"data":
                if fmt is None:
                    raise UnsupportedWav(f"{path}: WAV data comes before its fmt chunk")
                tag, channels, rate, block_align, bits = fmt
                offset = f.tell()
                # Streaming writers leave the size at 0 or 0xFFFFFFFF: the samples run to the end.
                available = size - offset
                data_bytes = available if length in (0, 0xFFFFFFFF) or length > available else length
                sample_bytes = block_align // channels
                kind = "float" if tag == IEEE_FLOAT else "int"
                widths = (4, 8) if kind == "float" else (1, 2, 3, 4)
                if sample_bytes not in widths:
                    raise UnsupportedWav(f"{path}: {bits}-bit {kind} WAV samples are not supported")
                return WavFormat(kind, channels, rate, sample_bytes, offset, data_bytes)
            else:
                f.seek(length + (length & 1), 1)


def _parse_fmt(path: Path, body: bytes) -> tuple[int, int, int, int, int]:
    """(format tag, channels, rate, block align, bits) of a fmt chunk, the extensible
    header's sub-format resolved to the plain tag it stands for."""
    if len(body) < 16:
        raise UnsupportedWav(f"{path}: WAV fmt chunk is {len(body)} bytes, too short")
    tag, channels, rate, _, block_align, bits = struct.unpack("<HHIIHH", body[:16])
    if tag == EXTENSIBLE:
        if len(body) < 26:
            raise UnsupportedWav(f"{path}: WAVE_FORMAT_EXTENSIBLE header is truncated")
        tag = struct.unpack("<H", body[24:26])[0]  # the sub-format GUID starts with the plain tag
    if tag not in (PCM, IEEE_FLOAT):
        raise UnsupportedWav(f"{path}: WAV codec 0x{tag:04x} is neither PCM nor float")
    if channels < 1 or rate < 1 or block_align < channels or block_align % channels:
        raise UnsupportedWav(f"{path}: WAV header is inconsistent (channels {channels}, rate {rate}, "
                             f"block align {block_align})")
    return tag, channels, rate, block_align, bits


def read_wav(path: str | Path) -> tuple[np.ndarray, int]:
    """A PCM (8/16/24/32-bit) or float (32/64-bit) WAV as float32 mono in [-1, 1] and its rate."""
    fmt = wav_format(path)
    with Path(path).open("rb") as f:
        f.seek(fmt.data_offset)
        raw = f.read(fmt.frames * fmt.channels * fmt.sample_bytes)
    width = fmt.sample_bytes
    if fmt.kind == "float":
        samples = np.frombuffer(raw, "<f4" if width == 4 else "<f8").astype(np.float32)
    elif width == 1:  # 8-bit WAV is unsigned, centred on 128
        samples = (np.frombuffer(raw, np.uint8).astype(np.float32) - 128.0) / 128.0
    elif width == 3:  # 24-bit: place each little-endian triple in the top of an int32
        b = np.frombuffer(raw, np.uint8).reshape(-1, 3).astype(np.int32)
        ints = (b[:, 0] << 8) | (b[:, 1] << 16) | (b[:, 2] << 24)
        samples = ints.astype(np.float32) / 2.0**31
    else:
        ints = np.frombuffer(raw, "<i2" if width == 2 else "<i4")
        samples = ints.astype(np.float32) / float(2 ** (8 * width - 1))
    return mono(samples.reshape(-1, fmt.channels)), fmt.rate


# ------------------------------------------------------------------------ the chain
def read_audio(path: str | Path, sample_rate: int = SAMPLE_RATE) -> np.ndarray:
    """A recording as float32 mono at ``sample_rate``, in [-1, 1], by the first decoder
    that reads it (see the module docstring for the order)."""
    path = Path(path)
    failures: list[str] = []
    for name, decode in _decoders():
        try:
            audio, rate = decode(path)
        except (SpeechDataError, OSError, RuntimeError) as exc:
            failures.append(f"{name}: {_one_line(exc, path)}")
            continue
        return resample(audio, rate, sample_rate)
    if len(failures) == 1:  # only the WAV reader was there to try
        raise SpeechDataError(f"{path}: no audio decoder is installed for it ({failures[0]}); {INSTALL_HINT}")
    raise SpeechDataError(f"{path}: no decoder could read it ({'; '.join(failures)}); {INSTALL_HINT}")


def _decoders() -> list[tuple[str, Callable[[Path], tuple[np.ndarray, int]]]]:
    """The decoders installed here, in the order they are tried."""
    chain: list[tuple[str, Callable[[Path], tuple[np.ndarray, int]]]] = [("wav reader", read_wav)]
    try:
        import soundfile  # noqa: F401

        chain.append(("soundfile", _read_soundfile))
    except ImportError:
        pass
    for tool in ("ffmpeg", "sox"):
        if shutil.which(tool):
            chain.append((tool, _read_with(tool)))
    return chain


def _read_soundfile(path: Path) -> tuple[np.ndarray, int]:
    import soundfile

    try:
        data, rate = soundfile.read(str(path), dtype="float32", always_2d=True)
    except Exception as exc:  # soundfile raises its own LibsndfileError or a TypeError per format
        raise SpeechDataError(str(exc)) from exc
    return mono(data), int(rate)


def _read_with(tool: str) -> Callable[[Path], tuple[np.ndarray, int]]:
    """A decoder running ``ffmpeg`` or ``sox`` to 32-bit float mono at 16 kHz on stdout."""

    def decode(path: Path) -> tuple[np.ndarray, int]:
        if tool == "ffmpeg":
            cmd = ["ffmpeg", "-nostdin", "-v", "error", "-i", str(path), "-f", "f32le", "-ac", "1",
                   "-ar", str(SAMPLE_RATE), "-"]
        else:
            cmd = ["sox", str(path), "-t", "raw", "-e", "floating-point", "-b", "32", "-L", "-c", "1",
                   "-r", str(SAMPLE_RATE), "-"]
        done = subprocess.run(cmd, capture_output=True, check=False)
        if done.returncode != 0:
            raise SpeechDataError(done.stderr.decode(errors="replace").strip() or f"exit {done.returncode}")
        return np.frombuffer(done.stdout, "<f4").astype(np.float32), SAMPLE_RATE

    return decode


def _one_line(exc: BaseException, path: Path) -> str:
    """An error's first line, without the file name the message already starts with."""
    text = str(exc).strip().replace(f"{path}: ", "").replace(str(path), "the file")
    first = text.splitlines()[0] if text else type(exc).__name__
    return first[:160]


# ------------------------------------------------------------------------- helpers
def mono(frames: np.ndarray) -> np.ndarray:
    """Average the channels of a (frames, channels) array."""
    return frames.mean(axis=1).astype(np.float32) if frames.ndim == 2 else frames.astype(np.float32)


def resample(audio: np.ndarray, rate: int, target: int = SAMPLE_RATE) -> np.ndarray:
    """Polyphase resampling (scipy) from ``rate`` to ``target`` Hz."""
    if rate == target:
        return audio.astype(np.float32)
    from scipy.signal import resample_poly

    ratio = Fraction(target, rate)
    return resample_poly(audio, ratio.numerator, ratio.denominator).astype(np.float32)

