"""A host added to a running elastic run, in one process: the coordinator grows the run by
a slot only at the launcher's request through the store, the gate admits the new host's
address and still refuses every other, the new slot joins with a peer's state, the data
is dealt to the new membership, and the control folder ``hosts add`` writes into."""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import threading
from collections import Counter
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from elastic_threads import loopback_fixture, on_threads  # noqa: F401 (the fixture)

from meshtrain.comm import rendezvous
from meshtrain.comm.elastic import ElasticCommunicator, start_pulse
from meshtrain.comm.membership import Growth, MembershipError, Table, request_slot
from meshtrain.data import SharedBatches
from meshtrain.hosts.inventory import InventoryError, load_inventory
from meshtrain.launch.adding import AddHostError, RunControl, entry_from_words

SECRET = b"s" * 64


# --------------------------------------------------------------------------- the gate
def _connect_from(source: str, port: int) -> socket.socket:
    sock = socket.socket()
    sock.bind((source, 0))
    sock.settimeout(5)
    sock.connect(("127.0.0.1", port))
    return sock


def _refused(sock: socket.socket) -> bool:
    """The gate closed the connection unanswered (no nonce sent)."""
    try:
        return sock.recv(32) == b""
    except ConnectionResetError:
        return True


def test_the_gate_admits_an_added_host_and_still_refuses_any_other_address() -> None:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=10))
    gate = rendezvous.Gate("127.0.0.1", 0, store.port, SECRET, peers=Counter({"127.0.0.5": 1}))
    try:
        stranger = _connect_from("127.0.0.2", gate.port)
        assert _refused(stranger)  # not in the inventory: closed before any handshake
        gate.allow(["127.0.0.2"])
        added = _connect_from("127.0.0.2", gate.port)
        rendezvous.rank_handshake(added, SECRET)  # now it passes (with the secret)
        assert _refused(_connect_from("127.0.0.3", gate.port))  # and nobody else does
        added.close()
        stranger.close()
    finally:
        gate.close()


# --------------------------------------------------------------------------- the coordinator
def test_a_slot_is_added_only_at_the_launchers_request_and_its_address_allowed() -> None:
    store = dist.HashStore()
    allowed: list[tuple[str, ...]] = []
    table = Table(store, 0, 2, pulse_timeout=600.0, wait_timeout=5.0,
                  allow=lambda g: allowed.append(g.addresses))
    assert table.take_new_slots() == [] and table.slots == 2
    growth = Growth(2, "box2", ("10.0.0.3", "box2.lan"))
    asking = threading.Thread(target=request_slot, args=(store, growth, 30.0))
    asking.start()
    while not store.check([Table.grow_key(2)]):
        threading.Event().wait(0.01)
    taken = table.take_new_slots()
    asking.join(30)
    assert not asking.is_alive()  # the launcher heard rank 0 took it
    assert [g.slot for g in taken] == [2] and table.slots == 3 and allowed == [("10.0.0.3", "box2.lan")]
    assert [g.name for g in table.added] == ["box2"]


def test_a_request_for_the_wrong_slot_or_malformed_is_refused() -> None:
    store = dist.HashStore()
    table = Table(store, 0, 2, pulse_timeout=600.0)
    store.set(Table.grow_key(2), Growth(5, "box5", ("10.0.0.5",)).to_json())
    with pytest.raises(MembershipError, match="as rank 5 was found under rank 2"):
        table.take_new_slots()
    for text in (b"not json", b'{"slot": 2}', b'{"slot": 2, "name": "a", "addresses": []}',
                 b'{"slot": true, "name": "a", "addresses": ["x"]}'):
        with pytest.raises(MembershipError):
            Growth.from_json(text)


class _Node:
    """One slot on a thread with a value it averages (as test_elastic_group's)."""

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
        def restore(saved: torch.Tensor) -> None:
            self.value.copy_(saved)

        self.comm.transaction(lambda: self.comm.all_reduce(self.value, op="mean"),
                              snapshot=lambda: self.value.clone(), restore=restore, admit=admit, step=step)


