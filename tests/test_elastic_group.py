"""The pieces of ``launch --elastic`` in one process: membership decisions, the state sent
to a joiner, and a real gloo group (threads on loopback) that loses a member mid-collective,
redoes the work among the survivors, and takes the member back with a peer's state."""

from __future__ import annotations

import copy
import threading
import time
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from elastic_threads import loopback_fixture, on_threads  # noqa: F401 (the fixture)

from meshtrain.comm.elastic import ElasticCommunicator, start_pulse
from meshtrain.comm.membership import Decision, MembershipError, Table, decide
from meshtrain.comm.state_transfer import StateTransferError, decode, encode
from meshtrain.data import SharedBatches


# --------------------------------------------------------------------------- decisions
def test_a_silent_member_is_dropped_and_the_work_redone_in_a_new_epoch() -> None:
    d = decide(4, 2, [0, 1, 2], {0: True, 1: False}, [], admit=True, step=9)
    assert (d.members, d.lost, d.redo, d.epoch, d.joiners) == ((0, 1), (2,), True, 3, ())


def test_joiners_come_in_only_at_an_admission_point_where_nothing_failed() -> None:
    everyone_ok = {0: True, 1: True}
    assert decide(1, 0, [0, 1], everyone_ok, [2], admit=False, step=0).members == (0, 1)
    d = decide(1, 0, [0, 1], everyone_ok, [2], admit=True, step=19)
    assert (d.members, d.joiners, d.redo, d.epoch) == ((0, 1, 2), (2,), False, 1)
    assert decide(1, 0, [0, 1], {0: True, 1: False}, [2], admit=True, step=19).joiners == ()
    # Nothing changed: the same epoch, the same group.
    assert decide(1, 5, [0, 1], everyone_ok, [], admit=True, step=19).epoch == 5


@pytest.mark.parametrize("text", [
    b"not json", b"[]", b'{"meeting": 1}',
    b'{"meeting": 1, "epoch": 0, "members": [0, "x"], "redo": false, "joiners": [], "lost": [], "step": 0}',
    b'{"meeting": 1, "epoch": 0, "members": [0], "redo": 1, "joiners": [], "lost": [], "step": 0}',
    b'{"meeting": true, "epoch": 0, "members": [0], "redo": false, "joiners": [], "lost": [], "step": 0}',
])
def test_a_malformed_decision_is_refused(text: bytes) -> None:
    with pytest.raises(MembershipError):
        Decision.from_json(text)


def test_a_member_that_pulses_but_never_reports_is_dropped_at_the_wait_timeout() -> None:
    """The coordinator waits for a pulsing member's report at most ``wait_timeout``: a member
    that never comes cannot hold the run forever."""
    store = dist.HashStore()
    table = Table(store, 0, 2, pulse_timeout=600.0, wait_timeout=0.5)  # slot 1 never counts as silent
    decided: list[Decision] = []
    meeting = threading.Thread(target=lambda: decided.append(table.meet(0, 0, (0, 1), True, admit=False,
                                                                         step=3)), daemon=True)
    meeting.start()
    meeting.join(30)
    assert decided and (decided[0].members, decided[0].lost, decided[0].redo) == ((0,), (1,), True)


# --------------------------------------------------------------------------- state transfer
def test_an_optimizer_state_survives_the_skeleton_bit_for_bit() -> None:
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, betas=(0.9, 0.95))
    model(torch.ones(4, 3)).sum().backward()
    opt.step()
    state = {"opt": opt.state_dict(), "step": 7, "none": None, "pair": (1, "a")}
    skeleton, tensors = encode(state)
    back = decode(skeleton, [t.clone() for t in tensors])
    assert back["step"] == 7 and back["none"] is None and back["pair"] == (1, "a")
    fresh = torch.optim.AdamW(torch.nn.Linear(3, 2).parameters(), lr=0.5)
    fresh.load_state_dict(back["opt"])  # integer keys and tuples came back as they were
    for key, value in opt.state_dict()["state"][0].items():
        assert torch.equal(fresh.state_dict()["state"][0][key], value), key
    assert fresh.param_groups[0]["betas"] == (0.9, 0.95)


