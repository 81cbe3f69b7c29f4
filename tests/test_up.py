"""`meshtrain up`: from machines announcing SSH over mDNS to a running Whisper LoRA launch,
answered one question at a time under a real pseudo-terminal (pexpect).

The machines are the session's two namespace hosts (real sshd each), announcing
``_ssh._tcp`` with zeroconf as Macs with Remote Login do. ``up`` logs in with a key
they do not accept yet: it must show the exact ``ssh-copy-id`` line, and the test then
does what ssh-copy-id would (appends the public key to the authorized keys) and presses
Enter. The hosts' environment is prepared beforehand (a venv seeing this one's packages,
with the manifest ``hosts setup`` writes), so setup finds it up to date: a real install
needs a package index the namespaces cannot reach (see tests/test_hosts_setup.py).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from speech_fixtures import SpeechAssets, speech_fixture  # noqa: F401 (the fixture)
from ssh_fixtures import PYTHON, Namespaces, SshWorld, generate_key, rogue_announcing, start_advertising
from typer.testing import CliRunner

from meshtrain.cli.main import app
from meshtrain.config.profiles import load_profile
from meshtrain.guided import (
    ADD_TO_AGENT,
    CANNOT_FIX_HERE,
    COPY_KEY,
    MAKE_KEY,
    TRUST_HOST_KEY,
    key_fixes,
    plan_profile,
    profile_settings,
    profile_text,
    ssh_copy_id_line,
)
from meshtrain.hosts import discovery as d
from meshtrain.hosts.inventory import load_inventory, parse_inventory
from meshtrain.hosts.local_install import installed_distribution, local_install, repack_installed
from meshtrain.hosts.provisioning import MANIFEST, manifest

pytest.importorskip("zeroconf", reason="pip install 'meshtrain[discover]' (the test extra includes it)")
pytest.importorskip("aiohttp", reason="pip install 'meshtrain[dashboard]' (the test extra includes it)")
pexpect = pytest.importorskip("pexpect", reason="the test extra installs pexpect")

MACS = [("Studio One", "studio-1.local."), ("Air Two", "air-2.local.")]


@dataclass
class Lan:
    world: SshWorld
    ns: Namespaces


@pytest.fixture(scope="module")
def lan(netns_hosts: tuple[SshWorld, Namespaces]) -> Iterator[Lan]:
    """The session's namespace hosts, each announcing itself over mDNS for this module."""
    world, ns = netns_hosts
    advertisers = []
    try:
        for (service, server), host_ns in zip(MACS, ns.hosts, strict=True):
            advertisers.append(start_advertising(host_ns, service, server, ns.addresses[host_ns]))
        yield Lan(world, ns)
    finally:
        for proc in advertisers:
            proc.kill()
            proc.wait(timeout=10)


