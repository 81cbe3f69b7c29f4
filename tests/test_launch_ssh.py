"""The launcher against a real OpenSSH server on 127.0.0.1: host keys, authentication,
preflight errors, `hosts check`, and two ranks launched through it (a script calling
Trainer.fit, its run directory copied back)."""

from __future__ import annotations

import os
import socket
import textwrap
from pathlib import Path

import pytest
import yaml
from ssh_fixtures import SshWorld, generate_key, meshtrain

from meshtrain.hosts.inventory import load_inventory
from meshtrain.hosts.ssh import SSHError, connect, run

pytestmark = pytest.mark.slow


def two_ranks(world: SshWorld, tmp_path: Path, **defaults: object) -> Path:
    port = world.servers[0].port
    defaults.setdefault("workdir", str(tmp_path / "remote"))
    return world.inventory(tmp_path / "inv.yaml", [
        {"name": "alpha", "host": "127.0.0.1", "port": port},
        {"name": "beta", "host": "127.0.0.1", "port": port},
    ], **defaults)


def test_connect_runs_commands(loopback_ssh: SshWorld, tmp_path: Path) -> None:
    host = load_inventory(two_ranks(loopback_ssh, tmp_path)).hosts[0]
    client = connect(host)
    try:
        assert client.get_transport().is_active()
        result = run(client, "echo out; echo err >&2; exit 3")
        assert (result.status, result.stdout, result.stderr) == (3, "out\n", "err\n")
    finally:
        client.close()


def test_unknown_host_key_is_refused_then_accepted_on_request(loopback_ssh: SshWorld, tmp_path: Path) -> None:
    known = tmp_path / "known_hosts"
    host = load_inventory(two_ranks(loopback_ssh, tmp_path, known_hosts=str(known))).hosts[0]
    with pytest.raises(SSHError) as info:
        connect(host)
    assert "unknown host key" in str(info.value) and "--accept-new-host-keys" in str(info.value)
    assert not known.exists()  # refusing records nothing

    connect(host, accept_new_host_keys=True).close()
    recorded = known.read_text()
    assert recorded == loopback_ssh.servers[0].known_hosts_line()
    connect(host).close()  # now known: no flag needed
    connect(host, accept_new_host_keys=True).close()
    assert known.read_text() == recorded  # not recorded twice


def test_changed_host_key_is_refused_even_when_accepting_new(loopback_ssh: SshWorld, tmp_path: Path) -> None:
    other = generate_key(tmp_path / "other_host_key")
    kind, blob = other.with_suffix(".pub").read_text().split()[:2]
    known = tmp_path / "known_hosts"
    known.write_text(f"[127.0.0.1]:{loopback_ssh.servers[0].port} {kind} {blob}\n")
    host = load_inventory(two_ranks(loopback_ssh, tmp_path, known_hosts=str(known))).hosts[0]
    with pytest.raises(SSHError, match="HOST KEY CHANGED.*ssh-keygen -R"):
        connect(host, accept_new_host_keys=True)
    assert known.read_text().count("\n") == 1


def test_wrong_key_and_closed_port_are_one_line_errors(loopback_ssh: SshWorld, tmp_path: Path) -> None:
    stranger = generate_key(tmp_path / "stranger")
    host = load_inventory(two_ranks(loopback_ssh, tmp_path, identity_file=str(stranger))).hosts[0]
    with pytest.raises(SSHError, match=r"alpha \(root@127.0.0.1:\d+\): authentication refused"):
        connect(host)
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    inv = loopback_ssh.inventory(tmp_path / "closed.yaml", [{"name": "gone", "host": "127.0.0.1",
                                                              "port": closed}])
    with pytest.raises(SSHError, match="cannot reach port .*connection refused"):
        connect(load_inventory(inv).hosts[0], timeout=3)


