"""Who is in an elastic run (``launch --elastic``), decided at meetings in the rendezvous store.

The ranks of an elastic run are *slots* 0 .. N-1 (the inventory's ranks); the slots in
the group at a time are its *membership*, numbered by an *epoch* that grows with every
change. Rank 0 hosts the store behind the HMAC gate (:mod:`meshtrain.comm.rendezvous`)
and is the coordinator: nothing changes the membership but its decisions, written into
the store, which only proven ranks reach.

Meetings. Every member counts the meetings it has attended; all members of an epoch go
through the same meetings, so the count names one meeting everywhere. At meeting ``n``
a member writes whether its part since the last meeting succeeded (``ok``) or failed (a
peer was lost in a collective), then waits for the decision. The coordinator waits until
every member has reported, or has sent no pulse for ``pulse_timeout`` seconds (killed,
stopped, cut off: each rank but 0 adds to its pulse counter from a thread on a store
connection of its own), or has not reported within ``wait_timeout`` (a member that pulses
but never comes must not hold the run forever), and decides:

* members: those who reported (the silent ones are *lost*), plus the *joiners* (slots
  asking to join, see below) when the meeting may admit and nothing failed;
* ``redo``: something failed, so the work since the last meeting is undone and done
  again by the new membership;
* epoch: the old one if nothing failed and the members did not change, else the next
  (every epoch has a freshly formed gloo group).

A member that finds itself left out of a decision (it was silent too long, then came
back) leaves the run (:class:`Dropped`); the launcher starts it again as a joiner.

Joining. A rank started as a joiner writes a fresh nonce under its slot and waits; the
coordinator admits it at the next meeting that may admit (an outer sync, see
:mod:`meshtrain.engine.elastic`) by writing the decision under the nonce too, with the
meeting's number, so the joiner attends the meetings that follow with everyone. Until it
is admitted a joiner pulses under its nonce, not its slot: the slot's pulse speaks for the
member process of that slot, and a new process of the slot pulsing there would keep its
dead predecessor "alive" in the coordinator's eyes (the coordinator would wait for that
member's report until the joiner gave up: the run stalled, the joiner was never admitted).

Growing. A host added to a running launch (``meshtrain hosts add``) becomes the next slot,
N: the launcher, which holds the launch's secret, passes the gate itself and writes a
:class:`Growth` under ``grow/N``. At its next meeting the coordinator lets the gate admit
the host's addresses (nothing else is admitted: the gate's list grows only this way),
counts N among the run's slots and answers under ``grown/N``; the launcher then starts
the new rank as a joiner, and it joins like a rank that comes back.

Every value read from the store was written by a proven rank of this launch, yet it is
still parsed strictly (JSON of known keys and types, never pickle).
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from meshtrain.errors import RunFailure

#: Every key of the elastic protocol starts with this (the store also holds gloo's keys).
PREFIX = "elastic/"
#: How often a waiting rank looks at the store (a key appears; the store cannot wake it
#: while another thread shares the connection).
POLL_S = 0.02
#: Most bytes of one decision (a few hundred for any real membership).
MAX_DECISION_BYTES = 1 << 16
#: Most bytes of one request to grow the run (a host's name and a few addresses).
MAX_GROWTH_BYTES = 4096


class Dropped(RunFailure):
    """This rank was left out of the group (silent past the pulse timeout): it must leave."""


class MembershipError(RunFailure):
    """The store answered with something that is not a decision of this protocol."""


def _store_record(text: bytes | str, max_bytes: int, what: str, fields: set[str]) -> dict[str, Any]:
    """A JSON object read from the store with exactly ``fields``, else one line naming ``what``."""
    if len(text) > max_bytes:
        raise MembershipError(f"{what} in the store is too large")
    try:
        raw = json.loads(text)
    except (ValueError, UnicodeDecodeError):
        raise MembershipError(f"{what} in the store is not JSON") from None
    if not isinstance(raw, dict) or set(raw) != fields:
        raise MembershipError(f"{what} in the store has unknown fields")
    return raw


@dataclass(frozen=True)
class Decision:
    """The coordinator's word at one meeting."""

    meeting: int
    epoch: int
    members: tuple[int, ...]
    redo: bool = False
    joiners: tuple[int, ...] = ()
    lost: tuple[int, ...] = ()
    #: The step the meeting was held at (the step whose work it closed), for joiners and logs.
    step: int = -1

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: bytes | str) -> Decision:
        """A decision from the store, checked field by field."""
        raw = _store_record(text, MAX_DECISION_BYTES, "a membership decision", set(cls.__dataclass_fields__))

        def number(key: str) -> int:
            value = raw[key]
            if not isinstance(value, int) or isinstance(value, bool):
                raise MembershipError(f"a membership decision's {key} is not a whole number")
            return value

        def slots(key: str) -> tuple[int, ...]:
            value = raw[key]
            if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool)
                                                      and v >= 0 for v in value):
                raise MembershipError(f"a membership decision's {key} is not a list of ranks")
            return tuple(value)

        if not isinstance(raw["redo"], bool):
            raise MembershipError("a membership decision's redo is not true or false")
        return cls(number("meeting"), number("epoch"), slots("members"), raw["redo"], slots("joiners"),
                   slots("lost"), number("step"))


