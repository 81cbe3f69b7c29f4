"""Errors shared across the package, kept at the bottom so that any module may raise them."""

from __future__ import annotations


class SettingError(ValueError):
    """A setting with the wrong type or out of range: one line naming it."""
