"""Reading YAML the way researchers write numbers, and YAML or JSON that a host wrote safely.

PyYAML's ``safe_load`` follows YAML 1.1, where a float needs a dot and a signed exponent:
``1e-3``, ``5e-1`` and ``1e8`` come back as *text*, and the strict settings checks then
refuse the most common way to write a learning rate. :func:`load` is ``safe_load`` with
YAML 1.2's float rule added, so everything YAML 1.2 (and Python's ``float()``) reads as a
number is one: ``1e-3``, ``1E8``, ``.5``, ``1.5e3``, ``1_000.5``. It also refuses a key given
twice (YAML's rule, which PyYAML does not apply). Every YAML read in meshtrain goes through it;
:func:`read` reads a file, :func:`problem` says in a few words what is wrong with a bad one.

It is also the one reader of YAML and JSON that may be hostile: a run directory copied back
from rank 0's host, a ``bench.json``, a checkpoint's ``meta.json``, a downloaded cluster file or
profile. A file over :data:`MAX_BYTES`, one whose aliases expand to more than
:data:`MAX_VALUES` values (a 300-byte "billion laughs" became 351 MB of JSON on every poll of
the dashboard), one nested deeper than :data:`MAX_DEPTH`, and anything but a regular file (a
FIFO would block the reader forever) are refused with a one-line :class:`Refused` error. JSON
is read by :func:`read_json` and :func:`json_load` under the same limits (NaN refused).
"""

from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path
from typing import Any, BinaryIO

import yaml

from meshtrain.errors import InputError

# YAML 1.2 core schema floats with an exponent and no dot (the forms YAML 1.1 misses), plus
# Python's digit separators; forms with a dot are already floats under YAML 1.1.
#: Bytes of one YAML or JSON file read (a cluster file, a run's config: a few KiB).
MAX_BYTES = 4 * 1024 * 1024
#: Values (scalars, lists, mappings) of one document, aliases counted each time they are used.
MAX_VALUES = 200_000
#: Levels of nesting of one document (settings go three deep).
MAX_DEPTH = 64

_EXPONENT_FLOAT = re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$")


class DuplicateKey(yaml.constructor.ConstructorError, InputError):
    """A mapping that gives one key twice: YAML requires keys to be unique, and PyYAML would
    keep the last value silently (an ``lr`` given twice in a profile trained with the second)."""


class Refused(yaml.YAMLError, InputError):
    """A file or document refused before (or instead of) being used: too large, an alias bomb,
    too deep, not a regular file, not text, not JSON. Its message is the problem, one line."""


class TooLarge(Refused):
    """More bytes, values or levels of nesting than the limits allow."""


class Loader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that also reads YAML 1.2 floats (``1e-3``) as numbers, refuses a
    key given twice in one mapping, and a document past :data:`MAX_VALUES` or :data:`MAX_DEPTH`
    (counted on the composed nodes, before anything is built from them)."""

    def get_single_data(self) -> Any:
        node = self.get_single_node()
        if node is None:
            return None
        _check_shape(node)
        return self.construct_document(node)

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        first_line: dict[Any, int] = {}
        for key_node, _ in node.value:
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                continue  # '<<' merges may override on purpose; a list or mapping key is rare
            key = self.construct_object(key_node)
            line = key_node.start_mark.line + 1
            if key in first_line:
                lines = f"line {line}" if line == first_line[key] else f"lines {first_line[key]} and {line}"
                raise DuplicateKey(None, None, f"key {key!r} is given twice ({lines})", key_node.start_mark)
            first_line[key] = line
        return super().construct_mapping(node, deep=deep)


def _check_shape(root: yaml.Node) -> None:
    """Raise :class:`TooLarge` if ``root`` expands to more than :data:`MAX_VALUES` values or
    nests deeper than :data:`MAX_DEPTH` (a recursive alias nests forever: refused too). An
    alias is the very node it names, so each distinct node's size is counted once."""
    sizes: dict[int, int] = {}

    def size(node: yaml.Node, depth: int) -> int:
        if depth > MAX_DEPTH:
            raise TooLarge(f"nested more than {MAX_DEPTH} levels deep")
        known = sizes.get(id(node))
        if known is not None:
            return known
        total = 1
        if isinstance(node, yaml.SequenceNode):
            for item in node.value:
                total += size(item, depth + 1)
                if total > MAX_VALUES:
                    break
        elif isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                total += size(key, depth + 1) + size(value, depth + 1)
                if total > MAX_VALUES:
                    break
        if total > MAX_VALUES:
            raise TooLarge(f"more than {MAX_VALUES} values once its aliases are expanded (an alias bomb?)")
        sizes[id(node)] = total
        return total

    size(root, 0)