@pytest.mark.parametrize("skeleton", [{"x": 1}, {"t": 5, "dtype": "float32", "shape": [1]},
                                      {"d": [[True, {"v": 1}]]}, {"v": [1, 2]}, {"l": [{"v": {}}]}])
def test_a_malformed_state_is_refused(skeleton: Any) -> None:
    with pytest.raises(StateTransferError):
        decode(skeleton, [])


# --------------------------------------------------------------------------- a real group
class _Node:
    """One slot on a thread: its communicator, a value it contributes, a pulse it can stop."""

    def __init__(self, store: Any, slot: int, slots: int, *, joining: bool = False) -> None:
        table = Table(store, slot, slots, pulse_timeout=1.0, wait_timeout=60.0, joining=joining)
        self.comm = ElasticCommunicator(table, timeout_s=3.0)
        self.stop = threading.Event()
        start_pulse(store, table, self.stop)
        self.value = torch.full((5,), float(slot + 1))
        self.comm.healer = self

    def capture(self) -> Any:
        return {"value": self.value}

    def apply(self, state: Any) -> None:
        self.value = state["value"].clone()

    def average(self, step: int, admit: bool = False) -> None:
        def body() -> None:
            self.comm.all_reduce(self.value, op="mean")

        def restore(saved: torch.Tensor) -> None:
            self.value.copy_(saved)

        self.comm.transaction(body, snapshot=lambda: self.value.clone(), restore=restore, admit=admit,
                              step=step)


def test_a_member_lost_mid_collective_is_dropped_then_rejoins_with_a_peers_state(loopback: None) -> None:
    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=60))
    nodes = [_Node(store, s, 3) for s in range(3)]
    on_threads(*(n.comm.start for n in nodes))
    on_threads(*(lambda n=n: n.average(0) for n in nodes))
    assert all(torch.equal(n.value, torch.full((5,), 2.0)) for n in nodes)

    # Slot 2 goes silent: no pulse, never comes to the next collective.
    nodes[2].stop.set()
    nodes[0].value += 1.0  # 3.0 and 2.0 now: the survivors' mean is 2.5
    on_threads(*(lambda n=n: n.average(1) for n in nodes[:2]))
    for n in nodes[:2]:
        assert n.comm.alive == [0, 1] and torch.equal(n.value, torch.full((5,), 2.5))
    assert nodes[0].comm.events[-1]["lost"] == [2]

    # Slot 2 starts again as a joiner; admitted at the next admission point with node 0's state.
    joiner = _Node(store, 2, 3, joining=True)
    joiner.value = torch.full((5,), -100.0)  # whatever it held is replaced
    survivors = nodes[:2]
    on_threads(lambda: joiner.comm.join(60.0), *(lambda n=n: n.average(2, admit=True) for n in survivors))
    assert joiner.comm.alive == [0, 1, 2] and torch.equal(joiner.value, nodes[0].value)
    event = nodes[0].comm.events[-1]
    assert event["joined"] == [2] and event["heal_bytes"] > 5 * 4

    # And the three average together again.
    joiner.value += 3.0
    on_threads(*(lambda n=n: n.average(3) for n in [*survivors, joiner]))
    for n in [*survivors, joiner]:
        assert torch.equal(n.value, torch.full((5,), 3.5))


def test_a_joiner_of_a_lost_members_slot_does_not_keep_the_lost_member_alive(loopback: None) -> None:
    """Slot 1 goes silent mid-round and its new process (the launcher's restart) is already
    pulsing before the others notice. The new process's pulse must not count for the old
    member: the survivors drop slot 1 after the pulse timeout (not after the joiner gives
    up) and admit the new process at the next admission point."""
    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=60))
    nodes = [_Node(store, s, 3) for s in range(3)]
    on_threads(*(n.comm.start for n in nodes))
    nodes[1].stop.set()
    joiner = _Node(store, 1, 3, joining=True)
    survivors = [nodes[0], nodes[2]]
    done = threading.Event()

    def survive() -> None:
        on_threads(*(lambda n=n: n.average(0) for n in survivors))
        done.set()
        on_threads(*(lambda n=n: n.average(1, admit=True) for n in survivors))

    # The joiner waits far longer than the pulse timeout: the survivors must not wait for it.
    on_threads(lambda: joiner.comm.join(20.0), survive)
    assert done.is_set() and nodes[0].comm.events[1]["lost"] == [1]
    assert joiner.comm.alive == [0, 1, 2] and torch.equal(joiner.value, nodes[0].value)
    joiner.stop.set()
    for n in survivors:
        n.stop.set()