def prepared_workdir(folder: Path) -> tuple[Path, Path]:
    """A hosts' workdir whose environment `hosts setup` finds up to date, and the wheel it holds.

    The wheel is this meshtrain's installed files packed up (as setup packs an install that is
    neither editable nor from a wheel file), not a build of the checkout (~10 s, which
    tests/test_hosts_setup.py does): setup compares it by digest with the manifest written
    here and, finding them equal, never installs it."""
    folder.mkdir(parents=True)
    wheel = repack_installed(installed_distribution(), folder)
    workdir = folder / "host-workdir"
    venv = workdir / ".venv"
    subprocess.run([PYTHON, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60)
    here = sysconfig.get_paths()["purelib"]
    (Path(sysconfig.get_paths(vars={"base": str(venv), "platbase": str(venv)})["purelib"])
     / "meshtrain-test.pth").write_text(f"import site; site.addsitedir({here!r})\n")
    python = ".".join(map(str, sys.version_info[:3]))
    (venv / MANIFEST).write_text(json.dumps(manifest(local_install(folder / "check", wheel), python)))
    return workdir, wheel


def spawn_up(lan: Lan, cwd: Path, *args: str, known_hosts: Path | None = None) -> pexpect.spawn:
    # A terminal without colours: the prompts' words arrive without escape codes between them.
    env = {**os.environ, "NO_COLOR": "1", "TERM": "dumb", "COLUMNS": "250"}
    command = lan.world.command(PYTHON, "-m", "meshtrain", "up", "--timeout", "2", "--user", "root",
                                "--known-hosts", str(known_hosts or lan.world.known_hosts), *args)
    return pexpect.spawn(command[0], command[1:], cwd=str(cwd), env=env, encoding="utf-8",
                         dimensions=(60, 250), timeout=120)


@pytest.mark.slow
def test_from_nothing_to_a_running_whisper_lora_launch(lan: Lan, speech: SpeechAssets,
                                                       tmp_path: Path) -> None:
    workdir, wheel = prepared_workdir(tmp_path / "prepared")
    newcomer = generate_key(tmp_path / "newcomer_ed25519")  # no host accepts it yet
    authorized = lan.world.user_key.with_suffix(".pub")  # every test sshd's AuthorizedKeysFile
    kept = authorized.read_text()
    cwd = tmp_path / "here"
    cwd.mkdir()
    child = spawn_up(lan, cwd, "--identity-file", str(newcomer), "--workdir", str(workdir),
                     "--wheel", str(wheel), "--profile", "whisper-tiny-random-lora",
                     "--data", str(speech.data), "--set", f"task_options.model={speech.model}",
                     "--set", "steps=6", "--set", "step_seconds=0.05")  # the plan's compute per step:
    # given, not timed here (tests/test_planning.py times it), so a loaded machine stays fast
    log = open(tmp_path / "up.log", "w")  # noqa: SIM115 - kept open for the child's life
    child.logfile_read = log
    try:
        child.expect("2 machines found")
        child.expect_exact("Train on all 2 machines? [y/n]")
        child.sendline("y")
        child.expect("press Enter to check again")
        for host_ns in lan.ns.hosts:
            # The exact step for a key the host lacks; never a password prompt of our own.
            assert f"run: ssh-copy-id -i {newcomer}.pub root@{lan.ns.addresses[host_ns]}\r\n" in child.before
        authorized.write_text(kept + newcomer.with_suffix(".pub").read_text())  # what ssh-copy-id does
        child.sendline("")
        child.expect("key login works")
        child.expect("wrote hosts/lan.yaml")
        child.expect("Install this meshtrain")
        child.expect_exact("[y/n]")
        child.sendline("y")
        child.expect("up to date in")  # hosts setup: nothing to install
        child.expect("every host ready")
        child.expect("wrote clusters/lan.yaml")
        child.expect("wrote profiles/lan.yaml")
        child.expect("Start training")
        child.expect_exact("[y/n]")
        child.sendline("y")
        child.expect(r"dashboard: (http://127\.0\.0\.1:\d+/)\?token=(\S+)", timeout=60)
        base, token = child.match.group(1), child.match.group(2)
        child.expect("press Enter to close it", timeout=240)  # the run ended; its page stays up
        # The page's data, fetched where it listens (127.0.0.1 of the launching machine).
        fetch = "import sys, urllib.request; print(urllib.request.urlopen(sys.argv[1]).read().decode())"
        url = f"{base}api/state?token={token}"
        state = json.loads(subprocess.run(lan.world.command(PYTHON, "-c", fetch, url), capture_output=True,
                                          text=True, timeout=30, check=True).stdout)
        child.sendline("")
        child.expect("all 2 ranks finished")
        child.expect(pexpect.EOF, timeout=30)
    finally:
        authorized.write_text(kept)
        child.close(force=True)
        log.close()
    output = (tmp_path / "up.log").read_text()
    assert child.exitstatus == 0, output
    assert "password" not in output.lower()

    inventory = load_inventory(cwd / "hosts" / "lan.yaml")
    assert {h.hostname for h in inventory.hosts} == {lan.ns.addresses[h] for h in lan.ns.hosts}
    # hosts setup pointed python at the environment it found up to date.
    assert {h.python for h in inventory.hosts} == {str(workdir / ".venv" / "bin" / "python")}
    cluster = yaml.safe_load((cwd / "clusters" / "lan.yaml").read_text())
    assert cluster["bandwidth"] > 0
    profile = load_profile(str(cwd / "profiles" / "lan.yaml"))
    assert profile["task"] == "whisper" and profile["nodes"] == 2 and profile["steps"] == 6
    assert profile["task_options"]["model"] == str(speech.model) and profile["data"] == str(speech.data)
    assert profile["task_options"]["lora"]["r"] == 8  # from whisper-tiny-lora, through the base chain
    (run,) = [p for p in (cwd / "runs").iterdir() if p.is_dir() and (p / "summary.json").is_file()]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["nodes"] == 2 and summary["runtime"] == "launched" and summary["steps"] == 6
    rows = {row["name"]: row for row in state["runs"][0]["nodes"]}
    assert set(rows) == {h.name for h in inventory.hosts} and {r["step"] for r in rows.values()} == {6}
    config = yaml.safe_load((run / "config.yaml").read_text())
    assert config["spec"]["strategy"] == profile["strategy"]  # the planner's choice trained


def test_yes_trusts_no_new_host_key_and_leaves_out_hosts_refusing_the_key(lan: Lan, tmp_path: Path) -> None:
    stranger = generate_key(tmp_path / "stranger_ed25519")
    known = tmp_path / "known_hosts"
    known.write_text("")  # first contact with both machines
    (tmp_path / "profiles").mkdir()
    (tmp_path / "profiles" / "lan.yaml").write_text("keep me\n")  # --force: may be replaced
    child = spawn_up(lan, tmp_path, "--yes", "--force", "--identity-file", str(stranger), "--no-dashboard",
                     known_hosts=known)
    child.expect(pexpect.EOF, timeout=60)
    child.close()
    assert child.exitstatus == 1, child.before
    assert "unknown host key" in child.before and "left out: air-2, studio-1" in child.before
    assert known.read_text() == ""  # --yes alone never trusts a host key

    child = spawn_up(lan, tmp_path, "--yes", "--force", "--accept-new-host-keys", "--identity-file",
                     str(stranger), "--no-dashboard", known_hosts=known)
    child.expect(pexpect.EOF, timeout=60)
    child.close()
    output = child.before
    assert child.exitstatus == 1, output
    assert len(known.read_text().splitlines()) == 2  # recorded, as asked
    for h in lan.ns.hosts:  # then the key is refused: the step to fix it, and the host left out
        assert f"ssh-copy-id -i {stranger}.pub root@{lan.ns.addresses[h]}" in output
    assert "0 machines let us in" in output
    assert not (tmp_path / "hosts").exists()  # nothing written: it stopped before the inventory
    assert (tmp_path / "profiles" / "lan.yaml").read_text() == "keep me\n"


def test_asks_before_replacing_the_files_it_writes(lan: Lan, tmp_path: Path) -> None:
    (tmp_path / "hosts").mkdir()
    (tmp_path / "hosts" / "lan.yaml").write_text("keep me\n")
    child = spawn_up(lan, tmp_path, "--no-dashboard")
    child.expect_exact("hosts/lan.yaml exists: replace? [y/n]")
    child.sendline("n")  # the default is no
    child.expect(pexpect.EOF, timeout=30)
    child.close()
    assert child.exitstatus == 2 and "pass --force to replace them" in child.before
    assert (tmp_path / "hosts" / "lan.yaml").read_text() == "keep me\n"


# ---------------------------------------------------------------- the library steps, no network
def test_key_fixes_give_the_exact_command(tmp_path: Path) -> None:
    key = generate_key(tmp_path / "id_ed25519")
    raw = {"defaults": {"user": "alice", "python": "/usr/bin/python3"},
           "hosts": [{"name": "a", "host": "192.168.1.5"}, {"name": "b", "host": "192.168.1.6", "port": 2222},
                     {"name": "c", "host": "192.168.1.7", "identity_file": str(tmp_path / "nokey")},
                     {"name": "e", "host": "192.168.1.8"}]}
    hosts = list(parse_inventory(raw, tmp_path / "x.yaml").hosts)
    checks = {"a": d.KeyCheck(d.REFUSED, "refused"), "b": d.KeyCheck(d.REFUSED, "refused"),
              "c": d.KeyCheck(d.REFUSED, "refused"), "e": d.KeyCheck(d.ACCEPTED, "")}
    fixes = {f.host.name: f for f in key_fixes(hosts, checks, home=tmp_path / "empty")}
    assert set(fixes) == {"a", "b", "c"}  # e lets us in already
    # No key pair at all: make one first.
    assert fixes["a"].kind == MAKE_KEY
    assert fixes["a"].command == f"ssh-keygen -t ed25519 -f {tmp_path}/empty/.ssh/id_ed25519"
    (home := tmp_path / "home" / ".ssh").mkdir(parents=True)
    shutil.copy2(key.with_suffix(".pub"), home / "id_ed25519.pub")
    fixes = {f.host.name: f for f in key_fixes(hosts, checks, home=tmp_path / "home")}
    assert fixes["a"].kind == COPY_KEY
    assert fixes["a"].command == f"ssh-copy-id -i {home}/id_ed25519.pub alice@192.168.1.5"
    assert fixes["b"].command == f"ssh-copy-id -i {home}/id_ed25519.pub -p 2222 alice@192.168.1.6"
    # An identity file without its .pub: make the pair first.
    assert fixes["c"].kind == MAKE_KEY and fixes["c"].command == f"ssh-keygen -t ed25519 -f {tmp_path}/nokey"
    checks = {**checks, "a": d.KeyCheck(d.NEEDS_AGENT, "passphrase"),
              "b": d.KeyCheck(d.HOST_KEY_UNKNOWN, "unknown host key (ssh-ed25519 SHA256:x)"),
              "c": d.KeyCheck(d.HOST_KEY_CHANGED, "HOST KEY CHANGED")}
    fixes = {f.host.name: f for f in key_fixes(hosts, checks, home=tmp_path / "home")}
    assert fixes["a"].kind == ADD_TO_AGENT and fixes["a"].command == "ssh-add"
    assert fixes["b"].kind == TRUST_HOST_KEY and fixes["b"].command is None
    assert fixes["c"].kind == CANNOT_FIX_HERE and fixes["c"].command is None
    assert (ssh_copy_id_line(hosts[0], Path("/k/my key.pub"))
            == "ssh-copy-id -i '/k/my key.pub' alice@192.168.1.5")  # quoted for the shell


# ---------------------------------------------------------------- bad input: one line, exit 2
runner = CliRunner()


@pytest.mark.parametrize(("args", "message"), [
    (["--name", "a/b"], "--name 'a/b': expected a plain file name"),
    (["--profile", "no-such-profile"], "no profile named 'no-such-profile'"),
    (["--set", "steps=abc"], "--set steps must be a whole number, got 'abc'"),
    (["--set", "H=5"], "--set: meshtrain up lets the planner choose the strategy"),
    (["--data", "/no/such/folder"], "--data /no/such/folder: no such file or folder"),
    (["--timeout", "0"], "--timeout: expected seconds"),
])
def test_bad_input(args: list[str], message: str) -> None:
    result = runner.invoke(app, ["up", "--yes", *args])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and message in lines[0], result.output


def test_without_zeroconf_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "zeroconf", None)  # what an environment without it sees
    result = runner.invoke(app, ["up", "--yes", "--no-dashboard"])
    assert result.exit_code == 2
    assert "pip install 'meshtrain[discover]'" in result.output and len(result.output.splitlines()) == 1


