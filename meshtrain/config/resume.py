"""What a resumed run may change, and why another change is refused."""

from __future__ import annotations

from typing import Any

from meshtrain.config.spec import RunSpec

#: Settings a resumed run may change: how far it goes (steps upward), where and how it
#: logs, how it runs here. Any other change would continue a different run from this
#: one's state (another strategy's optimizer, another task's weights) and is refused.
RESUMABLE = ("steps", "epochs", "description", "data", "nodes", "device", "runtime", "threads",
             "val_interval", "val_size", "out_dir", "progress", "timeout_s", "cluster",
             "step_seconds", "checkpoint_every", "keep_checkpoints", "check_sync",
             "skip_nonfinite", "wandb", "tensorboard", "fail", "straggler", "precision",
             "gradient_checkpointing")


def resume_conflict(saved: dict[str, Any], spec: RunSpec, step: int) -> str | None:
    """Why ``spec`` cannot continue the run whose settings were ``saved`` from its
    checkpoint after ``step`` steps, or None. ``nodes`` is checked by the trainer (fewer
    is allowed for some strategies) and ``data`` is a path (its contents are not known)."""
    now = spec.to_dict()
    for key in RunSpec.field_names():
        if key in RESUMABLE or key not in saved:
            continue
        if _comparable(saved[key]) != _comparable(now.get(key)):
            return (f"{key} was {saved[key]!r} in the checkpointed run, now {now.get(key)!r}; a "
                    f"resumed run keeps its settings (it may change: steps upward, logging, threads, "
                    "device and other settings of how it runs)")
    # steps equal to the checkpoint's writes its global model without a further step.
    if spec.steps is not None and spec.steps < step:
        return (f"the checkpoint is at step {step}, past steps {spec.steps}; give --steps of "
                f"at least {step}")
    return None


def _comparable(value: Any) -> Any:
    """Numbers compare by value (1 and 1.0, 1e-3 and 0.001); containers element-wise."""
    if isinstance(value, dict):
        return {k: _comparable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_comparable(v) for v in value]
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    return value
