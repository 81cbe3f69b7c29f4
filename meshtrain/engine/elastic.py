"""What a node of an elastic run (``launch --elastic``) adds to the training loop.

The loop runs each step's communicating work as a transaction of the communicator
(:mod:`meshtrain.comm.elastic`); this module gives it what a transaction needs from the
node: a copy of the node's state to go back to when a peer is lost mid-step
(:meth:`ElasticNode.snapshot`, :meth:`ElasticNode.restore`), the state a joiner takes
from a healthy peer (:meth:`ElasticNode.capture`, :meth:`ElasticNode.apply`), the steps
where joiners may come in (:func:`admits`), and rank 0's record of who was in at every
step (:attr:`ElasticNode.members_by_step`) for metrics.csv and the summary.
"""

from __future__ import annotations

import copy
import math
import time
from typing import Any

import torch

from meshtrain import checkpoint, observers
from meshtrain.comm.communicator import Communicator
from meshtrain.comm.elastic import ElasticCommunicator
from meshtrain.data import SharedBatches
from meshtrain.engine.callbacks import NodeRun
from meshtrain.engine.report import NodeReport
from meshtrain.strategies import Strategy


def admits(strategy: Strategy, step: int, max_steps: int) -> bool:
    """Whether joiners may come in after 0-based ``step``: where the strategy says so (an
    outer sync of DiLoCo, FedAvg, SPARTA-DiLoCo; every step of DDP; a step of Streaming
    DiLoCo with no fragment in flight), never after the last step."""
    return strategy.admits_joiners_after(step) and step + 1 < max_steps


