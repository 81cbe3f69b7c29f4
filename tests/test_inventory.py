"""Inventories: the shipped examples, defaults, ~/.ssh/config aliases, and every kind of
mistake named by file, host and key; and the command line each rank gets."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import yaml

from meshtrain.hosts.inventory import InventoryError, load_inventory
from meshtrain.launch.launcher import rank_command, rank_env, training_argv

REPO = Path(__file__).resolve().parent.parent


def write(tmp_path: Path, data: object, name: str = "inv.yaml") -> Path:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data, sort_keys=False))
    return path


def base(**host_overrides: object) -> dict:
    return {
        "defaults": {"user": "alice", "python": "/usr/bin/python3", "ssh_config": "/dev/null"},
        "hosts": [{"name": "a", "host": "10.0.0.1", **host_overrides}, {"name": "b", "host": "10.0.0.2"}],
    }


def test_shipped_inventories_load() -> None:
    macs = load_inventory(REPO / "hosts" / "macs.yaml")
    assert [h.name for h in macs.hosts] == ["studio-1", "studio-2", "macbook"]
    assert [h.rank for h in macs.hosts] == [0, 1, 2]
    assert macs.master.name == "studio-1" and macs.master.advertise == "192.168.1.101"
    assert macs.hosts[1].iface == "en0" and macs.hosts[2].iface == "en1"  # per-host override
    assert macs.hosts[2].device == "cpu" and macs.hosts[0].device == "auto"
    assert macs.hosts[0].env == {"PYTORCH_ENABLE_MPS_FALLBACK": "1"}
    assert macs.rendezvous.port == 29500 and macs.rendezvous.timeout == 1800
    local = load_inventory(REPO / "hosts" / "localhost.yaml")
    assert local.world_size == 2 and {h.hostname for h in local.hosts} == {"127.0.0.1"}


def test_defaults_apply_and_hosts_override(tmp_path: Path) -> None:
    raw = base(port=2222, env={"B": 2}, workdir="/data/runs")
    raw["defaults"]["env"] = {"A": "1", "B": "1", "FLAG": True}
    inv = load_inventory(write(tmp_path, raw))
    a, b = inv.hosts
    assert (a.user, a.port, a.workdir) == ("alice", 2222, "/data/runs")
    assert (b.port, b.workdir, b.device) == (22, "~/meshtrain-runs", "auto")
    assert a.env == {"A": "1", "B": "2", "FLAG": "true"} and b.env == {"A": "1", "B": "1", "FLAG": "true"}
    assert a.advertise == "10.0.0.1"  # defaults to the address SSH uses
    assert inv.rendezvous.port == 29500


def test_ssh_config_alias_is_resolved(tmp_path: Path) -> None:
    cfg = tmp_path / "ssh_config"
    cfg.write_text("Host studio\n  HostName 192.168.7.7\n  User bob\n  Port 2200\n"
                   "  IdentityFile /keys/studio\n")
    raw = {"defaults": {"python": "/usr/bin/python3", "ssh_config": str(cfg)},
           "hosts": [{"name": "s", "host": "studio"}]}
    (h,) = load_inventory(write(tmp_path, raw)).hosts
    assert (h.host, h.hostname, h.user, h.port, h.identity_file) == (
        "studio", "192.168.7.7", "bob", 2200, "/keys/studio")
    assert h.advertise == "192.168.7.7"


@pytest.mark.parametrize(
    "change, expected",
    [
        (lambda r: r["hosts"][1].update(prot=22), r"host 'b': unknown key 'prot'"),
        (lambda r: r["hosts"][1].pop("host"), r"host 'b': missing key 'host'"),
        (lambda r: r["hosts"][1].update(name="a"), r"host 'a': duplicate name 'a'"),
        (lambda r: r["hosts"][0].update(port=70000), r"host 'a': key 'port': bad port 70000"),
        (lambda r: r["hosts"][0].update(port="ssh"), r"host 'a': key 'port': bad port 'ssh'"),
        (lambda r: r["defaults"].update(port=True), r"host 'a': key 'port': bad port True"),
        (lambda r: r.update(rendezvous={"port": 0}), r"rendezvous: key 'port': bad port 0"),
        (lambda r: r.update(rendezvous={"timeout": -1}), r"rendezvous: key 'timeout'"),
        (lambda r: r.update(rendezvous={"prot": 1}), r"rendezvous: unknown key 'prot'"),
        (lambda r: r["hosts"][0].update(password="hunter2"), r"host 'a': key 'password': no passwords"),
        (lambda r: r["defaults"].update(ssh_passphrase="x"), r"defaults: key 'ssh_passphrase': no passwords"),
        (lambda r: r["defaults"].update(python="python3"),
         r"host 'a': key 'python': 'python3' must be an absolute"),
        (lambda r: r["defaults"].pop("python"), r"host 'a': missing key 'python'"),
        (lambda r: r["hosts"][1].update(device="tpu"), r"host 'b': key 'device': 'tpu' is not one of"),
        (lambda r: r["hosts"][1].update(env={"RANK": "3"}),
         r"host 'b': key 'env': RANK is set by the launcher"),
        (lambda r: r["hosts"][1].update(env={"1X": "3"}), r"host 'b': key 'env': '1X' is not a valid"),
        (lambda r: r["hosts"][1].update(iface="en0; rm -rf /"), r"host 'b': key 'iface'"),
        (lambda r: r["hosts"][1].update(host="10.0.0.2; rm -rf /"),
         r"host 'b': key 'host': '10.0.0.2; rm -rf /' is not a hostname, IP address or ssh config alias"),
        (lambda r: r["hosts"][1].update(advertise="10.0.0.2 --x"),
         r"host 'b': key 'advertise': .* is not a hostname"),
        (lambda r: r["hosts"][0].pop("name"), r"hosts\[0\]: missing key 'name'"),
        (lambda r: r["hosts"][1].update(threads=0), r"host 'b': key 'threads': expected a whole number"),
        (lambda r: r["defaults"].update(threads="8"), r"host 'a': key 'threads': .* got '8'"),
        (lambda r: r["hosts"][0].update(threads=2.5), r"host 'a': key 'threads': .* got 2.5"),
        (lambda r: r["hosts"][0].update(threads=True), r"host 'a': key 'threads': .* got True"),
        (lambda r: r["hosts"][0].update(env={"MESHTRAIN_THREADS": "2"}),
         r"host 'a': key 'env': set the thread count with 'threads'"),
        (lambda r: r.update(rendezvous={"heartbeat_timeout": 0}), r"rendezvous: key 'heartbeat_timeout'"),
        (lambda r: r.update(rendezvous={"heartbeat_timeout": "30s"}),
         r"rendezvous: key 'heartbeat_timeout': expected seconds > 0, got '30s'"),
        (lambda r: r.update(hosts=[]), r"'hosts' must be a non-empty list"),
        (lambda r: r.update(nodes=3), r"unknown key 'nodes'"),
    ],
)
def test_bad_inventory_names_file_host_and_key(tmp_path: Path, change, expected: str) -> None:
    raw = base()
    change(raw)
    path = write(tmp_path, raw)
    with pytest.raises(InventoryError) as info:
        load_inventory(path)
    message = str(info.value)
    assert message.startswith(str(path)), message
    assert re.search(expected, message), message
    assert "\n" not in message


def test_unreadable_inventories(tmp_path: Path) -> None:
    with pytest.raises(InventoryError, match="inventory file not found"):
        load_inventory(tmp_path / "nope.yaml")
    with pytest.raises(InventoryError, match=r"not valid YAML \(line \d+\)"):
        load_inventory(write(tmp_path, "hosts:\n  - [unclosed\n"))
    with pytest.raises(InventoryError, match="expected a mapping"):
        load_inventory(write(tmp_path, "- just a list\n"))


def test_rank_environment_and_command(tmp_path: Path) -> None:
    raw = base(iface="en0", env={"X": "a b"})
    raw["hosts"].append({"name": "c", "host": "10.0.0.1", "workdir": "/srv/my runs"})
    raw["rendezvous"] = {"port": 29511, "timeout": 90}
    inv = load_inventory(write(tmp_path, raw))
    a, b, c = inv.hosts
    env = rank_env(inv, c, "run-1")
    assert env["RANK"] == "2" and env["WORLD_SIZE"] == "3"
    assert (env["MASTER_ADDR"], env["MASTER_PORT"], env["MESHTRAIN_TIMEOUT"]) == ("10.0.0.1", "29511", "90")
    assert (env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"]) == ("1", "2")  # c shares a's machine
    assert env["MESHTRAIN_RUN_ID"] == "run-1" and env["PYTHONUNBUFFERED"] == "1"
    # Every rank knows the hosts by rank, to name one in a message (--balance refusing its claims).
    assert env["MESHTRAIN_HOST_NAMES"] == ",".join(h.name for h in inv.hosts)
    assert "MESHTRAIN_DEVICE" not in env  # never read: the device reaches the rank as --device
    assert rank_env(inv, a, "run-1")["GLOO_SOCKET_IFNAME"] == "en0"
    assert "GLOO_SOCKET_IFNAME" not in env
    # Rank 0's gate admits the other hosts only (names and addresses, one entry per host).
    assert rank_env(inv, a, "run-1")["MESHTRAIN_PEERS"] == "10.0.0.2,10.0.0.1"
    assert "MESHTRAIN_PEERS" not in env
    assert env["MESHTRAIN_SECRET_FILE"] == ".meshtrain-secret-run-1-2/secret"

    line = rank_command(inv, a, "run-1", training_argv(["--steps", "5", "--set", "H=2"]), training=True)
    words = shlex.split(line)
    assert words[:3] == ["cd", "~/meshtrain-runs", "&&"] or line.startswith("cd ~/")
    assert "X=a b" in words and "RANK=0" in words
    tail = words[words.index("/usr/bin/python3"):]
    assert tail == ["/usr/bin/python3", "-m", "meshtrain", "simulate", "--steps", "5", "--set", "H=2",
                    "--device", "auto", "--out", "runs", "--run-id", "run-1"]
    script = rank_command(inv, c, "run-1", ["python", "train.py", "--lr", "1e-3"], training=False)
    assert script.startswith("cd '/srv/my runs' && ") and " env " not in script
    assert script.endswith("/usr/bin/python3 train.py --lr 1e-3")


def test_launch_rejects_bad_flags_before_connecting(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from meshtrain.cli.main import app

    inv = write(tmp_path, base())  # 10.0.0.x: never contacted, the flags fail first
    runner = CliRunner()
    for args, expected in [
        (["--strategy", "nope"], "unknown strategy 'nope'"),
        (["--set", "nonsense=1"], "--set nonsense"),
        (["--profile", "no-such-profile"], "no profile named 'no-such-profile'"),
        (["--steps", "5", "--", "python", "x.py"], "training flags or a command after --, not both"),
        (["--upload", str(tmp_path / "missing.py"), "--", "true"], "--upload"),
        (["--threads", "0", "--", "true"], "--threads must be >= 1, got 0"),
        (["--threads", "100000", "--", "true"], "--threads must be <= 1024, got 100000"),
        (["--heartbeat-timeout", "-1", "--", "true"], "--heartbeat-timeout must be > 0, got -1.0"),
    ]:
        result = runner.invoke(app, ["launch", str(inv), *args])
        assert result.exit_code == 2, (args, result.output)
        assert expected in result.output, (args, result.output)
    result = runner.invoke(app, ["hosts", "check", str(tmp_path / "none.yaml")])
    assert result.exit_code == 2 and "inventory file not found" in result.output


def test_threads_default_per_host_and_reach_the_rank_environment(tmp_path: Path) -> None:
    raw = base(threads=4)
    raw["defaults"]["threads"] = 2
    raw["hosts"].append({"name": "c", "host": "10.0.0.3"})
    raw["defaults"].pop("threads")
    raw["hosts"][2]["threads"] = 1
    inv = load_inventory(write(tmp_path, raw))
    a, b, c = inv.hosts
    assert (a.threads, b.threads, c.threads) == (4, None, 1)
    assert rank_env(inv, a, "r")["MESHTRAIN_THREADS"] == "4"
    assert "MESHTRAIN_THREADS" not in rank_env(inv, b, "r")  # unset: the rank uses every core
    raw = base()
    raw["defaults"]["threads"] = 3
    inv = load_inventory(write(tmp_path, raw))
    assert [h.threads for h in inv.hosts] == [3, 3]


def test_heartbeat_settings_reach_the_rank_environment(tmp_path: Path) -> None:
    raw = base()
    inv = load_inventory(write(tmp_path, raw))
    assert inv.rendezvous.heartbeat_timeout == 30
    env = rank_env(inv, inv.hosts[0], "r")
    assert float(env["MESHTRAIN_HEARTBEAT"]) <= 30 / 4 and env["MESHTRAIN_HEARTBEAT_FD"] == "3"
    raw["rendezvous"] = {"heartbeat_timeout": 2}
    inv = load_inventory(write(tmp_path, raw))
    assert float(rank_env(inv, inv.hosts[0], "r")["MESHTRAIN_HEARTBEAT"]) <= 0.5


def test_interpreter_path_with_equals_sign_runs_as_the_program(tmp_path: Path) -> None:
    """``env`` would take ``/opt/py=3.12/bin/python`` for an assignment (exit 127); sh does not."""
    import subprocess

    folder = tmp_path / "py=3.12" / "bin"
    folder.mkdir(parents=True)
    fake = folder / "python"
    fake.write_text("#!/bin/sh\necho \"ran $0 with RANK=$RANK args $*\"\n")
    fake.chmod(0o755)
    raw = base(python=str(fake), workdir=str(tmp_path))
    inv = load_inventory(write(tmp_path, raw))
    line = rank_command(inv, inv.hosts[0], "run-1", ["python", "x.py"], training=False)
    result = subprocess.run(["/bin/sh", "-c", line], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"ran {fake} with RANK=0 args x.py\n"
