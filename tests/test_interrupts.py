"""A threads run that fails or is interrupted ends cleanly: exit 1 with the node's error, or
130 on Ctrl-C, never "terminate called without an active exception" (a node thread still
inside torch when the interpreter exits), and no half-written run."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from in_process import meshtrain_here

ABORT = "terminate called"

# Node 1 fails at its 30th step while the others are busy between collectives (DiLoCo with a
# huge H has no collective to stop them at): they must notice at their next step.
FAILING = textwrap.dedent("""
    import sys, torch
    from torch import nn
    from meshtrain import Trainer, NodeFailed
    from meshtrain.strategies import DiLoCo

    class Data(torch.utils.data.Dataset):
        def __init__(self, rank): self.rank = rank
        def __len__(self): return 4096
        def __getitem__(self, i):
            g = torch.Generator().manual_seed(i)
            return torch.randn(256, generator=g), torch.tensor(self.rank)

    class Wide(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 256))
            self.calls = 0
        def forward(self, batch):
            x, rank = batch
            if int(rank[0]) == 1:
                self.calls += 1
                if self.calls == 30:
                    raise ValueError("node 1 broke")
            return self.net(x).pow(2).mean()

    try:
        Trainer(Wide(), lambda rank, nodes, split: Data(rank)).fit(
            DiLoCo(H=100000), nodes=4, max_steps=100000, batch_size=64, out_dir=sys.argv[1],
            progress=False)
    except NodeFailed as exc:
        print(exc)
        sys.exit(1)
