"""The whisper LoRA profile launched on two hosts through a real sshd (127.0.0.1)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import yaml
from in_process import meshtrain_here
from speech_fixtures import SpeechAssets, speech_fixture  # noqa: F401 (the fixture)
from ssh_fixtures import SshWorld

pytestmark = pytest.mark.slow


def test_launch_whisper_lora_profile_on_two_hosts(
    loopback_ssh: SshWorld, speech: SpeechAssets, tmp_path: Path
) -> None:
    port = loopback_ssh.servers[0].port
    inv = loopback_ssh.inventory(tmp_path / "macs.yaml", [
        {"name": "mac-a", "host": "127.0.0.1", "port": port},
        {"name": "mac-b", "host": "127.0.0.1", "port": port},
    ], workdir=str(tmp_path / "remote"))
    result = meshtrain_here("launch", str(inv), "--profile", "whisper-tiny-random-lora",
                            "--data", str(speech.data), "--set", f"task_options.model={speech.model}",
                            "--run-id", "whisper-2h", "--out", str(tmp_path / "runs"), "--no-progress",
                            cwd=tmp_path, timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr
    run = tmp_path / "runs" / "whisper-2h"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["nodes"] == 2 and summary["runtime"] == "launched"
    assert 0 <= summary["final_wer"] < float("inf")
    # Over real sockets too, a sync sends only the adapter, and start-up sends nothing:
    # frozen weights are compared by hash (record=False), never transferred.
    assert summary["bytes_sent_per_node"] == 4 * 4 * summary["trainable_parameters"]
    assert summary["startup_bytes_sent_per_node"] == 0
    assert (run / "model" / "adapter_model.safetensors").is_file()
    # The model names the base this machine was given, not rank 0's shipped copy inside
    # its workdir (a path only the host has): with the hosts' disks gone, it still loads.
    adapter = json.loads((run / "model" / "adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"] == str(speech.model.resolve())
    shutil.rmtree(tmp_path / "remote")
    clip = sorted((speech.data / "clips").glob("*.wav"))[0]
    heard = meshtrain_here("transcribe", str(run / "model"), str(clip), cwd=tmp_path, timeout=120)
    assert heard.returncode == 0 and heard.stdout.startswith(f"{clip}: "), heard.stdout + heard.stderr
    # Both ranks run on this machine (LOCAL_WORLD_SIZE=2): they share its cores, not each
    # take all of them (oversubscribed, OpenMP's waiting threads spin against each other).
    threads = yaml.safe_load((run / "config.yaml").read_text())["train"]["threads"]
    assert threads == max(1, len(os.sched_getaffinity(0)) // 2)
