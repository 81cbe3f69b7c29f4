"""The ``meshtrain`` command starts without torch: ``--help``, the listings and the hosts
commands never compute, and torch's import (about 2 CPU-seconds) was a third of every
launched rank's and CLI subprocess's start. The commands that compute import it where they
run, and still choose MKL's math kernels before their first step (engine/math_kernels.py)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from meshtrain.config.spec import BUILT_IN_STRATEGIES
from meshtrain.strategies import STRATEGIES
from meshtrain.tasks import TASKS, get_task

# One fresh interpreter for both checks: the command's modules without torch, then the API
# (loaded on first use) with the math kernels chosen before any model is built.
FRESH_PROCESS = textwrap.dedent("""
    import sys
    import meshtrain.cli.main
    loaded = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
    assert not loaded, f"the CLI's modules imported torch: {loaded[:3]}"
    from meshtrain import Trainer
    from meshtrain.engine.math_kernels import math_kernels_resolved
    assert "torch" in sys.modules and math_kernels_resolved(), "the API loaded without resolving the kernels"
    print(Trainer.__name__)
""")


def test_the_command_loads_without_torch_and_the_api_resolves_the_kernels() -> None:
    proc = subprocess.run([sys.executable, "-c", FRESH_PROCESS], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "Trainer"


def test_the_help_texts_name_what_the_registries_hold() -> None:
    """The --strategy and --steps help are built without loading a strategy or a task: the
    names and steps they show are the registries' own."""
    assert BUILT_IN_STRATEGIES == tuple(STRATEGIES)
    for entry in TASKS.values():
        assert entry.steps == get_task(entry.name).defaults.get("steps"), entry.name
