"""Choose MKL's math kernels before intra-op threads race to choose them.

On x86 torch computes float ``exp``, ``tanh``, ``sqrt`` and a dozen more element-wise
functions with MKL's vector math library (VML), each intra-op thread on its own chunk.
oneMKL 2024.2, the version torch's wheels bundle, picks a function's kernel on its
first call; when that first call comes from two threads at once, one of them can run a
low-accuracy kernel on its whole chunk (pytorch/pytorch#188792). Measured here
(benchmarks/vml_race.py, 2 threads): the first ``tanh``, ``exp``, ``log`` or ``sqrt`` of
131,072 floats in a fresh process was wrong on one thread's half in 53 processes of 2,000,
by up to 4e-4. Every later call is right, so a run only differs when a node's first step
is its first such call; that was enough to break bit-identity between runtimes.

:func:`resolve_math_kernels` calls each of those functions once, on one element, so on one
thread; importing :mod:`meshtrain.engine` (the Trainer, the runtimes, a launched rank's
loop) calls it, so every process that builds a model or runs a node after that import
computes with the chosen kernels (0 wrong of 2,000 measured). ``import meshtrain`` alone
does not: it loads no torch.
"""

from __future__ import annotations

import torch

#: The element-wise functions torch sends to MKL VML (aten/src/ATen/cpu/vml.h), for float
#: and double. ``trunc`` is among them; the rest of torch's element-wise ops do not call MKL.
VML_FUNCTIONS: tuple[str, ...] = (
    "acos", "asin", "atan", "cos", "erf", "erfc", "erfinv", "exp", "log", "log10", "log2",
    "sin", "sqrt", "tan", "tanh", "trunc",
)

_resolved = False


def resolve_math_kernels() -> None:
    """Call every VML function once per dtype, on one thread (``import meshtrain.engine`` does)."""
    global _resolved
    if torch.backends.mkl.is_available():  # elsewhere (Apple silicon) there is nothing to choose
        for dtype in (torch.float32, torch.float64):
            one = torch.full((1,), 0.5, dtype=dtype)  # one element: a kernel runs on one thread
            for name in VML_FUNCTIONS:
                getattr(torch, name)(one)
    _resolved = True


def math_kernels_resolved() -> bool:
    """Whether :func:`resolve_math_kernels` has run in this process (the tests ask)."""
    return _resolved
