"""Every setting is defined once and reaches every way of giving it.

The test walks every setting (a run's RunSpec and a launch's LaunchSettings): a setting
with a Flag appears, with its help, in the ``--help`` of each command the flag names, and
its flag sets it; every setting a profile may hold is accepted by ``--set`` and by a
profile. A new setting needs only its
definition (and, if its type is text, a sample value below) for all of this to hold.
"""

from __future__ import annotations

import dataclasses
import re
import typing
from pathlib import Path
from typing import Any

import pytest
import yaml
from rich.markup import escape
from rich.text import Text
from typer.core import TyperOption
from typer.main import get_command
from typer.testing import CliRunner

import meshtrain.build
import meshtrain.cli.main as cli_main
from meshtrain.build import resolve_run
from meshtrain.cli.flags import setting_flags
from meshtrain.cli.main import app
from meshtrain.config.dashboard import DashboardSettings
from meshtrain.config.hosts import (
    HostsBenchSettings,
    HostsCheckSettings,
    HostsDiscoverSettings,
    HostsSetupSettings,
    Installing,
    Listening,
    UpSettings,
)
from meshtrain.config.launching import LaunchSettings
from meshtrain.config.plan import PlanSettings
from meshtrain.config.research import CompareSettings, PlotSettings
from meshtrain.config.settings import Flag
from meshtrain.config.spec import NOT_IN_PROFILES, ConfigError, RunSpec
from meshtrain.config.transcribe import TranscribeSettings

runner = CliRunner()
RUN = [f.name for f in dataclasses.fields(RunSpec) if f.name != "extra_config"]
FIELDS = {f.name: f for cls in (RunSpec, LaunchSettings) for f in dataclasses.fields(cls)}
HINTS = {**typing.get_type_hints(RunSpec), **typing.get_type_hints(LaunchSettings)}

#: A valid value other than the default for each setting whose type is text or a mapping
#: (numbers and switches get one from their type and limits).
TEXT_SAMPLES: dict[str, Any] = {
    "device": "auto", "out_dir": "elsewhere", "run_id": "my-run", "cluster": "wifi",
    "wandb": "my-project", "resume": "runs/old.checkpoints", "description": "a run",
    "task": "gpt", "data": "input.txt", "strategy": "ddp", "fail": ["node=1,step=2"],
    "straggler": ["node=1,slowdown=2"], "task_options": {"arch": "cnn"},
    "strategy_options": {"outer_lr": 0.5}, "copy_back_limit": "1GiB", "upload": ["a.txt"],
}


def sample(name: str) -> Any:
    """A valid, non-default value of setting ``name``."""
    if name in TEXT_SAMPLES:
        return TEXT_SAMPLES[name]
    meta = FIELDS[name].metadata
    kinds = [k for k in typing.get_args(HINTS[name]) or (HINTS[name],) if k is not type(None)]
    if meta.get("choices"):
        return next(c for c in meta["choices"] if c != FIELDS[name].default)
    if kinds == [bool]:
        return not FIELDS[name].default
    if int in kinds:
        return 3
    if float in kinds:
        return 0.5
    raise AssertionError(f"setting {name!r}: add a sample value to TEXT_SAMPLES")


def flagged() -> list[tuple[str, Flag, str]]:
    return [(name, f.metadata["flag"], command) for name, f in FIELDS.items()
            if f.metadata.get("flag") for command in f.metadata["flag"].commands]


def help_text(command: str) -> str:
    """``meshtrain COMMAND --help`` as one line: boxes gone, wrapping undone."""
    result = runner.invoke(app, [command, "--help"], env={"COLUMNS": "160"})
    assert result.exit_code == 0, result.output
    return " ".join(result.output.replace("│", " ").split())


def flag_args(flag: Flag, value: Any) -> list[str]:
    """The command-line words that give ``value`` by ``flag``."""
    on, _, off = flag.names[0].partition("/")
    if isinstance(value, bool):
        return [on if value else off]
    if isinstance(value, list):
        return [w for item in value for w in (on, item)]
    return [on, str(value)]


