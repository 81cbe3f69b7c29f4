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
from dataclasses import Field, dataclass, field, fields
from typing import Any, Union

from meshtrain.cluster import get_cluster
from meshtrain.errors import SettingError
from meshtrain.faults import FaultError, FaultPlan, parse_faults

RUNTIMES = ("threads", "processes", "launched", "vmap")  # meshtrain.engine.runtimes.RUNNERS (tested)
RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
#: Most intra-op threads a node may ask for: more than any machine meshtrain runs on has
#: cores, and far below what exhausts memory when torch creates the pool (100000 did).
MAX_THREADS = 1024
#: The largest seed: torch's generators take up to 2**64 - 1, and the tasks add small offsets.
MAX_SEED = 2**63 - 1
PRECISIONS = ("fp32", "bf16", "fp16")
#: The range of every whole-number setting that gives no tighter one: int64's, what torch's
#: counters and tensors hold (``--steps 99999999999999999999999`` was taken, and ran until killed).
MAX_INT, MIN_INT = 2**63 - 1, -(2**63)


def check_run_id(run_id: str, where: str = "run id") -> str:
    """``run_id`` if it is a safe name (letters, digits, ``.``, ``_``, ``-``; not starting
    with ``.`` or ``-``; at most 128 characters): it becomes a folder name here and on
    every host. Raises :class:`SettingError` naming ``where``."""
    if not isinstance(run_id, str) or not RUN_ID.match(run_id):
        raise SettingError(f"{where} {run_id!r}: use letters, digits, '.', '_' and '-' "
                           "(not starting with '.' or '-'), at most 128 characters")
    return run_id


#: The commands a setting's flag can belong to.
COMMANDS = ("simulate", "launch", "compare")
#: Help panels of the training commands, in the order ``--help`` shows them.
WHAT, CLUSTER, OUTPUT, LONG_RUNS = "What to train", "The simulated cluster", "Output", "Long runs"
#: The one panel of a command with few options.
OPTIONS = "Options"
BOTH, ALL = ("simulate", "launch"), COMMANDS


@dataclass(frozen=True)
class Flag:
    """How a setting is given on the command line: the CLI builds its options from these.

    ``names`` are the flag and its short form (``("--nodes", "-n")``); a bool setting
    names its on and off forms in one (``"--check-sync/--no-check-sync"``). ``commands``
    are the commands that take it; ``help`` replaces the setting's help in one command
    where the flag means something more there (``launch --threads`` overrides the
    inventory's), and ``panels`` its help panel in one command (``up`` groups the options
    of its ``hosts setup`` step under a panel of their own).
    """

    names: tuple[str, ...]
    panel: str
    commands: tuple[str, ...] = ("simulate",)
    metavar: str | None = None
    help: tuple[tuple[str, str], ...] = ()
    panels: tuple[tuple[str, str], ...] = ()

    def help_in(self, command: str, setting_help: str) -> str:
        """The flag's help text in ``command``."""
        return dict(self.help).get(command, setting_help)

    def panel_in(self, command: str) -> str:
        """The help panel the flag is shown under in ``command``."""
        return dict(self.panels).get(command, self.panel)


#: What a resumed run may do with a setting; every setting's definition says which
#: (``on_resume=``), and :mod:`meshtrain.config.resume` enforces it for ``Trainer.fit``
#: and the CLI alike.
#:
#: KEEP: part of what is trained (the model, data order, optimizer, strategy): a change
#: would continue another run from this one's state, so it is refused. The default: a
#: setting that does not say is kept, so a new one is safe until someone decides otherwise.
KEEP = "keep"
#: MAY_CHANGE: how or where the run runs, checkpoints or logs; the state it continues
#: from means the same whatever the value (threads, device, runtime, validation, output).
MAY_CHANGE = "may change"
#: AT_LEAST_STEP: may change, but not below the checkpoint's step (``steps``).
AT_LEAST_STEP = "at least the checkpoint's step"
ON_RESUME = (KEEP, MAY_CHANGE, AT_LEAST_STEP)


def on_resume(setting_field: Field[Any]) -> str:
    """What a resumed run may do with the setting ``setting_field`` (one of ON_RESUME);
    KEEP where its definition does not say."""
    return str(setting_field.metadata.get("on_resume", KEEP))


