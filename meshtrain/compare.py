"""Compare strategies under identical conditions: `meshtrain compare` and its library API.

Every strategy trains the same task with the same seed (so the same initial weights and
the same data order), nodes and step budget; only the strategy and its own options
differ. Each run is a normal run directory inside one comparison folder
(``runs/compare-<time>/<strategy>/``), next to ``comparison.json``, ``comparison.csv`` and
the plots of :mod:`meshtrain.plots`.

Every option is checked, and every run directory claimed, before the first run starts.

Steps to the target loss: the first validation at or below the target (so its resolution
is ``val_interval``). Default target: 1.05 x DDP's final validation loss when DDP is
compared, otherwise 1.05 x the lowest final validation loss among the runs.
"""

from __future__ import annotations

import csv
import importlib
import io
import json
import math
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from meshtrain.build import build_run  # the one resolution of settings layers
from meshtrain.config.spec import ConfigError, RunSpec
from meshtrain.config.strategy_options import strategy_class
from meshtrain.engine.trainer import Trainer, run_job
from meshtrain.plots import plot_runs
from meshtrain.run_dir import atomic_write_text
from meshtrain.runs import FinishedRun, load_run, strategy_label
from meshtrain.strategies import STRATEGIES

DEFAULT_STRATEGIES = ("ddp", "diloco", "sparta")

#: Options a strategy gets in a comparison on a task unless ``--set`` says otherwise, by task
#: then strategy. Tuned on digits (seeds 0-2, 300 steps) so that each method is run at a
#: setting where it gets close to DDP's loss: DiLoCo's outer momentum 0.8 (0.9 overshoots
#: with only 12 outer steps), SPARTA's lr 2e-3 (its local steps drift less than it gains).
COMPARE_DEFAULTS: dict[str, dict[str, list[str]]] = {
    "digits": {"diloco": ["outer_momentum=0.8"], "sparta": ["lr=0.002"],
               "streaming-diloco": ["outer_momentum=0.8"], "async-diloco": ["outer_momentum=0.8"]},
}

#: Default target: this factor times the reference (DDP's, else the best) final val loss.
TARGET_FACTOR = 1.05

#: Settings that a comparison decides itself: per run, they would break "identical conditions"
#: or the folder layout.
NOT_SHARED = ("strategy", "strategy_options", "out_dir", "run_id", "resume", "wandb")


@dataclass
class CompareSpec:
    """What to compare: the strategies, the settings every run shares, and ``overrides``,
    ``--set`` items: ``KEY=VALUE`` for every run, ``STRATEGY.KEY=VALUE`` (``diloco.H=50``)
    for one strategy's run.

    ``settings`` are RunSpec settings by name (``nodes``, ``task``, ``steps``, ``cluster``,
    ...), the layer a command's flags give (None: not given); a run's own defaults, its
    task's suggestions and ``--set`` resolve around them as for ``simulate``. Not mirrored
    here: the settings' one definition is :class:`~meshtrain.config.spec.RunSpec`.
    """

    strategies: list[str] = field(default_factory=lambda: list(DEFAULT_STRATEGIES))
    settings: dict[str, Any] = field(default_factory=dict)
    overrides: list[str] = field(default_factory=list)
    target_loss: float | None = None

    @property
    def out_dir(self) -> str:
        """The folder that gets the ``compare-<time>`` folder."""
        return str(self.settings.get("out_dir") or RunSpec.out_dir)


@dataclass
class PlannedRun:
    """One strategy's run, fully checked and built, not yet started."""

    strategy: str
    spec: RunSpec
    bundle: Any  # the task's TaskBundle
    instance: Any  # the Strategy


@dataclass
class Comparison:
    """A finished comparison: its folder, the runs read back, and one row per run."""

    folder: Path
    runs: list[FinishedRun]
    rows: list[dict[str, Any]]
    target_loss: float
    target_rule: str
    plots: list[Path]


def split_overrides(spec: CompareSpec) -> tuple[list[str], dict[str, list[str]]]:
    """``--set`` items as (shared, per strategy); :class:`ConfigError` naming a bad one.

    The per-strategy lists hold only what was given; :func:`plan` puts them after the
    shared items, which come after :data:`COMPARE_DEFAULTS` (later items win)."""
    shared: list[str] = []
    own: dict[str, list[str]] = {s: [] for s in spec.strategies}
    for item in spec.overrides:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE or STRATEGY.KEY=VALUE")
        head, dot, rest = key.strip().partition(".")
        if head in STRATEGIES:
            if head not in spec.strategies:
                raise ConfigError(f"--set {key}: {head!r} is not among --strategies "
                                  f"{','.join(spec.strategies)}")
            if not dot or not rest:
                raise ConfigError(f"--set {key}: name a parameter or setting, e.g. {head}.lr=0.01")
            own[head].append(f"{rest}={value}")
        elif head in NOT_SHARED:
            raise ConfigError(f"--set {key}: a comparison sets this itself; "
                              "use --strategies, --out or STRATEGY.KEY=VALUE")
        elif head not in RunSpec.field_names():
            raise ConfigError(f"--set {key}: not a setting shared by every run; for one strategy's "
                              f"parameter write STRATEGY.{key}=VALUE (e.g. diloco.H=50)")
        else:
            shared.append(item)
    return shared, own


