"""Reading YAML the way researchers write numbers.

PyYAML's ``safe_load`` follows YAML 1.1, where a float needs a dot and a signed exponent:
``1e-3``, ``5e-1`` and ``1e8`` come back as *text*, and the strict settings checks then
refuse the most common way to write a learning rate. :func:`load` is ``safe_load`` with
YAML 1.2's float rule added, so everything YAML 1.2 (and Python's ``float()``) reads as a
number is one: ``1e-3``, ``1E8``, ``.5``, ``1.5e3``, ``1_000.5``. Every YAML read in
meshtrain goes through it.
"""

from __future__ import annotations

import re
from typing import Any

import yaml

# YAML 1.2 core schema floats with an exponent and no dot (the forms YAML 1.1 misses), plus
# Python's digit separators; forms with a dot are already floats under YAML 1.1.
_EXPONENT_FLOAT = re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$")


class Loader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that also reads YAML 1.2 floats (``1e-3``) as numbers."""


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
