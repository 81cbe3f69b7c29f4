"""The options of ``meshtrain transcribe``, defined once like the training settings (see
:mod:`meshtrain.config.plan`). Which languages and tasks exist is the model's to say: the
command checks those against the model it loads."""

from __future__ import annotations

from dataclasses import dataclass

from meshtrain.config.settings import OPTIONS, Flag, setting

TRANSCRIBE = "transcribe"


def _flag(*names: str) -> Flag:
    return Flag(names, OPTIONS, (TRANSCRIBE,))


@dataclass
class TranscribeSettings:
    """``meshtrain transcribe``: how the recordings are decoded."""

    language: str | None = setting(None, "Language code or name (multilingual models; default: detected "
                                         "per clip).", flag=_flag("--language"))
    task: str | None = setting(None, "transcribe or translate (multilingual models).", flag=_flag("--task"))
    batch_size: int = setting(8, "Clips per generate call.", minimum=1, flag=_flag("--batch-size"))