# --------------------------------------------------------------------------- shared data
def test_shared_batches_draw_each_sample_once_per_epoch_across_membership_changes() -> None:
    """Three slots; slot 2 is lost mid-round (its round's samples are drawn again by the
    others) and comes back later with a peer's data state. Over each epoch, the samples whose
    work reached the global model cover the epoch's order exactly once, but the tail."""
    data = torch.utils.data.TensorDataset(torch.arange(300))
    batch, sync = 4, 3  # a sync every 3 steps
    nodes = {s: SharedBatches(data, slot=s, slots=3, batch_size=batch, seed=1, shuffle=True)
             for s in range(3)}
    counted: dict[int, list[int]] = {}  # epoch -> samples in the global model
    pending: dict[int, list[tuple[int, list[int]]]] = {s: [] for s in range(3)}  # draws since the last sync
    members = [0, 1, 2]
    for step in range(60):
        if step == 10:  # slot 2 lost mid-round: its draws of the round never reach the model
            members = [0, 1]
            pending[2] = []
            for s in members:
                nodes[s].members_lost([2])
        if step == 31:  # slot 2 back at a sync, with slot 0's state
            nodes[2] = SharedBatches(data, slot=2, slots=3, batch_size=batch, seed=1, shuffle=True)
            nodes[2].load_state_dict(nodes[0].state_dict())
            members = [0, 1, 2]
        for s in members:
            nodes[s].members = list(members)
            drawn = nodes[s].next_indices()
            pending[s].append((nodes[s].epoch, drawn))
        states = {json_state(nodes[s].state_dict()) for s in members}
        assert len(states) == 1, step  # every member holds the same data state
        if (step + 1) % sync == 0:
            for s in members:
                for epoch, drawn in pending[s]:
                    counted.setdefault(epoch, []).extend(drawn)
                pending[s] = []
                nodes[s].synced()
    for epoch, drawn in counted.items():
        assert len(drawn) == len(set(drawn)), f"epoch {epoch}: a sample counted twice"
    # Epoch 0's samples missing from the model are its order's tail alone (fewer than one
    # step's 3 * 4): the lost slot's draws were trained again, not skipped.
    order = SharedBatches(data, slot=0, slots=3, batch_size=batch, seed=1, shuffle=True)._order
    missing = set(order) - set(counted[0])
    assert missing <= set(order[-(3 * batch - 1):]), sorted(order.index(i) for i in missing)


def json_state(state: dict[str, Any]) -> str:
    import json

    return json.dumps(state, sort_keys=True, default=str)


# --------------------------------------------------------------------------- real strategies
class _Lost(Exception):
    """A slot's process gone (the test's stand-in for SIGKILL)."""


