"""Fine-tune Whisper with LoRA and DiLoCo on a folder of recordings.

    python examples/whisper_lora.py my-recordings/ --nodes 2          # simulated nodes
    meshtrain launch hosts/macs.yaml --upload examples/whisper_lora.py \\
        -- python whisper_lora.py my-recordings/                      # one rank per Mac

my-recordings/ holds audio files and metadata.csv (file_name,transcription). The run
directory gets the adapter (peft format) in model/ and final_wer in summary.json.
A model, tokenizer, recording or language that cannot be used is one line and exit 2.
"""

import argparse
import os
import sys

from meshtrain import Trainer
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
    load_tokenizer,
)
from meshtrain.hf.decoding import DecodingError, apply_to_tokenizer, check_generation, resolve_decoding
from meshtrain.hf.feature_cache import default_cache_dir
from meshtrain.strategies import DiLoCo, Optim


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("data", help="folder with metadata.csv and the recordings")
    parser.add_argument("--model", default="openai/whisper-tiny", help="hub id or local folder")
    parser.add_argument("--language", default=None, help="e.g. en (multilingual checkpoints)")
    parser.add_argument("--nodes", type=int, default=2,
                        help="simulated nodes (under meshtrain launch: one rank per host instead)")
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--H", type=int, default=50, help="inner steps between DiLoCo syncs")
    parser.add_argument("--batch-size", type=int, default=8)
    args = parser.parse_args()
    try:
        model, train, val = prepare(args.data, args.model, args.language)
    except (ModelLoadError, TokenizerError, SpeechDataError, DecodingError) as exc:
        print(f"error: {exc}", file=sys.stderr)  # bad input: one line, exit 2 as the CLI does
        sys.exit(2)
    strategy = DiLoCo(H=args.H, lr=1e-3, optim=Optim("adamw", weight_decay=0.0))
    result = Trainer(model, train, val, SpeechCollator(model.config.decoder_start_token_id)).fit(
        # Launched (meshtrain launch, torchrun), the world is WORLD_SIZE hosts: nodes is left out.
        strategy=strategy, nodes=None if "WORLD_SIZE" in os.environ else args.nodes,
        max_steps=args.steps, batch_size=args.batch_size,
        device="auto", val_size=64,
    )
    if result.run_dir is not None:  # rank 0
        print(f"final WER {result.summary.get('final_wer')}; run directory {result.run_dir}")


def prepare(
    data: str, name: str, language: str | None,
) -> tuple[HFModel, SpeechDataset, SpeechDataset | None]:
    """The LoRA model and datasets, every input checked before training starts."""
    # Only the LoRA adapters train, so every DiLoCo sync sends the adapters, not the model.
    model = HFModel.from_pretrained(name, lora=LoRA(r=8, alpha=32, target_modules=["q_proj", "v_proj"]))
    model.tokenizer = tokenizer = load_tokenizer(name)  # fails loudly if it loads empty
    decoding = resolve_decoding(model.base, language, "transcribe", name)  # *.en: no language token
    apply_to_tokenizer(tokenizer, decoding)
    model.generate_kwargs = decoding.generate_kwargs()
    model.feature_extractor = features = feature_extractor_for(model.config, name)
    train_clips, val_clips = find_splits(data, val_fraction=0.1)
    limit = model.config.max_target_positions
    cache = default_cache_dir()  # features on disk (~1 MB a clip), computed once
    train = SpeechDataset(train_clips, features, tokenizer, limit, cache)
    val = SpeechDataset(val_clips, features, tokenizer, limit, cache) if val_clips else None
    check_generation(model, train[0]["input_features"], name)
    return model, train, val


if __name__ == "__main__":
    main()
