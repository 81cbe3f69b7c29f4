"""Collectives of an elastic run: a group that loses members and takes them back.

:class:`ElasticCommunicator` is :class:`~meshtrain.comm.torch_dist.TorchDistCommunicator`'s
ring over a gloo process group of the *current membership* (:mod:`meshtrain.comm.membership`):
one ``ProcessGroupGloo`` per epoch, formed through the rendezvous store under that epoch's
key prefix, so only ranks that passed the HMAC gate can take part. Ranks keep their slot
numbers (the inventory's ranks); a slot's place in the epoch's group is its position
among the members.

Every collective runs inside a *transaction* (:meth:`transaction`): the work of one step
that communicates (the strategy's update and the callbacks after it). The node's state is
copied first. When a peer is lost inside it (gloo reports the connection closed, or its
timeout passes), the members meet, the coordinator drops the silent ones, every member
forms the next epoch's group, puts the copied state back and does the work again among
the survivors. A transaction at an *admission point* (an outer sync, or every step of
DDP) ends with a meeting that may admit joiners: the group is formed again with them and
the lowest old member sends them its whole state (:mod:`meshtrain.comm.state_transfer`);
a last meeting confirms the heal before anyone goes on.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist

from meshtrain.comm import rendezvous, sealing
from meshtrain.comm.membership import POLL_S, Decision, Dropped, Growth, Table, request_slot
from meshtrain.comm.state_transfer import receive_state, send_state
from meshtrain.comm.torch_dist import LEAVE_GRACE_S, TorchDistCommunicator, host_loopback_store
from meshtrain.errors import RunFailure

#: Pulses per pulse timeout: a few may be late without the rank counting as lost.
PULSES_PER_TIMEOUT = 5


class Healer(Protocol):
    """What a rejoining node needs from a healthy one: its state, and how to take it."""

    def capture(self) -> Any:
        """This node's state, to send (a ``state_dict``-like structure)."""

    def apply(self, state: Any) -> None:
        """Become the node that sent ``state``."""


def peer_lost(exc: BaseException) -> bool:
    """Whether ``exc`` is gloo's word that a peer went away (closed, reset, timed out)."""
    if isinstance(exc, dist.DistError):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and ("gloo" in text or "connection" in text or "timed out" in text)