class _Slot(ElasticCommunicator):
    """One slot of a real training run on a thread: it can die before the transaction of
    step ``dies_at`` (its pulse stops, its group is closed), and it records the state
    around the transactions of ``watch`` and what it sent or took at a heal."""

    def __init__(self, store: Any, slot: int, slots: int, *, joining: bool = False,
                 dies_at: int | None = None, watch: tuple[int, ...] = ()) -> None:
        table = Table(store, slot, slots, pulse_timeout=1.0, wait_timeout=60.0, joining=joining)
        super().__init__(table, timeout_s=3.0)
        self.stop = threading.Event()
        start_pulse(store, table, self.stop)
        self.dies_at, self.watch = dies_at, watch
        self.hold_at: int | None = None
        self.around: dict[int, dict[str, Any]] = {}  # step -> {"params", "grads", "after"}
        self.sent: list[Any] = []  # the states this slot healed joiners with
        self.taken: Any = None  # a joiner: its whole state right after the heal

    def _params(self) -> list[torch.Tensor]:
        assert self.healer is not None
        return list(self.healer.run.strategy.params)  # type: ignore[attr-defined]

    def transaction(self, body: Any, *, snapshot: Any, restore: Any, admit: bool, step: int,
                    meet: bool = False) -> None:
        if step == self.dies_at:  # as SIGKILL: no more pulse, its connections closed
            self.stop.set()
            self.pg.abort()
            raise _Lost
        if step == self.hold_at:  # the coordinator waits for the joiner to ask, however slow it starts
            deadline = time.monotonic() + 60
            while 2 not in self.alive and not self.store.check(["elastic/join/2"]):
                assert time.monotonic() < deadline, "the joiner never asked to join"
                time.sleep(0.01)
        if step in self.watch:
            self.around[step] = {"params": [p.detach().clone() for p in self._params()],
                                 "grads": [p.grad.clone() for p in self._params()]}  # type: ignore[union-attr]
        super().transaction(body, snapshot=snapshot, restore=restore, admit=admit, step=step, meet=meet)
        if step in self.watch:
            self.around[step]["after"] = [p.detach().clone() for p in self._params()]
            self.around[step]["strategy"] = copy.deepcopy(self.healer.run.strategy.state_dict())  # type: ignore[union-attr]

    def _regroup(self, decision: Decision) -> None:
        if decision.joiners and self.rank == min(set(decision.members) - set(decision.joiners)):
            assert self.healer is not None
            self.sent.append(copy.deepcopy(self.healer.capture()))
        super()._regroup(decision)

    def join(self, timeout: float) -> Decision:
        decision = super().join(timeout)
        assert self.healer is not None
        self.taken = copy.deepcopy(self.healer.capture())
        return decision


def _near(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.isclose(a, b, rtol=0, atol=1e-7)


def _same(a: Any, b: Any, where: str = "state") -> None:
    """``a`` and ``b`` hold the same structure and the same bits everywhere."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), where
        for k in a:
            _same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _same(x, y, f"{where}[{i}]")
    else:
        assert a == b, (where, a, b)


def _elastic_run(strategy: Any, steps: int, dies_at: int,
                 tmp_path: Any) -> tuple[list[_Slot], _Slot, list[Any]]:
    """Three slots train ``strategy`` for ``steps`` steps on threads; slot 2 dies before
    step ``dies_at``'s transaction and a new process of slot 2 joins at once. Returns the
    first processes of the slots, the joiner, and every process's result (0, 1, joiner)."""
    from helpers import MLP, regression_data

    from meshtrain.config.settings import TrainConfig
    from meshtrain.engine.job import NodeJob
    from meshtrain.engine.loop import train_node

    config = TrainConfig(nodes=3, steps=steps, batch_size=4, seed=3, progress=False, runtime="launched",
                         out_dir=str(tmp_path), threads=1)
    job = NodeJob(model=MLP(), train_data=regression_data(96), val_data=None, collate_fn=None,
                  strategy=strategy, config=config, run_id="elastic", started=0.0)
    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=60))
    slots = [_Slot(store, s, 3, dies_at=dies_at if s == 2 else None, watch=(dies_at,)) for s in range(3)]
    slots[0].hold_at = next(s for s in range(dies_at + 1, steps - 1) if strategy.admits_joiners_after(s))
    joiner = _Slot(store, 2, 3, joining=True)
    results: dict[str, Any] = {}

    def first(slot: _Slot) -> None:
        slot.start()
        try:
            results[str(slot.rank)] = train_node(job, slot)
        except _Lost:
            results["lost"] = slot.rank
            died.set()

    def rejoin() -> None:
        assert died.wait(120)
        store.add(Table.reachable_key(2), 1)  # the launcher's word: slot 2's host answers again
        results["joiner"] = train_node(job, joiner, join_timeout=60.0)

    died = threading.Event()
    on_threads(*(lambda s=s: first(s) for s in slots), rejoin)
    for s in (*slots, joiner):
        s.stop.set()
    assert results["lost"] == 2
    return slots, joiner, [results["0"], results["1"], results["joiner"]]


