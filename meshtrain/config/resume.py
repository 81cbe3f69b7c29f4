"""What a resumed run may change, and why another change is refused.

Every setting's one definition says what a resume may do with it (``on_resume`` in
:mod:`meshtrain.config.settings`: KEEP, MAY_CHANGE or AT_LEAST_STEP; KEEP where it does
not say). This module applies those rules, for the library and the CLI alike:

- ``Trainer.fit(resume=...)`` checks its settings and its strategy's parameters against
  what the checkpoint recorded of its run (:func:`recorded_settings`, in every
  checkpoint's meta.json): :func:`fit_conflict`.
- ``simulate --resume`` and ``launch --resume`` check the whole run (task, data, strategy
  options) against its spec.yaml or settings file before building anything:
  :func:`resume_conflict`; the trainer then checks again as above.

A strategy's parameters are all kept: they are what is trained (the learning rates, H,
what is sent), whichever strategy adds them.
"""

from __future__ import annotations

import json
from dataclasses import fields
from typing import TYPE_CHECKING, Any

from meshtrain.config.settings import AT_LEAST_STEP, KEEP, TrainConfig, on_resume
from meshtrain.config.spec import RunSpec

if TYPE_CHECKING:
    from meshtrain.strategies import Strategy

#: Said after a refused change: what a resume may change instead.
RULE = ("a resumed run keeps its settings (it may change: steps upward, logging, threads, device and "
        "other settings of how it runs)")


def changed_setting(cls: type, saved: dict[str, Any], now: dict[str, Any]) -> str | None:
    """The first setting of dataclass ``cls`` that its definition keeps on resume and
    whose value ``now`` differs from the ``saved`` one ("lr was 0.1 in the checkpointed
    run, now 0.5"), or None. A setting ``saved`` does not hold is not compared (a
    checkpoint written before it existed)."""
    for f in fields(cls):
        if on_resume(f) != KEEP or f.name not in saved:
            continue
        if _comparable(saved[f.name]) != _comparable(now.get(f.name)):
            return f"{f.name} was {saved[f.name]!r} in the checkpointed run, now {now.get(f.name)!r}"
    return None


def below_step(cls: type, now: dict[str, Any], step: int) -> str | None:
    """Why a setting that must stay at least the checkpoint's ``step`` (``steps``) is
    below it, or None. ``steps`` equal to the checkpoint's writes its global model
    without a further step."""
    for f in fields(cls):
        value = now.get(f.name)
        if on_resume(f) == AT_LEAST_STEP and isinstance(value, int) and value < step:
            return (f"the checkpoint is at step {step}, past {f.name} {value}; give --{f.name} of at "
                    f"least {step}")
    return None


def resume_conflict(saved: dict[str, Any], spec: RunSpec, step: int) -> str | None:
    """Why ``spec`` cannot continue the run whose settings were ``saved`` (its spec.yaml
    or launch settings file) from its checkpoint after ``step`` steps, or None. ``nodes``
    is checked by the trainer (fewer is allowed for some strategies)."""
    now = spec.to_dict()
    changed = changed_setting(RunSpec, saved, now)
    if changed:
        return f"{changed}; {RULE}"
    return below_step(RunSpec, now, step)


def recorded_settings(config: TrainConfig, strategy: Strategy) -> dict[str, Any]:
    """What a checkpoint records of its run for a resume to be checked against: the
    training settings and the strategy's parameters, as JSON values."""
    train = {f.name: getattr(config, f.name) for f in fields(config) if f.name != "extra_config"}
    # A custom strategy's parameter may be anything: recorded as its text.
    recorded: dict[str, Any] = json.loads(json.dumps({"train": train, "strategy": strategy.config()},
                                                     default=str))
    return recorded


def fit_conflict(saved: dict[str, Any] | None, config: TrainConfig, strategy: Strategy,
                 step: int) -> str | None:
    """Why ``Trainer.fit`` with ``config`` and ``strategy`` cannot continue the checkpoint
    after ``step`` steps whose run recorded ``saved`` (:func:`recorded_settings`; None: a
    checkpoint that recorded nothing, where only the step is checked), or None."""
    now = recorded_settings(config, strategy)
    train, before = (saved or {}).get("train"), (saved or {}).get("strategy")
    if isinstance(train, dict):
        changed = changed_setting(type(config), train, now["train"])
        if changed:
            return f"{changed}; {RULE}"
    if isinstance(before, dict):
        after = now["strategy"]
        if before.get("name") != after.get("name"):
            return f"strategy was {before.get('name')!r} in the checkpointed run, now {after.get('name')!r}"
        for key in sorted(set(before) | set(after) - {"name"}):
            if _comparable(before.get(key)) != _comparable(after.get(key)):
                return (f"strategy parameter {key} was {before.get(key)!r} in the checkpointed run, now "
                        f"{after.get(key)!r}; {RULE}")
    return below_step(type(config), now["train"], step)


def _comparable(value: Any) -> Any:
    """Numbers compare by value (1 and 1.0, 1e-3 and 0.001); containers element-wise."""
    if isinstance(value, dict):
        return {k: _comparable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_comparable(v) for v in value]
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    return value