class ElasticCommunicator(TorchDistCommunicator):
    """One slot's collectives over the membership of the moment (see the module docstring).

    ``seal`` is called after every group forms (closes its new listening socket to
    strangers, as a fixed group's is: :mod:`meshtrain.comm.sealing`)."""

    def __init__(self, table: Table, timeout_s: float, *, seal: Callable[[], object] = lambda: None) -> None:
        # No torch.distributed default group: every epoch has a process group of its own.
        self._setup(table.slot, table.slots, group=None, backend="gloo")
        self.reduces_in_background = False  # every collective on the node's thread, in a transaction
        self.table = table
        self.store = table.store
        self.timeout_s = timeout_s
        self.seal = seal
        self.epoch = -1
        self.meeting = 0
        self.pg: Any = None
        self._place: dict[int, int] = {}
        self._graveyard: list[Any] = []  # old groups and their requests: never freed mid-run
        self._calls = 0  # collectives so far: a transaction without one needs no meeting
        self._in_transaction = False
        self.healer: Healer | None = None
        #: Every change of membership: {"step", "epoch", "members", "lost", "joined", "heal_bytes"}.
        self.events: list[dict[str, Any]] = []
        self.heal_bytes = 0

    # ----------------------------------------------------------------- transport
    @property
    def group_size(self) -> int:
        return len(self.alive)

    def _sum_over_group(self, flat: torch.Tensor) -> None:
        self._calls += 1
        self.pg.allreduce([flat]).wait()

    def _post_send(self, tensor: torch.Tensor, dst: int) -> None:
        self._calls += 1
        self._sends.append(self.pg.send([tensor], self._place[dst], 0))
        self._finished_bytes += tensor.nbytes

    def _post_receive(self, tensor: torch.Tensor, src: int) -> None:
        self._calls += 1
        self._receives.append(self.pg.recv([tensor], self._place[src], 0))
        self._finished_bytes += tensor.nbytes

    def _exchange_now(self, send: torch.Tensor, dst: int, recv: torch.Tensor, src: int) -> None:
        self._post_send(send, dst)
        self._post_receive(recv, src)
        self._settle()

    def open_side_channel(self) -> None:
        return None  # work "beside" runs at once: a transaction holds every collective

    # ----------------------------------------------------------------- membership
    def start(self) -> None:
        """Form the first group, of every slot (the launch's first attempt starts them all)."""
        self._form(Decision(0, 0, tuple(range(self.world_size))))
        self.events.append({"step": 0, "epoch": 0, "members": list(self.alive), "lost": [], "joined": [],
                            "heal_bytes": 0})

    def join(self, timeout: float) -> Decision:
        """A joiner: be admitted, form the group with everyone, take the state from a healthy
        member, and confirm with everyone. Returns the decision that admitted it."""
        nonce = self.table.ask_to_join()
        decision = self.table.await_admission(nonce, timeout)
        self.meeting = decision.meeting + 1
        self.step = decision.step
        ok = self._attempt(lambda: self._regroup(decision))
        self._settle_membership(ok, step=decision.step)
        return decision

    def _form(self, decision: Decision) -> None:
        if self.pg is not None:
            self._graveyard.append(self.pg)
        self._graveyard += self._sends + self._receives + self._finished + self._retired
        self._sends, self._receives, self._finished, self._retired = [], [], [], []
        self._scratch = torch.empty(0)
        members = list(decision.members)
        self.pg = None
        self.alive = members
        # A host added mid-run (`meshtrain hosts add`) is a slot past the launch's: every member
        # counts it from the first group it is in (FedAvg draws its islands over all slots).
        self.world_size = max(self.world_size, max(members) + 1)
        self._place = {slot: i for i, slot in enumerate(members)}
        self.epoch = decision.epoch
        store = dist.PrefixStore(f"elastic/pg/{decision.epoch}/", self.store)
        self.pg = dist.ProcessGroupGloo(store, members.index(self.rank), len(members),
                                        timedelta(seconds=self.timeout_s))
        self.seal()

    def _regroup(self, decision: Decision) -> None:
        """Form ``decision``'s group; then the lowest old member heals the joiners."""
        self._form(decision)
        if not decision.joiners:
            return
        source = min(m for m in decision.members if m not in decision.joiners)
        group = sorted({source, *decision.joiners})
        if self.rank == source:
            assert self.healer is not None
            sent = send_state(self, self.healer.capture(), group) * len(decision.joiners)
            self.heal_bytes += sent
            self.events[-1]["heal_bytes"] += sent
        elif self.rank in decision.joiners:
            assert self.healer is not None
            state, _ = receive_state(self, source, group)
            self.healer.apply(state)

    def _attempt(self, work: Callable[[], object]) -> bool:
        """Run ``work``; False when a peer was lost in it (any other error propagates)."""
        try:
            work()
        except Exception as exc:
            if not peer_lost(exc):
                raise
            return False
        return True

    def _meet(self, ok: bool, *, admit: bool, step: int) -> Decision:
        decision = self.table.meet(self.meeting, self.epoch, tuple(self.alive), ok, admit=admit, step=step)
        self.meeting += 1
        if self.rank not in decision.members:
            raise Dropped(f"rank {self.rank} was left out of the group at step {step + 1} (silent for more "
                          f"than {self.table.pulse_timeout:g} s): it leaves, and may join again")
        if decision.epoch != self.epoch:
            self.events.append({"step": step + 1, "epoch": decision.epoch,
                                "members": list(decision.members), "lost": list(decision.lost),
                                "joined": list(decision.joiners), "heal_bytes": 0})
        return decision

    def _settle_membership(self, ok: bool, *, step: int) -> None:
        """Meet (without admitting) until a meeting changes nothing: every member then holds
        the same group, formed."""
        while True:
            decision = self._meet(ok, admit=False, step=step)
            if decision.epoch == self.epoch:
                return
            ok = self._attempt(lambda d=decision: self._regroup(d))  # type: ignore[misc]

    # ----------------------------------------------------------------- transactions
    def transaction(self, body: Callable[[], object], *, snapshot: Callable[[], Any],
                    restore: Callable[[Any], None], admit: bool, step: int, meet: bool = False) -> None:
        """Run ``body`` (this step's communicating work) so that a peer lost in it costs a
        redo among the survivors; at an admission point, take joiners in afterwards.
        ``meet``: hold the meeting even if this node said nothing (see the base class)."""
        saved = snapshot()
        calls = self._calls
        ok = self._attempt(body)
        if ok and not admit and not meet and self._calls == calls:
            return  # nothing was said to anyone, and every member knows none will ask: nothing to agree on
        while True:
            decision = self._meet(ok, admit=admit, step=step)
            if not decision.redo:  # the work stands
                if decision.epoch != self.epoch:  # joiners came: heal them, then all confirm
                    ok = self._attempt(lambda d=decision: self._regroup(d))  # type: ignore[misc]
                    self._settle_membership(ok, step=step)
                return
            restore(saved)  # a peer was lost: the survivors do the work again
            if not self._attempt(lambda d=decision: self._regroup(d)):  # type: ignore[misc]
                ok = False  # another was lost while the group formed: meet again
                continue
            ok = self._attempt(body)


