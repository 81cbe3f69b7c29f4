"""Which language and task tokens a Whisper checkpoint takes, decided before training.

Multilingual Whisper starts every transcript with ``<|startoftranscript|><|en|><|transcribe|>``;
English-only checkpoints (``whisper-tiny.en`` and friends) have no language or task
slot, and transformers refuses ``generate(language=...)`` on them. A profile's
``language: en`` must therefore be dropped for them, and a language the checkpoint does
not know must fail before the first step, not when validation first decodes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from meshtrain.errors import InputError


class DecodingError(InputError):
    """A language or task the checkpoint cannot decode in (one line, before training)."""


@dataclass(frozen=True)
class Decoding:
    """The resolved prefix: ``language`` is a code such as ``"en"`` (None: none in the prefix)."""

    language: str | None
    task: str | None
    english_only: bool

    def generate_kwargs(self) -> dict[str, Any]:
        """What ``generate`` takes for this prefix (nothing for English-only checkpoints)."""
        kwargs: dict[str, Any] = {}
        if self.language is not None:
            kwargs["language"] = self.language
        if self.task is not None:
            kwargs["task"] = self.task
        return kwargs


def is_english_only(model: Any, name_or_path: str = "") -> bool:
    """Whether a Whisper model has no language tokens to choose from: its generation config
    says ``is_multilingual: false``, has no ``lang_to_id``, or its name ends in ``.en``."""
    config = getattr(model, "generation_config", None)
    if config is None or getattr(config, "is_multilingual", True) is False:
        return True
    if not getattr(config, "lang_to_id", None):
        return True
    names = [name_or_path, getattr(model, "name_or_path", "") or ""]
    return any(Path(str(n).rstrip("/")).name.endswith(".en") for n in names if n)


def resolve_decoding(model: Any, language: str | None, task: str | None, name: str) -> Decoding:
    """The language/task prefix ``model`` (a transformers Whisper) decodes with.

    English-only checkpoints accept ``language`` None or English and ``task`` None or
    ``transcribe``, which are then left out; anything else raises :class:`DecodingError`.
    Multilingual checkpoints take a code (``en``) or a name (``english``) that their
    ``lang_to_id`` lists, and a task their ``task_to_id`` lists.
    """
    from transformers.models.whisper.tokenization_whisper import TO_LANGUAGE_CODE

    code = None
    if language is not None:
        lowered = str(language).strip().lower()
        code = TO_LANGUAGE_CODE.get(lowered, lowered)
    if is_english_only(model, name):
        if code not in (None, "en"):
            raise DecodingError(f"model {name} is English-only (no language tokens): it cannot transcribe "
                                f"language {language!r}; set task_options.language to en or null, or use a "
                                "multilingual checkpoint")
        if task not in (None, "transcribe"):
            raise DecodingError(f"model {name} is English-only: it has no {task!r} task "
                                "(set task_options.task to transcribe)")
        return Decoding(None, None, english_only=True)
    config = model.generation_config
    if code is not None and f"<|{code}|>" not in config.lang_to_id:
        known = sorted(t.strip("<|>") for t in config.lang_to_id)
        raise DecodingError(f"model {name} has no language {language!r} (task_options.language); it knows "
                            f"{len(known)}: {', '.join(known[:12])}{' ...' if len(known) > 12 else ''}")
    task_ids = getattr(config, "task_to_id", None) or {}
    if task is not None and task not in task_ids:
        raise DecodingError(f"model {name} has no task {task!r} (task_options.task); it knows: "
                            f"{', '.join(sorted(task_ids)) or 'none'}")
    # No language: transformers detects it per clip, and the task token goes with it.
    return Decoding(code, task if code is not None else None, english_only=False)


def apply_to_tokenizer(tokenizer: Any, decoding: Decoding) -> None:
    """Make a Whisper tokenizer's label prefix match what ``generate`` will produce.

    Tokenizers without Whisper's prefix (a plain BPE) are left as they are.
    """
    if not hasattr(tokenizer, "set_prefix_tokens"):
        return
    # set_prefix_tokens keeps the old value for None, so clear the attributes first: an
    # English-only model's labels must carry no language or task token.
    tokenizer.language, tokenizer.task = decoding.language, decoding.task
    tokenizer.set_prefix_tokens()


def check_generation(hf_model: Any, features: torch.Tensor, name: str) -> None:
    """Decode two tokens of one clip's features with the run's ``generate_kwargs``, so a
    setting transformers refuses fails now, with one line, instead of after training."""
    was_training = hf_model.training
    hf_model.eval()
    try:
        hf_model.transcribe({"input_features": features.unsqueeze(0)}, max_new_tokens=2)
    except (ValueError, KeyError, TypeError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DecodingError(f"model {name} cannot decode with {hf_model.generate_kwargs}: {first}") from exc
    finally:
        hf_model.train(was_training)