@pytest.mark.parametrize(("name", "flag", "command"), flagged(),
                         ids=[f"{c}-{n}" for n, _, c in flagged()])
def test_a_setting_with_a_flag_is_in_its_commands_help_and_its_flag_sets_it(
    name: str, flag: Flag, command: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    text = help_text(command)
    for word in (w for names in flag.names for w in names.split("/")):
        assert re.search(rf"(?<![\w-]){re.escape(word)}(?![\w-])", text), f"{word} not in {command} --help"
    setting_help = " ".join(flag.help_in(command, FIELDS[name].metadata["help"]).split())
    # --steps names each task's suggestion after its first words.
    assert setting_help.split(" (")[0] in text, f"{name}'s help not in {command} --help"
    value = sample(name)
    ctx = get_command(app).commands[command].make_context(  # type: ignore[attr-defined]
        command, [*(["inventory.yaml"] if command == "launch" else []), *flag_args(flag, value)])
    assert ctx.params[name] == (tuple(value) if isinstance(value, list) else value) or \
        ctx.params[name] == value
    if command != "simulate" or name == "resume":  # resume reads a checkpoint before resolving
        return
    # Through simulate's own body into the resolver: the spec holds the value.
    seen: list[RunSpec] = []

    def resolve_only(flags: dict[str, Any], overrides: list[str], launched: bool) -> Any:
        seen.append(resolve_run(flags, overrides, launched)[0])
        raise ConfigError("resolved")

    monkeypatch.setattr(meshtrain.build, "build_run", resolve_only)  # simulate imports it when it runs
    result = runner.invoke(app, ["simulate", *flag_args(flag, value)])
    assert result.exit_code == 2 and "resolved" in result.output, result.output
    assert getattr(seen[0], name) == value


@pytest.mark.parametrize("name", [n for n in RUN if n not in NOT_IN_PROFILES])
def test_every_setting_is_accepted_by_set_and_by_a_profile(name: str, tmp_path: Path) -> None:
    value = sample(name)
    as_set = [f"{name}.{k}={v}" for k, v in value.items()] if isinstance(value, dict) else \
        [f"{name}={yaml.safe_dump(value, default_flow_style=True).strip().removesuffix('...').strip()}"]
    profile = tmp_path / "p.yaml"
    profile.write_text(yaml.safe_dump({name: value}))
    for flags, overrides in (({}, as_set), ({"profile": str(profile)}, [])):
        got = getattr(resolve_run(flags, overrides, launched=False)[0], name)
        if isinstance(value, dict):  # merged over the task's suggestions
            assert value.items() <= got.items(), (overrides or profile.read_text(), got)
        else:
            assert got == value, (overrides or profile.read_text(), got)


def test_flags_keep_their_names_and_short_forms() -> None:
    """The flags users type today (a change here breaks their commands and scripts)."""
    def options(command: str) -> set[str]:
        cmd = get_command(app).commands[command]  # type: ignore[attr-defined]
        return {o for p in cmd.params for o in (*p.opts, *p.secondary_opts) if o.startswith("-")}

    assert {"--profile", "-p", "--strategy", "-s", "--task", "-t", "--data", "--steps", "--epochs",
            "--batch-size", "-b", "--microbatch-size", "--lr", "--seed", "--set", "--nodes", "-n",
            "--runtime", "--out", "--run-id", "--progress", "--no-progress", "--cluster",
            "--step-seconds", "--fail", "--straggler", "--check-sync", "--no-check-sync",
            "--skip-nonfinite", "--stop-on-nonfinite", "--checkpoint-every", "--keep", "--resume",
            "--verbose", "-v", "--device", "--threads", "--val-interval", "--wandb", "--tensorboard",
            "--no-tensorboard", "--dashboard"} <= options("simulate")
    assert {"--out", "--run-id", "--accept-new-host-keys", "--upload", "--progress", "--no-progress",
            "--threads", "--heartbeat-timeout", "--plain", "--profile", "-p", "--strategy", "-s",
            "--task", "-t", "--data", "--steps", "--batch-size", "-b", "--microbatch-size", "--lr",
            "--device", "--seed", "--val-interval", "--set", "--checkpoint-every", "--keep",
            "--resume", "--max-restarts", "--restart-wait", "--allow-shrink", "--copy-back-limit",
            "--copy-back-files", "--no-ship", "--dashboard"} <= options("launch")
    assert {"--strategies", "-s", "--nodes", "-n", "--task", "-t", "--data", "--steps", "--seed", "--lr",
            "--cluster", "--set", "--out", "--target-loss", "--progress", "--no-progress"} \
        <= options("compare")


def _commands(group: Any, path: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], Any]]:
    found = [(path, group)] if path else []
    for name, sub in getattr(group, "commands", {}).items():
        found += _commands(sub, (*path, name))
    return found


