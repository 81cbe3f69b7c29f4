"""How often a fresh process's first element-wise op comes out wrong, with and without
:func:`meshtrain.engine.math_kernels.resolve_math_kernels`.

Each trial is a fresh process (forked from this one, which has imported torch, not
meshtrain, and called no math) that sets its intra-op threads, optionally imports
meshtrain's engine (which resolves MKL's kernels), then applies
one function twice to the same 131,072 floats. The first result should equal the second
bit for bit; oneMKL 2024.2 sometimes runs a low-accuracy kernel on one thread's chunk of
the very first call (pytorch/pytorch#188792). ``--concurrent`` trials run at once, as the
nodes of a run start at once. Linux only (it forks).

    python benchmarks/vml_race.py                       # tanh exp sqrt, 300 trials each
    python benchmarks/vml_race.py --functions tanh --trials 1000 --threads 2
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import time

import torch
from rich.table import Table

from meshtrain.tables import print_fitted


def _trial(function: str, threads: int, resolve: bool, results: mp.SimpleQueue) -> None:  # type: ignore[type-arg]
    torch.set_num_threads(threads)
    if resolve:
        import meshtrain.engine  # noqa: F401 - importing it resolves the kernels, as in any run
    # Filled by one thread: no op before the measured one starts the intra-op thread pool
    # (starting it is part of the race), and in every function's domain.
    x = torch.empty(64, 2048).uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(1))
    op = getattr(torch, function)
    first, second = op(x), op(x)
    exact = op(x.double())
    results.put((int((first != second).sum()), float((first.double() - exact).abs().max())))


def _run(function: str, threads: int, resolve: bool, trials: int, concurrent: int) -> tuple[int, int, float]:
    ctx = mp.get_context("fork")  # nothing resolved to share: this process did no math
    results = ctx.SimpleQueue()
    wrong, worst, done = 0, 0.0, 0
    while done < trials:
        wave = [ctx.Process(target=_trial, args=(function, threads, resolve, results))
                for _ in range(min(concurrent, trials - done))]
        for p in wave:
            p.start()
        for _ in wave:
            differing, error = results.get()
            if differing:
                wrong += 1
                worst = max(worst, error)
        for p in wave:
            p.join()
        done += len(wave)
    return wrong, trials, worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--functions", nargs="+", default=["tanh", "exp", "sqrt"])
    parser.add_argument("--trials", type=int, default=300, help="fresh processes per cell")
    parser.add_argument("--threads", type=int, default=2, help="intra-op threads per process")
    parser.add_argument("--concurrent", type=int, default=2, help="processes started at once")
    args = parser.parse_args()

    table = Table(title=f"first call wrong, {args.threads} threads, {args.concurrent} processes at once")
    table.add_column("function")
    table.add_column("as torch does it", justify="right")
    table.add_column("worst error", justify="right")
    table.add_column("after import meshtrain.engine", justify="right")
    start = time.perf_counter()
    for function in args.functions:
        plain = _run(function, args.threads, False, args.trials, args.concurrent)
        fixed = _run(function, args.threads, True, args.trials, args.concurrent)
        table.add_row(function, f"{plain[0]} of {plain[1]}", f"{plain[2]:.2g}" if plain[0] else "-",
                      f"{fixed[0]} of {fixed[1]}")
    print_fitted(table)
    print(f"{time.perf_counter() - start:.0f} s; torch {torch.__version__}, "
          f"{torch.__config__.show().splitlines()[3].strip()[2:60]}")


if __name__ == "__main__":
    main()
