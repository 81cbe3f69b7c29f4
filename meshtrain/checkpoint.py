"""Checkpoints: everything a run needs to continue exactly where it stopped.

A run with ``checkpoint_every=N`` keeps ``<out>/<run-id>.checkpoints/``:

    spec.yaml            the run's settings (what ``--resume`` rebuilds the run from)
    step-000040/         one folder per checkpoint, newest kept ``keep_checkpoints``
        node-0.pt ...    each node's state: model, optimizer and strategy state, data
                         position, random stream, and its numbers so far
                             (with frozen parameters, LoRA's base: only what trains,
                         plus the frozen base's SHA-256, which a resume must match)
        meta.json        written last, by rank 0: run id, step, and every node file's
                         SHA-256; a folder without it (or whose files do not match it) is
                         not a checkpoint and is skipped in favour of the one before

Every file is written to a temporary name, fsynced, and renamed; a checkpoint folder is
renamed into place only when complete. Node files are read with
``torch.load(weights_only=True)``: tensors and plain containers only, never code.

A checkpoint of N nodes can continue on M < N nodes (a launch that lost a host for
good, ``launch --allow-shrink``) when every node holds the run's whole global state at
the checkpoint: see :func:`fewer_nodes_refusal`. Node r then continues from its own
saved state (a launched host's folder holds its own rank's file only), and the data
is sharded anew over the M nodes.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from meshtrain import yaml12
from meshtrain.errors import InputError
from meshtrain.strategies import STRATEGIES, Strategy

META = "meta.json"
SPEC = "spec.yaml"


class CheckpointError(InputError):
    """No usable checkpoint where one was asked for: one line naming the folder and why."""


def checkpoint_folder(out_dir: str | Path, run_id: str) -> Path:
    """Where a run's checkpoints live (beside its run directory, so a failed run keeps them)."""
    return Path(out_dir) / f"{run_id}.checkpoints"


def step_folder(folder: Path, step: int) -> Path:
    return folder / f"step-{step:06d}"


def write_synced(path: Path, write: Any) -> None:
    """``write(file)`` into a temporary file beside ``path``, fsync it, rename into place."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_node(folder: Path, step: int, rank: int, state: dict[str, Any]) -> str:
    """Write one node's state for the checkpoint after ``step`` steps; its SHA-256."""
    pending = folder / f".step-{step:06d}.partial"
    pending.mkdir(parents=True, exist_ok=True)
    path = pending / f"node-{rank}.pt"
    write_synced(path, lambda f: torch.save(state, f))
    return _sha256(path)


def model_state(model: torch.nn.Module) -> dict[str, Any]:
    """What a checkpoint keeps of ``model``: ``{"model": state dict, "frozen_sha256": digest}``.

    Frozen parameters (a LoRA run's base) never change during a run and every node holds
    the same ones (checked by hash at start-up), so they are left out and identified by
    their SHA-256 instead: a tiny Whisper's 2-node checkpoint shrinks from 295 MB to the
    adapters. Without frozen parameters the digest is None and the whole state is kept.
    """
    frozen = _frozen_ids(model)
    state = {name: tensor.detach() for name, tensor in model.state_dict(keep_vars=True).items()
             if id(tensor) not in frozen}
    return {"model": state, "frozen_sha256": frozen_sha256(model) if frozen else None}


def load_model_state(model: torch.nn.Module, saved: dict[str, Any], where: str) -> None:
    """Restore :func:`model_state`'s ``saved`` into ``model`` (built from its base again);
    :class:`CheckpointError` when the frozen base is not the one the checkpoint was
    trained on, or the saved tensors do not fit the model. ``where`` names the file."""
    if saved.get("frozen_sha256") is None:  # everything trains (or an older checkpoint kept it all)
        model.load_state_dict(saved["model"])
        return
    _check_base(model, saved, where)
    frozen = _frozen_ids(model)
    expected = {name for name, t in model.state_dict(keep_vars=True).items() if id(t) in frozen}
    result = model.load_state_dict(saved["model"], strict=False)
    if result.unexpected_keys or set(result.missing_keys) != expected:
        odd = [*result.unexpected_keys, *sorted(set(result.missing_keys) - expected)]
        raise CheckpointError(f"{where} does not fit this model ({', '.join(odd[:3])}): resume with the "
                              "model and LoRA settings the run started from")