@pytest.mark.parametrize(("path", "command"), _commands(get_command(app)),
                         ids=[" ".join(p) for p, _ in _commands(get_command(app))])
def test_help_at_80_columns_shows_every_option_name_whole(path: tuple[str, ...], command: Any) -> None:
    result = runner.invoke(app, [*path, "--help"], env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    assert max(len(line) for line in result.output.splitlines()) <= 80
    for param in (p for p in command.params if not getattr(p, "hidden", False)):
        for name in (*param.opts, *param.secondary_opts):
            if name.startswith("-"):
                assert re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", result.output), \
                    f"{' '.join(path)} --help at 80 columns: {name} is not shown whole"
    # Every description is readable whole: wrapped, never cut. At 80 columns (and piped) the
    # "What to train" panel of simulate and launch had cut 193 of its 376 lines to "P…", "n…":
    # with the panels' boxes and all white space taken away, each help text is still there.
    assert "…" not in result.output, f"{' '.join(path)} --help at 80 columns cuts a description"
    shown = re.sub(r"[\s│╭╮╰╯─]", "", result.output)
    for param in (p for p in command.params if not getattr(p, "hidden", False) and p.help):
        words = re.sub(r"\s", "", Text.from_markup(param.help).plain)  # typer reads it as markup
        assert words in shown, f"{' '.join(path)} --help at 80 columns: the help of {param.name} is not whole"


def test_settings_lists_every_setting_with_its_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cli_main.console, "width", 300)  # one line a row, however it was imported
    listed = runner.invoke(app, ["settings"])
    assert listed.exit_code == 0, listed.output
    rows = {line.split("│")[1].strip(): line for line in listed.output.splitlines() if line.count("│") > 3}
    for name in RUN:
        flag = FIELDS[name].metadata.get("flag")
        assert name in rows, f"{name} not listed"
        if flag:
            assert f"{', '.join(flag.names)} ({', '.join(flag.commands)})" in rows[name], rows[name]


@pytest.mark.parametrize(("cls", "command"), [(HostsCheckSettings, "hosts check"),
                                              (HostsBenchSettings, "hosts bench"),
                                              (HostsDiscoverSettings, "hosts discover"),
                                              (HostsSetupSettings, "hosts setup"),
                                              (PlanSettings, "plan"), (UpSettings, "up"),
                                              (CompareSettings, "compare"), (PlotSettings, "plot"),
                                              (DashboardSettings, "dashboard"),
                                              (TranscribeSettings, "transcribe")])
def test_every_commands_options_are_their_settings_one_definition(cls: type, command: str) -> None:
    """Every command's options are exactly the fields of its config/ dataclass, each with its
    field's default, help and panel (no hand-written typer option; an option two commands
    share is one field, with its help and panel in each). ``compare`` takes the training
    settings besides (and ``--set``), generated from RunSpec."""
    click_command: Any = get_command(app)
    for word in command.split():
        click_command = click_command.commands[word]
    options = {p.name: p for p in click_command.params if isinstance(p, TyperOption) and p.name != "help"}
    fields = {f.name: f for f in dataclasses.fields(cls)}
    training = {*setting_flags(command), "set_"} if command == "compare" else set()
    assert set(options) == set(fields) | training
    for name, field in fields.items():
        flag = field.metadata["flag"]
        assert [*options[name].opts, *options[name].secondary_opts] == \
            [n for names in flag.names for n in names.split("/")], name
        default = field.default_factory() if callable(field.default_factory) else field.default
        assert options[name].default == default, name
        # Escaped: typer renders help as rich markup ("meshtrain[dashboard]" would vanish).
        assert options[name].help == escape(flag.help_in(command, field.metadata["help"])), name
        assert options[name].rich_help_panel == flag.panel_in(command), name