""")


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    return env


def test_a_failing_node_ends_the_run_cleanly(tmp_path: Path) -> None:
    script = tmp_path / "failing.py"
    script.write_text(FAILING)
    for attempt in range(3):  # the crash was intermittent: three clean runs in a row
        out = tmp_path / f"runs{attempt}"
        proc = subprocess.run([sys.executable, str(script), str(out)], capture_output=True, text=True,
                              timeout=240, env=_env())
        assert proc.returncode == 1, proc.stdout + proc.stderr
        assert "node 1 failed: ValueError: node 1 broke" in proc.stdout
        assert ABORT not in proc.stderr
        assert [p.name.endswith(".error.log") for p in out.iterdir()] == [True]


def test_ctrl_c_on_a_threads_run_exits_130_and_keeps_nothing(tmp_path: Path) -> None:
    for attempt in range(2):
        out = tmp_path / f"runs{attempt}"
        proc = subprocess.Popen(
            [sys.executable, "-m", "meshtrain", "simulate", "--steps", "100000", "--set", "H=50000",
             "--no-progress", "--out", str(out)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(),
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        deadline = time.monotonic() + 60
        while not any(out.glob(".*.partial")) and time.monotonic() < deadline:
            time.sleep(0.2)  # the run directory is claimed just before training starts
        time.sleep(2)
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=60)
        assert proc.returncode == 130, stdout + stderr
        assert "interrupted: the run was stopped" in stderr and ABORT not in stderr
        assert list(out.iterdir()) == []  # no run directory, no .partial, no error log: all was well


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc to see torch loading")
@pytest.mark.parametrize("command", ["console-script", "python-m"])
def test_ctrl_c_while_the_command_imports_is_one_line_and_130(tmp_path: Path, command: str) -> None:
    """Ctrl-C while torch is still loading: one line, exit 130 and nothing written, not a
    Python traceback of whichever module was importing (before the command's handlers exist)."""
    script = Path(sys.executable).parent / "meshtrain"
    if command == "console-script" and not script.exists():
        pytest.skip(f"no console script at {script} (meshtrain is not installed in this environment)")
    argv = [str(script)] if command == "console-script" else [sys.executable, "-m", "meshtrain"]
    out = tmp_path / "runs"
    proc = subprocess.Popen(argv + ["simulate", "--out", str(out)], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(),
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        # torch's library mapped: the import of torch is under way, the slow part of starting.
        maps = Path(f"/proc/{proc.pid}/maps")
        while proc.poll() is None and "libtorch" not in maps.read_text():
            time.sleep(0.005)
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert (proc.returncode, stderr) == (130, "interrupted while starting: nothing was run\n"), \
        stdout + stderr
    assert not out.exists()


def test_ctrl_c_while_the_model_and_data_load_is_one_line_and_130(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Loading a Hugging Face model can take a while; a Ctrl-C then once left click's
    "Aborted!" and exit 1."""
    import meshtrain.build

    def loading(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(meshtrain.build, "build_run", loading)  # simulate imports it when it runs
    done = meshtrain_here("simulate", "--out", str(tmp_path / "runs"), cwd=tmp_path)
    assert (done.returncode, done.stderr) == (130, "interrupted before training began: nothing was written\n")
    assert not (tmp_path / "runs").exists()


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid``, from /proc."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
        if parent == pid:
            found.append(int(stat.parent.name))
    return found


def _node_server(command: int) -> int | None:
    """The forkserver the processes runtime of ``command`` started, once it exists."""
    for pid in _children(command):
        with contextlib.suppress(OSError):
            if b"multiprocessing.forkserver" in Path(f"/proc/{pid}/cmdline").read_bytes():
                return pid
    return None


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc to see the node server")
@pytest.mark.parametrize("when", ["node-server-imports", "nodes-start"])
def test_a_terminals_ctrl_c_on_a_processes_run_is_one_line_and_130(tmp_path: Path, when: str) -> None:
    """Ctrl-C from a terminal reaches every process of its group: the command, its node
    server and the nodes. While the server preloaded torch it printed a KeyboardInterrupt
    traceback; a Ctrl-C as the nodes started left one node never stopped, which printed
    FileNotFoundError (its queue gone) after the command had exited."""
    out = tmp_path / "runs"
    proc = subprocess.Popen(
        [sys.executable, "-m", "meshtrain", "simulate", "--runtime", "processes", "--nodes", "2",
         "--steps", "100000", "--set", "H=50000", "--no-progress", "--out", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(), start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        server = None
        while proc.poll() is None and time.monotonic() < deadline:
            server = server or _node_server(proc.pid)
            if server and (_children(server) if when == "nodes-start"
                           else "libtorch" in Path(f"/proc/{server}/maps").read_text()):
                break
            time.sleep(0.005)
        assert server and proc.poll() is None, f"no {when} seen"
        os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    # Whatever was still running of the group has had its say once the server is gone.
    deadline = time.monotonic() + 30
    while Path(f"/proc/{server}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not Path(f"/proc/{server}").exists(), "the node server outlived the run"
    assert proc.returncode == 130 and "Traceback" not in stdout + stderr, stdout + stderr
    assert "interrupted" in stderr
    assert not [p for p in out.rglob("*") if p.is_file()] if out.exists() else True


def test_a_ctrl_c_while_nodes_start_is_held_until_they_have() -> None:
    """Nothing is raised inside the block (a start is never cut in half); KeyboardInterrupt
    comes as it ends, and the handler is Python's again."""
    from meshtrain.engine.runtimes.processes import _ctrl_c_deferred

    reached_the_end = False
    runners = signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a command
    try:
        with pytest.raises(KeyboardInterrupt):
            with _ctrl_c_deferred():
                signal.raise_signal(signal.SIGINT)
                reached_the_end = True
        assert reached_the_end
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, runners)


@pytest.mark.parametrize(("started_as", "handler"), [
    ("from multiprocessing.forkserver import main", "ignored"),  # the node server: for good
    ("from multiprocessing.spawn import spawn_main", "python's"),  # given its parent's argv
])
def test_what_multiprocessings_processes_do_with_ctrl_c(started_as: str, handler: str) -> None:
    """As multiprocessing starts them (``python -c 'from multiprocessing.<module> import
    ...'``), with the command's sys.argv that a spawned child is given before it imports:
    the node server ignores Ctrl-C, and a spawned child is not taken for the command."""
    check = (f"{started_as} as _\nimport signal, sys\nsys.argv = ['/venv/bin/meshtrain', 'simulate']\n"
             "import meshtrain\nh = signal.getsignal(signal.SIGINT)\n"
             "print('ignored' if h is signal.SIG_IGN else\n"
             "      \"python's\" if h is signal.default_int_handler else h)")
    shown = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, env=_env(),
                           check=True)
    assert shown.stdout == f"{handler}\n"


def test_a_program_that_imports_meshtrain_keeps_its_ctrl_c() -> None:
    """The starting-up handler is the command's alone: a program importing the library still
    gets KeyboardInterrupt."""
    check = "import signal, meshtrain; print(signal.getsignal(signal.SIGINT) is signal.default_int_handler)"
    shown = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, env=_env(),
                           check=True)
    assert shown.stdout == "True\n"