@dataclass(frozen=True)
class Growth:
    """The launcher's request that ``slot`` (the run's next) be the host ``name``, reached
    from ``addresses`` (its inventory names and addresses, resolved by the gate)."""

    slot: int
    name: str
    addresses: tuple[str, ...]

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: bytes | str) -> Growth:
        """A request from the store, checked field by field."""
        raw = _store_record(text, MAX_GROWTH_BYTES, "a request to add a host", {"slot", "name", "addresses"})
        slot, name, addresses = raw["slot"], raw["name"], raw["addresses"]
        if not isinstance(slot, int) or isinstance(slot, bool) or slot < 1:
            raise MembershipError("a request to add a host names no rank")
        if not isinstance(name, str) or not isinstance(addresses, list) or not addresses \
                or not all(isinstance(a, str) and a for a in addresses):
            raise MembershipError("a request to add a host has no name or no addresses")
        return cls(slot, name, tuple(addresses))


def decide(meeting: int, epoch: int, members: Iterable[int], reported: dict[int, bool],
           joiners: Iterable[int], *, admit: bool, step: int) -> Decision:
    """The coordinator's rule, apart from any store: ``reported`` holds the members that
    reported (True: their part succeeded); the others are lost. Joiners come in only at a
    meeting that may ``admit`` where nothing failed (a failure is mended first)."""
    members = sorted(members)
    staying = [m for m in members if m in reported]
    lost = tuple(m for m in members if m not in reported)
    failed = bool(lost) or not all(reported[m] for m in staying)
    coming = tuple(sorted(j for j in set(joiners) if j not in staying)) if admit and not failed else ()
    new = tuple(sorted([*staying, *coming]))
    # After a failure the group is formed afresh even with the same members: a gloo group
    # whose collective broke is not trusted with another.
    changed = failed or new != tuple(members)
    return Decision(meeting, epoch + 1 if changed else epoch, new, failed, coming, lost, step)


@dataclass
class _Pulse:
    count: int
    seen: float  # when the count last changed (monotonic)


