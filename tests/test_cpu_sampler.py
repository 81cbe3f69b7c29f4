"""The CPU table of `benchmarks/scaling.py --profile-cpu` (once quoted in the README) gives each
thread the CPU it used: checked against a child process's own clock for its threads."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest

SAMPLER = Path(__file__).resolve().parent.parent / "benchmarks" / "cpu_sampler.py"

#: Spins 0.3 s of CPU in a thread named meshtrain-busy, then 0.1 s in the main thread;
#: prints both threads' own CPU clocks and idles (both threads alive, so the sampler can
#: read their final figures) until its stdin closes.
CHILD = """
import threading, time
def spin(seconds, out):
    start = time.thread_time()
    while time.thread_time() - start < seconds:
        pass
    out.append(time.thread_time())
got, done = [], threading.Event()
def busy():
    spin(0.3, got)
    done.wait()
thread = threading.Thread(target=busy, name="meshtrain-busy")
thread.start()
while not got:
    time.sleep(0.01)
spin(0.1, got)
print(got[0], got[1], flush=True)
import sys
sys.stdin.read()
done.set()
thread.join()
"""


def _sampler() -> ModuleType:
    spec = importlib.util.spec_from_file_location("cpu_sampler", SAMPLER)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_each_thread_gets_the_cpu_it_used(tmp_path: Path) -> None:
    sampler_module = _sampler()
    (tmp_path / "sitecustomize.py").write_text(sampler_module.THREAD_NAMER)
    sampler = sampler_module.CpuSampler({}, interval=0.05).start()
    started = time.monotonic()
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True, env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"})
    sampler.roots[child.pid] = "host0"
    assert child.stdout is not None and child.stdin is not None
    busy, main = map(float, child.stdout.readline().split())
    printed = time.monotonic()
    deadline = printed + 30
    def read_since() -> bool:  # both threads' figures read after the child's last spin
        mine = [s for (pid, _), s in list(sampler.series.items()) if pid == child.pid]
        return len(mine) == 2 and all(s.times[-1] > printed for s in mine)

    while not read_since():
        assert time.monotonic() < deadline, "no sample after the child's last spin"
        time.sleep(0.02)
    # The window ends at a sample taken while the child idled: its exit (the interpreter's
    # teardown) uses CPU its printed clocks never saw (a window to the end counted 35 ms more once).
    read = min(s.times[-1] for (pid, _), s in list(sampler.series.items()) if pid == child.pid)
    child.stdin.close()
    child.wait(timeout=30)
    sampler.stop()
    used = sampler.window(started, read)
    # The thread named itself "busy" (THREAD_NAMER); the main thread keeps "main". The
    # sampler reads clock ticks (10 ms), and counts from before the first sample.
    assert used[("host0 other", "busy")] == pytest.approx(busy, abs=0.03)
    assert used[("host0 other", "main")] == pytest.approx(main, abs=0.03)
    assert not any(sampler.window(started - 10, started).values())  # nothing before the child