class ElasticNode:
    """One node's side of an elastic run; see the module docstring."""

    def __init__(self, run: NodeRun) -> None:
        self.run = run
        self.comm: Communicator = run.comm
        #: Rank 0: the members whose work of each step reached the global model.
        self.members_by_step: list[list[int]] = []
        self._events_seen = 0
        self._round_start = run.first_step  # the first step of the round not yet synced
        #: Rank 0: each rejoin's timeline in steps done ({"rank", "reachable_step",
        #: "asked_step", "admitted_step", "asked_after_s"}), see :meth:`_watch_returning`.
        self.rejoins: list[dict[str, Any]] = []
        self._returning: dict[int, dict[str, Any]] = {}
        self._reachable_seen: dict[int, int] = {}
        self._ever_in: set[int] = set(run.comm.alive)  # rank 0: slots that were members once

    # ----------------------------------------------------------------- transactions
    def snapshot(self) -> dict[str, Any]:
        """The node's state before a step's communicating work (copies, not views)."""
        run = self.run
        # The gradients too: the local step zeroes them before a sync's collective, and a
        # redo without them would skip the step (torch's optimizers pass over grad None).
        return {"model": {k: v.detach().clone() for k, v in run.model.state_dict().items()},
                "grads": [None if p.grad is None else p.grad.clone() for p in run.strategy.params],
                "strategy": copy.deepcopy(run.strategy.state_dict()),
                "seconds": len(run.seconds), "val": dict(run.history_val)}

    def restore(self, saved: dict[str, Any]) -> None:
        run = self.run
        with torch.no_grad():
            for name, value in run.model.state_dict().items():
                value.copy_(saved["model"][name])
            for p, grad in zip(run.strategy.params, saved["grads"], strict=True):
                p.grad = None if grad is None else grad.clone()  # a clone: the redo may change it
        run.strategy.load_state_dict(copy.deepcopy(saved["strategy"]))
        del run.seconds[saved["seconds"]:]
        run.history_val = dict(saved["val"])

    # ----------------------------------------------------------------- healing
    def capture(self) -> dict[str, Any]:
        """What a joiner needs to be this node: model, strategy, data position, the step."""
        run = self.run
        return {"step": len(run.losses), **checkpoint.model_state(run.model),
                "strategy": run.strategy.state_dict(), "data": run.batches.state_dict()}

    def apply(self, state: dict[str, Any]) -> None:
        """Become the node that sent ``state`` (a joiner, before its first step)."""
        run = self.run
        checkpoint.load_model_state(run.model, state, "the state a peer sent")
        run.strategy.load_state_dict(state["strategy"])
        run.batches.load_state_dict(state["data"])
        run.first_step = int(state["step"])
        # The steps before it joined are not this node's: no loss, no time of its own.
        run.losses = [math.nan] * run.first_step
        run.seconds = [math.nan] * run.first_step
        self._round_start = run.first_step

    # ----------------------------------------------------------------- membership
    def before_step(self) -> None:
        """The step's members draw its samples (an elastic run's batches are shared)."""
        if isinstance(self.run.batches, SharedBatches):
            self.run.batches.members = list(self.comm.alive)

    def after_step(self, step: int, admitted: bool) -> None:
        """After a step's transaction: the samples of members lost before their round reached
        the global model are drawn again; a sync closes the round; rank 0 records who was in."""
        events = getattr(self.comm, "events", [])[self._events_seen:]
        self._events_seen += len(events)
        lost = sorted({slot for e in events for slot in e["lost"]})
        batches = self.run.batches
        if isinstance(batches, SharedBatches):
            batches.members_lost(lost)
        if self.comm.rank == 0:
            self._watch_returning(step, events)
            for e in events:
                self._announce(e)
            # Joiners admitted after this step's work did none of it: their first row is the next.
            joined = {slot for e in events for slot in e["joined"]}
            self.members_by_step.append([m for m in self.comm.alive if m not in joined])
            for s in range(self._round_start, step):  # their work of this round is gone
                row = self.members_by_step[s - self.run.first_step]
                row[:] = [m for m in row if m not in lost]
        if admitted:  # the round's work is in the global model
            if isinstance(batches, SharedBatches):
                batches.synced()
            self._round_start = step + 1

    def _watch_returning(self, step: int, events: list[dict[str, Any]]) -> None:
        """Rank 0, while a slot is out: the steps done when rank 0 knew the slot out and its
        host reachable again (the launcher's word, the later of the two), when its joiner
        asked to join (after its start-up), with the seconds between, and when it was
        admitted (summary.json's ``elastic.rejoins``). One look at the store per step and
        slot out, only while one is."""
        if not isinstance(self.comm, ElasticCommunicator):
            return
        table = self.comm.table
        done = step + 1
        changed = {slot for e in events for slot in (*e["lost"], *e["joined"])}
        for slot in sorted(changed | {s for s in range(table.slots) if s not in self.comm.alive}):
            reachable, asking = table.returning(slot)
            if reachable > self._reachable_seen.get(slot, 0):  # a new outage's host answers again
                self._reachable_seen[slot] = reachable
                self._returning[slot] = {"rank": slot, "reachable_step": done, "asked_step": None,
                                         "asked_after_s": None, "seen_at": time.monotonic()}
            record = self._returning.get(slot)
            if record is not None and asking and record["asked_step"] is None:
                record["asked_step"] = done
                record["asked_after_s"] = round(time.monotonic() - record["seen_at"], 2)
        for e in events:
            for slot in e["joined"]:
                record = self._returning.pop(slot, None)
                if record is not None:
                    seen_at = record.pop("seen_at")
                    if record["asked_step"] is None:  # it asked during the admitting step itself
                        record["asked_step"] = e["step"]
                        record["asked_after_s"] = round(time.monotonic() - seen_at, 2)
                    self.rejoins.append({**record, "admitted_step": e["step"]})

    def _announce(self, event: dict[str, Any]) -> None:
        """Rank 0 says who left or came back (the launcher's output, log.txt, the dashboard)."""
        run = self.run
        members, at = " ".join(map(str, event["members"])), f"step {event['step']}/{run.max_steps}"
        if event["lost"]:
            line = f"{at}  rank(s) {' '.join(map(str, event['lost']))} lost; members now {members}"
        elif event["joined"] and event["heal_bytes"]:
            line = (f"{at}  {self._who_joined(event['joined'])} with a peer's state "
                    f"({event['heal_bytes']} bytes); members now {members}")
        elif event["joined"]:  # the heal broke off (a member lost meanwhile): the next event says who
            line = f"{at}  rank(s) {' '.join(map(str, event['joined']))} admitted, but the heal broke off"
        else:
            return
        run.progress.note(line)
        observers.notify("event", "membership", line)
        self._ever_in.update(event["members"])

    def _who_joined(self, joined: list[int]) -> str:
        """"rank(s) 1 rejoined", and a host added to the run (``meshtrain hosts add``) by name
        the first time it comes in: "new host box3 joined as rank 3"."""
        added = {g.slot: g.name for g in self.comm.table.added} \
            if isinstance(self.comm, ElasticCommunicator) else {}
        back = [s for s in joined if s in self._ever_in or s not in added]
        new = [f"new host {added[s]} joined as rank {s}" for s in joined if s not in back]
        parts = ([f"rank(s) {' '.join(map(str, back))} rejoined"] if back else []) + new
        return ", ".join(parts)


def placeholder_report(steps: int) -> NodeReport:
    """The report of a slot whose process is gone at the end (lost for good, or its earlier
    run before it rejoined): no loss of its own at any step."""
    return NodeReport([math.nan] * steps, [math.nan] * steps, [0] * steps, [0] * steps, 0)

