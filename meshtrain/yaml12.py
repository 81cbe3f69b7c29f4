"""Reading YAML the way researchers write numbers.

PyYAML's ``safe_load`` follows YAML 1.1, where a float needs a dot and a signed exponent:
``1e-3``, ``5e-1`` and ``1e8`` come back as *text*, and the strict settings checks then
refuse the most common way to write a learning rate. :func:`load` is ``safe_load`` with
YAML 1.2's float rule added, so everything YAML 1.2 (and Python's ``float()``) reads as a
number is one: ``1e-3``, ``1E8``, ``.5``, ``1.5e3``, ``1_000.5``. It also refuses a key given
twice (YAML's rule, which PyYAML does not apply). Every YAML read in meshtrain goes through it;
:func:`read` reads a file, :func:`problem` says in a few words what is wrong with a bad one.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from meshtrain.errors import InputError

# YAML 1.2 core schema floats with an exponent and no dot (the forms YAML 1.1 misses), plus
# Python's digit separators; forms with a dot are already floats under YAML 1.1.
_EXPONENT_FLOAT = re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$")


class DuplicateKey(yaml.constructor.ConstructorError, InputError):
    """A mapping that gives one key twice: YAML requires keys to be unique, and PyYAML would
    keep the last value silently (an ``lr`` given twice in a profile trained with the second)."""


class Loader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that also reads YAML 1.2 floats (``1e-3``) as numbers and refuses a
    key given twice in one mapping."""

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


class NotText(yaml.YAMLError, InputError):
    """A YAML file whose bytes are not UTF-8 text (a binary file, or another encoding)."""


def read(path: Path) -> Any:
    """:func:`load` of the file at ``path``. Bytes that are not UTF-8 raise :class:`NotText`, a
    :data:`YAMLError`, so one ``except`` covers every way a file's content can be bad (a file
    copied back from a host may hold anything); ``OSError`` passes."""
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise NotText(f"not UTF-8 text (byte {exc.start}: a binary file?)") from None
    return load(text)


def problem(exc: yaml.YAMLError) -> str:
    """What is wrong with a file, for a one-line error: ``not valid YAML (line 2)``,
    ``not valid YAML (nested too deeply to read)``, ``key 'lr' is given twice (lines 3 and 7)``
    or ``not UTF-8 text (byte 0: a binary file?)``."""
    if isinstance(exc, NotText):
        return str(exc)
    if isinstance(exc, DuplicateKey):
        return str(exc.problem)
    mark = getattr(exc, "problem_mark", None)
    if mark is not None:
        return f"not valid YAML (line {mark.line + 1})"
    return f"not valid YAML ({exc})" if str(exc) else "not valid YAML"
