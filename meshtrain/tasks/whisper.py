"""Fine-tune a Hugging Face Whisper model (full or LoRA) on a folder of recordings.

``--data DIR`` is an audiofolder: ``DIR/metadata.csv`` with ``file_name,transcription``
(or ``DIR/train/`` and ``DIR/validation/`` each with one). Word error rate on the
validation clips is measured at the end (and every ``val_interval``) as ``final_wer``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from meshtrain.tasks import Task, TaskBundle, TaskError, TaskOptions

OPTIONS: dict[str, Any] = {
    "model": "openai/whisper-tiny",  # hub id or local folder (a saved run's model/ continues it)
    "tokenizer": None,  # default: the model's own
    "lora": {"r": 8, "alpha": 32, "dropout": 0.1, "target_modules": ["q_proj", "v_proj"]},  # null: full
    "save_merged": False,  # with LoRA, also save the merged model under model/merged/
    "language": None,  # e.g. "en": the language token multilingual Whisper labels and decoding use
    # (English-only checkpoints, *.en, take none: en is accepted and dropped)
    "task": "transcribe",
    "val_fraction": 0.1,  # held out when DIR has no validation/ split
    "max_new_tokens": 128,
    "text_column": "transcription",
    # Features on disk, computed once (~1 MB a clip for real Whisper): "auto" is
    # ~/.cache/meshtrain/features ($MESHTRAIN_CACHE), or a folder; null computes them every epoch.
    "feature_cache": "auto",
    # Clips longer than the model hears (30 s for Whisper) stop the run, listed; true skips
    # them instead (each named in a warning).
    "skip_long_clips": False,
}


def build(opts: TaskOptions) -> TaskBundle:
    from meshtrain.hf import (
        HFModel,
        LoRA,
        ModelLoadError,
        SpeechCollator,
        SpeechDataError,
        SpeechDataset,
        TokenizerError,
        feature_extractor_for,
        find_splits,
        is_adapter_folder,
        load_tokenizer,
    )
    from meshtrain.hf.decoding import DecodingError, apply_to_tokenizer, check_generation, resolve_decoding

    o, status = opts.options, opts.status
    if not opts.data:
        raise TaskError("the whisper task needs --data DIR: a folder of recordings with metadata.csv "
                        "(file_name,transcription)")
    try:
        train_clips, val_clips = find_splits(opts.data, float(o["val_fraction"]), opts.seed, o["text_column"])
        # A saved LoRA run (model/ with adapter_config.json) continues with its own adapter.
        lora = None if is_adapter_folder(o["model"]) else LoRA.from_options(o["lora"])
        with status.phase(f"loading model {o['model']}"):
            model = HFModel.from_pretrained(o["model"], lora=lora, seed=opts.seed, wer=True,
                                            save_merged=bool(o["save_merged"]))
            tokenizer = model.tokenizer = load_tokenizer(o["tokenizer"] or o["model"])
        # English-only checkpoints take no language/task tokens: decide the prefix now, the
        # same for the labels and for generate, instead of failing at the first validation.
        decoding = resolve_decoding(model.base, o["language"], o["task"], o["model"])
        apply_to_tokenizer(tokenizer, decoding)
        model.generate_kwargs = {"max_new_tokens": int(o["max_new_tokens"]), **decoding.generate_kwargs()}
        config = model.config
        if len(tokenizer) > config.vocab_size:
            raise TokenizerError(f"tokenizer has {len(tokenizer)} tokens but model {o['model']} only "
                                 f"{config.vocab_size}: they do not belong together")
        model.feature_extractor = feature_extractor_for(config, o["model"])
        limit = getattr(config, "max_target_positions", None)
        cache, extractor = _cache_dir(o["feature_cache"]), model.feature_extractor
        skip = bool(o["skip_long_clips"])
        if cache is None:
            status.line("note: no feature cache (task_options.feature_cache: null): every batch "
                        "computes its clips' features again")
        train = SpeechDataset(train_clips, extractor, tokenizer, limit, cache, skip, status=status,
                              split="training")
        val = SpeechDataset(val_clips, extractor, tokenizer, limit, cache, skip, status=status,
                            split="validation") if val_clips else None
        with status.phase("test decode (the model generates for one clip)"):
            check_generation(model, train[0]["input_features"], o["model"])
    except (SpeechDataError, TokenizerError, ModelLoadError, DecodingError) as exc:
        raise TaskError(str(exc)) from exc
    return TaskBundle(model, train, val, SpeechCollator(config.decoder_start_token_id))


def _cache_dir(value: Any) -> Path | None:
    if value is None or value is False:
        return None
    if not isinstance(value, str) or not value:
        raise TaskError(f"task_options.feature_cache must be a folder, auto or null, got {value!r}")
    from meshtrain.hf.feature_cache import default_cache_dir

    return default_cache_dir() if value == "auto" else Path(value).expanduser()


TASK = Task(
    name="whisper",
    description="fine-tune a Hugging Face Whisper model (full or LoRA) on a folder of recordings",
    build=build,
    defaults={
        "strategy": "diloco",
        "strategy_options": {"H": 50, "optim": {"name": "adamw", "weight_decay": 0.0}},
        "lr": 1e-3,
        "nodes": 2,
        "steps": 200,
        "batch_size": 8,
        "device": "auto",
        "val_size": 64,
    },
    options=OPTIONS,
)
