"""Simulated faults: nodes that leave a run, and nodes that compute slower than the rest.

``--fail node=2,step=150`` makes node 2 take steps 1-150 and then stop: from step 151 on
every collective runs among the survivors only (the communicator's alive group), so
means divide by the survivors' count and bytes are the survivors' real traffic. Every
node knows the plan from the start, so nothing has to detect the departure.

``--straggler node=1,slowdown=3`` changes only the projected timeline: a step's compute
lasts as long as its slowest alive node's, and the others wait for it (idle seconds).
Nothing sleeps. With ``--balance`` a node's compute also scales with its share of the
step's samples (``work``), so a slow node given fewer samples no longer holds the others up.

Node 0 may not fail: it writes the run directory and holds the global model.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from meshtrain.errors import SettingError


class FaultError(SettingError):
    """A ``--fail`` or ``--straggler`` value that cannot be used: one line naming it."""


@dataclass
class FaultPlan:
    """Which nodes leave and when, and which nodes are slow.

    ``failures`` maps a rank to the number of steps it completes before leaving (it takes
    no part in step ``failures[rank] + 1`` or later, 1-based). ``stragglers`` maps a rank
    to how many times longer its compute takes than a normal node's (>= 1). ``work`` maps a
    rank to its samples per step relative to ``batch_size`` (``--balance``; 1 where absent).
    """

    failures: dict[int, int] = field(default_factory=dict)
    stragglers: dict[int, float] = field(default_factory=dict)
    work: dict[int, float] = field(default_factory=dict)

    def compute_factor(self, rank: int) -> float:
        """How many normal steps' compute ``rank`` takes a step: its slowdown times its work."""
        return self.stragglers.get(rank, 1.0) * self.work.get(rank, 1.0)

    def __bool__(self) -> bool:
        return bool(self.failures or self.stragglers)

    def alive(self, rank: int, step: int) -> bool:
        """Whether ``rank`` takes part in 0-based loop step ``step``."""
        leaves = self.failures.get(rank)
        return leaves is None or step < leaves

    def alive_at(self, step: int, nodes: int) -> list[int]:
        """The ranks that take part in 0-based loop step ``step`` (``step >= steps``: the final
        sync after the last step)."""
        return [r for r in range(nodes) if self.alive(r, step)]

    def slowdown_at(self, step: int, nodes: int) -> float:
        """How many normal steps' time step ``step`` takes: its slowest alive node's factor."""
        return max((self.compute_factor(r) for r in self.alive_at(step, nodes)), default=1.0)

    def idle_factor_at(self, step: int, nodes: int) -> float:
        """Node-steps the alive nodes spend waiting for the slowest at ``step``:
        ``sum_i (max_slowdown - slowdown_i)`` over alive nodes i (each times its work)."""
        slowest = self.slowdown_at(step, nodes)
        return sum(slowest - self.compute_factor(r) for r in self.alive_at(step, nodes))

    def to_dict(self) -> dict[str, Any]:
        """The plan as summary.json records it (ranks as text: JSON keys)."""
        return {
            "failures": [{"node": r, "step": s} for r, s in sorted(self.failures.items())],
            "stragglers": [{"node": r, "slowdown": x} for r, x in sorted(self.stragglers.items())],
        }


def parse_faults(fail: Sequence[str], straggler: Sequence[str], nodes: int,
                 steps: int | None) -> FaultPlan:
    """Read the ``--fail`` and ``--straggler`` values (``node=2,step=150``,
    ``node=1,slowdown=3``) for a run of ``nodes`` nodes and ``steps`` steps (None: not
    known yet, as with ``epochs``; :func:`check_steps` checks later).

    Raises :class:`FaultError` naming the flag, the value and what is wrong.
    """
    plan = FaultPlan()
    for text in fail:
        values = _pairs("--fail", text, ("node", "step"))
        node = _node("--fail", text, values["node"], nodes)
        if node == 0:
            raise FaultError(f"--fail {text}: node 0 cannot fail (it writes the run directory "
                             "and holds the global model); pick a node from 1 to "
                             f"{nodes - 1}")
        if node in plan.failures:
            raise FaultError(f"--fail {text}: node {node} already fails at step "
                             f"{plan.failures[node]}")
        step = _whole("--fail", text, "step", values["step"])
        plan.failures[node] = step
        check_steps(plan, steps)
    for text in straggler:
        values = _pairs("--straggler", text, ("node", "slowdown"))
        node = _node("--straggler", text, values["node"], nodes)
        if node in plan.stragglers:
            raise FaultError(f"--straggler {text}: node {node} is already a straggler")
        try:
            slowdown = float(values["slowdown"])
        except ValueError:
            slowdown = math.nan
        if not (math.isfinite(slowdown) and slowdown >= 1):
            raise FaultError(f"--straggler {text}: slowdown must be a number >= 1 (how many times "
                             f"slower than the other nodes), got {values['slowdown']!r}")
        plan.stragglers[node] = slowdown
    return plan


def check_steps(plan: FaultPlan, steps: int | None) -> None:
    """Every failure must leave at least one step before it and one after it."""
    for node, step in plan.failures.items():
        if step < 1 or (steps is not None and step > steps - 1):
            upper = "the run's steps - 1" if steps is None else str(steps - 1)
            raise FaultError(f"--fail node={node},step={step}: step must be from 1 to {upper} "
                             "(the node takes that many steps, then leaves)")


def _pairs(flag: str, text: str, keys: tuple[str, ...]) -> dict[str, str]:
    """``a=1,b=2`` as a dict; every key of ``keys`` exactly once, nothing else."""
    values: dict[str, str] = {}
    for part in text.split(","):
        key, sep, value = part.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not key or not value:
            raise FaultError(f"{flag} {text}: expected {','.join(k + '=...' for k in keys)}, "
                             f"got {part.strip()!r}")
        if key not in keys:
            raise FaultError(f"{flag} {text}: unknown key {key!r} (expected {', '.join(keys)})")
        if key in values:
            raise FaultError(f"{flag} {text}: {key} is given twice")
        values[key] = value
    missing = [k for k in keys if k not in values]
    if missing:
        raise FaultError(f"{flag} {text}: missing {missing[0]}=...")
    return values


def _whole(flag: str, text: str, key: str, value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise FaultError(f"{flag} {text}: {key} must be a whole number, got {value!r}") from None


def _node(flag: str, text: str, value: str, nodes: int) -> int:
    node = _whole(flag, text, "node", value)
    if not 0 <= node < nodes:
        raise FaultError(f"{flag} {text}: node {node} is out of range for --nodes {nodes} "
                         f"(nodes are 0 to {nodes - 1})")
    return node