def test_a_run_of_two_grows_to_three_and_the_new_slot_joins_with_a_peers_state(loopback: None) -> None:
    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=60))
    nodes = [_Node(store, s, 2) for s in range(2)]
    on_threads(*(n.comm.start for n in nodes))
    # A joiner for slot 2 before the launcher asked: not a slot of the run, never admitted.
    assert nodes[0].comm.table.joiners([0, 1]) == {}
    # The launcher asks (through the store); rank 0 takes it at its next meeting.
    on_threads(lambda: request_slot(store, Growth(2, "box2", ("127.0.0.1",)), 60.0),
                *(lambda n=n: n.average(0) for n in nodes))
    assert nodes[0].comm.table.slots == 3
    newcomer = _Node(store, 2, 3, joining=True)
    newcomer.value = torch.full((5,), -100.0)  # whatever it held is replaced
    on_threads(lambda: newcomer.comm.join(60.0), *(lambda n=n: n.average(1, admit=True) for n in nodes))
    assert newcomer.comm.alive == [0, 1, 2] and torch.equal(newcomer.value, nodes[0].value)
    # Every member counts the new slot (the old ones were started with WORLD_SIZE=2).
    assert [n.comm.world_size for n in [*nodes, newcomer]] == [3, 3, 3]
    event = nodes[0].comm.events[-1]
    assert event["joined"] == [2] and event["members"] == [0, 1, 2] and event["heal_bytes"] > 0
    newcomer.value += 3.0  # 1.5 + 3 beside 1.5, 1.5: the mean of three is 2.5
    on_threads(*(lambda n=n: n.average(2) for n in [*nodes, newcomer]))
    for n in [*nodes, newcomer]:
        assert torch.equal(n.value, torch.full((5,), 2.5))
    for n in [*nodes, newcomer]:
        n.stop.set()


# --------------------------------------------------------------------------- the data
def test_the_samples_are_dealt_to_the_grown_membership_each_once_per_epoch() -> None:
    """Two slots, then a third added at a sync with a peer's data state: over each epoch
    every sample that reached the global model was drawn once, and the newcomer draws its
    share from its first step."""
    data = torch.utils.data.TensorDataset(torch.arange(240))
    batch, sync = 4, 3
    nodes = {s: SharedBatches(data, slot=s, slots=2, batch_size=batch, seed=1, shuffle=True)
             for s in range(2)}
    counted: dict[int, list[int]] = {}
    drawn_by_new: list[int] = []
    members = [0, 1]
    for step in range(60):
        if step == 12:  # slot 2 admitted at the sync after step 11, with slot 0's state
            nodes[2] = SharedBatches(data, slot=2, slots=3, batch_size=batch, seed=1, shuffle=True)
            nodes[2].load_state_dict(nodes[0].state_dict())
            members = [0, 1, 2]
        for s in members:
            nodes[s].members = list(members)
            drawn = nodes[s].next_indices()
            counted.setdefault(nodes[s].epoch, []).extend(drawn)
            if s == 2:
                drawn_by_new += drawn
        assert len({json.dumps(nodes[s].state_dict(), sort_keys=True) for s in members}) == 1, step
        if (step + 1) % sync == 0:
            for s in members:
                nodes[s].synced()
    assert len(drawn_by_new) == 48 * batch  # its share of every step since it came
    for epoch, drawn in counted.items():
        assert len(drawn) == len(set(drawn)), f"epoch {epoch}: a sample drawn twice"
    assert len(counted[0]) > 240 - 3 * batch  # nothing lost but the tail


