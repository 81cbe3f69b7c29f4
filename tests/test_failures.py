"""A node that fails stops the whole run quickly, names itself, and leaves no run behind."""

from __future__ import annotations

import threading
import time

import pytest
from helpers import MLP, ExitOnRank, FailOnRank, SleepOnRank, ranked_factory, regression_data

from meshtrain import NodeFailed, Trainer
from meshtrain.strategies import DDP, DiLoCo

GUARD_S = 60  # a hang fails the test instead of blocking the suite


def fit_guarded(model, strategy, tmp_path, **kwargs):
    """fit in a daemon thread; returns (exception or result, seconds), failing on a hang."""
    box: dict = {}

    def main():
        started = time.monotonic()
        try:
            box["result"] = Trainer(model, kwargs.pop("data", ranked_factory)).fit(
                strategy, out_dir=tmp_path, progress=False, batch_size=4, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - inspected by the test
            box["error"] = exc
        box["seconds"] = time.monotonic() - started

    t = threading.Thread(target=main, daemon=True)
    t.start()
    t.join(GUARD_S)
    assert not t.is_alive(), f"fit hung for more than {GUARD_S} s"
    return box.get("error", box.get("result")), box["seconds"]


def no_run_left(tmp_path):
    """No run directory (nor .partial folder) left: only the failure's <run-id>.error.log."""
    return not tmp_path.exists() or all(p.name.endswith(".error.log") for p in tmp_path.iterdir())


@pytest.mark.parametrize(
    ("runtime", "strategy"),
    [("threads", DDP("sgd", 0.1)), ("threads", DiLoCo(H=50, lr=0.01)), ("processes", DDP("sgd", 0.1))],
    ids=["threads-ddp", "threads-diloco", "processes-ddp"],
)
def test_node_that_raises_fails_the_run_naming_it(runtime, strategy, tmp_path):
    # Under DDP the other nodes are blocked in an all-reduce; under DiLoCo(H=50) they
    # train on alone until the end-of-run collectives.
    error, seconds = fit_guarded(FailOnRank(rank=1, at_call=3), strategy, tmp_path, nodes=3,
                                 max_steps=8, runtime=runtime)
    assert isinstance(error, NodeFailed), error
    assert error.rank == 1
    assert "node 1 failed" in str(error) and "boom on rank 1 at step 3" in str(error)
    assert "RuntimeError" in error.message
    assert seconds < (5 if runtime == "threads" else 45)  # processes: mostly start-up (2 cores)
    assert no_run_left(tmp_path)


def test_rank_zero_failing_is_named(tmp_path):
    error, _ = fit_guarded(FailOnRank(rank=0, at_call=0), DDP("sgd", 0.1), tmp_path, nodes=2,
                           max_steps=4)
    assert isinstance(error, NodeFailed) and error.rank == 0
    assert no_run_left(tmp_path)


def test_process_that_dies_without_a_word_fails_the_run(tmp_path):
    error, seconds = fit_guarded(ExitOnRank(rank=2, at_call=1), DDP("sgd", 0.1), tmp_path, nodes=3,
                                 max_steps=6, runtime="processes")
    assert isinstance(error, NodeFailed), error
    assert error.rank == 2 and "exited with code 3" in str(error)
    assert seconds < 45
    assert no_run_left(tmp_path)


def test_the_run_after_a_failure_works(tmp_path):
    fit_guarded(FailOnRank(rank=1, at_call=1), DDP("sgd", 0.1), tmp_path / "a", nodes=2, max_steps=3)
    result, _ = fit_guarded(MLP(), DDP("sgd", 0.1), tmp_path / "b", nodes=2, max_steps=3,
                            data=regression_data(32))
    assert result.run_dir is not None and result.run_dir.exists()


def test_threads_collective_timeout_fails_the_run(tmp_path):
    """A node stuck outside the collectives: the waiting nodes give up after timeout_s.

    Without the timeout this run succeeds (the sleeper wakes after 2.5 s)."""
    error, seconds = fit_guarded(SleepOnRank(rank=1, at_call=1, seconds=2.5), DDP("sgd", 0.1), tmp_path,
                                 nodes=2, max_steps=4, timeout_s=1.0)
    assert isinstance(error, NodeFailed), error
    assert error.rank == 0 and "TimeoutError" in str(error) and "[1]" in str(error)
    assert seconds < 8
    assert no_run_left(tmp_path)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(nodes=0), "nodes must be >= 1"),
        (dict(runtime="cloud"), "runtime must be one of"),
        (dict(max_steps=0), "steps must be >= 1"),
        (dict(max_steps=3, epochs=1.0), "give steps or epochs, not both"),
        (dict(batch_size=0), "batch_size must be >= 1"),
        (dict(val_interval=0), "val_interval must be >= 1"),
    ],
)
def test_bad_settings_fail_before_any_node_starts(kwargs, match, tmp_path):
    kwargs = {"nodes": 2, "max_steps": 2, **kwargs}
    with pytest.raises(ValueError, match=match):
        Trainer(MLP(), regression_data(32)).fit(DDP("sgd", 0.1), out_dir=tmp_path, progress=False, **kwargs)
    assert no_run_left(tmp_path)


def _local_factory():
    return lambda rank, nodes, split: regression_data(32)


def test_processes_runtime_explains_unpicklable_jobs(tmp_path):
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="picklable"):
        Trainer(MLP(), _local_factory()).fit(DDP("sgd", 0.1), nodes=2, max_steps=2, runtime="processes",
                                             out_dir=tmp_path, progress=False)
    assert time.monotonic() - started < 30


def test_a_node_of_a_failed_fit_leaves_the_global_generator_alone() -> None:
    """A threads-runtime node that fit left behind (stuck past the grace period) may wake
    while the process runs something else that draws from torch's global generator: its
    next forward must stop, not swap its own stream into that generator."""
    import torch

    from meshtrain.comm import NodeAborted, ThreadHub
    from meshtrain.engine.runtimes.threads import _SharedGenerator

    hub = ThreadHub(2, timeout_s=5.0)
    shared = _SharedGenerator(hub)
    guard = shared.guard_for(seed=123, rank=1, device=torch.device("cpu"))
    hub.abort(RuntimeError("node 0 failed"))
    torch.manual_seed(7)
    before = torch.get_rng_state()
    with pytest.raises(NodeAborted):
        with guard():
            torch.rand(1)  # a forward's draw: never reached
    assert torch.equal(torch.get_rng_state(), before)
    assert shared.lock.acquire(blocking=False)  # and the generator's lock was given back


def _report_then_exit(results) -> None:  # noqa: ANN001 - a multiprocessing queue
    results.put((0, "error", (time.monotonic(), "ValueError: node 0 broke\ntraceback")))
    raise SystemExit(1)


def test_a_node_that_reported_before_it_exited_is_not_blamed_for_exiting_silently() -> None:
    """The parent saw node 0's exit code before it had read node 0's report (CI, once:
    "node 0 failed: process exited with code 1" instead of the node's own error). A report
    is in the queue before its node's exit code shows: the parent reads it."""
    from meshtrain.engine.runtimes.processes import _first_failure, node_context

    ctx = node_context()
    results = ctx.Queue()
    node = ctx.Process(target=_report_then_exit, args=(results,))
    node.start()
    node.join(timeout=60)
    assert node.exitcode == 1  # settled, its report unread: what the parent met
    failed = _first_failure([node], results, {}, {})
    assert failed.rank == 0 and "node 0 broke" in str(failed), failed
