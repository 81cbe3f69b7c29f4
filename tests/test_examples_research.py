"""The research examples run as documented (small settings so the suite stays fast)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from test_examples import load_example

from meshtrain.runs import load_run


def test_compare_digits_example_writes_a_comparison_with_plots(tmp_path: Path, capsys) -> None:
    result = load_example("compare_digits").main(["--steps", "30", "--out", str(tmp_path)])
    assert [row["strategy"] for row in result.rows] == ["ddp", "diloco", "sparta"]
    document = json.loads((result.folder / "comparison.json").read_text())
    assert document["runs"] == json.loads(json.dumps(result.rows))
    for row in result.rows:
        summary = json.loads((result.folder / row["strategy"] / "summary.json").read_text())
        assert row["final_val_loss"] == summary["final_val_loss"]
        assert summary["steps"] == 30
    # DiLoCo(H=25) syncs at step 25 and at the end: 2 of DDP's 30 all-reduces, 15x fewer bytes.
    assert result.rows[1]["ddp_bytes_per_this"] == pytest.approx(15, rel=0.01)
    # SPARTA's 30 sparse steps are cheap; its final full average dominates a run this short.
    assert 20 < result.rows[2]["ddp_bytes_per_this"] < 30
    for name in ("val_loss_vs_steps", "val_loss_vs_bytes", "val_loss_vs_time"):
        assert (result.folder / f"{name}.png").stat().st_size > 10_000
    assert "15x fewer than DDP" in capsys.readouterr().out


def test_nanogpt_example_learns_from_a_text_file_and_samples(tmp_path: Path, capsys) -> None:
    text = tmp_path / "input.txt"
    text.write_text("First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n\n"
                    * 60)
    summary = load_example("nanogpt_shakespeare").main(
        [str(text), "--steps", "40", "--H", "10", "--layers", "1", "--dim", "32", "--block-size", "16",
         "--out", str(tmp_path / "runs")])
    assert summary["strategy"] == "diloco"
    assert summary["final_val_loss"] < summary["initial"]["val_loss"] - 0.5  # it learns the text
    # 4 syncs of H=10 over 40 steps, each a ring all-reduce of the float32 parameters.
    assert summary["bytes_sent_per_node"] == 4 * 2 * 3 / 4 * summary["trainable_parameters"] * 4
    out = capsys.readouterr().out
    assert re.search(r"^step 40/40  loss ", out, re.MULTILINE)  # it shows its progress
    sample = out.split("run directory", 1)[1].split("\n", 1)[1]
    assert len(sample.strip()) > 100 and set(sample) <= set(text.read_text())


def test_federated_islands_example_averages_in_groups_of_4(tmp_path: Path) -> None:
    summaries = load_example("federated_islands").main(
        ["--steps", "20", "--H", "10", "--out", str(tmp_path)])
    size = summaries["islands"]["trainable_parameters"] * 4
    assert summaries["islands"]["nodes"] == 16
    # Two island rounds (a ring of 4 sends 2*3/4 of the model per node), then the final
    # sync over all 16 (2*15/16) so the run ends with one global model.
    assert summaries["islands"]["bytes_sent_per_node"] == pytest.approx(
        (2 * 2 * 3 / 4 + 2 * 15 / 16) * size)
    assert summaries["everyone"]["bytes_sent_per_node"] == pytest.approx(2 * (2 * 15 / 16) * size)
    # Both runs are named <time>-fedavg-16n (the second -2 when both start within one second):
    # tell them apart by what each recorded.
    runs = [load_run(p) for p in tmp_path.iterdir() if re.search(r"-fedavg-16n(-\d+)?$", p.name)]
    assert sorted(str(r.config["strategy"]["island_size"]) for r in runs) == ["4", "None"]
