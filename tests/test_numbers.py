"""Numbers the way researchers write them (``1e-3``, ``5e-1``, ``1e8``, ``.5``, ``1_000``) are
numbers in every layer: flags, ``--set``, profiles, cluster files and inventories.

PyYAML alone (YAML 1.1) reads ``1e-3`` as text; meshtrain.yaml12 adds YAML 1.2's rule.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from meshtrain import yaml12
from meshtrain.cli.main import app
from meshtrain.cluster import load_cluster_file
from meshtrain.hosts.inventory import InventoryError, load_inventory

runner = CliRunner()


@pytest.mark.parametrize(
    ("text", "value"),
    [("1e-3", 0.001), ("5e-1", 0.5), ("1e8", 1e8), ("1E+8", 1e8), ("-2.5e-4", -2.5e-4), (".5", 0.5),
     ("1.5e3", 1500.0), ("1_000", 1000), ("1_000.5", 1000.5), ("3", 3), ("0.1", 0.1)],
)
def test_yaml_reads_every_python_float(text: str, value: float) -> None:
    assert yaml.safe_load(text) == value or text in ("1e-3", "5e-1", "1e8", "1E+8", "-2.5e-4",
                                                     "1.5e3")  # the YAML 1.1 gap
    parsed = yaml12.load(text)
    assert parsed == value and type(parsed) is type(value)
    assert float(text) == value  # the same number Python reads


@pytest.mark.parametrize("text", ["1e", "e5", "v1e3", "1e-3x", "abc", "1.2.3"])
def test_text_that_is_not_a_number_stays_text(text: str) -> None:
    assert yaml12.load(text) == text


def test_exponent_floats_in_flags_set_profile_and_cluster_file(tmp_path: Path) -> None:
    cluster = tmp_path / "lab.yaml"
    cluster.write_text("bandwidth: 1e8\nlatency: 5e-4\nspeed: 1.5e0\n")
    profile = tmp_path / "p.yaml"
    profile.write_text(f"strategy: diloco\nlr: 1e-3\nsteps: 4\nnodes: 2\ncluster: {cluster}\n"
                       "strategy_options: {H: 2, min_lr: 1e-5}\n")
    result = runner.invoke(app, ["simulate", "--profile", str(profile), "--set", "outer_lr=5e-1",
                                 "--step-seconds", "2e-3", "--no-progress",
                                 "--out", str(tmp_path / "r"), "--run-id", "x"])
    assert result.exit_code == 0, result.output
    config = yaml12.load((tmp_path / "r" / "x" / "config.yaml").read_text())
    assert config["spec"]["lr"] == 0.001
    assert config["spec"]["step_seconds"] == 0.002
    options = config["spec"]["strategy_options"]
    assert (options["H"], options["min_lr"], options["outer_lr"]) == (2, 1e-5, 0.5)
    assert load_cluster_file(cluster).bandwidth == 1e8
    assert load_cluster_file(cluster).latency == 5e-4
    # And a flag with the same form.
    again = runner.invoke(app, ["simulate", "--lr", "1e-3", "--steps", "2", "--nodes", "2",
                                "--no-progress", "--out", str(tmp_path / "r"), "--run-id", "y"])
    assert again.exit_code == 0, again.output
    assert yaml12.load((tmp_path / "r" / "y" / "config.yaml").read_text())["spec"]["lr"] == 0.001


def test_exponent_floats_in_an_inventory(tmp_path: Path) -> None:
    path = tmp_path / "inv.yaml"
    path.write_text("rendezvous: {timeout: 3e1, heartbeat_timeout: 1.5e1}\n"
                    "defaults: {user: alice, python: /usr/bin/python3, ssh_config: /dev/null}\n"
                    "hosts:\n  - {name: a, host: 127.0.0.1}\n")
    inventory = load_inventory(path)
    assert inventory.rendezvous.timeout == 30.0 and inventory.rendezvous.heartbeat_timeout == 15.0


def test_a_file_nested_deeper_than_the_parser_follows_is_one_line(tmp_path: Path) -> None:
    """PyYAML's parser recurses: 5,000 nested lists raised RecursionError, a traceback from
    every command that reads YAML. It is a bad file like any other, named in one line."""
    deep = "[" * 5000 + "]" * 5000
    with pytest.raises(yaml12.YAMLError, match="nested too deeply"):
        yaml12.load(f"a: {deep}\n")
    path = tmp_path / "inv.yaml"
    path.write_text(f"defaults: {{user: alice}}\nhosts: {deep}\n")
    with pytest.raises(InventoryError, match=rf"^{path}: not valid YAML \(nested too deeply to read\)$"):
        load_inventory(path)


def test_a_key_given_twice_is_named_with_its_lines(tmp_path: Path) -> None:
    """YAML keys are unique; PyYAML kept the last value silently (a profile with lr twice
    trained with the second). Every YAML a user writes is read by one loader, so one rule."""
    with pytest.raises(yaml12.YAMLError) as info:
        yaml12.load("lr: 1e-3\nsteps: 5\nlr: 1e-2\n")
    assert yaml12.problem(info.value) == "key 'lr' is given twice (lines 1 and 3)"
    # '<<' merges may override on purpose; unique keys and nested mappings are untouched.
    assert yaml12.load("base: &b {a: 1, b: 2}\nrun:\n  <<: *b\n  a: 3\n")["run"] == {"a": 3, "b": 2}

    profile = tmp_path / "twice.yaml"
    profile.write_text("task: digits\nsteps: 5\nsteps: 6\n")
    result = runner.invoke(app, ["simulate", "--profile", str(profile), "--out", str(tmp_path / "runs")])
    assert result.exit_code == 2, result.output
    assert result.output.strip() == f"error: profile {profile}: key 'steps' is given twice (lines 2 and 3)"
    assert not (tmp_path / "runs").exists()

    inventory = tmp_path / "inv.yaml"
    inventory.write_text("hosts:\n  - {name: a, host: 127.0.0.1, host: 10.0.0.1}\n")
    with pytest.raises(InventoryError, match=rf"^{inventory}: key 'host' is given twice \(line 2\)$"):
        load_inventory(inventory)
    cluster = tmp_path / "lab.yaml"
    cluster.write_text("bandwidth: 1e9\nlatency: 1e-4\nbandwidth: 1e8\n")
    with pytest.raises(ValueError, match=rf"^{cluster}: key 'bandwidth' is given twice \(lines 1 and 3\)$"):
        load_cluster_file(cluster)


def test_a_file_that_is_not_text_is_one_line(tmp_path: Path) -> None:
    """An inventory or cluster file of other bytes (a binary, or UTF-16) raised
    UnicodeDecodeError: a traceback from `meshtrain launch`."""
    binary = tmp_path / "inv.yaml"
    binary.write_bytes(b"\xff\xfehosts: []\n")
    result = runner.invoke(app, ["launch", str(binary)])
    assert result.exit_code == 2, result.output
    assert result.output.strip() == f"error: {binary}: not UTF-8 text (byte 0: a binary file?)"
    with pytest.raises(ValueError, match=rf"^{binary}: not UTF-8 text \(byte 0: a binary file\?\)$"):
        load_cluster_file(binary)
