"""Hugging Face models as meshtrain models: ``model(batch)`` returns the loss.

    model = HFModel.from_pretrained("openai/whisper-tiny", lora=LoRA(r=8))
    Trainer(model, train, val, collate_fn).fit(strategy=DiLoCo(H=50), nodes=2)

Any model whose forward returns ``.loss`` when given ``labels`` works (Whisper, causal
LMs, seq2seq). With LoRA only the adapter weights require grad, and meshtrain's
strategies optimise and communicate only those: a sync costs the adapter's bytes.
"""

from __future__ import annotations

import contextlib
import copy
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

import torch
from torch import nn

from meshtrain import yaml12
from meshtrain.errors import InputError
from meshtrain.run_dir import atomic_write_text

ADAPTER_CONFIG = "adapter_config.json"
#: What peft may train besides the adapters: no biases, every bias, or the adapted layers' biases.
LoraBias = Literal["none", "all", "lora_only"]


class ModelLoadError(InputError):
    """A model that cannot be loaded (unknown id offline, missing folder, bad LoRA settings)."""


@dataclass
class LoRA:
    """LoRA settings by name (peft's ``LoraConfig``): ``W + (alpha / r) * B @ A`` on each
    target module. ``target_modules`` are module-name suffixes such as ``q_proj``."""

    r: int = 8
    alpha: float = 32
    dropout: float = 0.1
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "v_proj"])
    bias: LoraBias = "none"

    @classmethod
    def from_options(cls, options: dict[str, Any] | bool | None) -> LoRA | None:
        """From a profile's ``lora:`` mapping (missing keys take defaults); null/false: none."""
        if options is None or options is False:
            return None
        if options is True:
            return cls()
        if not isinstance(options, dict):
            raise ModelLoadError(f"lora must be a mapping (r, alpha, dropout, target_modules) or null, "
                                 f"got {options!r}")
        known = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ModelLoadError(f"lora has no setting {unknown[0]!r} (settings: {', '.join(sorted(known))})")
        lora = cls(**options)
        if isinstance(lora.target_modules, str):
            lora.target_modules = [lora.target_modules]
        if lora.r < 1:
            raise ModelLoadError(f"lora.r must be >= 1, got {lora.r}")
        if lora.bias not in get_args(LoraBias):
            choices = ", ".join(get_args(LoraBias))
            raise ModelLoadError(f"lora.bias must be one of {choices}, got {lora.bias!r}")
        return lora

    def peft_config(self, model: nn.Module) -> Any:
        """peft's ``LoraConfig`` for ``model``: ``fan_in_fan_out`` says how its targeted
        layers store their weights (GPT-2's ``Conv1D`` keeps (in, out), ``nn.Linear`` (out,
        in)); left to peft, a Conv1D target is corrected with a warning on every run."""
        from peft import LoraConfig
        from transformers.pytorch_utils import Conv1D

        targets = [m for name, m in model.named_modules()
                   if any(name == t or name.endswith("." + t) for t in self.target_modules)]
        # peft annotates lora_alpha as int; a float scales the same (alpha / r).
        alpha: Any = self.alpha
        return LoraConfig(r=self.r, lora_alpha=alpha, lora_dropout=self.dropout,
                          target_modules=list(self.target_modules), bias=self.bias,
                          fan_in_fan_out=bool(targets) and all(isinstance(m, Conv1D) for m in targets))