def plan(spec: CompareSpec) -> list[PlannedRun]:
    """Check every option and build every run (task, model, strategy); nothing is written.

    Raises ``ValueError`` (:class:`ConfigError`, ``TaskError``) with one line naming the
    strategy, option or value at fault.
    """
    if not spec.strategies:
        raise ConfigError("--strategies: give at least one strategy, e.g. ddp,diloco")
    for name in spec.strategies:
        if spec.strategies.count(name) > 1:
            raise ConfigError(f"--strategies: {name!r} is given twice; compare a strategy with "
                              "itself by running compare twice with different --set")
        try:
            strategy_class(name)
        except ConfigError as exc:
            raise ConfigError(f"--strategies: {exc}") from None
    if spec.target_loss is not None and not (math.isfinite(spec.target_loss) and spec.target_loss > 0):
        raise ConfigError(f"--target-loss must be a positive number, got {spec.target_loss!r}")
    shared, own = split_overrides(spec)
    for key in spec.settings:
        if key not in RunSpec.field_names() and key != "progress":
            raise ConfigError(f"unknown setting {key!r}")
        if key in NOT_SHARED and key != "out_dir":
            raise ConfigError(f"{key}: a comparison sets this itself; use --strategies or "
                              "STRATEGY.KEY=VALUE")
    planned = []
    for name in spec.strategies:
        flags = {**spec.settings, "strategy": name, "out_dir": spec.out_dir}
        defaults = COMPARE_DEFAULTS.get(_task_of(spec, shared), {}).get(name, [])
        try:
            run_spec, bundle, instance = build_run(flags, [*defaults, *shared, *own[name]], launched=False)
        except ValueError as exc:  # name the run unless the message does already
            raise type(exc)(str(exc) if f"'{name}'" in str(exc) else f"{name}: {exc}") from None
        if run_spec.runtime == "launched":
            raise ConfigError("--set runtime=launched: compare simulates; use threads or processes")
        if bundle.val_data is None:
            raise ConfigError(f"task {run_spec.task!r} has no validation data to compare losses on")
        planned.append(PlannedRun(name, run_spec, bundle, instance))
    return planned


def _task_of(spec: CompareSpec, shared: list[str]) -> str:
    """The task the runs train: a shared ``--set task=...`` wins over ``--task``."""
    for item in reversed(shared):
        key, _, value = item.partition("=")
        if key.strip() == "task":
            return value.strip()
    return spec.settings.get("task") or RunSpec.task


def claim_folder(out_dir: str | Path) -> Path:
    """Create a fresh ``compare-<time>`` folder under ``out_dir`` (``-2``, ... if taken)."""
    root = Path(out_dir)
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"--out {root}: cannot create it ({exc.strerror})") from None
    base = f"compare-{time.strftime('%Y%m%d-%H%M%S')}"
    for n in range(1, 1000):
        folder = root / (base if n == 1 else f"{base}-{n}")
        try:
            folder.mkdir()
            return folder
        except FileExistsError:
            continue
        except OSError as exc:
            raise ConfigError(f"--out {root}: not a writable folder ({exc.strerror})") from None
    raise ConfigError(f"--out {root}: no free comparison folder name starting {base!r}")


#: What a process imports during its first run and never again: the optimizer's first step
#: imports torch._dynamo (about 1 s), the run's plot matplotlib (0.4 s). A comparison imports
#: them before its first run, whose "wall here" would otherwise be 2-10x the others'.
FIRST_RUN_IMPORTS = ("torch._dynamo", "matplotlib.figure", "matplotlib.backends.backend_agg")


