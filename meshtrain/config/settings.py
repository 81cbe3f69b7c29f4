"""Every training setting, defined once: its type, default, limits and help text.

:class:`TrainConfig` is the single definition. ``Trainer.fit`` builds one from its
keyword arguments, the CLI takes its flags' help from :func:`help_for`, and profiles and
``--set`` go through :func:`check_settings`, so a setting has one default and one rule
wherever it is given. A bad value raises :class:`SettingError` naming where it came from
(``--set steps``, ``profile fast.yaml: steps``) and what is wrong.
"""

from __future__ import annotations

import math
import re
import types
import typing
from dataclasses import dataclass, field, fields
from typing import Any, Union

from meshtrain.cluster import get_cluster
from meshtrain.errors import SettingError
from meshtrain.faults import FaultError, FaultPlan, parse_faults

RUNTIMES = ("threads", "processes", "launched")
RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
#: Most intra-op threads a node may ask for: more than any machine meshtrain runs on has
#: cores, and far below what exhausts memory when torch creates the pool (100000 did).
MAX_THREADS = 1024
PRECISIONS = ("fp32", "bf16", "fp16")


def check_run_id(run_id: str, where: str = "run id") -> str:
    """``run_id`` if it is a safe name (letters, digits, ``.``, ``_``, ``-``; not starting
    with ``.`` or ``-``; at most 128 characters): it becomes a folder name here and on
    every host. Raises :class:`SettingError` naming ``where``."""
    if not isinstance(run_id, str) or not RUN_ID.match(run_id):
        raise SettingError(f"{where} {run_id!r}: use letters, digits, '.', '_' and '-' "
                           "(not starting with '.' or '-'), at most 128 characters")
    return run_id


def _setting(default: Any, help: str, *, minimum: float | None = None, above: float | None = None,
             maximum: float | None = None, choices: tuple[str, ...] | None = None,
             factory: Any = None) -> Any:
    """A dataclass field carrying the setting's help text and limits."""
    meta = {"help": help, "minimum": minimum, "above": above, "maximum": maximum, "choices": choices}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class TrainConfig:
    """Everything about a run except the model, the data and the strategy."""

    nodes: int = _setting(4, "Number of nodes (simulated, or ranks of a launch).", minimum=1)
    steps: int | None = _setting(None, "Training steps; each node takes one batch a step "
                                       "(default 100 when epochs is not given).", minimum=1)
    epochs: float | None = _setting(None, "Train for this many passes over the smallest node's "
                                          "data instead of a number of steps.", above=0)
    batch_size: int = _setting(32, "Batch size per node.", minimum=1)
    microbatch_size: int | None = _setting(None, "Accumulate gradients in pieces of this size.",
                                           minimum=1)
    seed: int = _setting(0, "Seed of weights, data order and shared random choices.")
    device: str = _setting("cpu", "cpu, cuda, mps or auto.")
    precision: str = _setting("fp32", "Forward-pass precision: fp32, or bf16/fp16 autocast (mixed "
                                      "precision: less memory for activations; weights, gradients "
                                      "and what nodes send stay fp32). bf16 runs on cpu and recent "
                                      "GPUs, fp16 on cuda and mps only (with loss scaling).",
                              choices=PRECISIONS)
    gradient_checkpointing: bool = _setting(False, "Recompute activations in the backward pass "
                                                   "instead of keeping them: less memory, more "
                                                   "compute (each layer's forward runs twice; "
                                                   "Hugging Face models and the gpt task).")
    runtime: str = _setting("threads", "Where simulated nodes live: threads (fast) or processes "
                                       "(one process per node over gloo).", choices=RUNTIMES)
    threads: int | None = _setting(None, "Torch intra-op threads per node (default: 1 per simulated "
                                         "node, every core on a launched rank; MESHTRAIN_THREADS "
                                         "sets it too). Runs are bit-identical only at the same "
                                         f"thread count. At most {MAX_THREADS}.", minimum=1,
                                 maximum=MAX_THREADS)
    shuffle: bool = _setting(True, "Reshuffle each node's shard every epoch (seeded).")
    val_interval: int | None = _setting(None, "Evaluate the global model every N steps.", minimum=1)
    val_size: int | None = _setting(None, "Evaluate on at most this many validation samples.",
                                    minimum=1)
    out_dir: str = _setting("runs", "Where run directories go.")
    run_id: str | None = _setting(None, "Name of the run directory (letters, digits, . _ -).")
    progress: bool = _setting(True, "Show a progress bar (plain lines when not a terminal).")
    timeout_s: float = _setting(1800.0, "Seconds a collective may wait before the run fails.",
                                above=0)
    cluster: str = _setting("gbe", "Project wall-clock on this named cluster "
                                   "(`meshtrain clusters` lists them).")
    step_seconds: float | None = _setting(None, "A node's compute per step on that cluster, if "
                                                "known (default: measured here).", above=0)
    checkpoint_every: int | None = _setting(None, "Write a checkpoint every N steps (DiLoCo-like "
                                                   "strategies: rounded up to a multiple of H, so "
                                                   "it follows an outer sync).", minimum=1)
    keep_checkpoints: int = _setting(2, "How many of the newest checkpoints to keep.", minimum=1)
    resume: str | None = _setting(None, "Continue a stopped run from its newest intact checkpoint "
                                        "(its <run-id>.checkpoints folder or run directory).")
    check_sync: bool = _setting(False, "After every sync, verify by a hash all-gather that the "
                                       "nodes hold the identical parameters the strategy promises "
                                       "(DDP, DeMo: all; DiLoCo: the outer ones; FedAvg: each "
                                       "island); a difference stops the run naming the nodes.")
    skip_nonfinite: bool = _setting(False, "When a loss or gradient is NaN or infinite on any node, "
                                           "skip that step on every node (counted in metrics) "
                                           "instead of stopping the run.")
    wandb: str | None = _setting(None, "Also log to Weights & Biases, in this project (rank 0: loss, "
                                       "bytes, validation, summary; needs pip install "
                                       "'meshtrain[wandb]'; WANDB_MODE=offline logs locally).")
    tensorboard: bool = _setting(False, "Also write TensorBoard event files into <run>/tensorboard/ "
                                        "(the numbers of metrics.csv; needs pip install "
                                        "'meshtrain[tensorboard]').")
    fail: list[str] | str = _setting(None, "Simulate a node leaving: node=2,step=150 makes node 2 take "
                                     "150 steps, then stop; the others go on without it "
                                     "(repeatable; simulate only; node 0 cannot fail).",
                               factory=list)
    straggler: list[str] | str = _setting(None, "Project a slow node: node=1,slowdown=3 makes node 1's "
                                          "compute 3x longer in the projected timeline, the others "
                                          "waiting for it (repeatable; simulate only).",
                                    factory=list)
    extra_config: dict[str, Any] = _setting(None, "Recorded in config.yaml as given.", factory=dict)

    def validate(self) -> None:
        """Check every setting and the rules between them; raise :class:`SettingError`."""
        check_settings(type(self), {f.name: getattr(self, f.name) for f in fields(self)}, "")
        if self.steps is not None and self.epochs is not None:
            raise SettingError("give steps or epochs, not both")
        if self.microbatch_size is not None and self.microbatch_size > self.batch_size:
            raise SettingError(f"microbatch_size ({self.microbatch_size}) must not exceed "
                               f"batch_size ({self.batch_size})")
        if self.run_id is not None:
            check_run_id(self.run_id)
        get_cluster(self.cluster)
        self.fault_plan()

    def fault_plan(self) -> FaultPlan:
        """The simulated faults of ``fail`` and ``straggler``, checked against the run."""
        given: dict[str, list[Any]] = {}
        for name in ("fail", "straggler"):
            values = getattr(self, name)
            # One fault may be one text (--set fail=node=2,step=5), several a list.
            given[name] = [values] if isinstance(values, str) else list(values)
            for value in given[name]:
                if not isinstance(value, str):
                    raise FaultError(f"--{name} must be given as text like "
                                     f"{'node=2,step=150' if name == 'fail' else 'node=1,slowdown=3'}"
                                     f", got {value!r}")
        plan = parse_faults(given["fail"], given["straggler"], self.nodes, self.steps)
        if plan and self.runtime == "launched":
            raise FaultError("--fail and --straggler simulate faults: use them with meshtrain "
                             "simulate (threads or processes), not in a launched run")
        if plan.failures and (self.checkpoint_every or self.resume):
            raise FaultError("--fail cannot be combined with --checkpoint-every or --resume")
        return plan