class HFModel(nn.Module):
    """A Hugging Face model (optionally LoRA-wrapped) with meshtrain's model contract.

    Args:
        model: a ``PreTrainedModel`` or a peft ``PeftModel``.
        tokenizer: decodes generated text for word error rate, and is saved with the model.
        feature_extractor: saved with the model (speech models), so the output folder
            is a complete checkpoint.
        wer: compute word error rate in :meth:`validation_metrics` (default None: when the
            model is an encoder-decoder and has a tokenizer, which may be set later).
        generate_kwargs: passed to ``generate`` for evaluation (e.g. language, task).
        save_merged: also save the LoRA-merged plain model under ``merged/``.
    """

    def __init__(
        self,
        model: nn.Module,
        tokenizer: Any = None,
        feature_extractor: Any = None,
        *,
        wer: bool | None = None,
        generate_kwargs: dict[str, Any] | None = None,
        save_merged: bool = False,
    ) -> None:
        super().__init__()
        # A transformers PreTrainedModel or a peft PeftModel: their own methods (generate,
        # save_pretrained, get_base_model, ...) are called on it, which nn.Module's type hides.
        self.model: Any = model
        self.tokenizer = tokenizer
        self.feature_extractor = feature_extractor
        self.wer = wer
        self.generate_kwargs = dict(generate_kwargs or {})
        self.save_merged = save_merged

    # ---------------------------------------------------------------- building
    @classmethod
    def from_pretrained(
        cls,
        name_or_path: str,
        *,
        lora: LoRA | None = None,
        tokenizer: Any = None,
        feature_extractor: Any = None,
        seed: int = 0,
        **kwargs: Any,
    ) -> HFModel:
        """Load by hub id or local folder (fp32, also on MPS). A folder this class saved
        with LoRA (``adapter_config.json``) loads its base model plus the adapter."""
        path = Path(name_or_path)
        model: nn.Module
        if is_adapter_folder(name_or_path):
            if lora is not None:
                raise ModelLoadError(f"{name_or_path} already holds a LoRA adapter; do not pass lora")
            from peft import PeftConfig, PeftModel

            base_name = PeftConfig.from_pretrained(str(path)).base_model_name_or_path
            base = _load_pretrained(base_name)
            with _quiet_transformers():
                model = PeftModel.from_pretrained(base, str(path), is_trainable=True)
        else:
            model = _with_lora(_load_pretrained(model_reference(name_or_path)), lora, seed)
        return cls(model, tokenizer, feature_extractor, **kwargs)

    @classmethod
    def from_config(
        cls, config: Any, *, lora: LoRA | None = None, seed: int = 0, tokenizer: Any = None,
        feature_extractor: Any = None, **kwargs: Any,
    ) -> HFModel:
        """A randomly initialised model of ``config``'s architecture (for tests and demos)."""
        klass = _model_class(config)
        with _forked_seed(seed):
            model = klass.from_config(config) if klass.__name__.startswith("Auto") else klass(config)
        return cls(_with_lora(model, lora, seed), tokenizer, feature_extractor, **kwargs)

    # ---------------------------------------------------------------- training
    @property
    def config(self) -> Any:
        return self.model.config

    @property
    def base(self) -> Any:
        """The underlying transformers model (inside the peft wrapper, if any)."""
        return self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model

    @property
    def is_lora(self) -> bool:
        return hasattr(self.model, "peft_config")

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        out = self.model(**batch)
        if getattr(out, "loss", None) is None:
            raise ValueError(f"{type(self.base).__name__} returned no loss: the batch needs 'labels' "
                             f"(batch keys: {', '.join(batch)})")
        return out.loss

    @property
    def measures_wer(self) -> bool:
        """Whether validation reports WER: as set, else for encoder-decoders with a tokenizer."""
        if self.wer is not None:
            return self.wer
        return bool(getattr(self.config, "is_encoder_decoder", False)) and self.tokenizer is not None

    def gradient_checkpointing_enable(self) -> None:
        """Recompute activations in the backward pass (transformers' own checkpointing,
        which HF's docs call gradient or activation checkpointing).

        Non-reentrant checkpointing: with LoRA the layers' inputs do not require grad, and
        the reentrant kind would then give the adapters no gradient.
        """
        kwargs = {"use_reentrant": False}
        base = self.base
        if hasattr(base, "activation_checkpointing_enable"):  # its name from transformers 5.2x on
            base.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            base.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        # A checkpointed model keeps no cache. Said in the config, which every submodule
        # reads (an argument to forward does not reach Whisper's encoder, and transformers
        # warned there); generate() follows generation_config and still decodes from its cache.
        base.config.use_cache = False

    def trainable_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters() if p.requires_grad)

    # -------------------------------------------------------------- evaluation
    @torch.no_grad()
    def transcribe(self, batch: dict[str, torch.Tensor], max_new_tokens: int | None = None) -> list[str]:
        """Greedy transcripts of a batch's ``input_features`` (``generate_kwargs`` apply;
        ``max_new_tokens`` overrides theirs)."""
        kwargs = {"max_new_tokens": 128, **self.generate_kwargs}
        if max_new_tokens is not None:
            kwargs["max_new_tokens"] = max_new_tokens
        limit = getattr(self.config, "max_target_positions", None)
        if limit is not None:  # Whisper refuses to decode past its positions; leave room for the prefix
            kwargs["max_new_tokens"] = min(kwargs["max_new_tokens"], limit - 8)
        with _quiet_transformers():
            ids = self.model.generate(input_features=batch["input_features"], **kwargs)
        return self.tokenizer.batch_decode(ids, skip_special_tokens=True)

    def references(self, batch: dict[str, torch.Tensor]) -> list[str]:
        """The transcripts a batch's labels encode (-100 padding removed)."""
        return [self.tokenizer.decode(row[row != -100].tolist(), skip_special_tokens=True)
                for row in batch["labels"].cpu()]

    def validation_metrics(self, batches: list[dict[str, torch.Tensor]]) -> dict[str, float]:
        """Corpus word error rate of greedy transcripts over the validation batches."""
        if not self.measures_wer:
            return {}
        refs, hyps = [], []
        for batch in batches:
            refs += self.references(batch)
            hyps += self.transcribe(batch)
        # English unless decoding names another language (English-only models name none).
        language = str(self.generate_kwargs.get("language") or "en").lower()
        english = language in ("en", "english", "<|en|>")
        return {"wer": word_error_rate(refs, hyps, english=english),
                "wer_raw": raw_word_error_rate(refs, hyps)}

    # ------------------------------------------------------------------ saving
    def save_pretrained(self, directory: str) -> None:
        """Save a loadable checkpoint: the adapter (peft format) with LoRA, else the full
        model; the tokenizer and feature extractor beside it; with ``save_merged`` also
        the LoRA-merged plain model under ``merged/``."""
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        with _quiet_transformers():
            self.model.save_pretrained(str(out))
            self._save_processors(out)
            if self.is_lora and self.save_merged:
                merged = copy.deepcopy(self.model).merge_and_unload()
                merged.save_pretrained(str(out / "merged"))
                self._save_processors(out / "merged")

    def _save_processors(self, out: Path) -> None:
        for part in (self.tokenizer, self.feature_extractor):
            if part is not None:
                part.save_pretrained(str(out))


