"""Remote commands are built by one quoting helper; run ids are plain names everywhere."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from meshtrain.config.settings import SettingError
from meshtrain.hosts.ssh import EnvAssignment, HostPath, Shell, sh, shell_line
from meshtrain.launch.launcher import LaunchOptions

EVIL = "a;touch M;$(touch M)`touch M`'\"\n&touch M&|touch M|* b\\c"


def run_sh(line: str, cwd: Path) -> str:
    return subprocess.run(["/bin/sh", "-c", line], cwd=cwd, capture_output=True, text=True,
                          check=True, env={"HOME": str(cwd), "PATH": "/usr/bin:/bin"}).stdout


def test_every_word_reaches_the_program_verbatim(tmp_path: Path) -> None:
    line = shell_line(EnvAssignment("V", EVIL), "/bin/sh", "-c", 'printf "%s|%s|%s" "$V" "$1" "$2"',
                      "sh", EVIL, HostPath(f"~/{EVIL}"))
    assert run_sh(sh(line), tmp_path) == f"{EVIL}|{EVIL}|{tmp_path}/{EVIL}"
    assert not (tmp_path / "M").exists()
    assert run_sh(shell_line("echo", HostPath("~"), Shell("&&"), "echo", "~"), tmp_path) == f"{tmp_path}\n~\n"


def test_an_environment_name_must_be_an_identifier() -> None:
    with pytest.raises(ValueError, match="not a valid environment variable name"):
        EnvAssignment("A;touch M", "x")


@pytest.mark.parametrize("run_id", ["r1;touch M;", "..", ".", "-rf", ".hidden", "a/b", "a b", "", "x" * 129])
def test_a_launch_refuses_an_unsafe_run_id(run_id: str) -> None:
    with pytest.raises(SettingError, match="run id .*: use letters, digits"):
        LaunchOptions(run_id=run_id)


def test_fit_refuses_an_unsafe_run_id_from_its_settings_or_the_environment(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from helpers import MLP, regression_data

    from meshtrain import Trainer
    from meshtrain.strategies import DDP

    trainer = Trainer(MLP(), regression_data(16))
    with pytest.raises(ValueError, match="run id '\\.\\./x'"):
        trainer.fit(DDP("sgd", 0.1), nodes=1, max_steps=1, out_dir=tmp_path, run_id="../x", progress=False)
    monkeypatch.setenv("MESHTRAIN_RUN_ID", "r1;touch M")
    with pytest.raises(ValueError, match="run id 'r1;touch M'"):
        trainer.fit(DDP("sgd", 0.1), nodes=1, max_steps=1, batch_size=4, out_dir=tmp_path, progress=False)
    assert list(tmp_path.iterdir()) == []