def start_pulse(store: Any, table: Table, stop: threading.Event | None = None) -> threading.Thread:
    """Add to ``table``'s pulse counter (:attr:`Table.beat_key`: the slot's, or a joiner's
    own until it is admitted) every ``pulse_timeout / 5`` seconds, from a daemon thread on
    ``store`` (a connection of its own: the main one may wait long in a group's formation),
    until ``stop`` is set. A stopped or cut-off process stops pulsing: the coordinator drops it."""
    interval = table.pulse_timeout / PULSES_PER_TIMEOUT
    stopped = stop or threading.Event()

    def beat() -> None:
        while not stopped.is_set():
            try:
                store.add(table.beat_key, 1)
            except Exception:  # noqa: BLE001 - rank 0 is gone: the main thread finds out itself
                return
            stopped.wait(interval)

    thread = threading.Thread(target=beat, name="meshtrain-pulse", daemon=True)
    thread.start()
    return thread


#: Counter of the ranks that have left at the end (rank 0 waits for the members').
LEFT_KEY = "elastic/left"


@dataclass
class ElasticStore:
    """One rank's connections to an elastic run's store (see :func:`open_elastic_store`)."""

    table: Table
    keep_open: set[int]  # listening ports never sealed: rank 0's gate and loopback store
    held: list[Any] = field(default_factory=list)  # the gate, tunnels, stores: alive as long as this

    def seal(self) -> None:
        """Close every listening socket of this rank to new connections but the gate and
        the store: gloo's new listener of each epoch (:mod:`meshtrain.comm.sealing`)."""
        fds = [fd for fd in sealing.listening_tcp_sockets() if _port(fd) not in self.keep_open]
        sealing.seal_listening_sockets(fds)

    def all_ready(self, timeout_s: float) -> None:
        """Wait until every slot has reached its store (the first group then forms at once)."""
        store, slot = self.table.store, self.table.slot
        store.set(f"elastic/ready/{slot}", b"1")
        deadline = time.monotonic() + timeout_s
        keys = [f"elastic/ready/{s}" for s in range(self.table.slots)]
        while not store.check(keys):
            if time.monotonic() > deadline:
                raise RunFailure(f"not every rank reached the rendezvous within {timeout_s:g} s")
            time.sleep(POLL_S)

    def leave(self, members: int, timeout_s: float) -> None:
        """The end: every rank but 0 says it has left; rank 0, whose process holds the store,
        waits for the other ``members - 1`` (at most a grace: a rank lost at the very end
        never says so) before it exits."""
        store = self.table.store
        if self.table.slot != 0:
            with contextlib.suppress(Exception):  # rank 0 may be gone already: nothing left to do
                store.add(LEFT_KEY, 1)
            return
        deadline = time.monotonic() + min(timeout_s, LEAVE_GRACE_S)
        while int(store.add(LEFT_KEY, 0)) < members - 1 and time.monotonic() < deadline:
            time.sleep(POLL_S)


