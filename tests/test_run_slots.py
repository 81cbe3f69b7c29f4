"""The threads runtime's run slots: at most ``concurrent_nodes`` nodes compute at once, and
how many do never changes a result."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from helpers import MLP, regression_data
from torch import nn

from meshtrain import Trainer
from meshtrain.comm import NodeAborted, ThreadCommunicator, ThreadHub
from meshtrain.config.settings import SettingError
from meshtrain.strategies import DDP, FedAvg


class CountingMLP(MLP):
    """An MLP whose backward pass records how many node threads were inside one at once
    (forward passes take turns on the random generator anyway)."""

    inside = 0
    most = 0
    lock = threading.Lock()

    def forward(self, batch):  # type: ignore[override]
        loss = super().forward(batch)
        loss.register_hook(self._count)
        return loss

    @staticmethod
    def _count(grad: torch.Tensor) -> torch.Tensor:
        cls = CountingMLP
        with cls.lock:
            cls.inside += 1
            cls.most = max(cls.most, cls.inside)
        try:
            # Long enough that unslotted nodes run into each other's backward pass.
            time.sleep(0.01)
            return grad
        finally:
            with cls.lock:
                cls.inside -= 1


def _fit(model: nn.Module, tmp_path, concurrent, strategy=None):
    return Trainer(model, regression_data(97)).fit(
        strategy or DDP("sgd", 0.05), nodes=4, max_steps=6, batch_size=4, runtime="threads",
        out_dir=tmp_path, progress=False, concurrent_nodes=concurrent)


@pytest.mark.parametrize("concurrent", [1, 2, 4])
def test_no_more_nodes_compute_at_once_than_the_setting(tmp_path, concurrent):
    CountingMLP.most = 0
    _fit(CountingMLP(), tmp_path, concurrent)
    assert 1 <= CountingMLP.most <= concurrent


@pytest.mark.parametrize("make", [lambda: DDP("sgd", 0.05),
                                  lambda: FedAvg(H=2, island_size=2, lr=0.05)],
                         ids=["ddp", "fedavg-islands"])
def test_results_do_not_depend_on_how_many_nodes_compute_at_once(tmp_path, make):
    states = [_fit(MLP(dropout=0.3), tmp_path / str(c), c, make()).model.state_dict()
              for c in (1, 3, 4)]
    for other in states[1:]:
        for key in states[0]:
            assert torch.equal(states[0][key], other[key]), key


def test_concurrent_nodes_is_refused_outside_the_threads_runtime(tmp_path):
    with pytest.raises(SettingError, match="concurrent_nodes applies to the threads runtime only"):
        Trainer(MLP(), regression_data(16)).fit(DDP(), nodes=2, max_steps=1, batch_size=4,
                                                runtime="processes", out_dir=tmp_path,
                                                concurrent_nodes=1, progress=False)


def test_a_node_waiting_for_a_slot_times_out_naming_the_holder():
    hub = ThreadHub(2, timeout_s=0.2, slots=1)
    hub.take_slot(0)
    with pytest.raises(TimeoutError, match=r"a run slot, held by nodes \[0\]"):
        hub.take_slot(1)


def test_a_failed_node_wakes_a_node_waiting_for_a_slot():
    hub = ThreadHub(2, slots=1)
    hub.take_slot(0)
    errors: list[BaseException] = []

    def wait_for_slot() -> None:
        try:
            hub.take_slot(1)
        except BaseException as exc:  # noqa: BLE001 - checked below
            errors.append(exc)

    waiter = threading.Thread(target=wait_for_slot)
    waiter.start()
    hub.abort(RuntimeError("node 0 broke"))
    waiter.join(timeout=5)
    assert not waiter.is_alive() and "node 0 broke" in str(errors[0])


def test_a_meeting_complete_before_a_peer_failed_still_gives_its_result():
    """Node 0's exchange is complete, but node 1 holds the only slot and then fails: node 0
    gets the exchange's result (as rank 0 must, to commit the checkpoint every node saved
    before the failure) and stops at its next check, not inside the finished meeting."""
    hub = ThreadHub(2, timeout_s=30, slots=1)
    hub.take_slot(0)
    seen: dict[str, object] = {}

    def node_1() -> None:
        hub.take_slot(1)  # granted when node 0 gives its slot up to wait in the exchange
        seen["result"] = hub.exchange(((0, 1), 0), 1, "b", list)
        seen["node 0 queued"] = hub.queued(0)  # its wait is over; it waits for node 1's slot
        hub.abort(RuntimeError("node 1 broke a step later"))

    peer = threading.Thread(target=node_1)
    peer.start()
    assert hub.exchange(((0, 1), 0), 0, "a", list) == ["a", "b"]
    peer.join(timeout=10)
    assert seen == {"result": ["a", "b"], "node 0 queued": True}
    with pytest.raises(NodeAborted, match="node 1 broke a step later"):
        hub.check()


def test_a_node_gives_its_slot_up_while_it_waits_for_its_peers():
    """With one slot, node 1 can only reach the all-reduce if node 0 gave the slot up."""
    hub = ThreadHub(2, timeout_s=10, slots=1)
    out: dict[int, torch.Tensor] = {}

    def node(rank: int) -> None:
        hub.take_slot(rank)
        try:
            out[rank] = ThreadCommunicator(hub, rank)._ring_all_reduce(
                torch.full((4,), float(rank + 1)), "sum", [0, 1])
        finally:
            hub.give_slot(rank)

    threads = [threading.Thread(target=node, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert torch.equal(out[0], torch.full((4,), 3.0)) and torch.equal(out[1], out[0])


def test_slots_are_handed_on_in_the_order_the_nodes_asked():
    hub = ThreadHub(4, timeout_s=10, slots=1)
    hub.take_slot(0)
    order: list[int] = []
    asked = [threading.Event() for _ in range(4)]

    def node(rank: int) -> None:
        asked[rank].set()
        hub.take_slot(rank)
        order.append(rank)
        hub.give_slot(rank)

    threads = []
    for rank in (3, 1, 2):  # each asks once the one before is queued
        threads.append(threading.Thread(target=node, args=(rank,)))
        threads[-1].start()
        asked[rank].wait(5)
        while not hub.queued(rank):
            time.sleep(0.001)
    hub.give_slot(0)
    for t in threads:
        t.join(timeout=10)
    assert order == [3, 1, 2]


def test_a_node_that_gave_up_waiting_is_not_handed_a_slot():
    """A node that timed out in the queue leaves it: the next slot goes to a node still there."""
    hub = ThreadHub(3, timeout_s=0.2, slots=1)
    hub.take_slot(0)
    with pytest.raises(TimeoutError):
        hub.take_slot(1)
    assert not hub.queued(1)
    hub.give_slot(0)
    hub.take_slot(2)  # at once: the free slot was not handed to node 1


def test_a_node_hands_its_slot_on_at_a_step_once_its_turn_is_up(monkeypatch):
    """Between steps a node keeps its slot while its turn lasts, then hands it to the node
    waiting for one and queues for it again."""
    from meshtrain.comm import threads

    hub = ThreadHub(2, timeout_s=10, slots=1)
    hub.take_slot(0)
    ran: list[str] = []

    def node_1() -> None:
        hub.take_slot(1)
        ran.append("node 1 ran")
        hub.give_slot(1)

    waiter = threading.Thread(target=node_1)
    waiter.start()
    while not hub.queued(1):
        time.sleep(0.001)
    monkeypatch.setattr(threads, "SLOT_TURN_SECONDS", 3600.0)
    hub.take_turn(0)  # its turn is not up: it goes on, node 1 still waits
    assert hub.queued(1) and ran == []
    monkeypatch.setattr(threads, "SLOT_TURN_SECONDS", 0.0)
    hub.take_turn(0)  # up: node 1 runs, and node 0 goes on once node 1 gives the slot back
    ran.append("node 0 went on")
    waiter.join(timeout=10)
    assert ran == ["node 1 ran", "node 0 went on"]


class _RankData(torch.utils.data.Dataset):
    """Regression samples that carry the rank of the node reading them."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.data = regression_data(97)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        x, y = self.data[i]
        return x, y, self.rank