def setting(default: Any, help: str, *, minimum: float | None = None, above: float | None = None,
             maximum: float | None = None, choices: tuple[str, ...] | None = None,
             factory: Any = None, flag: Flag | None = None, on_resume: str = KEEP) -> Any:
    """A dataclass field carrying the setting's help text, limits, command-line flag
    (none: given by a profile or ``--set`` only) and what a resumed run may do with it
    (``on_resume``: KEEP unless said, see ON_RESUME)."""
    if on_resume not in ON_RESUME:
        raise ValueError(f"on_resume must be one of {ON_RESUME}, got {on_resume!r}")
    meta = {"help": help, "minimum": minimum, "above": above, "maximum": maximum, "choices": choices,
            "flag": flag, "on_resume": on_resume}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class TrainConfig:
    """Everything about a run except the model, the data and the strategy."""

    nodes: int = setting(4, "Number of nodes (simulated, or ranks of a launch).", minimum=1,
                      flag=Flag(("--nodes", "-n"), CLUSTER, ("simulate", "compare")), on_resume=MAY_CHANGE)
    steps: int | None = setting(None, "Training steps; each node takes one batch a step "
                                       "(default 100 when epochs is not given).", minimum=1,
                                flag=Flag(("--steps",), WHAT, ALL), on_resume=AT_LEAST_STEP)
    epochs: float | None = setting(None, "Train for this many passes over the smallest node's "
                                          "data instead of a number of steps.", above=0,
                                  flag=Flag(("--epochs",), WHAT), on_resume=MAY_CHANGE)
    batch_size: int = setting(32, "Batch size per node.", minimum=1,
                                flag=Flag(("--batch-size", "-b"), WHAT, BOTH), on_resume=KEEP)
    microbatch_size: int | None = setting(None, "Accumulate gradients in pieces of this size.",
                                           minimum=1, flag=Flag(("--microbatch-size",), WHAT, BOTH),
                                           on_resume=KEEP)
    seed: int = setting(0, "Seed of weights, data order and shared random choices (0 to 2**63 - 1).",
                         minimum=0, maximum=MAX_SEED, flag=Flag(("--seed",), WHAT, ALL), on_resume=KEEP)
    device: str = setting("cpu", "cpu, cuda, mps or auto.", flag=Flag(("--device",), CLUSTER, BOTH),
    on_resume=MAY_CHANGE)
    precision: str = setting("fp32", "Forward-pass precision: fp32, or bf16/fp16 autocast (mixed "
                                     "precision: less memory for activations; weights, gradients "
                                     "and what nodes send stay fp32). bf16 runs on cpu and recent "
                                     "GPUs, fp16 on cuda and mps only (with loss scaling).",
                             choices=PRECISIONS, flag=Flag(("--precision",), WHAT, BOTH),
                             on_resume=MAY_CHANGE)
    gradient_checkpointing: bool = setting(False, "Recompute activations in the backward pass "
                                                  "instead of keeping them: less memory, more "
                                                  "compute (each layer's forward runs twice; "
                                                  "Hugging Face models and the gpt task).",
                                           flag=Flag(("--gradient-checkpointing/--no-gradient-checkpointing",),
                                                     WHAT, BOTH), on_resume=MAY_CHANGE)
    runtime: str = setting("threads", "Where simulated nodes live: threads (fast), processes "
                                      "(one process per node over gloo) or vmap (every node in one "
                                      "vectorised computation; DDP, DiLoCo, SPARTA, FedAvg).",
                           choices=RUNTIMES, flag=Flag(("--runtime",), CLUSTER), on_resume=MAY_CHANGE)
    threads: int | None = setting(None, "Torch intra-op threads per node (default: 1 per simulated "
                                         "node, a launched rank's cores shared by the ranks on its "
                                         "machine; MESHTRAIN_THREADS "
                                         "sets it too). Runs are bit-identical only at the same "
                                         f"thread count. At most {MAX_THREADS}.", minimum=1,
                                 maximum=MAX_THREADS, flag=Flag(("--threads",), CLUSTER, BOTH, help=(
                                     ("launch", "Torch intra-op threads of every rank (overrides the "
                                                "inventory's 'threads'; default: each host's cores, "
                                                "shared by the ranks on it)."),)), on_resume=MAY_CHANGE)
    concurrent_nodes: int | None = setting(None, "Threads runtime: how many nodes compute at "
                                                  "once (default: the cores this process may use "
                                                  "divided by threads). Each node's Python waits "
                                                  "its turn instead of contending for the "
                                                  "interpreter lock; 1 runs the nodes one after "
                                                  "another, as a plain loop would.", minimum=1,
                                           flag=Flag(("--concurrent-nodes",), CLUSTER), on_resume=MAY_CHANGE)
    shuffle: bool = setting(True, "Reshuffle each node's shard every epoch (seeded).", on_resume=KEEP)
    val_interval: int | None = setting(None, "Evaluate the global model every N steps.", minimum=1,
                                     flag=Flag(("--val-interval",), OUTPUT, BOTH), on_resume=MAY_CHANGE)
    val_size: int | None = setting(None, "Evaluate on at most this many validation samples.",
                                    minimum=1, on_resume=MAY_CHANGE)
    out_dir: str = setting("runs", "Where run directories go.", flag=Flag(("--out",), OUTPUT, ALL, help=(
        ("launch", "Local folder for rank 0's run directory (default: runs)."),
        ("compare", "Folder that gets the compare-<time> folder (default: runs)."))), on_resume=MAY_CHANGE)
    run_id: str | None = setting(None, "Name of the run directory (letters, digits, . _ -).",
                                 flag=Flag(("--run-id",), OUTPUT, BOTH), on_resume=MAY_CHANGE)
    progress: bool = setting(True, "Show a progress bar (plain lines when not a terminal).",
                              flag=Flag(("--progress/--no-progress",), OUTPUT, ALL, help=(
                                  ("launch", "Progress lines from rank 0."),
                                  ("compare", "Progress bar of each run."))), on_resume=MAY_CHANGE)
    timeout_s: float = setting(1800.0, "Seconds a collective may wait before the run fails.",
                                above=0, on_resume=MAY_CHANGE)
    cluster: str = setting("gbe", "Project wall-clock on this named cluster "
                                   "(`meshtrain clusters` lists them).",
                           flag=Flag(("--cluster",), CLUSTER, ("simulate", "compare")), on_resume=MAY_CHANGE)
    step_seconds: float | None = setting(None, "A node's compute per step on that cluster, if "
                                                "known (default: measured here).", above=0,
                                        flag=Flag(("--step-seconds",), CLUSTER), on_resume=MAY_CHANGE)
    checkpoint_every: int | None = setting(None, "Write a checkpoint every N steps (DiLoCo-like "
                                                   "strategies: rounded up to a multiple of H, so "
                                                   "it follows an outer sync).", minimum=1,
                                           flag=Flag(("--checkpoint-every",), LONG_RUNS, BOTH, help=(
                                               ("launch", "Every rank checkpoints its state every N "
                                                          "steps into its host's workdir "
                                                          "(runs/RUN-ID.checkpoints/)."),)),
                                                          on_resume=MAY_CHANGE)
    keep_checkpoints: int = setting(2, "How many of the newest checkpoints to keep.", minimum=1,
                                   flag=Flag(("--keep",), LONG_RUNS, BOTH, help=(
                                       ("launch", "Checkpoints each host keeps (default 2)."),)),
                                       on_resume=MAY_CHANGE)
    resume: str | None = setting(None, "Continue a stopped run from its newest intact checkpoint "
                                        "(its <run-id>.checkpoints folder or run directory; its settings "
                                        "come from there).",
                                flag=Flag(("--resume",), LONG_RUNS, BOTH, help=(
                                    ("launch", "Continue the launch RUN-ID from the newest checkpoint "
                                               "every host holds (give the same inventory and flags)."),)),
                                               on_resume=MAY_CHANGE)
    check_sync: bool = setting(False, "After every sync, verify by a hash all-gather that the "
                                       "nodes hold the identical parameters the strategy promises "
                                       "(DDP, DeMo: all; DiLoCo: the outer ones; FedAvg: each "
                                       "island); a difference stops the run naming the nodes.",
                              flag=Flag(("--check-sync/--no-check-sync",), LONG_RUNS), on_resume=MAY_CHANGE)
    skip_nonfinite: bool = setting(False, "When a loss or gradient is NaN or infinite on any node, "
                                           "skip that step on every node (counted in metrics) "
                                           "instead of stopping the run.",
                                  flag=Flag(("--skip-nonfinite/--stop-on-nonfinite",), LONG_RUNS),
                                  on_resume=MAY_CHANGE)
    wandb: str | None = setting(None, "Also log to Weights & Biases, in this project (rank 0: loss, "
                                       "bytes, validation, summary; needs pip install "
                                       "'meshtrain[wandb]'; WANDB_MODE=offline logs locally).",
                              flag=Flag(("--wandb",), OUTPUT, metavar="PROJECT"), on_resume=MAY_CHANGE)
    tensorboard: bool = setting(False, "Also write TensorBoard event files into <run>/tensorboard/ "
                                        "(the numbers of metrics.csv; needs pip install "
                                        "'meshtrain[tensorboard]').",
                                flag=Flag(("--tensorboard/--no-tensorboard",), OUTPUT), on_resume=MAY_CHANGE)
    fail: list[str] | str = setting(None, "Simulate a node leaving: node=2,step=150 makes node 2 take "
                                     "150 steps, then stop; the others go on without it "
                                     "(repeatable; simulate only; node 0 cannot fail).",
                               factory=list, flag=Flag(("--fail",), CLUSTER, metavar="node=N,step=S"),
                               on_resume=MAY_CHANGE)
    straggler: list[str] | str = setting(None, "Project a slow node: node=1,slowdown=3 makes node 1's "
                                          "compute 3x longer in the projected timeline, the others "
                                          "waiting for it (repeatable; simulate only).",
                                    factory=list,
                                    flag=Flag(("--straggler",), CLUSTER, metavar="node=N,slowdown=X"),
                                    on_resume=MAY_CHANGE)
    balance: bool = setting(False, "Give each node a share of every step's samples in proportion "
                                   "to its throughput (launch: measured by warm-up passes; simulate: "
                                   "1/slowdown of --straggler). The global batch stays nodes x "
                                   "batch_size and every average is weighted by samples (see "
                                   "meshtrain.engine.balance).",
                            flag=Flag(("--balance/--no-balance",), WHAT, BOTH), on_resume=KEEP)
    extra_config: dict[str, Any] = setting(None, "Recorded in config.yaml as given.", factory=dict,
    on_resume=MAY_CHANGE)

    def validate(self) -> None:
        """Check every setting and the rules between them; raise :class:`SettingError`."""
        check_settings(type(self), {f.name: getattr(self, f.name) for f in fields(self)}, "")
        if self.steps is not None and self.epochs is not None:
            raise SettingError("give steps or epochs, not both")
        if self.microbatch_size is not None and self.microbatch_size > self.batch_size:
            raise SettingError(f"microbatch_size ({self.microbatch_size}) must not exceed "
                               f"batch_size ({self.batch_size})")
        if self.concurrent_nodes is not None and self.runtime != "threads":
            raise SettingError(f"concurrent_nodes applies to the threads runtime only, not to "
                               f"runtime {self.runtime!r}")
        if self.run_id is not None:
            check_run_id(self.run_id)
        get_cluster(self.cluster)
        plan = self.fault_plan()
        if self.balance and (plan.failures or self.resume):
            raise SettingError("balance cannot be combined with --fail or --resume yet: the shares "
                               "are measured at the start of a run and not kept in checkpoints")

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


