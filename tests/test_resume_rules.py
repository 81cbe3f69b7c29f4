"""What a resumed run may change is said by each setting's own definition, and the library
enforces it: ``Trainer.fit(resume=...)`` refuses what ``simulate --resume`` refuses (another
learning rate, seed or batch size), and both accept what only says how the run runs or
logs (threads, concurrent nodes, validation, checkpoints)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path

import pytest
from helpers import MLP, regression_data

from meshtrain import Trainer
from meshtrain.config import resume as resume_rules
from meshtrain.config.settings import KEEP, ON_RESUME, TrainConfig, on_resume, setting
from meshtrain.config.spec import RunSpec
from meshtrain.errors import SettingError
from meshtrain.strategies import DiLoCo


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A DiLoCo run of 4 steps that checkpointed after step 2 (kept in its run directory)."""
    out = tmp_path_factory.mktemp("rules")
    Trainer(MLP(), regression_data(64)).fit(DiLoCo(H=2, lr=0.01, outer_lr=0.7), nodes=2, max_steps=4,
                                           batch_size=4, out_dir=out, progress=False, run_id="a",
                                           checkpoint_every=2)
    return out / "a"


def _resume(finished: Path, tmp_path: Path, strategy: DiLoCo, **settings: object):
    return Trainer(MLP(), regression_data(64)).fit(
        strategy, **{"nodes": 2, "max_steps": 6, "batch_size": 4, "progress": False, "out_dir": tmp_path,
                     "resume": str(finished), "run_id": "b", "checkpoint_every": 2, **settings})


SAME = {"H": 2, "lr": 0.01, "outer_lr": 0.7}


@pytest.mark.parametrize(("strategy", "settings", "message"), [
    ({**SAME, "lr": 0.05}, {}, "strategy parameter lr was 0.01 in the checkpointed run, now 0.05"),
    ({**SAME, "outer_lr": 0.3}, {}, "strategy parameter outer_lr was 0.7 in the checkpointed run, now 0.3"),
    (SAME, {"seed": 3}, "seed was 0 in the checkpointed run, now 3"),
    (SAME, {"batch_size": 2}, "batch_size was 4 in the checkpointed run, now 2"),
    (SAME, {"max_steps": 1}, "the checkpoint is at step 2, past steps 1"),
], ids=["lr", "outer_lr", "seed", "batch_size", "steps"])
def test_fit_refuses_what_simulate_refuses(finished: Path, tmp_path: Path, strategy: dict, settings: dict,
                                           message: str) -> None:
    with pytest.raises(SettingError, match=f"--resume {finished}: {message}"):
        _resume(finished, tmp_path, DiLoCo(**strategy), **settings)
    assert not any(tmp_path.iterdir())  # refused before anything was written


def test_fit_continues_with_what_may_change(finished: Path, tmp_path: Path) -> None:
    result = _resume(finished, tmp_path, DiLoCo(H=2, lr=0.01, outer_lr=0.7), concurrent_nodes=1, threads=2,
                     val_interval=2, keep_checkpoints=3, check_sync=True)
    assert result.summary["steps"] == 6


def test_every_setting_says_what_a_resume_may_do_with_it() -> None:
    for f in fields(RunSpec):
        assert f.metadata.get("on_resume") in ON_RESUME, f"{f.name} does not say (on_resume=...)"
    assert on_resume(next(f for f in fields(RunSpec) if f.name == "concurrent_nodes")) != KEEP
    assert on_resume(next(f for f in fields(RunSpec) if f.name == "lr")) == KEEP


def test_a_new_setting_that_does_not_say_is_kept(tmp_path: Path) -> None:
    """The safe default: a setting added without saying (a ``compression``, a ``delay``)
    is part of what is trained, and a resume that changes it is refused."""

    @dataclass
    class WithCompression(TrainConfig):
        compression: str = setting("none", "How updates are compressed.")

    (added,) = [f for f in fields(WithCompression) if f.name == "compression"]
    assert on_resume(added) == KEEP
    assert resume_rules.changed_setting(WithCompression, {"compression": "none"},
                                        {"compression": "int8"}) == \
        "compression was 'none' in the checkpointed run, now 'int8'"
