"""A small character-level GPT trained with DiLoCo on a text file, then sampled.

Get the tiny-shakespeare text (1.1 MB) once:

    curl -O https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt
    python examples/nanogpt_shakespeare.py input.txt                  # 4 nodes, DiLoCo H=20
    python examples/nanogpt_shakespeare.py input.txt --steps 1000 --layers 4 --dim 256

Any UTF-8 text works. The model is meshtrain's ``gpt`` task (a pre-norm transformer
decoder with tied embeddings): every node trains on its shard of the windows and the
nodes exchange the model once every H steps instead of gradients every step.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from meshtrain import Trainer
from meshtrain.strategies import DiLoCo
from meshtrain.tasks import TaskOptions, check_options
from meshtrain.tasks.gpt import TASK, CharGPT


@torch.no_grad()
def sample(model: CharGPT, vocab: list[str], prompt: str, length: int, seed: int = 0) -> str:
    """Continue ``prompt`` by ``length`` characters, sampling from the model's softmax."""
    lookup = {c: i for i, c in enumerate(vocab)}
    ids = torch.tensor([[lookup.get(c, 0) for c in prompt]])
    generator = torch.Generator().manual_seed(seed)
    model.eval()
    for _ in range(length):
        x = ids[:, -model.block_size:]
        h = model.tokens(x) + model.positions(torch.arange(x.shape[1]))
        for block in model.blocks:
            h = block(h)
        logits = model.head(model.norm(h))[:, -1]
        nxt = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator)
        ids = torch.cat([ids, nxt], dim=1)
    return "".join(vocab[i] for i in ids[0].tolist())


def main(argv: list[str] | None = None) -> dict:
    """Train, print the loss and bytes, print a sample; returns the run's summary."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("text", type=Path, help="a UTF-8 text file, e.g. tiny-shakespeare's input.txt")
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--H", type=int, default=20, help="inner steps between DiLoCo syncs")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--out", default="runs")
    args = parser.parse_args(argv)

    options = check_options(TASK, {"layers": args.layers, "dim": args.dim, "block_size": args.block_size})
    gpt = TASK.build(TaskOptions(data=str(args.text), seed=0, options=options))
    result = Trainer(gpt.model, gpt.train_data, gpt.val_data).fit(
        strategy=DiLoCo(H=args.H, lr=1e-3), nodes=args.nodes, max_steps=args.steps,
        batch_size=args.batch_size, val_interval=max(1, args.steps // 4), val_size=256,
        out_dir=args.out)  # the progress bar (plain lines when piped): training takes minutes
    s = result.summary
    print(f"val loss {s['initial']['val_loss']:.3f} -> {s['final_val_loss']:.3f} "
          f"(nats per character), sent {s['bytes_sent_per_node'] / 1e6:.2f} MB per node, "
          f"run directory {result.run_dir}")
    vocab = sorted(set(args.text.read_text(encoding="utf-8")))
    print(sample(result.model, vocab, prompt="\n", length=200))
    return s


if __name__ == "__main__":
    main()