def _check_heal_and_end(slots: list[_Slot], joiner: _Slot, results: list[Any], round_steps: int) -> None:
    """The joiner took slot 0's whole state bit for bit (model, strategy, data position,
    step), every process ends on one global model, and rank 0 recorded the loss, the heal and
    the rejoin's timeline (admitted within ``round_steps`` of asking)."""
    assert len(slots[0].sent) == 1 and joiner.taken is not None
    _same(slots[0].sent[0], joiner.taken)
    finals = [[p.detach() for p in r.model.parameters()] for r in results]
    for other in finals[1:]:
        _same(finals[0], other, "final model")
    events = results[0].summary["elastic"]["events"]
    assert [e["lost"] for e in events if e["lost"]] == [[2]]
    assert [e["joined"] for e in events if e["joined"]] == [[2]]
    assert results[0].summary["elastic"]["final_members"] == [0, 1, 2]
    # Its timeline in steps done: reachable again, asked to join (after its start-up),
    # admitted at the next admission point after it asked.
    (rejoin,) = results[0].summary["elastic"]["rejoins"]
    assert rejoin["rank"] == 2 and rejoin["asked_after_s"] >= 0, rejoin
    assert rejoin["reachable_step"] <= rejoin["asked_step"] <= rejoin["admitted_step"], rejoin
    assert rejoin["admitted_step"] - rejoin["asked_step"] <= round_steps, rejoin
    assert rejoin["admitted_step"] == [e["step"] for e in events if e["joined"]][0]


def test_ddp_goes_on_without_a_lost_slot_from_the_same_step_and_takes_it_back(
        loopback: None, tmp_path: Any) -> None:
    """DDP, plain SGD: slot 2 dies before step 2's update. The survivors' step 2 is
    p - lr * mean of THEIR gradients (plain torch), not a step lost or a mean over three."""
    from meshtrain.strategies import DDP

    lr, dies = 0.1, 2
    slots, joiner, results = _elastic_run(DDP(optim="sgd", lr=lr), steps=6, dies_at=dies, tmp_path=tmp_path)
    a, b = slots[0].around[dies], slots[1].around[dies]
    for p, g0, g1, after0, after1 in zip(a["params"], a["grads"], b["grads"], a["after"], b["after"],
                                         strict=True):
        expected = p - lr * ((g0 + g1) / 2)
        torch.testing.assert_close(after0, expected, rtol=1e-6, atol=1e-7)
        assert torch.equal(after0, after1)
    _check_heal_and_end(slots, joiner, results, round_steps=1)


def test_fedavg_averages_over_the_survivors_and_takes_the_lost_slot_back(loopback: None,
                                                                        tmp_path: Any) -> None:
    """FedAvg H=2, plain SGD: slot 2 dies before step 3's update (an average). The
    survivors' step 3 is the mean over THEM of p_i - lr * g_i (plain torch)."""
    from meshtrain.strategies import FedAvg

    lr, dies = 0.1, 3
    slots, joiner, results = _elastic_run(FedAvg(H=2, lr=lr), steps=8, dies_at=dies, tmp_path=tmp_path)
    a, b = slots[0].around[dies], slots[1].around[dies]
    for p0, p1, g0, g1, after0, after1 in zip(a["params"], b["params"], a["grads"], b["grads"], a["after"],
                                              b["after"], strict=True):
        expected = ((p0 - lr * g0) + (p1 - lr * g1)) / 2
        torch.testing.assert_close(after0, expected, rtol=1e-6, atol=1e-7)
        assert torch.equal(after0, after1)
    _check_heal_and_end(slots, joiner, results, round_steps=2)