Loader.add_implicit_resolver("tag:yaml.org,2002:float", _EXPONENT_FLOAT, list("-+0123456789."))

#: What a bad file raises (re-exported so callers need not import yaml for it).
YAMLError = yaml.YAMLError


def load(text: str) -> Any:
    """Parse one YAML document safely (no Python objects), YAML 1.2 floats included.
    A bad document raises :data:`YAMLError`, one nested deeper than the parser can follow too
    (PyYAML's parser recurses: it would raise RecursionError)."""
    try:
        return yaml.load(text, Loader=Loader)  # noqa: S506 - Loader is a SafeLoader subclass
    except RecursionError:
        raise YAMLError("nested too deeply to read") from None


class NotText(Refused):
    """A YAML file whose bytes are not UTF-8 text (a binary file, or another encoding)."""


def open_regular(path: Path) -> BinaryIO:
    """``path`` opened for reading in binary, if it is a regular file. A FIFO, a device or a
    directory raises :class:`Refused` without blocking (opened non-blocking, checked before
    anything is read: a FIFO named metrics.csv hung the dashboard); ``OSError`` passes."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise Refused("not a regular file")
        os.set_blocking(fd, True)  # a regular file never blocks; buffered reads expect this
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_bytes(path: Path, limit: int = MAX_BYTES) -> bytes:
    """The bytes of the regular file at ``path`` (:func:`open_regular`), at most ``limit``
    of them: a longer file raises :class:`TooLarge`; ``OSError`` passes."""
    with open_regular(path) as f:
        size = os.fstat(f.fileno()).st_size
        if size > limit:
            raise TooLarge(f"{size} bytes, more than the {limit} a file may have")
        data = bytearray()
        while len(data) <= limit:  # in chunks: read(limit) would allocate all of limit at once
            chunk = f.read(min(1 << 16, limit + 1 - len(data)))
            if not chunk:
                break
            data += chunk
    if len(data) > limit:  # a file that grew since fstat
        raise TooLarge(f"more than the {limit} bytes a file may have")
    return bytes(data)


def _text(data: bytes) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise NotText(f"not UTF-8 text (byte {exc.start}: a binary file?)") from None


def read(path: Path) -> Any:
    """:func:`load` of the file at ``path`` (:func:`read_bytes`' limits). Bytes that are not
    UTF-8 raise :class:`NotText`, a :data:`YAMLError`, so one ``except`` covers every way a
    file's content can be bad (a file copied back from a host may hold anything); ``OSError``
    passes."""
    return load(_text(read_bytes(path)))


def json_load(text: str) -> Any:
    """One JSON value from ``text`` (a host's answer, a file's content), within
    :data:`MAX_DEPTH` levels; NaN and Infinity are refused. Anything else raises
    :class:`Refused` (a ``ValueError`` and a :data:`YAMLError`), never another exception."""
    def refuse(constant: str) -> None:
        raise Refused(f"{constant} is not a number")

    try:
        value = json.loads(text, parse_constant=refuse)
    except RecursionError:
        raise TooLarge("nested too deeply") from None
    except json.JSONDecodeError as exc:
        raise Refused(f"not valid JSON (line {exc.lineno}: {exc.msg})") from None
    stack = [(value, 0)]
    while stack:  # iterative: the parser's own recursion stops near 1,000 levels, ours at 64
        item, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise TooLarge(f"nested more than {MAX_DEPTH} levels deep")
        if isinstance(item, dict):
            stack += [(v, depth + 1) for v in item.values()]
        elif isinstance(item, list):
            stack += [(v, depth + 1) for v in item]
    return value


def read_json(path: Path) -> Any:
    """:func:`json_load` of the file at ``path``, under :func:`read_bytes`' limits."""
    return json_load(_text(read_bytes(path)))


def problem(exc: yaml.YAMLError) -> str:
    """What is wrong with a file, for a one-line error: ``not valid YAML (line 2)``,
    ``not valid YAML (nested too deeply to read)``, ``key 'lr' is given twice (lines 3 and 7)``
    or ``not UTF-8 text (byte 0: a binary file?)``."""
    if isinstance(exc, Refused):
        return str(exc)
    if isinstance(exc, DuplicateKey):
        return str(exc.problem)
    mark = getattr(exc, "problem_mark", None)
    if mark is not None:
        return f"not valid YAML (line {mark.line + 1})"
    return f"not valid YAML ({exc})" if str(exc) else "not valid YAML"