# --------------------------------------------------------------------------- the control folder
def _control(tmp_path: Path) -> RunControl:
    inventory = tmp_path / "hosts.yaml"
    inventory.write_text("defaults: {python: /usr/bin/python3, workdir: /tmp/mt, user: me}\n"
                         "hosts:\n  - {name: a, host: 10.255.0.1}\n  - {name: b, host: 10.255.0.2}\n")
    launched = load_inventory(inventory)  # as `launch --threads 1` runs it
    launched = dataclasses.replace(launched, hosts=tuple(dataclasses.replace(h, threads=1)
                                                         for h in launched.hosts))
    control = RunControl.claim(tmp_path / "runs" / "r1", "r1", launched)
    assert control is not None
    return control


def test_hosts_add_checks_the_entry_as_the_inventory_does_and_leaves_one_request(tmp_path: Path) -> None:
    control = _control(tmp_path)
    run_dir = tmp_path / "runs" / "r1"
    running = RunControl.of_running(run_dir)  # this process is the "launcher": alive
    host = running.request(entry_from_words(["name=c", "host=10.255.0.3", "threads=2"]))
    assert (host.rank, host.python, host.threads, host.user) == (2, "/usr/bin/python3", 2, "me")
    # Not given: the thread count every host of the launch runs with (its --threads).
    assert control.host_for({"name": "z", "host": "10.255.0.99"}).threads == 1
    for words, message in (
            (["name=c", "host=10.255.0.9"], "duplicate name 'c'"),  # asked for already
            (["name=d", "host=10.255.0.2"], "already in the run as 'b'"),
            (["name=d", "host=10.255.0.4", "colour=red"], "unknown key 'colour'"),
            (["name=d"], "missing key 'host'"),
            (["name=d", "host=10.255.0.4", "python=python3"], "must be an absolute path")):
        with pytest.raises((InventoryError, AddHostError), match=message) as caught:
            running.request(entry_from_words(words))
        assert str(run_dir / "launch" / "hosts.yaml") in str(caught.value)
        assert "\n" not in str(caught.value)
    with pytest.raises(AddHostError, match="is not KEY=VALUE"):
        entry_from_words(["box3"])
    taken = control.take_requests()
    assert [e for _, e in taken] == [{"name": "c", "host": "10.255.0.3", "threads": 2}]
    assert control.take_requests() == []
    # While the launcher brings it in, it still counts: the next host is rank 3.
    with pytest.raises(InventoryError, match="duplicate name 'c'"):
        running.request(entry_from_words(["name=c", "host=10.255.0.9"]))
    assert running.request(entry_from_words(["name=d", "host=10.255.0.4"])).rank == 3
    control.append(taken[0][1])
    control.done(taken[0][0])
    assert running.request(entry_from_words(["name=e", "host=10.255.0.5"])).rank == 4
    assert control.host_for({"name": "f", "host": "10.255.0.6"}).rank == 3  # the record: a, b, c
    control.finished("r1")
    with pytest.raises(AddHostError, match="its launch has ended"):
        RunControl.of_running(run_dir)
    assert os.path.isdir(run_dir / "launch")


# --------------------------------------------------------------------------- what the user sees
def test_an_added_host_gets_a_row_in_the_output_the_live_panel_and_the_dashboard(tmp_path: Path) -> None:
    import io

    from meshtrain import observers
    from meshtrain.dashboard.state import RunState
    from meshtrain.launch.live import LiveOutput

    board = RunState("r1", ["box0", "box1"], kind="launch", clock=lambda: 0.0, changed=lambda: None)
    live = LiveOutput(["box0", "box1"], stream=io.StringIO(), log_dir=tmp_path / "ranks")
    with observers.watching(board):
        row = live.add_row("box2")
        live.line(row, "hello from the new host")
        live.ended(row, "ok")
    assert row == 2 and [r.name for r in live.view.rows] == ["box0", "box1", "box2"]
    assert live.tail(2) == ["hello from the new host"]
    assert (tmp_path / "ranks" / "box2-r2.log").read_text() == "hello from the new host\n"
    assert [n.name for n in board.nodes] == ["box0", "box1", "box2"] and board.nodes[2].state == "done"