def run_comparison(
    spec: CompareSpec,
    planned: list[PlannedRun] | None = None,
    notify: Callable[[str], None] = lambda line: None,
) -> Comparison:
    """Train every planned run one after another and write the comparison files.

    ``notify`` receives one line as each run starts and ends (the CLI prints them).
    Raises ``ValueError`` for bad input (before anything trains); a failing run raises
    its error after the comparison folder's finished runs are kept.
    """
    planned = planned if planned is not None else plan(spec)
    folder = claim_folder(spec.out_dir)
    jobs = []
    try:  # claim every run directory first: a taken name or a too-large batch fails before any run
        for p in planned:
            config = p.spec.train_config(extra_config={"spec": {**p.spec.to_dict(),
                                                                "out_dir": str(folder)}})
            trainer = Trainer(p.bundle.model, p.bundle.train_data, p.bundle.val_data, p.bundle.collate_fn)
            jobs.append(trainer.prepare(p.instance, config=config, out_dir=str(folder),
                                        run_id=p.instance.name))  # a custom one's path holds a ':'
    except (ValueError, FileExistsError) as exc:
        shutil.rmtree(folder, ignore_errors=True)
        name = planned[len(jobs)].strategy
        raise ConfigError(f"{name}: {exc}") from None
    for module in FIRST_RUN_IMPORTS:  # each run's "wall here" is its own, not the process's
        importlib.import_module(module)
    finished: list[FinishedRun] = []
    measure_once = all(job.config.step_seconds is None for job in jobs)
    for i, (p, job) in enumerate(zip(planned, jobs, strict=True), start=1):
        if measure_once and finished:
            # One compute time for every run (the first run's, measured here): the same model
            # on the same hardware, so projections differ only by what the strategies do.
            job.config = replace(job.config, step_seconds=finished[0].summary[
                "projected"]["step_seconds"])
        options = p.instance.config()
        lr = f", lr {options['lr']:g}" if isinstance(options.get("lr"), float) else ""
        notify(f"[{i}/{len(jobs)}] {strategy_label(p.instance.name, options)}{lr}")
        job.started = time.time()  # wall time of this run only, not of the ones before it
        try:
            result = run_job(job)
        except BaseException:
            for later in jobs[i:]:  # never leave claimed, unstarted run directories behind
                if later.run_dir is not None:
                    later.run_dir.discard()
            raise
        finished.append(load_run(result.run_dir))  # type: ignore[arg-type]
        notify(f"[{i}/{len(jobs)}] done: {result.run_dir}")
    return summarise(folder, finished, spec.target_loss)


def summarise(folder: Path, runs: list[FinishedRun], target_loss: float | None = None) -> Comparison:
    """The comparison rows of finished runs, written to comparison.json/.csv with the plots."""
    target, rule = choose_target(runs, target_loss)
    reference = next((r for r in runs if r.strategy == "ddp"), None)
    rows = [row_for(run, target, reference) for run in runs]
    plots = plot_runs(runs, folder, target)
    document = {"target_loss": target, "target_rule": rule,
                "nodes": sorted({n for r in runs if (n := r.summary.get("nodes")) is not None}),
                "tasks": sorted({r.task for r in runs}),
                "plots": [p.name for p in plots], "runs": rows}
    atomic_write_text(folder / "comparison.json", json.dumps(document, indent=2) + "\n")
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(rows[0]))
    writer.writeheader()
    writer.writerows({k: "" if v is None else v for k, v in row.items()} for row in rows)
    atomic_write_text(folder / "comparison.csv", buf.getvalue())
    return Comparison(folder, runs, rows, target, rule, plots)


def choose_target(runs: list[FinishedRun], target_loss: float | None) -> tuple[float, str]:
    """The target validation loss and how it was chosen (see the module docstring)."""
    if target_loss is not None:
        return target_loss, "given (--target-loss)"
    finals = {r.strategy: r.summary.get("final_val_loss") for r in runs}
    ddp = finals.get("ddp")
    if ddp is not None:
        return TARGET_FACTOR * ddp, f"{TARGET_FACTOR} x DDP's final val loss"
    known = [v for v in finals.values() if v is not None]
    if not known:
        raise ValueError("no run has a final validation loss to set a target from")
    return TARGET_FACTOR * min(known), f"{TARGET_FACTOR} x the lowest final val loss"


def row_for(run: FinishedRun, target: float, reference: FinishedRun | None) -> dict[str, Any]:
    """One comparison row; every number is read from the run's own files."""
    s = run.summary
    projected = s.get("projected") or {}
    sent = s["bytes_sent_per_node"]
    ratio = None
    if reference is not None and sent > 0:
        ratio = reference.summary["bytes_sent_per_node"] / sent
    reached = next((row for row in run.validation()
                    if (row.get("step") or 0) > 0 and row["val_loss"] <= target), None)  # type: ignore[operator]
    metric = run.metric()
    return {
        "strategy": run.strategy,
        "label": run.label,
        "run_dir": run.path.name,
        "initial_val_loss": (s.get("initial") or {}).get("val_loss"),
        "final_val_loss": s.get("final_val_loss"),
        "metric": metric[0] if metric else None,
        "final_metric": metric[1] if metric else None,
        "bytes_sent_per_node": sent,
        "ddp_bytes_per_this": ratio,
        "cluster": projected.get("cluster"),
        "projected_seconds": projected.get("total_seconds"),
        "step_seconds": projected.get("step_seconds"),  # the compute time per step it assumes
        "steps": s.get("steps"),
        "steps_to_target": int(reached["step"]) if reached else None,  # type: ignore[arg-type]
        "projected_seconds_to_target": reached.get("projected_seconds") if reached else None,
        "wall_seconds": s.get("wall_seconds"),
    }
