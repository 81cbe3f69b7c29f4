"""`meshtrain launch` checks locally what it can before any rank starts: settings as every
rank resolves them, simulated faults, empty data, an unwritable --out (no host contacted at
all), and a script's program (found on every host in preflight). Each is one line, exit 2."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from ssh_fixtures import SshWorld, loopback_world, meshtrain
from typer.testing import CliRunner

from meshtrain.cli.main import app
from meshtrain.config.hosts import HostsBenchSettings
from meshtrain.errors import InputError
from meshtrain.hosts.inventory import load_inventory
from meshtrain.launch.benchmark import benchmark_hosts
from meshtrain.launch.training import abandon_launch, prepare_launch

pytestmark = pytest.mark.slow
runner = CliRunner()


@pytest.fixture(scope="module")
def loopback_ssh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SshWorld]:
    yield from loopback_world(tmp_path_factory)


def two_ranks(world: SshWorld, tmp_path: Path) -> Path:
    port = world.servers[0].port
    return world.inventory(tmp_path / "inv.yaml", [
        {"name": "alpha", "host": "127.0.0.1", "port": port},
        {"name": "beta", "host": "127.0.0.1", "port": port},
    ], workdir=str(tmp_path / "remote"))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--set", "H=-1"], "strategy 'diloco': H must be >= 1, got -1"),
        (["--set", "fail=node=1,step=5"], "--fail and --straggler simulate faults: use them with "
                                          "meshtrain simulate"),
        (["--strategy", "fedavg", "--set", "island_size=3"], "island_size=3 exceeds the 2 nodes"),
        (["--task", "gpt", "--data", "{empty}"], "--data {empty}: the folder holds no files"),
        # Shipped, then refused on both hosts with their internal paths: refused here as simulate does.
        (["--task", "gpt", "--data", "{emptytext}"], "task 'gpt': {emptytext} has 0 characters; need at "
                                                     "least 1280"),
        (["--steps", "99999999999999999999999"], "steps must be <= 9223372036854775807"),
        (["--out", "/proc/x"], "--out /proc/x: cannot write into /proc"),
        (["--set", "steps="], "--set steps=: empty value"),
        (["--strategy", "auto"], "--strategy auto plans from the hosts' measured network: run "
                                 "`meshtrain hosts bench"),
        (["--strategy", "auto", "--set", "cluster={noprobe}"],
         "{noprobe}: it has no compute probe, this run is task digits, batch 32, threads all"),
        (["--strategy", "auto", "--set", "H=5"], "--set H: --strategy auto chooses the strategy"),
        (["--set", "strategy=auto"], "strategy auto is planned from the --strategy flag"),
    ],
)
def test_bad_launch_input_stops_before_any_host_is_contacted(
    loopback_ssh: SshWorld, tmp_path: Path, args: list[str], message: str
) -> None:
    inv = two_ranks(loopback_ssh, tmp_path)
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "noprobe.yaml").write_text("bandwidth: 1.0e+8\nlatency: 0.0002\n")  # no compute probe
    for name, path in (("{empty}", tmp_path / "empty"), ("{noprobe}", tmp_path / "noprobe.yaml"),
                       ("{emptytext}", tmp_path / "empty.txt")):
        args = [a.replace(name, str(path)) for a in args]
        message = message.replace(name, str(path))
    result = runner.invoke(app, ["launch", str(inv), "--out", str(tmp_path / "runs"), *args])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.output
    # Preflight creates every workdir: its absence proves no host was contacted, no rank ran.
    assert not (tmp_path / "remote").exists()
    assert not (tmp_path / "runs").exists()


def test_nothing_after_the_dashes_is_refused_not_trained(loopback_ssh: SshWorld, tmp_path: Path) -> None:
    """`launch inv.yaml --` meant a command and gave none: it trained the default run on
    every host; now it is one line, exit 2, no host contacted."""
    inv = two_ranks(loopback_ssh, tmp_path)
    result = runner.invoke(app, ["launch", str(inv), "--out", str(tmp_path / "runs"), "--"])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "nothing after --: give the command to run on every host" in lines[0], \
        result.output
    assert not (tmp_path / "remote").exists() and not (tmp_path / "runs").exists()


def test_a_program_missing_on_the_hosts_starts_no_rank(loopback_ssh: SshWorld, tmp_path: Path) -> None:
    inv = two_ranks(loopback_ssh, tmp_path)
    result = meshtrain(loopback_ssh, "launch", str(inv), "--", "nosuchprog", "--flag", cwd=tmp_path)
    assert result.returncode == 2, result.stdout + result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 2  # one line per host
    assert all("program 'nosuchprog' not found there" in e for e in errors)
    assert "nothing was started" in result.stderr
    # A program the launch uploads is not looked up before it is there: it runs.
    script = tmp_path / "mark.sh"
    script.write_text("#!/bin/sh\ntouch \"started-$RANK\"\n")
    script.chmod(0o755)
    ran = meshtrain(loopback_ssh, "launch", str(inv), "--upload", str(script), "--", "./mark.sh",
                    cwd=tmp_path)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert {p.name for p in (tmp_path / "remote").glob("started-*")} == {"started-0", "started-1"}


def test_launch_sends_one_resolved_settings_file_not_a_profile_name(loopback_ssh: SshWorld,
                                                                    tmp_path: Path) -> None:
    """A profile that exists only here (a relative path, with a base: chain) reaches every
    rank as its resolved settings: the hosts' workdirs hold no such file."""
    inv = two_ranks(loopback_ssh, tmp_path)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "base.yaml").write_text("task: digits\nstrategy: fedavg\nsteps: 50\n")
    (tmp_path / "mine" / "quick.yaml").write_text("base: mine/base.yaml\nsteps: 3\nlr: 5e-2\n"
                                                  "strategy_options: {H: 1}\n")
    result = meshtrain(loopback_ssh, "launch", str(inv), "--profile", "mine/quick.yaml", "--threads", "1",
                       "--plain", "--run-id", "profiled", "--out", str(tmp_path / "runs"), cwd=tmp_path,
                       timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    config = yaml.safe_load((tmp_path / "runs" / "profiled" / "config.yaml").read_text())
    assert (config["spec"]["strategy"], config["spec"]["steps"], config["spec"]["lr"]) == ("fedavg", 3, 0.05)
    assert not (tmp_path / "remote" / "mine").exists()
    # What every rank received: the one resolved settings file, no profile and no flags.
    shipped = yaml.safe_load((tmp_path / "remote" / "profiled.settings.yaml").read_text())
    assert "base" not in shipped and (shipped["strategy"], shipped["steps"]) == ("fedavg", 3)
    assert shipped["strategy_options"]["H"] == 1 and shipped["threads"] is None
    assert not list((tmp_path / "remote").glob("profile-*.yaml"))
    assert not (tmp_path / "runs" / "profiled.settings.yaml").exists()  # the run came back


RANK_SCRIPT = """
import os
import torch
from torch.utils.data import TensorDataset
from meshtrain import Trainer
from meshtrain.strategies import DiLoCo

x = torch.randn(64, 4, generator=torch.Generator().manual_seed(0))
model = torch.nn.Linear(4, 1)
data = TensorDataset(x, x.sum(dim=1))
loss = lambda batch: torch.nn.functional.mse_loss(model(batch[0]).squeeze(-1), batch[1])
class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = model
    def forward(self, batch):
        return loss(batch)
# No nodes=: a launched fit is one rank of WORLD_SIZE.
result = Trainer(Model(), data).fit(strategy=DiLoCo(H=2), max_steps=4, batch_size=8, progress=False)
print(f"rank {os.environ['RANK']} history {len(result.history)} run_dir {result.run_dir is not None}")
try:
    Trainer(Model(), data).fit(strategy=DiLoCo(H=2), nodes=4, max_steps=4, batch_size=8, progress=False)
except ValueError as exc:
    print(f"rank {os.environ['RANK']} refused: {exc}")
"""


def test_a_launched_fit_is_one_rank_and_only_rank_0_keeps_history(loopback_ssh: SshWorld,
                                                                   tmp_path: Path) -> None:
    """What docs/reference/python-api.md says of Trainer.fit under a launch."""
    inv = two_ranks(loopback_ssh, tmp_path)
    script = tmp_path / "fit_rank.py"
    script.write_text(RANK_SCRIPT)
    result = meshtrain(loopback_ssh, "launch", str(inv), "--upload", str(script), "--plain",
                       "--out", str(tmp_path / "runs"), "--", "python", "fit_rank.py", cwd=tmp_path,
                       timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "rank 0 history 4 run_dir True" in result.stdout
    assert "rank 1 history 0 run_dir False" in result.stdout
    assert "rank 1 refused: nodes=4 but this launched run has WORLD_SIZE=2" in result.stdout


def test_launch_resume_is_checked_here_before_any_host_is_contacted(
    loopback_ssh: SshWorld, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``launch --resume RUN-ID`` applies simulate's resume rules to the settings the run
    was launched with (<out>/RUN-ID.settings.yaml, kept while the run may be resumed)."""
    inv = two_ranks(loopback_ssh, tmp_path)
    runs = tmp_path / "runs"
    launched = ["--strategy", "ddp", "--set", "optim=sgd", "--lr", "1e30", "--checkpoint-every", "1",
                "--steps", "5"]
    failed = meshtrain(loopback_ssh, "launch", str(inv), "--run-id", "old", "--out", str(runs), "--plain",
                       "--threads", "1", *launched, cwd=tmp_path, timeout=300)
    assert failed.returncode == 1, failed.stdout + failed.stderr  # the loss overflows at step 2
    assert "continue with: meshtrain launch" in failed.stderr
    assert (runs / "old.settings.yaml").is_file()

    def no_host(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a host was contacted")

    monkeypatch.setattr("meshtrain.launch.launcher.launch", no_host)

    def resume(run_id: str, *args: str) -> Any:
        return runner.invoke(app, ["launch", str(inv), "--out", str(runs), "--resume", run_id, *args])

    changed = resume("old", *launched[2:], "--strategy", "diloco")
    assert changed.exit_code == 2, changed.output
    assert changed.output.strip().splitlines() == [
        "error: --resume old: strategy was 'ddp' in the checkpointed run, now 'diloco'; a resumed run "
        "keeps its settings (it may change: steps upward, logging, threads, device and other settings "
        "of how it runs)"]
    wrong_lr = resume("old", *launched[:4], "--lr", "0.1", *launched[6:])
    assert wrong_lr.exit_code == 2 and "lr was 1e+30 in the checkpointed run, now 0.1" in wrong_lr.output
    (runs / "done").mkdir()
    (runs / "done" / "summary.json").write_text("{}")
    finished = resume("done", *launched)
    assert finished.exit_code == 2 and "--resume done: the run already finished" in finished.output
    # A change a resume may make passes here, and the hosts are contacted.
    allowed = resume("old", *launched[:-1], "10")  # steps upward
    assert "a host was contacted" in str(allowed.exception), allowed.output


def test_every_rank_gets_the_resolved_settings_file_and_no_training_flags(
    loopback_ssh: SshWorld, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    inv = two_ranks(loopback_ssh, tmp_path)
    seen: dict[str, Any] = {}

    def capture(inventory: Any, argv: list[str], options: Any, **kwargs: Any) -> None:
        seen.update(argv=argv, uploads=[p.name for p in options.uploads])
        raise AssertionError("captured")

    monkeypatch.setattr("meshtrain.launch.launcher.launch", capture)
    result = runner.invoke(app, ["launch", str(inv), "--out", str(tmp_path / "runs"), "--run-id", "r",
                                 "--strategy", "fedavg", "--set", "H=3", "--steps", "7", "--lr", "0.05"])
    assert "captured" in str(result.exception), result.output
    # The launcher adds what differs per host (--device, --out, --run-id) in rank_command.
    assert seen == {"argv": ["-m", "meshtrain", "simulate", "--settings-file", "r.settings.yaml"],
                    "uploads": ["r.settings.yaml"]}
    settings = yaml.safe_load((tmp_path / "runs" / "r.settings.yaml").read_text())
    assert (settings["strategy"], settings["steps"], settings["lr"]) == ("fedavg", 7, 0.05)
    assert settings["strategy_options"]["H"] == 3 and settings["task"] == "digits"


def test_the_library_prepares_a_launch_without_the_cli(loopback_ssh: SshWorld, tmp_path: Path) -> None:
    """What `launch` and `meshtrain up` both run: every check and the one resolution, as a
    library call that raises InputError and contacts no host."""
    inv = two_ranks(loopback_ssh, tmp_path)
    runs = str(tmp_path / "runs")
    with pytest.raises(InputError, match="strategy 'diloco': H must be >= 1, got -1"):
        prepare_launch(inv, None, {"set_": ["H=-1"], "out_dir": runs})
    prepared = prepare_launch(inv, None, {"set_": ["H=5"], "strategy": "diloco", "steps": 4, "out_dir": runs,
                                          "run_id": "lib"})
    assert prepared.training and prepared.spec is not None and prepared.settings_file is not None
    assert (prepared.spec.strategy_options["H"], prepared.spec.steps) == (5, 4)
    assert prepared.options.run_id == "lib" and prepared.settings_file.name in prepared.argv
    assert yaml.safe_load(prepared.settings_file.read_text())["strategy_options"]["H"] == 5
    assert not (tmp_path / "remote").exists()  # no host was contacted
    abandon_launch(prepared)  # nothing started: a new run leaves no settings file
    assert not prepared.settings_file.exists()
    with pytest.raises(InputError, match="a benchmark needs at least 2 hosts, the inventory has 1"):
        one = loopback_ssh.inventory(tmp_path / "one.yaml", [
            {"name": "alpha", "host": "127.0.0.1", "port": loopback_ssh.servers[0].port}],
            workdir=str(tmp_path / "remote"))
        benchmark_hosts(one, load_inventory(one), HostsBenchSettings())
    assert not (tmp_path / "remote").exists()
