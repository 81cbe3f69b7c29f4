"""The command exits without the interpreter's final full garbage collection (torch's
objects made it 0.5-1 s of every command, a launched rank's included); a program that
imports meshtrain as a library exits as before."""

from __future__ import annotations

import subprocess
import sys

# A handler registered first runs last: after the command's own, just before the teardown.
PROBE = "import atexit, gc\natexit.register(lambda: print('frozen', gc.get_freeze_count() > 0))\n"


def _frozen_at_exit(imports: str) -> str:
    done = subprocess.run([sys.executable, "-c", PROBE + imports], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_the_command_leaves_its_objects_to_the_exit() -> None:
    assert _frozen_at_exit("import meshtrain.cli.main") == "frozen True"


def test_the_library_exits_as_before() -> None:
    assert _frozen_at_exit("import meshtrain\nfrom meshtrain import Trainer") == "frozen False"