def check_flag(cls: type, name: str, value: Any) -> None:
    """``value`` of setting ``name`` of dataclass ``cls``, given by its flag: checked by the
    setting's own rule, the error naming the flag (``--threads must be >= 1, got 0``)."""
    field_ = next(f for f in fields(cls) if f.name == name)
    check_value(field_.metadata["flag"].names[0].partition("/")[0], value,
                typing.get_type_hints(cls)[name], field_.metadata)


Options = typing.TypeVar("Options")


def from_flags(cls: type[Options], given: dict[str, Any]) -> Options:
    """A command's options (dataclass ``cls``) from the values its flags gave (None: not
    given, the default), each checked by its own rule; a :class:`SettingError` names the flag."""
    values = {k: v for k, v in given.items() if v is not None}
    for name, value in values.items():
        check_flag(cls, name, value)
    return cls(**values)


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
    # Text is never empty but where a setting says so: `--resume "$RUN"` with RUN unset must
    # not train from scratch, nor `--out ""` write into the current folder.
    texts = value if isinstance(value, list) else [value]  # a repeatable flag: each value
    if any(isinstance(t, str) and not t.strip() for t in texts) and not meta.get("may_be_empty"):
        raise SettingError(f"{label} must not be empty")
    if isinstance(value, float) and not math.isfinite(value):
        raise SettingError(f"{label} must be a finite number, got {value!r}")
    if isinstance(value, int) and not isinstance(value, bool) and meta.get("maximum") is None \
            and value > MAX_INT:
        raise SettingError(f"{label} must be <= {MAX_INT}, got {value!r}")
    if isinstance(value, int) and not isinstance(value, bool) and meta.get("minimum") is None \
            and value < MIN_INT:
        raise SettingError(f"{label} must be >= {MIN_INT}, got {value!r}")
    if meta.get("minimum") is not None and value < meta["minimum"]:
        raise SettingError(f"{label} must be >= {_limit(meta['minimum'])}, got {value!r}")
    if meta.get("maximum") is not None and value > meta["maximum"]:
        raise SettingError(f"{label} must be <= {_limit(meta['maximum'])}, got {value!r}")
    if meta.get("above") is not None and value <= meta["above"]:
        raise SettingError(f"{label} must be > {_limit(meta['above'])}, got {value!r}")
    if meta.get("choices") and value not in meta["choices"]:
        raise SettingError(f"{label} must be one of {', '.join(meta['choices'])}; got {value!r}")


def _limit(bound: float) -> str:
    """A limit as written: integers in full (a seed's 9223372036854775807, not 9.22337e+18)."""
    return str(bound) if isinstance(bound, int) else f"{bound:g}"


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
