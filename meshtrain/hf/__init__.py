"""Hugging Face models in meshtrain: a model wrapper with LoRA, speech data, tokenizers.

Importing this package imports transformers; the rest of meshtrain does not.
"""

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
    "HFModel",
    "LoRA",
    "ModelLoadError",
    "SpeechCollator",
    "SpeechDataError",
    "SpeechDataset",
    "TokenizerError",
    "build_tokenizer",
    "check_tokenizer",
    "feature_extractor_for",
    "find_splits",
    "is_adapter_folder",
    "load_tokenizer",
    "read_audio",
    "word_error_rate",
]
