"""Whisper as a Mac owner meets it: every slow phase (before the first step, and a mid-run
validation's decoding) says so, and the progress line's clock, rate and time left tell
the truth."""

from __future__ import annotations

import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from in_process import meshtrain_here
from speech_fixtures import SpeechAssets, speech_fixture, whisper_options  # noqa: F401 (the fixture)

from meshtrain.hf import SpeechDataset, feature_extractor_for, find_splits, load_tokenizer
from meshtrain.progress import Progress, Status, clock
from meshtrain.tasks import TaskOptions
from meshtrain.tasks.whisper import TASK


def test_each_phase_before_training_has_a_line_before_the_first_step(speech: SpeechAssets,
                                                                      tmp_path: Path) -> None:
    cache = tmp_path / "features"  # empty: this run computes every clip's features
    proc = meshtrain_here("simulate", "--profile", "whisper-tiny-random-lora", "--nodes", "2", "--steps", "6",
                          "--data", str(speech.data), "--set", f"task_options.model={speech.model}",
                          "--set", f"task_options.feature_cache={cache}",
                          "--set", "task_options.val_fraction=0.25", "--batch-size", "2",
                          "--val-interval", "3", "--out", str(tmp_path / "runs"), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()

    def first(pattern: str) -> int:
        found = [i for i, line in enumerate(lines) if re.search(pattern, line)]
        assert found, f"no line matching {pattern!r} in:\n{proc.stdout}"
        return found[0]

    phases = [
        first(rf"^loading model {re.escape(str(speech.model))} \.\.\.$"),
        first(r"^checking and computing features of 9 training clips \.\.\.$"),
        first(r"^checking and computing features of 3 validation clips \.\.\.$"),
        first(r"^test decode \(the model generates for one clip\) \.\.\.$"),
        first(r"^measuring the untrained model's validation loss and word error rate "
              r"\(\d+ batch(es)?\) \.\.\.$"),
    ]
    step = first(r"^step 1/6  loss ")
    assert phases == sorted(phases) and phases[-1] < step
    # The validation at step 3 decodes for its WER while the bar stands still: it says so.
    mid_run = first(r"^validating at step 3/6: loss and word error rate \(\d+ batch(es)?\) \.\.\.$")
    assert first(r"^step 2/6  loss ") < mid_run < first(r"^step 3/6  loss ")
    # The features were computed up front, so the first epoch reads them (one file a clip).
    assert len(list(cache.glob("*/*.npy"))) == 12
    # Every progress line after the first step has its rate, the clock and the time left.
    progress_lines = [line for line in lines if line.startswith("step ")]
    assert progress_lines[-1].startswith("step 6/6")
    for line in progress_lines:
        assert re.search(r"  \d+\.\d\d steps/s  \d+:\d\d:\d\d", line), line
    assert re.search(r"  left \d+:\d\d:\d\d$", progress_lines[0]), progress_lines[0]


def test_the_clock_counts_from_when_the_work_began() -> None:
    began = time.time() - 84  # 84 s of loading before the bar
    progress = Progress(10, enabled=True, title="diloco", began=began)
    with progress:
        time.sleep(0.05)
        progress.update(1, 2.5, 100)
    line = progress.lines[0]
    clock_shown = re.search(r"steps/s  (\d+):(\d\d):(\d\d)  left", line)
    assert clock_shown, line
    h, m, s = map(int, clock_shown.groups())
    assert 84 <= 3600 * h + 60 * m + s <= 90, line
    assert clock(3725.9) == "1:02:05"


def test_a_phase_over_many_clips_prints_a_line_every_few_seconds(capsys: object) -> None:
    status = Status()
    status.LINE_EVERY = 0.0  # every clip, so the test needs no slow phase
    with status.items("checking 3 training clips", 3, "clips") as advance:
        for _ in range(3):
            advance()
    out = capsys.readouterr().out.splitlines()  # type: ignore[attr-defined]
    assert out[0] == "checking 3 training clips ..."
    assert re.fullmatch(r"  1/3 clips, [\d.]+ clips/s, left \d:\d\d:\d\d", out[1]), out
    assert Status(enabled=False).phase("quiet").__enter__() is None


def test_building_the_task_quietly_prints_nothing(speech: SpeechAssets, capsys: object) -> None:
    options = whisper_options(speech.model)
    TASK.build(TaskOptions(str(speech.data), 0, options, Status(enabled=False)))
    assert capsys.readouterr().out == ""  # type: ignore[attr-defined]


def test_without_a_cache_a_note_says_features_are_computed_every_batch(speech: SpeechAssets,
                                                                       capsys: object) -> None:
    options = whisper_options(speech.model, feature_cache=None)
    TASK.build(TaskOptions(str(speech.data), 0, options, Status()))
    out = capsys.readouterr().out  # type: ignore[attr-defined]
    assert "checking 9 training clips ..." in out and "checking 3 validation clips ..." in out
    assert out.count("note: no feature cache (task_options.feature_cache: null)") == 1


@pytest.mark.skipif(shutil.which("sox") is None, reason="no sox to write a FLAC clip")
def test_non_wav_clips_are_decoded_during_the_announced_check(speech: SpeechAssets, tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    from meshtrain.hf import HFModel

    folder = tmp_path / "mixed"
    folder.mkdir()
    shutil.copy(speech.data / "clips" / "0000.wav", folder / "a.wav")
    subprocess.run(["sox", str(speech.data / "clips" / "0001.wav"), str(folder / "b.flac")], check=True)
    (folder / "metadata.csv").write_text(f"file_name,transcription\na.wav,{speech.texts[0]}\n"
                                         f"b.flac,{speech.texts[1]}\n", encoding="utf-8")
    model = HFModel.from_pretrained(str(speech.model))
    clips, _ = find_splits(folder, 0.0)
    cache = tmp_path / "features"
    SpeechDataset(clips, feature_extractor_for(model.config, str(speech.model)),
                  load_tokenizer(str(speech.model)), None, cache, status=Status(), split="training")
    out = capsys.readouterr().out
    assert "checking, decoding non-WAV and computing features of 2 training clips ..." in out
    assert len(list(cache.glob("*/*.npy"))) == 2  # both clips' features, before any epoch


def test_a_phase_over_a_second_says_how_long_it_took(monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    import meshtrain.progress as progress

    now = [100.0]
    monkeypatch.setattr(progress.time, "perf_counter", lambda: now[0])
    with Status().phase("loading model openai/whisper-tiny"):
        now[0] += 84.2  # a real checkpoint on a slow disk
    with Status().phase("test decode"):
        now[0] += 0.3
    assert capsys.readouterr().out.splitlines() == [
        "loading model openai/whisper-tiny ...", "loading model openai/whisper-tiny: done in 84.2 s",
        "test decode ..."]
