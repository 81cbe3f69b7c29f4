"""Streaming DiLoCo and DiLoCo with ``delay=1`` on two launched hosts (namespaces, real sshd).

* The numbers: the launched run's weights are bit-identical to ``meshtrain simulate`` on the
  threads runtime with the same options (where nothing overlaps: the work runs when started).
* The overlap is real: on the launched hosts the outer gradients' all-reduce runs on the
  gloo side channel while the node's thread goes on computing. A tracer loaded into every
  rank (``sitecustomize``) records, on the monotonic clock, when each side-channel ring
  all-reduce ran and when each forward-backward pass ran; at least one pass must lie wholly
  inside a side-channel all-reduce. The hosts' links are shaped to 4 Mbit/s with ``tc tbf``
  while the test runs, so one all-reduce of the digits model (39 KB) takes ~80 ms, and a
  pass takes a few ms: a side channel that ran its work at once (or a node thread that
  waited for it) would show none.

Skipped (with the reason) where namespaces, sshd or tc cannot be had.
"""

from __future__ import annotations

import json
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from ssh_fixtures import Namespaces, SshWorld, meshtrain, rate_limited

pytestmark = pytest.mark.slow

STEPS = 20
#: (strategy, --set items): both start an all-reduce at one step and use it steps later.
RUNS = {
    "streaming-diloco": ["--set", "fragments=2", "--set", "H=5", "--set", "tau=2"],
    "diloco-delay": ["--set", "H=5", "--set", "delay=1"],
}

#: Every rank with MESHTRAIN_OVERLAP_TRACE set writes rank<R>.json there at exit: the
#: (entered, left) monotonic times of its side channel's ring all-reduces and of its
#: forward-backward passes (the same clock in every namespace of this machine).
TRACER = textwrap.dedent("""
    import atexit, json, os, time
    folder = os.environ.get("MESHTRAIN_OVERLAP_TRACE")
    if folder and os.environ.get("RANK"):
        from meshtrain.comm import torch_dist
        from meshtrain.engine import loop
        side, passes = [], []
        ring = torch_dist.TorchDistCommunicator._ring_all_reduce
        forward_backward = loop._forward_backward

        def traced_ring(self, *args, **kwargs):
            entered = time.monotonic()
            try:
                return ring(self, *args, **kwargs)
            finally:
                if self.group is not None:  # the side channel's own process group
                    side.append((entered, time.monotonic()))

        def traced_pass(*args, **kwargs):
            entered = time.monotonic()
            try:
                return forward_backward(*args, **kwargs)
            finally:
                passes.append((entered, time.monotonic()))

        torch_dist.TorchDistCommunicator._ring_all_reduce = traced_ring
        loop._forward_backward = traced_pass

        def save():
            with open(os.path.join(folder, "rank%s.json" % os.environ["RANK"]), "w") as f:
                json.dump({"side": side, "passes": passes}, f)

        atexit.register(save)
""")


@pytest.fixture(scope="module")
def shaped(netns_hosts: tuple[SshWorld, Namespaces]) -> Iterator[SshWorld]:
    """The session's two namespace hosts (conftest.py), each sending at most 4 Mbit/s through
    its eth0 while this module runs (the limit is removed afterwards)."""
    world, ns = netns_hosts
    with rate_limited(ns, "4mbit", burst="32kbit", latency="200ms"):
        yield world


@pytest.mark.parametrize("run", list(RUNS))
def test_overlapped_sync_on_two_hosts_matches_simulate_and_overlaps_compute(shaped: SshWorld, run: str,
                                                                           tmp_path: Path) -> None:
    strategy = "streaming-diloco" if run == "streaming-diloco" else "diloco"
    training = ["--task", "digits", "--strategy", strategy, *RUNS[run], "--steps", str(STEPS),
                "--seed", "3", "--batch-size", "16", "--no-progress", "--threads", "1",
                "--val-interval", str(STEPS)]
    tracer, traces = tmp_path / "tracer", tmp_path / "traces"
    tracer.mkdir()
    traces.mkdir()
    (tracer / "sitecustomize.py").write_text(TRACER)
    hosts = [{"name": f"box{i}", "host": s.address, "workdir": str(tmp_path / f"box{i}")}
             for i, s in enumerate(shaped.servers)]
    inv = shaped.inventory(tmp_path / "inv.yaml", hosts, iface="eth0",
                           env={"PYTHONPATH": str(tracer), "MESHTRAIN_OVERLAP_TRACE": str(traces)},
                           rendezvous={"port": 29500, "timeout": 60})
    launched = meshtrain(shaped, "launch", str(inv), "--out", str(tmp_path / "runs"), "--run-id", "l",
                         *training, cwd=tmp_path, timeout=240)
    assert launched.returncode == 0, launched.stdout + launched.stderr
    simulated = meshtrain(shaped, "simulate", "--nodes", "2", "--runtime", "threads", "--device", "cpu",
                          "--out", str(tmp_path / "sim"), "--run-id", "s", *training, cwd=tmp_path)
    assert simulated.returncode == 0, simulated.stdout + simulated.stderr
    a = torch.load(tmp_path / "runs" / "l" / "model.pt", weights_only=True)
    b = torch.load(tmp_path / "sim" / "s" / "model.pt", weights_only=True)
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), f"{key} differs between launch and simulate"

    for rank in (0, 1):
        trace = json.loads((traces / f"rank{rank}.json").read_text())
        side, passes = trace["side"], trace["passes"]
        # Every sync but the last round's goes over the side channel (the end-of-training
        # syncs go over the node's own group).
        assert len(side) >= 3, trace
        inside = [p for p in passes if any(s[0] < p[0] and p[1] < s[1] for s in side)]
        assert inside, (f"rank {rank}: no forward-backward pass ran while a side-channel all-reduce "
                        f"was in flight: {trace}")