def test_without_a_terminal_it_asks_for_yes() -> None:
    result = runner.invoke(app, ["up", "--no-dashboard"])  # stdin is no terminal here
    assert result.exit_code == 2
    assert "run it in one, or pass --yes" in result.output


def test_existing_files_are_not_replaced_under_yes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "hosts").mkdir()
    (tmp_path / "hosts" / "lan.yaml").write_text("keep me\n")
    result = runner.invoke(app, ["up", "--yes", "--no-dashboard"])
    assert result.exit_code == 2
    assert "hosts/lan.yaml already exist; pass --force" in result.output
    assert (tmp_path / "hosts" / "lan.yaml").read_text() == "keep me\n"


def test_the_planned_strategy_keeps_the_profiles_own_options(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mine.yaml").write_text("task: digits\nstrategy: diloco\n"
                                        "strategy_options: {H: 7, outer_lr: 0.5}\nsteps: 30\n")
    # A millisecond of compute per step over the internet: syncing every step would dominate.
    settings = profile_settings("mine.yaml", data=None, overrides=["step_seconds=0.001", "lr=0.01"])
    slow = plan_profile(settings, cluster="internet", hosts=2)
    assert slow.plan.choice.strategy == "diloco" and slow.settings["strategy"] == "diloco"
    options = slow.settings["strategy_options"]  # the task's suggestions < the profile's < the plan's
    assert options["H"] == slow.plan.choice.options["H"] != 7 and options["outer_lr"] == 0.5
    assert slow.settings["lr"] == 0.01 and slow.settings["nodes"] == 2
    # Ten seconds of compute on 10 Gb Ethernet: DDP, without DiLoCo's options.
    settings = profile_settings("mine.yaml", data=None, overrides=["step_seconds=10"])
    fast = plan_profile(settings, cluster="10gbe", hosts=2)
    assert fast.settings["strategy"] == "ddp" and fast.settings["strategy_options"] == {}
    # The written profile loads back as the planned settings, the reasons as comments.
    text = profile_text(fast, inventory=Path("hosts/lan.yaml"), cluster=Path("clusters/lan.yaml"),
                        source="mine.yaml", path=Path("profiles/lan.yaml"))
    (tmp_path / "profiles").mkdir()
    (tmp_path / "profiles" / "lan.yaml").write_text(text)
    loaded = load_profile("profiles/lan.yaml")
    assert {k: v for k, v in loaded.items() if k != "description"} == fast.settings
    assert f"#   {fast.plan.reasons[0]}" in text


def test_yes_never_takes_a_name_a_rogue_claims(lan: Lan, tmp_path: Path) -> None:
    """A rogue announcing studio-1.local at its own address became rank 0 under
    `up --yes --accept-new-host-keys`, and the real studio-1 was dropped. The name is a
    conflict: reported, left out, never offered, even to --yes."""
    rogue_ns = lan.ns.hosts[1]  # air-2's namespace: another machine on the LAN claims studio-1
    with rogue_announcing(rogue_ns, "claim", 1, [lan.ns.addresses[rogue_ns]], lan.ns.addresses[rogue_ns]):
        child = spawn_up(lan, tmp_path, "--yes", "--accept-new-host-keys", "--no-dashboard",
                         known_hosts=tmp_path / "known_hosts")
        child.expect(pexpect.EOF, timeout=60)
        child.close()
    output = " ".join(child.before.split())
    assert child.exitstatus == 1, output
    studio, air = (lan.ns.addresses[h] for h in lan.ns.hosts)
    assert f"conflict: studio-1 was announced with 2 addresses ({', '.join(sorted([studio, air]))})" in output
    assert "training across machines needs at least 2, 1 chosen" in output
    assert not (tmp_path / "known_hosts").exists() and not (tmp_path / "hosts").exists()
