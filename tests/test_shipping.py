"""Data and local models follow a launch: content-addressed shipping through a real sshd.

The launcher runs in ``local/`` and the ranks in ``remote/`` (their workdir), so a
relative ``--data`` exists only on the launching side, as on real machines.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import yaml
from in_process import meshtrain_here
from safetensors.torch import load_file
from speech_fixtures import SpeechAssets, speech_fixture  # noqa: F401 (the fixture)
from ssh_fixtures import SshWorld, start_sshd

from meshtrain.hosts import shipping
from meshtrain.hosts.blobstore import BLOBS, INCOMING, TREES
from meshtrain.hosts.inventory import load_inventory
from meshtrain.hosts.shipping import ShipError, hash_path, ship_to_hosts
from meshtrain.hosts.ssh import connect

pytestmark = pytest.mark.slow


def two_hosts(world: SshWorld, tmp_path: Path, port: int | None = None, **defaults: object) -> Path:
    port = port or world.servers[0].port
    defaults.setdefault("workdir", str(tmp_path / "remote"))
    return world.inventory(tmp_path / "inv.yaml", [
        {"name": "alpha", "host": "127.0.0.1", "port": port},
        {"name": "beta", "host": "127.0.0.1", "port": port},
    ], **defaults)


def make_folder(root: Path) -> Path:
    (root / "sub").mkdir(parents=True)
    for i in range(4):
        (root / f"part-{i}.bin").write_bytes(os.urandom(20_000 + i))
    (root / "sub" / "same.bin").write_bytes((root / "part-0.bin").read_bytes())  # stored once
    (root / "sub" / "notes.txt").write_text("hello\n")
    return root


def test_ships_only_what_a_host_lacks_and_verifies_blobs(loopback_ssh: SshWorld, tmp_path: Path) -> None:
    folder = make_folder(tmp_path / "local" / "corpus")
    host = load_inventory(two_hosts(loopback_ssh, tmp_path)).hosts[0]
    notes: list[str] = []
    client = connect(host)
    try:
        def ship() -> tuple[int, int, int]:
            shipment = hash_path("--data", folder)
            report, = ship_to_hosts([(host, client)], [shipment], notes.append)
            tree = tmp_path / "remote" / shipment.remote
            for f in shipment.files:  # the rank's tree: the same bytes, hardlinks to blobs
                shipped = tmp_path / "remote" / TREES / shipment.tree / f.rel
                assert shipped.read_bytes() == f.local.read_bytes()
                assert shipped.stat().st_ino == (tmp_path / "remote" / BLOBS / f.sha256).stat().st_ino
            assert tree.name == "corpus" and (tree / "sub" / "notes.txt").read_text() == "hello\n"
            return report.files_sent, report.bytes_sent, report.bytes_present

        total = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) - 20_000  # one duplicate
        assert ship() == (5, total, 0)
        assert ship() == (0, 0, total)  # a second launch sends nothing
        (folder / "part-2.bin").write_bytes(os.urandom(30_000))  # one file changed: only it goes
        assert ship() == (1, 30_000, total - 20_002)
        total += 30_000 - 20_002

        # A blob damaged on the host is found (its stamp no longer matches), sent again, and
        # the tree points at the good copy.
        blob = tmp_path / "remote" / BLOBS / hash_path("--data", folder).files[0].sha256
        blob.chmod(0o644)
        blob.write_bytes(b"x" * blob.stat().st_size)
        assert ship() == (1, 20_000, total - 20_000)
        assert not any((tmp_path / "remote" / INCOMING).iterdir())  # no upload left behind
    finally:
        client.close()
    assert any("shipped to alpha: 5 files, 80.01 kB sent, 0 B already there" in n for n in notes), notes


def test_hosts_without_sftp_get_a_tar_stream(loopback_ssh: SshWorld, tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shipping, "has_sftp", lambda client: False)  # as on an sshd without the subsystem
    shipment = hash_path("--data", make_folder(tmp_path / "local" / "corpus"))
    host = load_inventory(two_hosts(loopback_ssh, tmp_path)).hosts[0]
    client = connect(host)
    try:
        report, = ship_to_hosts([(host, client)], [shipment], lambda line: None)
    finally:
        client.close()
    assert report.files_sent == 5
    for f in shipment.files:
        assert (tmp_path / "remote" / TREES / shipment.tree / f.rel).read_bytes() == f.local.read_bytes()


def test_a_host_without_space_fails_before_training(loopback_ssh: SshWorld, tmp_path: Path) -> None:
    if subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode != 0:
        pytest.skip("cannot create a mount namespace here (unshare -m) for a tiny tmpfs")
    tiny = tmp_path / "tiny"
    tiny.mkdir()
    mount = f"mount -t tmpfs -o size=8m tmpfs {tiny} && exec \"$@\""
    server = start_sshd(tmp_path / "sshd", loopback_ssh.user_key.with_suffix(".pub"),
                        wrap=("unshare", "-m", "sh", "-c", mount, "sh"))
    loopback_ssh.trust(server)
    try:
        local = tmp_path / "local"
        local.mkdir()
        (local / "corpus.txt").write_text("to be or not to be " * 5000)
        inv = two_hosts(loopback_ssh, tmp_path, port=server.port, workdir=str(tiny / "work"))
        result = meshtrain_here("launch", str(inv), "--task", "gpt", "--data", "corpus.txt",
                                "--steps", "2", "--no-progress", cwd=local)
    finally:
        server.stop()
    assert result.returncode == 2, result.stdout + result.stderr
    line, = [x for x in result.stderr.splitlines() if "not enough space" in x]
    assert f"alpha (root@127.0.0.1:{server.port}): not enough space in {tiny}/work to ship --data " \
           "corpus.txt: needs 50.10 MB (95.00 kB to send + 50.00 MB margin), " in line, line
    assert line.endswith(" free") and "8." in line  # what the tmpfs has left
    assert "nothing was started" in result.stderr and " r0 | " not in result.stdout


def test_no_ship_needs_the_path_on_every_host(loopback_ssh: SshWorld, tmp_path: Path) -> None:
    local = tmp_path / "local"
    local.mkdir()
    (local / "corpus.txt").write_text("to be or not to be " * 200)
    inv = two_hosts(loopback_ssh, tmp_path)
    args = ["launch", str(inv), "--task", "gpt", "--data", "corpus.txt", "--no-ship", "--steps", "2",
            "--set", "task_options.layers=1", "--set", "task_options.dim=16", "--set", "task_options.heads=2",
            "--set", "task_options.block_size=8", "--threads", "1", "--no-progress",
            "--out", str(tmp_path / "runs"), "--run-id", "no-ship"]
    missing = meshtrain_here(*args, cwd=local)
    assert missing.returncode == 2, missing.stdout + missing.stderr
    assert "--data corpus.txt does not exist there (relative paths start at workdir " in missing.stderr
    assert "with --no-ship every host needs it at that path" in missing.stderr

    shutil.copy(local / "corpus.txt", tmp_path / "remote" / "corpus.txt")  # today's way: put it there
    ran = meshtrain_here(*args, cwd=local)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert "shipped" not in ran.stdout and not (tmp_path / "remote" / ".meshtrain").exists()


def test_launch_ships_data_and_model_that_exist_only_here_and_matches_simulate(
    loopback_ssh: SshWorld, speech: SpeechAssets, tmp_path: Path
) -> None:
    local = tmp_path / "local"
    shutil.copytree(speech.data, local / "recordings")
    shutil.copytree(speech.model, local / "tiny-whisper")
    inv = two_hosts(loopback_ssh, tmp_path)
    training = ["--profile", "whisper-tiny-random-lora", "--data", "recordings",
                "--set", "task_options.model=tiny-whisper", "--set", "task_options.feature_cache=null",
                "--steps", "6", "--threads", "1", "--no-progress"]
    launched = meshtrain_here("launch", str(inv), *training, "--run-id", "shipped",
                              "--out", str(tmp_path / "runs"), cwd=local, timeout=240)
    assert launched.returncode == 0, launched.stdout + launched.stderr
    assert "meshtrain: shipped to alpha, beta: " in launched.stdout  # one workdir, shipped once
    assert "meshtrain: shipped --data recordings, task_options.model tiny-whisper to 2 hosts: " \
        in launched.stdout, launched.stdout
    spec = yaml.safe_load((tmp_path / "runs" / "shipped" / "config.yaml").read_text())["spec"]
    assert spec["data"].endswith("/recordings") and f"/{TREES}/" in spec["data"]

    simulated = meshtrain_here("simulate", "--nodes", "2", "--device", "cpu",  # threads: bit-identical
                               "--out", str(tmp_path / "sim"), "--run-id", "sim", *training,
                               cwd=local, timeout=240)
    assert simulated.returncode == 0, simulated.stderr
    run = tmp_path / "runs" / "shipped"
    a = load_file(run / "model" / "adapter_model.safetensors")
    b = load_file(tmp_path / "sim" / "sim" / "model" / "adapter_model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    # The whisper LoRA profile launched on two hosts (this was tests/test_hf_launch.py's own
    # launch of the same profile, on the same loopback hosts: ~30 s of CPU for the same path).
    summary = json.loads((run / "summary.json").read_text())
    assert summary["nodes"] == 2 and summary["runtime"] == "launched" and summary["steps"] == 6
    assert 0 <= summary["final_wer"] < float("inf")
    # Over real sockets too, a sync sends only the adapter, and start-up sends nothing:
    # frozen weights are compared by hash (record=False), never transferred. Two outer syncs
    # in 6 steps: at step 5 (the profile's H) and at the last step.
    assert summary["bytes_sent_per_node"] == 2 * 4 * summary["trainable_parameters"]
    assert summary["startup_bytes_sent_per_node"] == 0
    # The model names the base this machine was given, not rank 0's shipped copy inside
    # its workdir (a path only the host has): with the hosts' disks gone, it still loads.
    adapter = json.loads((run / "model" / "adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"] == str((local / "tiny-whisper").resolve())
    shutil.rmtree(tmp_path / "remote")
    clip = sorted((local / "recordings" / "clips").glob("*.wav"))[0]
    heard = meshtrain_here("transcribe", str(run / "model"), str(clip), cwd=tmp_path, timeout=120)
    assert heard.returncode == 0 and heard.stdout.startswith(f"{clip}: "), heard.stdout + heard.stderr


def test_data_that_is_nowhere_here_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(ShipError, match=r"--data nowhere: no such file or folder here .*--no-ship"):
        hash_path("--data", Path("nowhere"))