def test_sparta_diloco_exchanges_among_the_survivors_and_heals_with_the_outer_state(
        loopback: None, tmp_path: Any) -> None:
    """SPARTA+DiLoCo (inner SGD, p=0.25, H=4): slot 2 dies before step 1's update (a sparse
    exchange, no outer sync). After it every survivor's element is either its own local step
    p_i - lr * g_i or, on both alike, the mean of the two local steps: the exchange spans the
    survivors alone, round(p * numel) elements of each tensor. The joiner takes the outer
    parameters and the outer optimizer's momentum with the rest."""
    from meshtrain.strategies import SPARTADiLoCo

    lr, dies, p = 0.1, 1, 0.25
    slots, joiner, results = _elastic_run(SPARTADiLoCo(p=p, H=4, optim="sgd", lr=lr), steps=10, dies_at=dies,
                                          tmp_path=tmp_path)
    a, b = slots[0].around[dies], slots[1].around[dies]
    for p0, p1, g0, g1, after0, after1 in zip(a["params"], b["params"], a["grads"], b["grads"], a["after"],
                                              b["after"], strict=True):
        local0, local1 = p0 - lr * g0, p1 - lr * g1
        mean = (local0 + local1) / 2
        averaged = _near(after0, mean) & _near(after1, mean)
        kept = _near(after0, local0) & _near(after1, local1)
        assert bool((averaged | kept).all())
        assert int((averaged & ~kept).sum()) == max(1, round(p * p0.numel()))
    momentum = slots[0].sent[0]["strategy"]["modules"][1]["outer_optimizer"]["state"]
    assert momentum and all(torch.count_nonzero(s["momentum_buffer"]) for s in momentum.values())
    _check_heal_and_end(slots, joiner, results, round_steps=4)


