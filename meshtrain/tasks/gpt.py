"""A small character-level GPT on any text file (``--data FILE``).

The model is a plain pre-norm transformer decoder; every window of ``block_size``
characters is a sample, the last 10% of the text is the validation split.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from torch.utils.data import Dataset

from meshtrain.tasks import Task, TaskBundle, TaskError, TaskOptions, require_positive


class CharWindows(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """(input, target) pairs: ``block_size`` characters and the same shifted by one."""

    def __init__(self, ids: torch.Tensor, block_size: int) -> None:
        self.ids = ids
        self.block_size = block_size

    def __len__(self) -> int:
        return max(0, len(self.ids) - self.block_size - 1)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.ids[i : i + self.block_size + 1]
        return chunk[:-1], chunk[1:]


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention: one projection to q, k and v, scaled dot-product
    attention, an output projection.

    Written out rather than ``nn.MultiheadAttention``, which projects a transposed,
    non-contiguous input: under ``torch.func.vmap`` (the vmap runtime) that matmul copied
    every node's projection weight once per position. Here the projection reads the
    contiguous ``(batch, time, dim)`` input. The parameters, their names, order and
    initialisation are ``nn.MultiheadAttention``'s (same random draws, same state-dict keys).
    Attention dropout goes through ``F.dropout``, so each node's own random stream draws it
    in every runtime (sdpa's fused kernels draw their masks their own way).
    """

    def __init__(self, dim: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.dropout = dropout
        self.in_proj_weight = nn.Parameter(torch.empty(3 * dim, dim))
        self.in_proj_bias = nn.Parameter(torch.empty(3 * dim))
        self.out_proj = nn.Linear(dim, dim)
        # nn.MultiheadAttention's initialisation, draw for draw (out_proj's above, then these).
        nn.init.xavier_uniform_(self.in_proj_weight)
        nn.init.zeros_(self.in_proj_bias)
        nn.init.zeros_(self.out_proj.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, time, dim = x.shape
        qkv = nn.functional.linear(x, self.in_proj_weight, self.in_proj_bias)
        # (batch, time, 3, heads, head_dim) -> three (batch, heads, time, head_dim)
        q, k, v = qkv.view(batch, time, 3, self.heads, dim // self.heads).permute(2, 0, 3, 1, 4)
        if self.dropout and self.training:
            scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
            causal = torch.ones(time, time, dtype=torch.bool, device=x.device).tril()
            weights = scores.masked_fill(~causal, float("-inf")).softmax(dim=-1)
            attended = nn.functional.dropout(weights, p=self.dropout, training=True) @ v
        else:
            attended = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out_proj(attended.transpose(1, 2).reshape(batch, time, dim))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = CausalSelfAttention(dim, heads, dropout)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim),
                                 nn.Dropout(dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class CharGPT(nn.Module):
    """Token + position embeddings, causal blocks, a tied output head."""

    def __init__(self, vocab_size: int, block_size: int = 64, layers: int = 2, heads: int = 4,
                 dim: int = 128, dropout: float = 0.0) -> None:
        super().__init__()
        self.block_size = block_size
        self.tokens = nn.Embedding(vocab_size, dim)
        self.positions = nn.Embedding(block_size, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, dropout) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab_size, bias=False)
        self.head.weight = self.tokens.weight  # weight tying, as in GPT-2
        self.checkpointing = False
        for p in self.parameters():
            if p.dim() >= 2:
                nn.init.normal_(p, std=0.02)

    def gradient_checkpointing_enable(self) -> None:
        """Recompute each block's activations in the backward pass (less memory, more compute)."""
        self.checkpointing = True

    def forward(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        t = x.shape[1]
        h = self.tokens(x) + self.positions(torch.arange(t, device=x.device))
        recompute = self.checkpointing and self.training and torch.is_grad_enabled()
        for block in self.blocks:
            if recompute:  # keep only each block's input; its inside is recomputed in backward
                h = checkpoint(block, h, use_reentrant=False)
            else:
                h = block(h)
        logits = self.head(self.norm(h))
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def build(opts: TaskOptions) -> TaskBundle:
    if not opts.data:
        raise TaskError("task 'gpt' needs a text file: --data FILE")
    o = opts.options
    text = _text(Path(opts.data).expanduser(), o)
    vocab = sorted(set(text))
    lookup = {c: i for i, c in enumerate(vocab)}
    ids = torch.tensor([lookup[c] for c in text], dtype=torch.long)
    cut = math.floor(len(ids) * 0.9)
    torch.manual_seed(opts.seed)
    block = o["block_size"]
    model = CharGPT(len(vocab), block, o["layers"], o["heads"], o["dim"], o["dropout"])
    return TaskBundle(model, CharWindows(ids[:cut], block), CharWindows(ids[cut:], block))


def check_data(path: Path, options: dict[str, Any]) -> None:
    """What :func:`build` refuses of the data file and options, without building."""
    _text(path.expanduser(), options)


def _text(path: Path, o: dict[str, Any]) -> str:
    """The text of ``path``, checked (a UTF-8 file long enough for ``o``'s block size)."""
    if path.is_dir():
        raise TaskError(f"task 'gpt': {path} is a folder; --data takes one text file")
    if not path.is_file():
        raise TaskError(f"task 'gpt': data file {path} does not exist")
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise TaskError(f"task 'gpt': {path} is not UTF-8 text (byte {exc.start}); give a text file") \
            from None
    if "\x00" in text:
        raise TaskError(f"task 'gpt': {path} holds NUL bytes: it looks binary, give a text file")
    require_positive("gpt", o, "block_size", "layers", "heads", "dim")
    if not 0 <= o["dropout"] < 1:
        raise TaskError(f"task 'gpt': task_options.dropout must be in [0, 1), got {o['dropout']!r}")
    if o["dim"] % o["heads"]:
        raise TaskError(f"task 'gpt': task_options.dim ({o['dim']}) must be a multiple of heads "
                        f"({o['heads']})")
    block = o["block_size"]
    if len(text) < 20 * block:
        raise TaskError(f"task 'gpt': {path} has {len(text)} characters; need at least {20 * block}")
    return text


TASK = Task(
    name="gpt",
    description="character-level GPT on a text file given by --data",
    build=build,
    defaults={"steps": 200, "batch_size": 16, "val_interval": 50, "val_size": 256},
    strategy_defaults={"diloco": {"H": 20}, "sparta-diloco": {"H": 20},
                      "streaming-diloco": {"H": 20}, "async-diloco": {"H": 20}, "sparseloco": {"H": 20},
                      "fedavg": {"lr": 0.1}},
    options={"block_size": 64, "layers": 2, "heads": 4, "dim": 128, "dropout": 0.0},
    check_data=check_data,
)
