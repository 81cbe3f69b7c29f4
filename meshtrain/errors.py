"""The errors meshtrain raises on purpose, under one root, kept at the bottom of the package
so that any module may raise them.

Two kinds, as types rather than wording: :class:`InputError` (bad input: a file, key or
value at fault, nothing ran; the CLI exits 2) and :class:`RunFailure` (a run or a host
failed after it started; exit 1). Each keeps the built-in base its callers catch
(``ValueError`` for input, ``RuntimeError`` for failures).
"""

from __future__ import annotations


class MeshtrainError(Exception):
    """An error meshtrain raises on purpose: its message is one line naming what is at fault."""

    exit_code = 1


class InputError(MeshtrainError, ValueError):
    """Bad input (a file, key or value): nothing ran. The CLI exits 2."""

    exit_code = 2


class RunFailure(MeshtrainError, RuntimeError):
    """A run, a node or a host failed after the run started. The CLI exits 1."""

    exit_code = 1


class SettingError(InputError):
    """A setting with the wrong type or out of range: one line naming it."""
