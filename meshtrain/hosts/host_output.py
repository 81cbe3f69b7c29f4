"""What a host prints, made safe to read and to show: bounded lines, visible control
characters, and the one frame that carries a rank's exit status.

Every byte of a rank's output comes from the host (and from whatever the program there
prints: a dataset's text, a user's debug line). None of it may steer the launcher:

- lines are cut at :data:`LINE_LIMIT` bytes, with a visible mark of what was dropped
  (``… [cut 150.0 MiB] …``), and a flood without a newline is read in bounded memory;
- control characters other than tab are shown as ``\\x1b`` etc., so escape sequences
  never reach the terminal or the logs;
- the exit status travels in a frame that carries a random key the launcher gave only
  to the remote shell that wraps the command (over the pty, after echo is off: never on
  a command line), so a program printing a look-alike cannot end its rank as "ok".
"""

from __future__ import annotations

import hmac
import re
import unicodedata
from typing import Any

from meshtrain import yaml12

LINE_LIMIT = 16 * 1024  # bytes of one line that are kept and shown
TAIL_KEPT = 1024  # bytes kept from the end of a cut line (a frame may close it)
EXIT_TAG = "MESHTRAIN_EXIT"
_EXIT_FRAME = re.compile("\x02" + EXIT_TAG + " ([0-9a-f]{32}) ([0-9]{1,3})\x03")


def human_size(n: int) -> str:
    """``150.0 MiB``: the size of what a cut dropped."""
    size, unit = float(n), "B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            break
        size /= 1024
    return f"{n} B" if unit == "B" else f"{size:.1f} {unit}"


class LineSplitter:
    """Bytes in, complete lines out, never holding more than about :data:`LINE_LIMIT`
    plus :data:`TAIL_KEPT` bytes of one line."""

    def __init__(self, limit: int = LINE_LIMIT, tail: int = TAIL_KEPT) -> None:
        self.limit, self.tail_size = limit, tail
        self._head = bytearray()  # the first ``limit`` bytes of the current line
        self._tail = bytearray()  # once cut: its last ``tail`` bytes
        self._dropped = 0  # once cut: bytes between head and tail that are gone

    @property
    def buffered(self) -> int:
        """Bytes held for the current line (bounded)."""
        return len(self._head) + len(self._tail)

    def feed(self, data: bytes) -> list[bytes]:
        """The lines ``data`` completes (without their newline)."""
        lines = []
        while data:
            end = data.find(b"\n")
            piece, data = (data, b"") if end < 0 else (data[:end], data[end + 1:])
            self._add(piece)
            if end >= 0:
                lines.append(self._take())
        return lines

    def flush(self) -> bytes | None:
        """The unfinished last line, if any (the stream ended)."""
        return self._take() if self.buffered or self._dropped else None

    def _add(self, piece: bytes) -> None:
        room = self.limit - len(self._head)
        if room > 0 and not self._dropped and not self._tail:
            self._head += piece[:room]
            piece = piece[room:]
        if not piece:
            return
        self._tail += piece
        excess = len(self._tail) - self.tail_size
        if excess > 0:
            del self._tail[:excess]
            self._dropped += excess

    def _take(self) -> bytes:
        line = bytes(self._head)
        if self._dropped:
            line += f" … [cut {human_size(self._dropped)}] … ".encode() + bytes(self._tail)
        else:
            line += bytes(self._tail)
        self._head, self._tail, self._dropped = bytearray(), bytearray(), 0
        return line


def host_json(text: str) -> dict[str, Any]:
    """The JSON object in a host's answer (a probe's line, a helper's reply, a result file).

    The text is hostile input: anything but one JSON object raises ValueError, never another
    exception. NaN and Infinity are refused, and so is nesting deeper than
    :data:`meshtrain.yaml12.MAX_DEPTH` (:func:`meshtrain.yaml12.json_load`). The object's
    fields are the caller's to check: their types are whatever the host sent.
    """
    value = yaml12.json_load(text)  # the one reader of hostile JSON: its limits, ValueError
    if not isinstance(value, dict):
        raise ValueError(f"a JSON {type(value).__name__}, not an object")
    return value


def visible(text: str) -> str:
    """``text`` with every control character but tab written out (ESC as ``\\x1b``)."""
    if text.isprintable():
        return text
    return "".join(c if c == "\t" or unicodedata.category(c) != "Cc" else f"\\x{ord(c):02x}"
                   for c in text)


# The remote shell's printf format for the exit frame; its arguments: the key, the status.
EXIT_PRINTF = "\\002" + EXIT_TAG + " %s %s\\003\\n"


def take_exit_status(line: str, key: str) -> tuple[str, int | None]:
    """The line without the exit frame keyed with ``key``, and that frame's status (None
    when absent). A frame with another key is a program's print: it stays in the line."""
    for match in _EXIT_FRAME.finditer(line):
        if hmac.compare_digest(match.group(1), key):
            return line[:match.start()] + line[match.end():], int(match.group(2))
    return line, None
