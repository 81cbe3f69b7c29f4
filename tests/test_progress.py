"""The progress numbers' schedule: what a step pays to show progress."""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest

from meshtrain.engine.loop import _ProgressNumbers
from meshtrain.progress import Progress


def _printed_lines(steps: int, due: Callable[[int], bool]) -> list[str]:
    """The plain lines rank 0 prints when the numbers are collected after the ``due`` steps
    (and once more after the last, as the trainer does)."""
    progress = Progress(steps, enabled=True, title="ddp")
    for step in range(steps):
        if due(step):
            progress.update(step + 1, 0.5, 100.0)
    progress.update(steps, 0.5, 100.0)
    return [re.sub(r"  [\d.]+ steps/s.*$", "", line) for line in progress.lines]  # timings vary


@pytest.mark.parametrize("steps", [1, 7, 10, 100, 199, 250, 1000])
def test_a_launched_run_collects_progress_only_for_the_lines_it_prints(steps: int) -> None:
    numbers = _ProgressNumbers(comm=None, startup_sent=0, steps=steps, lines_only=True)  # type: ignore[arg-type]
    collected = [s for s in range(steps) if numbers.due(s)]
    # The same lines as collecting after every step, for at most eleven all-reduces a run
    # (not one per step: each is a round trip over a real link).
    assert _printed_lines(steps, numbers.due) == _printed_lines(steps, lambda s: s + 1 < steps)
    assert len(collected) <= 11
