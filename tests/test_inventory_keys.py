"""Inventory and key-file mistakes a new user makes: each is one line naming the file and
the key (no traceback), found before any connection is attempted."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml
from ssh_fixtures import generate_key
from typer.testing import CliRunner

from meshtrain.cli.main import app
from meshtrain.hosts.inventory import InventoryError, load_inventory
from meshtrain.hosts.ssh import identity_file_problem

runner = CliRunner()


def inventory(tmp_path: Path, **defaults: object) -> Path:
    # 10.0.0.x: never contacted, every fault here is found first.
    raw = {"defaults": {"user": "alice", "python": "/usr/bin/python3", "ssh_config": "/dev/null",
                        **defaults},
           "hosts": [{"name": "a", "host": "10.0.0.1"}, {"name": "b", "host": "10.0.0.2"}]}
    path = tmp_path / "inv.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def test_env_given_as_a_list_names_file_and_key(tmp_path: Path) -> None:
    path = inventory(tmp_path, env=["PYTORCH_ENABLE_MPS_FALLBACK=1"])
    with pytest.raises(InventoryError, match=rf"^{path}: defaults: key 'env' must be a mapping of "
                                             r"NAME: value \(one per line\), got a list"):
        load_inventory(path)
    text = path.read_text().replace("host: 10.0.0.2", "host: 10.0.0.2\n  env: [X=1]")
    path.write_text(text.replace("  env:\n  - PYTORCH_ENABLE_MPS_FALLBACK=1\n", ""))
    with pytest.raises(InventoryError, match=rf"^{path}: host 'b': key 'env' must be a mapping"):
        load_inventory(path)
    result = runner.invoke(app, ["hosts", "check", str(path)])
    assert result.exit_code == 2 and result.output.count("\n") == 1, result.output
    assert "key 'env' must be a mapping" in result.output and "Traceback" not in result.output


def test_key_files_that_are_not_private_keys(tmp_path: Path) -> None:
    private = generate_key(tmp_path / "id_ed25519")
    assert identity_file_problem(str(private)) is None
    public = f"{private}.pub"
    assert identity_file_problem(public) == (f"identity_file {public}: this is a public key; give "
                                             f"the private key file ({private})")
    noise = tmp_path / "noise"
    noise.write_bytes(os.urandom(2048) + b"\xff\xfe")
    assert "not an SSH private key (binary data" in identity_file_problem(str(noise))
    text = tmp_path / "notes.txt"
    text.write_text("my key is on the other laptop\n")
    assert "no -----BEGIN ... PRIVATE KEY----- line" in identity_file_problem(str(text))
    folder = identity_file_problem(str(tmp_path))
    assert folder == f"identity_file {tmp_path} is a folder, not a private key file"


@pytest.mark.parametrize("which", ["public", "noise"])
def test_launch_and_hosts_check_say_why_the_key_is_wrong(tmp_path: Path, which: str) -> None:
    private = generate_key(tmp_path / "id_ed25519")
    key = Path(f"{private}.pub")
    if which == "noise":
        key = tmp_path / "noise"
        key.write_bytes(os.urandom(1024) + b"\xff")
    expected = "this is a public key; give the private key file" if which == "public" else \
        "not an SSH private key (binary data"
    path = inventory(tmp_path, identity_file=str(key))
    launched = runner.invoke(app, ["launch", str(path), "--out", str(tmp_path / "runs"), "--", "true"])
    assert launched.exit_code == 2, launched.output
    errors = [line for line in launched.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 2 and all(expected in e and str(key) in e for e in errors), launched.output
    assert "Traceback" not in launched.output and "UnicodeDecodeError" not in launched.output
    checked = runner.invoke(app, ["hosts", "check", str(path)])
    assert checked.exit_code == 1
    assert f"a: ssh: identity_file {key}" in checked.output and expected in checked.output


def test_plot_refuses_a_target_loss_that_is_not_a_positive_number(tmp_path: Path) -> None:
    for value in ("nan", "inf", "-1", "0"):
        result = runner.invoke(app, ["plot", str(tmp_path), "--target-loss", value])
        assert result.exit_code == 2, result.output
        expected = (f"error: --target-loss must be a finite number, got {float(value)!r}"
                    if value in ("nan", "inf") else f"error: --target-loss must be > 0, got {float(value)!r}")
        assert result.output.strip() == expected
