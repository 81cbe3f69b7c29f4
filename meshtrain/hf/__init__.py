"""Hugging Face models in meshtrain: a model wrapper with LoRA, speech data, tokenizers.

Importing this package imports transformers; the rest of meshtrain does not.
"""

from meshtrain.hf.decoding import DecodingError, resolve_decoding
from meshtrain.hf.feature_cache import FeatureCache, default_cache_dir
from meshtrain.hf.model import HFModel, LoRA, ModelLoadError, is_adapter_folder, word_error_rate
from meshtrain.hf.speech import (
    SpeechCollator,
    SpeechDataError,
    SpeechDataset,
    feature_extractor_for,
    find_splits,
    read_audio,
)
from meshtrain.hf.tokenizer import TokenizerError, build_tokenizer, check_tokenizer, load_tokenizer

__all__ = [
    "DecodingError",
    "FeatureCache",
    "HFModel",
    "LoRA",
    "ModelLoadError",
    "SpeechCollator",
    "SpeechDataError",
    "SpeechDataset",
    "TokenizerError",
    "build_tokenizer",
    "check_tokenizer",
    "default_cache_dir",
    "feature_extractor_for",
    "find_splits",
    "is_adapter_folder",
    "load_tokenizer",
    "read_audio",
    "resolve_decoding",
    "word_error_rate",
]
