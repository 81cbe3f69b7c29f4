"""Tokenizers for fine-tuning: load one safely, or build a small one offline.

Loading a Whisper tokenizer with no network and no cache can return an EMPTY tokenizer
(vocabulary size 0) that encodes every text to zeros without complaint; training on
that learns nothing and reports a plausible loss. :func:`load_tokenizer` refuses it.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from meshtrain.errors import InputError

#: Whisper's special tokens: every label starts with the decoder start token and ends with
#: end-of-text, which is also the padding token.
START_TOKEN = "<|startoftranscript|>"
END_TOKEN = "<|endoftext|>"


class TokenizerError(InputError):
    """A tokenizer that cannot be used: missing, or loaded empty (vocabulary size 0)."""


def vocab_size(tokenizer: Any) -> int:
    """Every token the tokenizer can produce, added special tokens included."""
    return len(tokenizer)


def check_tokenizer(tokenizer: Any, source: str) -> Any:
    """Return ``tokenizer`` if it has a vocabulary; :class:`TokenizerError` naming ``source`` if not."""
    if vocab_size(tokenizer) == 0 or getattr(tokenizer, "vocab_size", 1) == 0:
        raise TokenizerError(
            f"tokenizer from {source} loaded EMPTY (vocabulary size 0): it would encode every "
            "transcript to zeros. Put the tokenizer files (tokenizer.json or vocab.json + "
            "merges.txt) in the model folder or pass a tokenizer path"
        )
    return tokenizer


def load_tokenizer(name_or_path: str) -> Any:
    """``AutoTokenizer.from_pretrained`` that fails loudly instead of loading empty."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(name_or_path)
    except (OSError, ValueError, TypeError) as exc:
        raise TokenizerError(f"cannot load a tokenizer from {name_or_path}: {_first_line(exc)}") from exc
    return check_tokenizer(tokenizer, name_or_path)


def build_tokenizer(
    texts: Iterable[str], vocab_size: int = 512, directory: str | Path | None = None
) -> Any:
    """Train a small byte-level BPE on ``texts`` and wrap it for transformers.

    Encoding adds Whisper's frame, ``<|startoftranscript|> text <|endoftext|>``, so labels
    look like a real Whisper tokenizer's; ``<|endoftext|>`` doubles as padding as in
    Whisper. Saved to ``directory`` when given (load it back with :func:`load_tokenizer`).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    texts = [t for t in texts if t]
    if not texts:
        raise TokenizerError("cannot build a tokenizer from no text")
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[END_TOKEN, START_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # any text stays encodable
        show_progress=False,
    )
    bpe.train_from_iterator(texts, trainer)
    start, end = bpe.token_to_id(START_TOKEN), bpe.token_to_id(END_TOKEN)
    bpe.post_processor = processors.TemplateProcessing(
        single=f"{START_TOKEN} $A {END_TOKEN}",
        special_tokens=[(START_TOKEN, start), (END_TOKEN, end)],
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe, bos_token=START_TOKEN, eos_token=END_TOKEN, pad_token=END_TOKEN
    )
    if directory is not None:
        tokenizer.save_pretrained(str(directory))
    return tokenizer


def whisper_tokenizer(texts: Iterable[str], vocab_size: int = 512) -> Any:
    """A real ``WhisperTokenizer`` with a small BPE trained on ``texts`` and Whisper's
    special tokens in Whisper's order (``<|startoftranscript|>``, one token per language,
    ``<|translate|>``, ``<|transcribe|>``, ..., ``<|notimestamps|>``), so language and task
    prefixes behave exactly as with a hub checkpoint's tokenizer."""
    import json

    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers, trainers
    from transformers import WhisperTokenizer
    from transformers.models.whisper.tokenization_whisper import LANGUAGES

    texts = [t for t in texts if t]
    if not texts:
        raise TokenizerError("cannot build a tokenizer from no text")
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[END_TOKEN],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    bpe.train_from_iterator(texts, trainer)
    trained = json.loads(bpe.to_str())["model"]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in trained["merges"]]
    tokenizer = WhisperTokenizer(vocab=trained["vocab"], merges=merges)
    # The tokenizer finds a language token at start + 1 + its index in LANGUAGES: keep that order.
    specials = [START_TOKEN, *(f"<|{code}|>" for code in LANGUAGES), "<|translate|>", "<|transcribe|>",
                "<|startoflm|>", "<|startofprev|>", "<|nospeech|>", "<|notimestamps|>"]
    tokenizer.add_tokens([AddedToken(t, special=True, normalized=False) for t in specials],
                         special_tokens=True)
    tokenizer.set_prefix_tokens()  # rebuild the label template now that the prefix tokens exist
    return tokenizer


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