@dataclass
class Table:
    """One rank's side of the protocol over ``store`` (a torch ``Store``: the TCPStore client,
    or rank 0's own store). ``slot`` is this rank's; the coordinator is slot 0."""

    store: Any
    slot: int
    slots: int  # the run's slots (the inventory's ranks)
    pulse_timeout: float
    #: How long a rank waits for a decision before giving up (rank 0 gone quiet), and the
    #: coordinator for a member's report.
    wait_timeout: float = 1800.0
    clock: Callable[[], float] = time.monotonic
    #: This process was started to rejoin: it pulses under its nonce until admitted.
    joining: bool = False
    #: This process's own name for its request to join (fresh in every process).
    nonce: str = field(default_factory=lambda: secrets.token_hex(8))
    #: The coordinator: lets the gate admit a host added to the run (:class:`Growth`).
    allow: Callable[[Growth], None] | None = None
    #: The coordinator: the hosts added to the run while it trained, in order.
    added: list[Growth] = field(default_factory=list)
    _pulses: dict[str, _Pulse] = field(default_factory=dict)

    def __post_init__(self) -> None:
        #: The counter this process's pulse adds to now (:func:`~meshtrain.comm.elastic.start_pulse`).
        self.beat_key = (self.join_pulse_key(self.slot, self.nonce) if self.joining
                         else self.pulse_key(self.slot))

    # ------------------------------------------------------------------ keys
    @staticmethod
    def _report_key(meeting: int, slot: int) -> str:
        return f"{PREFIX}m/{meeting}/{slot}"

    @staticmethod
    def _decision_key(meeting: int) -> str:
        return f"{PREFIX}m/{meeting}/decision"

    @staticmethod
    def pulse_key(slot: int) -> str:
        return f"{PREFIX}pulse/{slot}"

    @staticmethod
    def join_pulse_key(slot: int, nonce: str) -> str:
        return f"{PREFIX}pulse/{slot}/join/{nonce}"

    @staticmethod
    def _join_key(slot: int) -> str:
        return f"{PREFIX}join/{slot}"

    @staticmethod
    def reachable_key(slot: int) -> str:
        """A counter the launcher adds to when a lost slot's host answers SSH again (a record
        for the summary, never a vote: the joiner still asks and is admitted as any)."""
        return f"{PREFIX}reachable/{slot}"

    def returning(self, slot: int) -> tuple[int, bool]:
        """(times the launcher found ``slot``'s host reachable again, whether a joiner of the
        slot asks to join now): rank 0 notes the step of each (one outage's timeline)."""
        reachable = int(self.store.add(self.reachable_key(slot), 0))
        return reachable, bool(self.store.check([self._join_key(slot)]))

    @staticmethod
    def _admit_key(slot: int, nonce: str) -> str:
        return f"{PREFIX}admit/{slot}/{nonce}"

    @staticmethod
    def grow_key(slot: int) -> str:
        return f"{PREFIX}grow/{slot}"

    @staticmethod
    def grown_key(slot: int) -> str:
        return f"{PREFIX}grown/{slot}"

    # ------------------------------------------------------------------ every member
    def meet(self, meeting: int, epoch: int, members: tuple[int, ...], ok: bool, *, admit: bool,
             step: int) -> Decision:
        """Attend meeting ``meeting``: report, then the decision (the coordinator makes it)."""
        self.store.set(self._report_key(meeting, self.slot), b"ok" if ok else b"failed")
        if self.slot == 0:
            return self._decide(meeting, epoch, members, admit=admit, step=step)
        key = self._decision_key(meeting)
        self._wait_for(key, f"the decision of meeting {meeting}")
        decision = Decision.from_json(self.store.get(key))
        if decision.meeting != meeting:
            raise MembershipError(f"the decision of meeting {meeting} names meeting {decision.meeting}")
        return decision

    def _wait_for(self, key: str, what: str) -> None:
        deadline = self.clock() + self.wait_timeout
        while not self.store.check([key]):
            if self.clock() > deadline:
                raise RunFailure(f"no word from rank 0 within {self.wait_timeout:g} s waiting for {what}")
            time.sleep(POLL_S)

    # ------------------------------------------------------------------ the coordinator
    def _decide(self, meeting: int, epoch: int, members: tuple[int, ...], *, admit: bool,
                step: int) -> Decision:
        self.take_new_slots()
        reported: dict[int, bool] = {}
        deadline = self.clock() + self.wait_timeout
        while True:
            for m in members:
                key = self._report_key(meeting, m)
                if m not in reported and self.store.check([key]):
                    reported[m] = self.store.get(key) == b"ok"
            waiting = [m for m in members if m not in reported and not self.silent(m)]
            if not waiting or self.clock() > deadline:  # past the deadline the silent-to-us are lost
                break
            time.sleep(POLL_S)
        joiners = self.joiners(members) if admit else {}
        decision = decide(meeting, epoch, members, reported, joiners, admit=admit, step=step)
        text = decision.to_json()
        for j in decision.joiners:  # first the joiner's own copy: it attends from this meeting on
            self.store.set(self._admit_key(j, joiners[j]), text)
            self.store.delete_key(self._join_key(j))
            # Its pulse moves to the slot's counter now: counted afresh from here.
            self._pulses.pop(self.pulse_key(j), None)
        self.store.set(self._decision_key(meeting), text)
        return decision

    def take_new_slots(self) -> list[Growth]:
        """The coordinator: the hosts the launcher asked to add since the last look, each
        now a slot of the run whose addresses the gate admits (:class:`Growth`)."""
        taken = []
        while self.store.check([self.grow_key(self.slots)]):
            growth = Growth.from_json(self.store.get(self.grow_key(self.slots)))
            if growth.slot != self.slots:
                raise MembershipError(f"a request to add a host as rank {growth.slot} was found under "
                                      f"rank {self.slots}")
            if self.allow is not None:
                self.allow(growth)
            self.slots += 1
            self.added.append(growth)
            taken.append(growth)
            self.store.set(self.grown_key(growth.slot), b"1")
        return taken

    def silent(self, slot: int) -> bool:
        """Whether ``slot`` has sent no pulse for ``pulse_timeout`` seconds (the coordinator
        never is). A slot never heard counts from the first time it is asked about."""
        if slot == 0:
            return False
        return self._silent(self.pulse_key(slot))

    def _silent(self, key: str) -> bool:
        count = int(self.store.add(key, 0))
        now = self.clock()
        known = self._pulses.get(key)
        if known is None or known.count != count:
            self._pulses[key] = _Pulse(count, now)
            return False
        return now - known.seen > self.pulse_timeout

    def joiners(self, members: Iterable[int]) -> dict[int, str]:
        """Slots outside ``members`` asking to join now whose joiner's pulse is alive, each
        with the nonce it asked under."""
        found = {}
        for s in (s for s in range(self.slots) if s not in set(members)):
            if not self.store.check([self._join_key(s)]):
                continue
            nonce = self.store.get(self._join_key(s)).decode(errors="replace")
            if not self._silent(self.join_pulse_key(s, nonce)):
                found[s] = nonce
        return found

    # ------------------------------------------------------------------ a joiner
    def ask_to_join(self) -> str:
        """Ask to be admitted (a joiner): the nonce its admission will be written under."""
        self.beat_key = self.join_pulse_key(self.slot, self.nonce)
        self.store.set(self._join_key(self.slot), self.nonce.encode())
        return self.nonce

    def await_admission(self, nonce: str, timeout: float) -> Decision:
        """The decision that admits this joiner (asked with ``nonce``)."""
        key = self._admit_key(self.slot, nonce)
        deadline = self.clock() + timeout
        while not self.store.check([key]):
            if self.clock() > deadline:
                raise RunFailure(f"rank {self.slot} was not admitted back within {timeout:g} s")
            time.sleep(POLL_S)
        decision = Decision.from_json(self.store.get(key))
        if self.slot not in decision.joiners:
            raise MembershipError(f"the admission of rank {self.slot} does not name it")
        self.beat_key = self.pulse_key(self.slot)  # a member now: the slot's pulse is this process's
        self.store.add(self.beat_key, 1)
        return decision


def request_slot(store: Any, growth: Growth, timeout: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
    """The launcher: ask the coordinator over ``store`` to make ``growth.slot`` a slot of the
    run, and wait until it has (it looks at every meeting: within one outer round)."""
    store.set(Table.grow_key(growth.slot), growth.to_json().encode())
    deadline = clock() + timeout
    while not store.check([Table.grown_key(growth.slot)]):
        if clock() > deadline:
            raise RunFailure(f"rank 0 did not take host {growth.name} as rank {growth.slot} within "
                             f"{timeout:g} s")
        time.sleep(POLL_S)