def test_fedavg_islands_go_on_without_the_lost_slot_and_take_it_back(loopback: None, tmp_path: Any) -> None:
    """FedAvg with islands of 2 among 3 slots (H=2, plain SGD): slot 2 dies before step 3's
    update (round 1's island averages). Each survivor's step 3 is the mean of p_j - lr * g_j
    over its seeded island of round 1 without slot 2 (the split is the input, as in
    test_reference_math; the average is plain torch)."""
    from meshtrain.comm import ThreadCommunicator, ThreadHub
    from meshtrain.strategies import FedAvg

    lr, dies = 0.1, 3
    split = FedAvg(H=2, island_size=2)
    split.setup(torch.nn.Linear(1, 1), ThreadCommunicator(ThreadHub(3), 0), seed=3, max_steps=8)
    islands = split.modules[0].islands(dies // 2)  # type: ignore[attr-defined]
    slots, joiner, results = _elastic_run(FedAvg(H=2, island_size=2, lr=lr), steps=8, dies_at=dies,
                                          tmp_path=tmp_path)
    around = [slots[0].around[dies], slots[1].around[dies]]
    local = [[p - lr * g for p, g in zip(a["params"], a["grads"], strict=True)] for a in around]
    for rank in (0, 1):
        group = [m for m in next(i for i in islands if rank in i) if m != 2]
        for j, after in enumerate(around[rank]["after"]):
            expected = sum(local[m][j] for m in group) / len(group)
            torch.testing.assert_close(after, expected, rtol=1e-6, atol=1e-7)
    assert any(2 in i and len(i) == 2 for i in islands)  # the round's split put slot 2 with a survivor
    _check_heal_and_end(slots, joiner, results, round_steps=2)


def test_which_strategies_an_elastic_run_serves() -> None:
    """``launch --elastic`` serves the strategies whose nodes hold one global state at an
    admission point; FedAvg's islands and DiLoCo's delay=1 included."""
    from meshtrain.strategies import STRATEGIES, DiLoCo, FedAvg, StreamingDiLoCo

    assert sorted(n for n, cls in STRATEGIES.items() if cls.elastic) == [
        "ddp", "diloco", "fedavg", "sparseloco", "sparta-diloco", "streaming-diloco"]
    assert FedAvg(H=2, island_size=2).elastic_problem() is None
    assert DiLoCo(delay=1).elastic_problem() is None  # unlike a checkpoint on fewer nodes
    assert "delay=1" in (DiLoCo(delay=1).fewer_nodes_problem() or "")
    assert "never hold one global state" in (STRATEGIES["sparta"]().elastic_problem() or "")
    always = StreamingDiLoCo(fragments=4, H=4, tau=1).elastic_problem()
    assert always is not None and "always on its way" in always


def test_streaming_diloco_redoes_a_fragments_sync_among_the_survivors_and_admits_between_syncs(
        loopback: None, tmp_path: Any) -> None:
    """Streaming DiLoCo (2 fragments, H=4, tau=1: overlapped syncs, inner SGD): slot 2 dies
    before step 5's transaction, where fragment 0's sync starts. The survivors redo it: the
    outer gradient on its way is theta - mean of THEIR local fragments (plain torch). The
    joiner comes in once a round where no sync is on its way (after step 8), with every
    fragment's outer parameters and momentum."""
    from meshtrain.strategies import StreamingDiLoCo

    lr, dies = 0.1, 5
    strategy = StreamingDiLoCo(fragments=2, H=4, tau=1, optim="sgd", lr=lr)
    assert [s for s in range(12) if strategy.admits_joiners_after(s)] == [0, 4, 8]
    slots, joiner, results = _elastic_run(strategy, steps=12, dies_at=dies, tmp_path=tmp_path)
    a, b = slots[0].around[dies], slots[1].around[dies]
    first = slots[0].healer.run.strategy.modules[0].fragments[0]  # type: ignore[union-attr]
    sync = a["strategy"]["modules"][0]
    assert list(sync["in_flight"]) == [0] and sync["in_flight"][0][0] == dies + 1  # merges after step 6
    on_its_way = sync["in_flight"][0][1]
    for k, i in enumerate(first):
        mean_local = ((a["params"][i] - lr * a["grads"][i]) + (b["params"][i] - lr * b["grads"][i])) / 2
        torch.testing.assert_close(on_its_way[k], sync["outer"][i] - mean_local, rtol=1e-6, atol=1e-7)
    _same(sync, b["strategy"]["modules"][0], "the survivors' outer state")
    assert [e["step"] for e in results[0].summary["elastic"]["events"] if e["joined"]] == [9]
    healed = slots[0].sent[0]["strategy"]["modules"][0]
    assert healed["in_flight"] == {} and all(
        torch.count_nonzero(s["momentum_buffer"]) for s in healed["outer_optimizer"]["state"].values())
    _check_heal_and_end(slots, joiner, results, round_steps=4)


def test_diloco_delay_1_starts_the_survivors_average_and_heals_with_the_average_on_its_way(
        loopback: None, tmp_path: Any) -> None:
    """DiLoCo with delay=1 (H=2, inner SGD): slot 2 dies before step 3's transaction (a round's
    end). The survivors apply the last round's average, then start this round's among
    THEMSELVES: the progress on its way is theta - mean of their new parameters (each node's
    parameters are theta minus its own progress; plain torch). The joiner takes the anchor
    and that average, to apply at the next round's end as everyone does."""
    from meshtrain.strategies import DiLoCo

    dies = 3
    slots, joiner, results = _elastic_run(DiLoCo(H=2, delay=1, optim="sgd", lr=0.1), steps=10,
                                          dies_at=dies, tmp_path=tmp_path)
    a, b = slots[0].around[dies], slots[1].around[dies]
    sync = a["strategy"]["modules"][0]
    other = b["strategy"]["modules"][0]
    for key in ("outer", "outer_optimizer", "in_flight"):  # the anchors are each node's own
        _same(sync[key], other[key], f"the survivors' {key}")
    averaged = sync["in_flight"][0]
    for theta, on_its_way, after0, after1 in zip(sync["outer"], averaged, a["after"], b["after"],
                                                 strict=True):
        torch.testing.assert_close(on_its_way, theta - (after0 + after1) / 2, rtol=1e-6, atol=1e-7)
    assert slots[0].sent[0]["strategy"]["modules"][0]["in_flight"] is not None
    _check_heal_and_end(slots, joiner, results, round_steps=2)
