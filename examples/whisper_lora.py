"""Fine-tune Whisper with LoRA and DiLoCo on a folder of recordings.

    python examples/whisper_lora.py my-recordings/ --nodes 2          # simulated nodes
    meshtrain launch hosts/macs.yaml --upload examples/whisper_lora.py \\
        -- python whisper_lora.py my-recordings/                      # one rank per Mac

my-recordings/ holds audio files and metadata.csv (file_name,transcription). The run
directory gets the adapter (peft format) in model/ and final_wer in summary.json.
"""

import argparse

from meshtrain import Trainer
from meshtrain.hf import (
    HFModel,
    LoRA,
    SpeechCollator,
    SpeechDataset,
    feature_extractor_for,
    find_splits,
    load_tokenizer,
)
from meshtrain.strategies import DiLoCo, Optim

parser = argparse.ArgumentParser()
parser.add_argument("data", help="folder with metadata.csv and the recordings")
parser.add_argument("--model", default="openai/whisper-tiny", help="hub id or local folder")
parser.add_argument("--language", default=None, help="e.g. en (real Whisper checkpoints)")
parser.add_argument("--nodes", type=int, default=2)
parser.add_argument("--steps", type=int, default=500)
parser.add_argument("--H", type=int, default=50, help="inner steps between DiLoCo syncs")
parser.add_argument("--batch-size", type=int, default=8)
args = parser.parse_args()

# Only the LoRA adapters train, so every DiLoCo sync sends the adapters, not the model.
gen = {"language": args.language, "task": "transcribe"} if args.language else {}
model = HFModel.from_pretrained(args.model, lora=LoRA(r=8, alpha=32, target_modules=["q_proj", "v_proj"]),
                                generate_kwargs=gen)
model.tokenizer = tokenizer = load_tokenizer(args.model)  # fails loudly if it loads empty
if args.language:
    tokenizer.set_prefix_tokens(language=args.language, task="transcribe")
model.feature_extractor = features = feature_extractor_for(model.config, args.model)

train_clips, val_clips = find_splits(args.data, val_fraction=0.1)
limit = model.config.max_target_positions
train = SpeechDataset(train_clips, features, tokenizer, limit)
val = SpeechDataset(val_clips, features, tokenizer, limit) if val_clips else None

strategy = DiLoCo(H=args.H, lr=1e-3, optim=Optim("adamw", weight_decay=0.0))
result = Trainer(model, train, val, SpeechCollator(model.config.decoder_start_token_id)).fit(
    strategy=strategy, nodes=args.nodes, max_steps=args.steps, batch_size=args.batch_size,
    device="auto", val_size=64,
)
if result.run_dir is not None:  # rank 0
    print(f"final WER {result.summary.get('final_wer')}; run directory {result.run_dir}")