def test_node_failed_keeps_the_nodes_whole_traceback(tmp_path: Path) -> None:
    """str() is one line; .traceback holds the failing node's own frames, in both runtimes."""
    from helpers import FailOnRank, ranked_factory

    from meshtrain import NodeFailed, Trainer
    from meshtrain.strategies import DDP

    for runtime in ("threads", "processes"):
        with pytest.raises(NodeFailed) as caught:
            Trainer(FailOnRank(rank=1, at_call=2), ranked_factory).fit(
                DDP("sgd", 0.1), nodes=2, max_steps=6, batch_size=4, runtime=runtime,
                out_dir=tmp_path / runtime, progress=False)
        error = caught.value
        assert "\n" not in str(error) and error.rank == 1
        assert "Traceback" in error.traceback and "in forward" in error.traceback
        assert "boom on rank 1" in error.traceback
        log = next((tmp_path / runtime).glob("*.error.log")).read_text()
        assert "in forward" in log


def test_ctrl_c_while_node_threads_start_stops_those_already_started(tmp_path: Path, monkeypatch) -> None:
    """A Ctrl-C that lands while fit is still starting node threads (start() waits for each
    new thread, long on a loaded machine) stops the ones already running before it leaves."""
    import threading

    from helpers import MLP, regression_data

    from meshtrain import Trainer
    from meshtrain.strategies import DiLoCo

    real_start = threading.Thread.start
    started: list[threading.Thread] = []

    def start(self: threading.Thread) -> None:
        if self.name.startswith("meshtrain-node-") and started:
            raise KeyboardInterrupt  # as if Ctrl-C arrived while the second node starts
        real_start(self)
        if self.name.startswith("meshtrain-node-"):
            started.append(self)

    monkeypatch.setattr(threading.Thread, "start", start)
    with pytest.raises(KeyboardInterrupt):
        Trainer(MLP(), regression_data(64)).fit(DiLoCo(H=10_000), nodes=2, max_steps=100_000,
                                                batch_size=4, out_dir=tmp_path, progress=False)
    assert len(started) == 1 and not started[0].is_alive()


