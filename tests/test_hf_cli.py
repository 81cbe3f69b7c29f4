"""Whisper through the command line: profiles resolve, list, and run end to end."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
from in_process import meshtrain_here
from speech_fixtures import SpeechAssets, speech_fixture  # noqa: F401 (the fixture)

from meshtrain.config.layers import parse_set, resolve_spec
from meshtrain.config.profiles import list_profiles, load_profile
from meshtrain.config.strategy_options import build_strategy
from meshtrain.tasks import check_options, get_task

ROOT = Path(__file__).resolve().parent.parent
WHISPER_PROFILES = ["whisper-tiny-lora", "whisper-small-diloco", "whisper-tiny-random-lora"]



@pytest.mark.parametrize("name", WHISPER_PROFILES)
def test_whisper_profiles_resolve_to_a_valid_run(name: str) -> None:
    task = get_task("whisper")
    spec = resolve_spec([("task defaults: ", task.defaults), (f"profile {name}: ", load_profile(name))])
    assert spec.task == "whisper" and spec.strategy == "diloco"
    build_strategy(spec)  # every strategy option is a real parameter
    options = check_options(task, spec.task_options)  # every task option is known
    assert options["model"]
    assert spec.description and "\n" not in spec.description


def test_whisper_tiny_lora_profile_says_what_the_issue_asks() -> None:
    spec = resolve_spec([("", load_profile("whisper-tiny-lora"))])
    assert spec.task_options["model"] == "openai/whisper-tiny"
    assert spec.task_options["lora"]["target_modules"] == ["q_proj", "v_proj"]
    assert spec.device == "auto"
    small = resolve_spec([("", load_profile("whisper-small-diloco"))])
    assert small.task_options["model"] == "openai/whisper-small" and small.task_options["lora"] is None
    # base: chains and --set overrides reach nested task options.
    random = resolve_spec([("", load_profile("whisper-tiny-random-lora")),
                           ("--set ", parse_set(["task_options.lora.r=16", "H=7"], "diloco"))])
    assert random.task_options["lora"] == {"r": 16, "alpha": 32, "dropout": 0.1,
                                           "target_modules": ["q_proj", "v_proj"]}
    assert random.task_options["language"] is None and random.strategy_options["H"] == 7


def test_profiles_command_lists_whisper_profiles_with_descriptions(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "200")  # a table 200 columns wide, as cli_process.run_cli gives it
    proc = meshtrain_here("profiles", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    found = list_profiles()
    for name in WHISPER_PROFILES:
        assert name in proc.stdout
        description = resolve_spec([("", load_profile(str(found[name])))]).description
        assert description.split()[0] in proc.stdout


def test_simulate_whisper_lora_profile_end_to_end(speech: SpeechAssets, tmp_path: Path) -> None:
    proc = meshtrain_here("simulate", "--profile", "whisper-tiny-random-lora", "--nodes", "2",
                          "--data", str(speech.data), "--set", f"task_options.model={speech.model}",
                          "--set", "task_options.save_merged=true", "--val-interval", "10",
                          "--out", str(tmp_path / "runs"), "--run-id", "w", "--no-progress", cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run = tmp_path / "runs" / "w"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["nodes"] == 2 and summary["steps"] == 20 and summary["strategy"] == "diloco"
    assert 0 <= summary["final_wer"] < float("inf")
    adapter_bytes = 4 * summary["trainable_parameters"]
    assert summary["trainable_parameters"] < 0.05 * summary["parameters"]
    assert summary["bytes_sent_per_node"] == 4 * adapter_bytes  # H=5 over 20 steps: 4 syncs
    rows = {int(r["step"]): r for r in csv.DictReader((run / "metrics.csv").open())}
    assert rows[10]["val_wer"] != "" and rows[20]["val_wer"] != ""
    model = run / "model"
    assert (model / "adapter_config.json").is_file() and (model / "merged" / "model.safetensors").is_file()


def test_whisper_hub_model_offline_is_one_line_exit_2(speech: SpeechAssets, tmp_path: Path) -> None:
    proc = meshtrain_here("simulate", "--profile", "whisper-tiny-lora", "--data", str(speech.data),
                          "--out", str(tmp_path / "runs"), "--no-progress", cwd=ROOT)
    if proc.returncode == 0:
        pytest.skip("this machine can reach the Hugging Face hub")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "openai/whisper-tiny" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


def test_missing_data_folder_is_one_line_exit_2(speech: SpeechAssets, tmp_path: Path) -> None:
    proc = meshtrain_here("simulate", "--profile", "whisper-tiny-random-lora",
                          "--data", str(tmp_path / "nope"), "--set", f"task_options.model={speech.model}",
                          "--no-progress", cwd=tmp_path)
    assert proc.returncode == 2
    assert "does not exist" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize(("setting", "message"), [
    ("task_options.lora.bias=some", "lora.bias must be one of none, all, lora_only, got 'some'"),
    ("task_options.lora.r=0", "lora.r must be >= 1, got 0"),
    ("task_options.lora.rank=4", "lora has no setting 'rank'"),
])
def test_a_bad_lora_setting_is_one_line_exit_2(speech: SpeechAssets, tmp_path: Path, setting: str,
                                               message: str) -> None:
    proc = meshtrain_here("simulate", "--profile", "whisper-tiny-random-lora", "--data", str(speech.data),
                          "--set", f"task_options.model={speech.model}", "--set", setting,
                          "--out", str(tmp_path / "runs"), "--no-progress", cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert message in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())