def check_base(found: Found, model: torch.nn.Module) -> None:
    """Refuse, before any node starts, a checkpoint trained on another frozen base than
    ``model``'s (:class:`CheckpointError` naming both digests)."""
    where = f"{found.folder}/node-{found.source_rank(0)}.pt"
    # mmap: a full model's checkpoint is not read whole just to find it has no digest.
    saved = torch.load(where, weights_only=True, map_location="cpu", mmap=True)
    if saved.get("frozen_sha256") is not None:
        _check_base(model, saved, where)


def _check_base(model: torch.nn.Module, saved: dict[str, Any], where: str) -> None:
    digest, mine = saved["frozen_sha256"], frozen_sha256(model)
    if mine != digest:
        raise CheckpointError(f"{where} was trained on another frozen base (sha256 {digest[:12]}, this "
                              f"model's is {mine[:12]}): resume with the base model the run started from")


def frozen_sha256(model: torch.nn.Module) -> str:
    """SHA-256 of the frozen parameters' bytes, in the model's parameter order."""
    h = hashlib.sha256()
    for p in model.parameters():
        if not p.requires_grad:
            # reshape(-1): a 0-dim tensor has no byte view of its own.
            h.update(p.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _frozen_ids(model: torch.nn.Module) -> set[int]:
    # By identity: a tied weight (Whisper's proj_out and embed_tokens) appears under two
    # names in the state dict but is one parameter.
    return {id(p) for p in model.parameters() if not p.requires_grad}


def commit(folder: Path, step: int, run_id: str, hashes: dict[int, str], keep: int, nodes: int,
           settings: dict[str, Any] | None = None) -> Path:
    """Once every node has saved: write meta.json (the checksums of the node files in this
    folder, and the run's ``settings`` a resume is checked against), publish the folder,
    prune old ones. Local runtimes share one folder, which rank 0 commits; each launched
    rank commits its own folder on its own host."""
    pending = folder / f".step-{step:06d}.partial"
    meta = {"run_id": run_id, "step": step, "nodes": nodes,
            "files": {f"node-{r}.pt": h for r, h in sorted(hashes.items())},
            **({"settings": settings} if settings is not None else {})}
    write_synced(pending / META, lambda f: f.write(json.dumps(meta, indent=2).encode()))
    final = step_folder(folder, step)
    if final.exists():  # a resumed run passing the same step again
        shutil.rmtree(final)
    os.replace(pending, final)
    _fsync_dir(folder)
    for old in sorted(folder.glob("step-*"))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def copy_checkpoint(found: Found, folder: Path) -> Path:
    """Put the checkpoint ``found`` into ``folder`` as well, published by one rename once
    complete. Files are hard links where the disk allows (a checkpoint's files are never
    changed in place: each is written anew and renamed), else copies."""
    final = step_folder(folder, found.step)
    pending = folder / f".step-{found.step:06d}.copy"
    shutil.rmtree(pending, ignore_errors=True)
    pending.mkdir(parents=True)
    names = [f"node-{r}.pt" for r in found.ranks] + [META]
    for name in names:
        try:
            os.link(found.folder / name, pending / name)
        except OSError:  # another file system, or one without hard links
            shutil.copyfile(found.folder / name, pending / name)
    if final.exists():  # an earlier continuation of the same checkpoint
        shutil.rmtree(final)
    os.replace(pending, final)
    _fsync_dir(folder)
    return final


@dataclass
class Found:
    """A checkpoint that passed every check."""

    folder: Path
    step: int
    run_id: str
    nodes: int
    skipped: list[str]  # why newer checkpoint folders were not used
    ranks: tuple[int, ...] = ()  # the node files this folder holds (a launched host: its own)
    settings: dict[str, Any] | None = None  # what the run recorded of its settings (None: nothing)

    def source_rank(self, rank: int) -> int:
        """The saved node that node ``rank`` continues from: on a launched host the one file
        its folder holds (after a shrink the ranks are renumbered), else ``node-<rank>``."""
        return self.ranks[0] if len(self.ranks) == 1 else rank


def find_latest(path: str | Path) -> Found:
    """The newest complete, intact checkpoint under ``path``.

    ``path`` is a ``<run-id>.checkpoints`` folder, a run directory holding
    ``checkpoints/``, or one ``step-N`` folder. Damaged or partial checkpoints are
    skipped (and listed in ``skipped``) in favour of the previous good one.
    """
    root = Path(path).expanduser()
    if (root / "checkpoints").is_dir():
        root = root / "checkpoints"
    if not root.is_dir():
        raise CheckpointError(f"--resume {path}: no such folder")
    candidates = [root] if (root / META).exists() or root.name.startswith("step-") else \
        sorted(root.glob("step-*"), reverse=True)
    skipped: list[str] = []
    for candidate in candidates:
        problem = _problem(candidate)
        if problem is None:
            meta = yaml12.read_json(candidate / META)
            ranks = tuple(sorted(int(name[len("node-"):-len(".pt")]) for name in meta["files"]))
            settings = meta.get("settings")
            return Found(candidate, int(meta["step"]), str(meta["run_id"]), int(meta["nodes"]), skipped,
                         ranks, settings if isinstance(settings, dict) else None)
        skipped.append(f"{candidate.name}: {problem}")
    detail = f" ({'; '.join(skipped)})" if skipped else ""
    raise CheckpointError(f"--resume {path}: no complete checkpoint found{detail}")


def load_node(found: Found, rank: int) -> dict[str, Any]:
    """The state node ``rank`` continues from (:meth:`Found.source_rank`) in a checkpoint
    :func:`find_latest` accepted."""
    source = found.source_rank(rank)
    state = torch.load(found.folder / f"node-{source}.pt", weights_only=True, map_location="cpu")
    if state.get("run_id") != found.run_id or state.get("step") != found.step:
        raise CheckpointError(f"{found.folder}/node-{source}.pt belongs to another run or step")
    return state


def fewer_nodes_refusal(strategy: Strategy) -> str | None:
    """Why a checkpoint of ``strategy`` cannot continue on fewer nodes, or None if it can.

    It can when dropping a node loses nothing but that node's future work: DDP's nodes
    are exact replicas (parameters and optimizer); DiLoCo's (and SPARTA-DiLoCo's)
    checkpoints fall on outer syncs, where every node's parameters equal the outer ones
    and the outer optimizer is the same everywhere (the inner optimizer is each node's
    own); after FedAvg's full average every node holds the global model. Not so for
    SPARTA (the nodes never agree: the global model is the mean of ALL of them), FedAvg
    with islands (the same, between full averages), and DeMo (each node's residual holds
    gradient that was never applied anywhere).
    """
    problem = strategy.fewer_nodes_problem()  # each strategy says so itself
    if problem or strategy.continues_on_fewer_nodes:
        return problem
    able = [name for name, cls in STRATEGIES.items() if cls.continues_on_fewer_nodes]
    return (f"strategy {strategy.name}: a checkpoint cannot continue on fewer nodes (only "
            f"{', '.join(able)} hold the whole global state on every node)")


def _problem(folder: Path) -> str | None:
    """Why ``folder`` is not a usable checkpoint, or None."""
    try:
        meta = yaml12.read_json(folder / META)  # may have come from a host: bounded
        files = meta["files"]
        int(meta["step"]), str(meta["run_id"]), int(meta["nodes"])
    except FileNotFoundError:
        return "incomplete (no meta.json)"
    except (ValueError, KeyError, TypeError):
        return "meta.json is damaged"
    for name, digest in files.items():
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        if _sha256(path) != digest:
            return f"{name} does not match its checksum (truncated or changed)"
    # meta.json is checked against what the folder holds before a resume announces its step:
    # a meta.json saying step 27 of a checkpoint at step 4 failed only once the nodes started.
    step, run_id = int(meta["step"]), str(meta["run_id"])
    named = folder.name.removeprefix("step-")
    if folder.name.startswith("step-") and named.isdigit() and int(named) != step:
        return f"meta.json says step {step}, the folder's name step {int(named)}"
    for name in files:
        # mmap: the tensors stay on disk; only the small plain values are read.
        try:
            state = torch.load(folder / name, weights_only=True, mmap=True, map_location="cpu")
        except (pickle.UnpicklingError, RuntimeError, EOFError) as exc:  # not tensors and plain values
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            return f"{name} cannot be read as a checkpoint ({first})"
        held = (state.get("run_id"), state.get("step")) if isinstance(state, dict) else (None, None)
        if held != (run_id, step):
            return (f"meta.json says run {run_id} step {step}, but {name} holds run {held[0]!r} "
                    f"step {held[1]!r}")
    return None


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