def test_hosts_setup_and_up_share_what_they_install_with() -> None:
    """``up`` runs ``hosts setup`` as its step 3: the options of installing are one definition,
    shown in ``up`` under that step's panel."""
    shared = {f.name for f in dataclasses.fields(Installing)}
    assert shared == {"base_python", "pip_arg", "wheel"}
    assert shared <= {f.name for f in dataclasses.fields(HostsSetupSettings)}
    assert shared <= {f.name for f in dataclasses.fields(UpSettings)}
    up: Any = get_command(app).commands["up"]  # type: ignore[attr-defined]
    assert {p.name: p.rich_help_panel for p in up.params if p.name in shared} == \
        dict.fromkeys(shared, "Setting them up (hosts setup)")


@pytest.mark.parametrize(("argv", "expected"), [
    (["hosts", "setup", "INVENTORY", "--timeout", "nan"], "--timeout must be a finite number, got nan"),
    (["hosts", "setup", "INVENTORY", "--timeout", "0"], "--timeout must be > 0, got 0.0"),
    (["hosts", "setup", "INVENTORY", "--base-python", " "], "--base-python must not be empty"),
    (["transcribe", "MODEL", "AUDIO", "--batch-size", "0"], "--batch-size must be >= 1, got 0"),
    (["transcribe", "MODEL", "AUDIO", "--language", ""], "--language must not be empty"),
    (["plot", "RUN", "--out", ""], "--out must not be empty"),
    (["dashboard", "--port", "65536"], "--port must be <= 65535, got 65536"),
    (["compare", "--strategies", ""], "--strategies must not be empty"),
    # Each value of a repeatable flag: `--upload ""` read as "." and `--pip-arg ""` reached pip.
    (["hosts", "setup", "INVENTORY", "--pip-arg=--isolated", "--pip-arg", ""], "--pip-arg must not be empty"),
    (["launch", "INVENTORY", "--upload", "", "--", "true"], "--upload must not be empty"),
])
def test_a_commands_option_is_checked_by_its_rule_before_anything_is_read(
        argv: list[str], expected: str, tmp_path: Path) -> None:
    """Each bad value is refused with one line naming the flag, exit 2, before the command
    reads a file or reaches a host: the files named here are valid, so only the option is
    at fault."""
    inventory = tmp_path / "hosts.yaml"
    inventory.write_text("hosts:\n  - {name: a, host: 127.0.0.1, port: 9, python: /usr/bin/python3}\n")
    model = tmp_path / "model"
    model.mkdir()
    audio = tmp_path / "a.wav"
    audio.write_bytes(b"RIFF")
    named = {"INVENTORY": str(inventory), "MODEL": str(model), "AUDIO": str(audio), "RUN": str(tmp_path)}
    result = runner.invoke(app, [named.get(word, word) for word in argv])
    assert result.exit_code == 2, result.output
    assert result.output.strip() == f"error: {expected}"


def test_up_and_discover_share_their_listening_options() -> None:
    """The options of finding machines and logging in are defined once for both commands."""
    shared = {f.name for f in dataclasses.fields(Listening)}
    assert shared <= {f.name for f in dataclasses.fields(HostsDiscoverSettings)}
    assert shared <= {f.name for f in dataclasses.fields(UpSettings)}
    assert {"timeout", "iface", "network", "user", "identity_file", "known_hosts"} == shared


def test_a_hosts_bench_option_is_checked_by_its_rule_before_any_host(tmp_path: Path) -> None:
    result = runner.invoke(app, ["hosts", "bench", str(tmp_path / "nowhere.yaml"), "--repeats", "0"])
    assert result.exit_code == 2
    assert result.output.strip() == "error: --repeats must be >= 1, got 0", result.output