# ------------------------------------------------------------------------ helpers
def is_adapter_folder(name_or_path: str) -> bool:
    """Whether ``name_or_path`` is a folder holding a saved LoRA adapter (peft format)."""
    return (Path(name_or_path) / ADAPTER_CONFIG).is_file()


def model_reference(name_or_path: str) -> str:
    """How a saved adapter should name its base model: a local folder as an absolute path
    (so the adapter reloads from any directory), anything else (a hub id) as given."""
    path = Path(name_or_path).expanduser()
    return str(path.resolve()) if path.exists() else name_or_path


def base_model_of(name_or_path: str) -> str:
    """The base model a run on ``name_or_path`` adapts, as its saved adapter should name
    it: a saved adapter folder's own base, else :func:`model_reference`."""
    if is_adapter_folder(name_or_path):
        try:
            config = yaml12.read_json(Path(name_or_path) / ADAPTER_CONFIG)
        except (OSError, ValueError) as exc:
            raise ModelLoadError(f"{Path(name_or_path) / ADAPTER_CONFIG}: unreadable ({exc})") from None
        base = config.get("base_model_name_or_path") if isinstance(config, dict) else None
        if isinstance(base, str) and base:
            return base
    return model_reference(name_or_path)


#: An adapter_config.json is a few hundred bytes; a bigger one came from no peft.
ADAPTER_CONFIG_LIMIT = 1_000_000


def name_base_model(model_dir: Path, base: str) -> bool:
    """Make the adapter saved in ``model_dir`` name ``base`` as its base model; False when
    ``model_dir`` holds no adapter (a full model names no base). A launched run's rank 0
    saved the path of its shipped copy, which exists only on its host.

    Raises :class:`ModelLoadError` for an adapter_config.json that is not a small JSON
    object (it came back from a host: anything may be there)."""
    path = model_dir / ADAPTER_CONFIG
    if not path.is_file():
        return False
    if path.stat().st_size > ADAPTER_CONFIG_LIMIT:
        raise ModelLoadError(f"{path}: {path.stat().st_size} bytes, larger than any adapter config")
    try:
        config = yaml12.read_json(path)  # the one reader of hostile JSON: bounded depth
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{path}: not JSON ({exc})") from None
    if not isinstance(config, dict):
        raise ModelLoadError(f"{path}: not a JSON object")
    config["base_model_name_or_path"] = base
    atomic_write_text(path, json.dumps(config, indent=2, sort_keys=True) + "\n")
    return True