def help_for(name: str, cls: type = TrainConfig) -> str:
    """The help text of setting ``name`` (for CLI flags)."""
    return next(f.metadata["help"] for f in fields(cls) if f.name == name)


def check_settings(cls: type, values: dict[str, Any], where: str) -> None:
    """Check ``values`` against the types and limits of dataclass ``cls``'s fields.

    ``where`` prefixes error messages (e.g. ``"profile fast.yaml: "``). Unknown names
    are errors too.
    """
    hints = typing.get_type_hints(cls)
    known = {f.name: f for f in fields(cls)}
    for name, value in values.items():
        if name not in known:
            raise SettingError(f"{where}unknown setting {name!r}")
        check_value(f"{where}{name}", value, hints[name], known[name].metadata)


def check_value(label: str, value: Any, annotation: Any, meta: Any = None) -> None:
    """One value against its annotation (int, float, bool, str, dict, ``X | None``) and limits."""
    meta = meta or {}
    allowed = _types_of(annotation)
    if value is None:
        if type(None) not in allowed:
            raise SettingError(f"{label} must be given, got nothing")
        return
    if not _is_instance(value, allowed):
        names = " or ".join(_type_name(t) for t in allowed if t is not type(None))
        raise SettingError(f"{label} must be {names}, got {value!r}")
    if isinstance(value, float) and not math.isfinite(value):
        raise SettingError(f"{label} must be a finite number, got {value!r}")
    if meta.get("minimum") is not None and value < meta["minimum"]:
        raise SettingError(f"{label} must be >= {meta['minimum']:g}, got {value!r}")
    if meta.get("maximum") is not None and value > meta["maximum"]:
        raise SettingError(f"{label} must be <= {meta['maximum']:g}, got {value!r}")
    if meta.get("above") is not None and value <= meta["above"]:
        raise SettingError(f"{label} must be > {meta['above']:g}, got {value!r}")
    if meta.get("choices") and value not in meta["choices"]:
        raise SettingError(f"{label} must be one of {', '.join(meta['choices'])}; got {value!r}")


def _types_of(annotation: Any) -> tuple[type, ...]:
    origin = typing.get_origin(annotation)
    if origin in (Union, types.UnionType):
        return tuple(t for a in typing.get_args(annotation) for t in _types_of(a))
    if origin is not None:
        return (origin,)
    return (annotation,)


def _is_instance(value: Any, allowed: tuple[type, ...]) -> bool:
    if isinstance(value, bool):  # YAML's true is not a number
        return bool in allowed
    if isinstance(value, int) and float in allowed:
        return True
    return isinstance(value, tuple(t for t in allowed if t is not Any))


def _type_name(t: type) -> str:
    return {int: "a whole number", float: "a number", bool: "true or false", str: "text",
            dict: "a mapping (key: value)", list: "a list"}.get(t, t.__name__)
