"""One error root: bad input (exit 2) and run failures (exit 1) are types, not wording."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from pathlib import Path
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

import meshtrain
from meshtrain.cli.main import _report_failure, app
from meshtrain.errors import InputError, MeshtrainError, RunFailure

runner = CliRunner()

#: paramiko's host-key policy must raise paramiko's own exception type; connect() turns
#: these two into one SSHError line (a RunFailure) before anyone else sees them.
OUTSIDE_THE_ROOT = {"meshtrain.hosts.ssh.UnknownHostKey", "meshtrain.hosts.ssh.RevokedHostKey"}


def package_exceptions() -> dict[str, type[Exception]]:
    found = {}
    for info in pkgutil.walk_packages(meshtrain.__path__, "meshtrain."):
        if info.name == "meshtrain.__main__":  # running it starts the CLI
            continue
        module = importlib.import_module(info.name)
        for _, cls in inspect.getmembers(module, inspect.isclass):
            # Errors only: a signal raised as a BaseException (Interrupted) is no error.
            if issubclass(cls, Exception) and cls.__module__ == info.name:
                found[f"{cls.__module__}.{cls.__qualname__}"] = cls
    return found


def test_every_error_of_the_package_has_the_one_root_and_a_kind() -> None:
    found = package_exceptions()
    assert len(found) > 20  # the walk saw the package
    strays = sorted(name for name, cls in found.items()
                    if not issubclass(cls, MeshtrainError) and name not in OUTSIDE_THE_ROOT)
    assert not strays, f"not under MeshtrainError: {strays}"
    rooted = [cls for cls in found.values() if issubclass(cls, MeshtrainError)]
    assert all(issubclass(cls, (InputError, RunFailure)) for cls in rooted if cls is not MeshtrainError)


def test_the_kinds_keep_the_builtin_bases_callers_catch() -> None:
    from meshtrain.config.spec import ConfigError
    from meshtrain.engine.job import NodeFailed
    from meshtrain.launch.launcher import PreflightError

    assert issubclass(InputError, ValueError) and InputError.exit_code == 2
    assert issubclass(RunFailure, RuntimeError) and RunFailure.exit_code == 1
    assert issubclass(ConfigError, InputError) and issubclass(NodeFailed, RunFailure)
    assert issubclass(PreflightError, InputError) and issubclass(PreflightError, RuntimeError)


def test_bad_input_exits_2_with_one_line(tmp_path: Path) -> None:
    for args in (["simulate", "--resume", str(tmp_path / "nothing.checkpoints")],  # CheckpointError
                 ["runs", str(tmp_path / "no-such-folder")],  # RunError
                 ["simulate", "--strategy", "nope"]):  # ConfigError
        result = runner.invoke(app, args)
        assert result.exit_code == 2, (args, result.output)
        assert result.output.count("error:") == 1 and "Traceback" not in result.output


def test_a_failure_is_reported_by_its_type_not_its_wording(capsys: pytest.CaptureFixture[str]) -> None:
    job = SimpleNamespace(run_dir=None, checkpoints=None)
    _report_failure(RunFailure("the disk of node 1 is full"), job, verbose=False)
    assert capsys.readouterr().err.strip() == "error: the disk of node 1 is full"
    _report_failure(RuntimeError("connection failed"), job, verbose=False)  # not meshtrain's own
    assert capsys.readouterr().err.strip() == "error: RuntimeError: connection failed"