def word_error_rate(references: Sequence[str], hypotheses: Sequence[str], *,
                    english: bool = True) -> float:
    """Corpus WER (word edits / reference words) of the normalised texts
    (:func:`normalize_text`), as Whisper is evaluated. Empty references are skipped."""
    return _wer([normalize_text(r, english=english) for r in references],
                [normalize_text(h, english=english) for h in hypotheses])


def raw_word_error_rate(references: Sequence[str], hypotheses: Sequence[str]) -> float:
    """Corpus WER of the texts as written: only runs of whitespace count as one."""
    return _wer([" ".join(r.split()) for r in references], [" ".join(h.split()) for h in hypotheses])


def _wer(references: list[str], hypotheses: list[str]) -> float:
    import jiwer

    pairs = [(r, h) for r, h in zip(references, hypotheses, strict=True) if r]
    if not pairs:
        return float("nan")
    return float(jiwer.wer([r for r, _ in pairs], [h for _, h in pairs]))


# Typographic quotes (macOS and phones type them) as the straight ones Whisper's normaliser knows.
_STRAIGHT_QUOTES = str.maketrans({"\u2019": "'", "\u2018": "'", "\u02bc": "'", "\u201c": '"',
                                  "\u201d": '"'})


def normalize_text(text: str, *, english: bool = True) -> str:
    """Text as Whisper's evaluation compares it.

    Typographic apostrophes and quotes become straight ones; then, for English, the
    ``EnglishTextNormalizer`` transformers ships with Whisper: lower case, contractions
    expanded ("don't" -> "do not"), number words as numerals ("five" -> "5"), titles
    ("Mr." -> "mister"), fillers ("um", "uh") and punctuation removed, whitespace
    collapsed. Its British-to-American spelling map comes with the Whisper tokenizer
    files, not offline, so spellings are left as written. Other languages get
    ``BasicTextNormalizer`` (lower case, punctuation and bracketed text removed).
    """
    from transformers.models.whisper.english_normalizer import (
        BasicTextNormalizer,
        EnglishTextNormalizer,
    )

    text = text.translate(_STRAIGHT_QUOTES)
    normalizer = EnglishTextNormalizer({}) if english else BasicTextNormalizer()
    return " ".join(normalizer(text).split())


def _load_pretrained(name_or_path: str) -> nn.Module:
    """The model class its config names (``architectures``), in fp32."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(name_or_path)
        with _quiet_transformers():
            return _model_class(config).from_pretrained(name_or_path, dtype=torch.float32)
    except (OSError, ValueError) as exc:  # ValueError: a folder that is no model ("Unrecognized model")
        where = "folder" if Path(name_or_path).exists() else "hub id (no local folder of that name)"
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelLoadError(f"cannot load model {name_or_path!r} as a {where}: {first}") from exc


def _model_class(config: Any) -> type[Any]:
    import transformers

    for name in getattr(config, "architectures", None) or []:
        if hasattr(transformers, name):
            return getattr(transformers, name)
    # No architectures recorded (a bare config): the auto class that knows this config type.
    autos = ([transformers.AutoModelForSpeechSeq2Seq, transformers.AutoModelForSeq2SeqLM]
             if config.is_encoder_decoder else [transformers.AutoModelForCausalLM])
    for auto in autos:
        mapping: Any = auto._model_mapping  # config class -> model class, as the auto class holds it
        if type(config) in mapping:
            return auto
    raise ModelLoadError(f"no model class for a {config.model_type!r} config that returns a loss; "
                         "set config.architectures")


def _with_lora(model: nn.Module, lora: LoRA | None, seed: int) -> nn.Module:
    if lora is None:
        return model
    from peft import get_peft_model

    # LoRA's A matrices are random: seed them so every host builds the same adapter.
    with _forked_seed(seed), _quiet_transformers():
        try:
            return get_peft_model(model, lora.peft_config(model))
        except ValueError as exc:
            raise ModelLoadError(f"lora.target_modules {lora.target_modules}: {exc}") from exc


@contextlib.contextmanager
def _forked_seed(seed: int) -> Iterator[None]:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """Hide transformers' progress bars and advice while loading and generating."""
    import warnings

    from transformers.utils import logging

    level = logging.get_verbosity()
    bars = logging.is_progress_bar_enabled()
    logging.set_verbosity_error()
    logging.disable_progress_bar()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            yield
    finally:
        logging.set_verbosity(level)
        if bars:
            logging.enable_progress_bar()