def _port(fd: int) -> int | None:
    sock = socket.socket(fileno=os.dup(fd))
    try:
        return int(sock.getsockname()[1])
    except OSError:
        return None
    finally:
        sock.close()


def open_elastic_store(slot: int, slots: int, addr: str, port: int, timeout_s: float,
                       heartbeat_s: float, *, joining: bool = False) -> ElasticStore:
    """Reach the run's store as ``slot``. Rank 0 hosts it on 127.0.0.1 behind the HMAC gate
    on ``addr:port``, which stays open all run (a joiner must pass it: only a rank that
    proves the launch's secret gets in, from an inventory host's address). Every other rank
    opens two connections through the gate, each through a tunnel of its own: one for the
    protocol and one for its pulse (started here; ``joining``: this process was started to
    rejoin, and pulses as a joiner until it is admitted)."""
    secret = rendezvous.take_secret()
    if secret is None:
        raise RunFailure("an elastic run needs the launch secret: start it with meshtrain launch --elastic")
    timeout = timedelta(seconds=timeout_s)
    if slot == 0:
        store, store_port = host_loopback_store(timeout_s)
        gate = rendezvous.Gate(addr, port, store_port, secret, admissions=None,
                               peers=rendezvous.peers_from_env())
        table = Table(store, slot, slots, heartbeat_s, wait_timeout=timeout_s,
                      allow=lambda growth: gate.allow(growth.addresses))
        return ElasticStore(table, {store_port, gate.port}, [gate, store])
    held: list[Any] = []
    stores = []
    for _ in range(2):
        tunnel = rendezvous.Tunnel(addr, port, secret, timeout_s)
        stores.append(dist.TCPStore("127.0.0.1", tunnel.port, is_master=False, timeout=timeout))
        held += [tunnel, stores[-1]]
    main, pulse = stores
    table = Table(main, slot, slots, heartbeat_s, wait_timeout=timeout_s, joining=joining)
    start_pulse(pulse, table)
    return ElasticStore(table, set(), held)


def mark_reachable(addr: str, port: int, secret: bytes, slot: int, timeout_s: float) -> None:
    """The launcher: pass the gate at ``addr:port`` as a rank does and tell rank 0 that lost
    ``slot``'s host answers SSH again (rank 0 records the step: summary.json's rejoins)."""
    tunnel = rendezvous.Tunnel(addr, port, secret, timeout_s)
    try:
        store = dist.TCPStore("127.0.0.1", tunnel.port, is_master=False, timeout=timedelta(seconds=timeout_s))
        store.add(Table.reachable_key(slot), 1)
        del store
    finally:
        tunnel.close()


def add_slot(addr: str, port: int, secret: bytes, growth: Growth, timeout_s: float) -> None:
    """The launcher (``meshtrain hosts add``): pass the gate at ``addr:port`` with the launch's
    ``secret``, as a rank does, and have rank 0 make ``growth`` the run's next slot."""
    tunnel = rendezvous.Tunnel(addr, port, secret, timeout_s)
    try:
        store = dist.TCPStore("127.0.0.1", tunnel.port, is_master=False, timeout=timedelta(seconds=timeout_s))
        request_slot(store, growth, timeout_s)
        del store
    finally:
        tunnel.close()
