"""Simulated nodes share one malloc arena (glibc): memory a node frees is reused by the
next, not kept per thread (issue 44: four whisper-tiny nodes kept ~8 GB that way)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

#: A run of 4 thread nodes in a fresh process, then glibc's own account of its arenas:
#: malloc_info writes one <heap nr="N"> element per arena.
RUN = r"""
import ctypes, json, os, re, sys, tempfile
import torch
from torch import nn
from meshtrain import Trainer
from meshtrain.strategies import DDP

class Regression(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(64, 1)
    def forward(self, batch):
        x, y = batch
        return ((self.layer(x) - y) ** 2).mean()

data = torch.utils.data.TensorDataset(torch.randn(64, 64), torch.randn(64, 1))
with tempfile.TemporaryDirectory() as out:
    Trainer(Regression(), data).fit(strategy=DDP(lr=0.1), nodes=4, max_steps=3, batch_size=4, out_dir=out,
                                    progress=False)
    libc = ctypes.CDLL(None)
    libc.fopen.restype = ctypes.c_void_p
    libc.fopen.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
    libc.fclose.argtypes = [ctypes.c_void_p]
    libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
    path = os.path.join(out, "malloc.xml")
    f = libc.fopen(path.encode(), b"w")
    libc.malloc_info(0, f)
    libc.fclose(f)
    heaps = len(re.findall(r'<heap nr="\d+">', open(path).read()))
print(json.dumps({"arenas": heaps, "env": os.environ.get("MALLOC_ARENA_MAX")}))
"""


def glibc() -> bool:
    import ctypes

    try:
        ctypes.CDLL(None).gnu_get_libc_version  # noqa: B018
    except AttributeError:
        return False
    return sys.platform.startswith("linux")


@pytest.mark.skipif(not glibc(), reason="malloc arenas are glibc's (macOS and musl have none to limit)")
def test_thread_nodes_allocate_from_one_arena(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"}
    done = subprocess.run([sys.executable, "-c", RUN], capture_output=True, text=True, env=env, cwd=tmp_path,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    # Without the limit every node thread gets its own arena (5 or more here).
    assert seen == {"arenas": 1, "env": "1"}  # and the processes a run starts inherit it