def test_launch_preflight_errors_start_nothing(loopback_ssh: SshWorld, tmp_path: Path) -> None:
    inv = two_ranks(loopback_ssh, tmp_path)
    text = inv.read_text().replace("name: beta", "name: beta\n  python: /nonexistent/bin/python3")
    inv.write_text(text)
    marker = tmp_path / "remote" / "started"
    result = meshtrain(loopback_ssh, "launch", str(inv), "--", "touch", str(marker), cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "beta" in errors[0] and "/nonexistent/bin/python3 not found" in errors[0]
    assert "nothing was started" in result.stderr
    assert not marker.exists()

    bad = tmp_path / "bad.yaml"
    bad.write_text(inv.read_text().replace("port:", "prot:", 1))
    result = meshtrain(loopback_ssh, "launch", str(bad), "--", "true", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and "unknown key 'prot'" in result.stderr
    assert "Traceback" not in result.stderr


def test_hosts_check_passes_and_finds_a_busy_rendezvous_port(loopback_ssh: SshWorld, tmp_path: Path) -> None:
    inv = two_ranks(loopback_ssh, tmp_path)
    result = meshtrain(loopback_ssh, "hosts", "check", str(inv), cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "all 2 hosts ready" in result.stdout
    assert "FAIL" not in result.stdout and result.stdout.count("ok reached") == 2

    with socket.socket() as busy:  # someone else holds rank 0's rendezvous port
        busy.bind(("0.0.0.0", 0))
        busy.listen()
        port = busy.getsockname()[1]
        inv = two_ranks(loopback_ssh, tmp_path, rendezvous={"port": port, "timeout": 60},
                        python="/usr/bin/nonexistent-python")
        text = inv.read_text().replace("name: alpha", f"name: alpha\n  python: {_python()}")
        inv.write_text(text)
        result = meshtrain(loopback_ssh, "hosts", "check", str(inv), cwd=tmp_path)
    assert result.returncode == 1
    assert "alpha: rendezvous: cannot listen on port" in result.stderr
    assert "beta: python: /usr/bin/nonexistent-python is not an executable" in result.stderr


def test_hosts_check_on_an_80_column_terminal_shows_every_check_whole(
        loopback_ssh: SshWorld, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ten columns do not fit 80: rich cut every check to "o…". Each host is then its name
    and address on a line, and every check, named, below it."""
    from meshtrain.cli.console import wide_console
    from meshtrain.hosts.checks import CHECKS

    inv = two_ranks(loopback_ssh, tmp_path)
    monkeypatch.setattr(wide_console, "_width", 80)
    result = meshtrain(loopback_ssh, "hosts", "check", str(inv), cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "…" not in result.stdout and "all 2 hosts ready" in result.stdout
    assert max(len(line.rstrip()) for line in result.stdout.splitlines()) <= 80
    lines = result.stdout.splitlines()
    alpha, beta, ready = lines.index("alpha"), lines.index("beta"), lines.index("all 2 hosts ready")
    for rank, (start, end) in enumerate(((alpha, beta), (beta, ready))):
        card = " ".join(" ".join(lines[start + 2 : end]).split())  # below the name and address
        assert card.startswith(f"rank {rank} ssh ok"), card
        for check in CHECKS:
            assert f" {check} ok " in f" {card} ", (rank, check, card)
    assert " ".join(" ".join(lines[beta + 2 : ready]).split()).endswith("rendezvous ok reached")


def _python() -> str:
    import sys

    return sys.executable


TRAIN_SCRIPT = textwrap.dedent("""
    # An ordinary training script: the same file runs under torchrun or `meshtrain launch`.
    import os
    import torch
    from torch import nn
    from torch.utils.data import TensorDataset
    from meshtrain import Trainer
    from meshtrain.strategies import DiLoCo

    class Regression(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(8, 1)

        def forward(self, batch):
            x, y = batch
            return nn.functional.mse_loss(self.linear(x).squeeze(-1), y)

    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 8, generator=g)
    data = TensorDataset(x, x.sum(dim=1))
    torch.manual_seed(0)
    result = Trainer(Regression(), data).fit(strategy=DiLoCo(H=4), max_steps=8, batch_size=16,
                                             progress=False)
    # One string, one write: with PYTHONUNBUFFERED two ranks' multi-argument prints interleave.
    print(f"rank {os.environ['RANK']} local rank {os.environ['LOCAL_RANK']} done")
""")


def test_launch_script_with_trainer_fit(loopback_ssh: SshWorld, tmp_path: Path) -> None:
    inv = two_ranks(loopback_ssh, tmp_path)
    script = tmp_path / "train.py"
    script.write_text(TRAIN_SCRIPT)
    result = meshtrain(loopback_ssh, "launch", str(inv), "--upload", str(script), "--run-id", "fit",
                       "--out", str(tmp_path / "runs"), "--", "python", "train.py", cwd=tmp_path)
    run_id = "fit"
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert "alpha r0 | rank 0 local rank 0 done" in lines
    assert "beta r1  | rank 1 local rank 1 done" in lines
    local = tmp_path / "runs" / run_id
    assert {"config.yaml", "metrics.csv", "summary.json", "model.pt"} <= {p.name for p in local.iterdir()}
    remote = tmp_path / "remote" / "runs" / run_id
    assert (remote / "model.pt").read_bytes() == (local / "model.pt").read_bytes()
    assert '"nodes": 2' in (local / "summary.json").read_text()
    assert not any(p.name.startswith(".") for p in (tmp_path / "runs").iterdir())  # no temp dir left
    # Both ranks run on this machine (LOCAL_WORLD_SIZE=2): they share its cores, not each
    # take all of them (oversubscribed, OpenMP's waiting threads spin against each other).
    threads = yaml.safe_load((local / "config.yaml").read_text())["train"]["threads"]
    assert threads == max(1, len(os.sched_getaffinity(0)) // 2)


def test_the_same_script_runs_under_torchrun(tmp_path: Path) -> None:
    import shutil
    import subprocess
    import sys

    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    if torchrun is None:
        pytest.skip("torchrun is not installed beside this interpreter")
    (tmp_path / "train.py").write_text(TRAIN_SCRIPT)
    result = subprocess.run([torchrun, "--standalone", "--nproc-per-node", "2", "train.py"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "rank 0 local rank 0 done" in result.stdout and "rank 1 local rank 1 done" in result.stdout
    (run_dir,) = (tmp_path / "runs").iterdir()
    assert (run_dir / "model.pt").is_file() and '"nodes": 2' in (run_dir / "summary.json").read_text()


def test_launch_refuses_unknown_host_then_accepts_it_once(loopback_ssh: SshWorld, tmp_path: Path) -> None:
    known = tmp_path / "known_hosts"
    inv = two_ranks(loopback_ssh, tmp_path, known_hosts=str(known))
    refused = meshtrain(loopback_ssh, "launch", str(inv), "--", "true", cwd=tmp_path)
    assert refused.returncode == 2
    assert refused.stderr.count("unknown host key") == 2 and "--accept-new-host-keys" in refused.stderr
    accepted = meshtrain(loopback_ssh, "launch", str(inv), "--accept-new-host-keys", "--", "true",
                         cwd=tmp_path)
    assert accepted.returncode == 0, accepted.stdout + accepted.stderr
    assert known.read_text() == loopback_ssh.servers[0].known_hosts_line()  # both ranks, one line