class _BreaksOnNode2(MLP):
    steps: dict[int, int] = {}

    def forward(self, batch):  # type: ignore[override]
        rank = int(batch[2][0])
        _BreaksOnNode2.steps[rank] = _BreaksOnNode2.steps.get(rank, 0) + 1
        if rank == 2 and _BreaksOnNode2.steps[rank] == 3:
            raise ValueError("node 2 broke")
        return super().forward(batch)


def test_nodes_that_seldom_meet_take_turns_so_a_failure_ends_the_run_early(tmp_path):
    """DiLoCo with a huge H on one slot: node 0 once ran all 50,000 of its steps before
    node 1 began, so node 2's failure at its third step surfaced only after two whole runs."""
    from meshtrain import NodeFailed
    from meshtrain.strategies import DiLoCo

    _BreaksOnNode2.steps = {}
    with pytest.raises(NodeFailed, match="node 2 broke") as failed:
        Trainer(_BreaksOnNode2(), lambda rank, nodes, split: _RankData(rank)).fit(
            DiLoCo(H=1_000_000), nodes=3, max_steps=50_000, batch_size=4, runtime="threads",
            out_dir=tmp_path, progress=False, concurrent_nodes=1)
    assert failed.value.rank == 2
    # Which node takes the slot first is up to the threads (node 2 may break before node 0
    # ever runs); none may run its whole run first: a turn of 0.1 s is hundreds of steps.
    assert max(_BreaksOnNode2.steps.get(r, 0) for r in (0, 1)) < 5_000, _BreaksOnNode2.steps


def test_a_node_waiting_its_turn_for_a_slot_meets_no_collective_timeout(tmp_path):
    """Each node's 3,000 steps take seconds, the collective timeout is 1 s: a node that
    waited for node 0's whole run timed out ("waited more than 1 s for a run slot")."""
    from meshtrain.strategies import DiLoCo

    Trainer(MLP(), regression_data(97)).fit(
        DiLoCo(H=1_000_000), nodes=2, max_steps=3_000, batch_size=4, runtime="threads",
        out_dir=tmp_path, progress=False, concurrent_nodes=1, timeout_s=1.0)