def test_a_node_thread_that_comes_up_after_the_ctrl_c_does_not_train(tmp_path: Path, monkeypatch) -> None:
    """Ctrl-C inside the second node's start(), its thread coming up only afterwards: fit
    cannot wait for it (it had no ident yet), so it must see the abort and never train (it
    would be inside torch when the interpreter exits: rc -6, seen once under the full suite)."""
    import threading

    from helpers import MLP, regression_data

    import meshtrain.engine.runtimes.threads as threads_runtime
    from meshtrain import Trainer
    from meshtrain.strategies import DiLoCo

    real_start, real_train = threading.Thread.start, threads_runtime.train_node
    late: list[threading.Thread] = []
    trained: list[int] = []
    fit_returned, came_up = threading.Event(), threading.Event()

    def start(self: threading.Thread) -> None:
        if self.name == "meshtrain-node-1":
            late.append(self)
            threading.Thread(target=lambda: (fit_returned.wait(30), real_start(self), came_up.set())).start()
            raise KeyboardInterrupt  # as if Ctrl-C arrived while this node starts
        real_start(self)

    def train_node(job, comm, **kwargs):  # type: ignore[no-untyped-def]
        trained.append(comm.rank)
        return real_train(job, comm, **kwargs)

    monkeypatch.setattr(threading.Thread, "start", start)
    monkeypatch.setattr(threads_runtime, "train_node", train_node)
    with pytest.raises(KeyboardInterrupt):
        Trainer(MLP(), regression_data(64)).fit(DiLoCo(H=10_000), nodes=2, max_steps=100_000,
                                                batch_size=4, out_dir=tmp_path, progress=False)
    fit_returned.set()
    assert came_up.wait(30)
    late[0].join(timeout=30)
    assert not late[0].is_alive() and 1 not in trained, trained



@pytest.fixture
def ctrl_c_raises() -> Iterator[None]:
    """Ctrl-C raises KeyboardInterrupt in this process, whatever it inherited: a suite started
    in the background of a shell without job control has SIGINT ignored, and
    ``_thread.interrupt_main`` then does nothing."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_ctrl_c_waits_for_the_node_fit_was_waiting_on(tmp_path: Path, ctrl_c_raises: None) -> None:
    """In Python 3.11 a Thread.join interrupted by Ctrl-C marks the thread it waited for as
    stopped while it still runs: fit must still wait for that node (here mid-step for a
    moment), or the interpreter exits with it inside torch (rc -6)."""
    import _thread
    import threading

    from helpers import MLP, regression_data

    from meshtrain import Trainer
    from meshtrain.strategies import DiLoCo

    steps: list[int] = []

    class SlowToStop(MLP):
        def forward(self, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
            if self.training and threading.current_thread().name == "meshtrain-node-0":
                steps.append(1)
                if len(steps) == 5:
                    _thread.interrupt_main()  # Ctrl-C while fit waits on this node
                    time.sleep(0.5)  # this step finishes only after fit was interrupted
            return super().forward(batch)

    with pytest.raises(KeyboardInterrupt):  # 200 steps: a Ctrl-C that never came fails, never hangs
        Trainer(SlowToStop(), regression_data(64)).fit(
            DiLoCo(H=10_000), nodes=2, max_steps=200, batch_size=4, out_dir=tmp_path, progress=False)
    assert not [t.name for t in threading.enumerate() if t.name.startswith("meshtrain-node-")]


def test_ctrl_c_during_a_validation_pass_stops_it_at_the_next_batch(
        tmp_path: Path, ctrl_c_raises: None) -> None:
    """Rank 0's validation before step 1 (a long one: word error rates decode every batch)
    stops at its next batch: fit waits only a few seconds for its nodes, and a node left in
    its validation pass was inside torch when the interpreter exited (rc -6)."""
    import _thread
    import threading

    from helpers import MLP, regression_data

    from meshtrain import Trainer
    from meshtrain.strategies import DiLoCo

    validated: list[int] = []

    class SlowToValidate(MLP):
        def forward(self, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
            if not self.training:
                validated.append(1)
                if len(validated) == 1:
                    _thread.interrupt_main()  # Ctrl-C while the first batch is validated
                time.sleep(0.05)  # 200 batches: 10 s, far beyond fit's grace for its nodes
            return super().forward(batch)

    with pytest.raises(KeyboardInterrupt):  # 5 steps: a Ctrl-C that never came fails, never hangs
        Trainer(SlowToValidate(), regression_data(64), regression_data(200)).fit(
            DiLoCo(H=10_000), nodes=2, max_steps=5, batch_size=1, out_dir=tmp_path, progress=False)
    assert not [t.name for t in threading.enumerate() if t.name.startswith("meshtrain-node-")]
    assert len(validated) < 10
