"""Values that used to be accepted silently (or ended in a traceback) and now stop the run
before it trains: one line naming the value and the rule, exit 2, nothing written."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from meshtrain.cli.main import app
from meshtrain.strategies import DeMo, FedAvg

runner = CliRunner()


def one_line_exit_2(result, message: str) -> None:  # noqa: ANN001 - click's Result
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.output
    assert lines[0].startswith("error:")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--strategy", "fedavg", "--nodes", "4", "--set", "island_size=8"],
         "island_size=8 exceeds the 4 nodes"),
        (["--strategy", "demo", "--set", "compression_topk=5000"],
         "compression_topk (5000) must not exceed the coefficients of a chunk, "
         "compression_chunk^2 = 4096"),
        (["--strategy", "demo", "--set", "compression_chunk=4", "--set", "compression_topk=17"],
         "compression_chunk^2 = 16"),
        (["--strategy", "demo", "--set", "compression_decay=1.5"],
         "compression_decay must be in [0, 1], got 1.5"),
        (["--strategy", "demo", "--set", "compression_decay=-0.1"], "compression_decay must be in [0, 1]"),
        (["--set", "steps="], "--set steps=: empty value; give steps=VALUE"),
        (["--set", "steps= "], "--set steps=: empty value"),
        (["--threads", "100000"], "threads must be <= 1024, got 100000"),
        # torch raised "Overflow when unpacking long long" (no setting named) past 2**64 - 1.
        (["--seed", "99999999999999999999999"],
         "seed must be <= 9223372036854775807, got 99999999999999999999999"),
        (["--seed", "-1"], "seed must be >= 0, got -1"),
        # Above int64 a run was accepted and trained until killed.
        (["--steps", "99999999999999999999999"],
         "steps must be <= 9223372036854775807, got 99999999999999999999999"),
        (["--set", "H=99999999999999999999999"], "strategy 'diloco': H must be between "),
        # An empty text was taken as "not given": `--resume "$RUN"` with RUN unset trained from
        # scratch, `--out ""` wrote into the current folder.
        (["--resume", ""], "resume must not be empty"),
        (["--out", ""], "out_dir must not be empty"),
        (["--wandb", " "], "wandb must not be empty"),
        (["--task", ""], "task must not be empty"),
        # Each value of a repeatable flag as well.
        (["--fail", ""], "fail must not be empty"),
        (["--straggler", "node=1,slowdown=2", "--straggler", " "], "straggler must not be empty"),
        (["--set", "diloco.H=5"], "--set diloco.H: the STRATEGY.KEY form belongs to `meshtrain compare`; "
                                  "for this run give --strategy diloco --set H=5"),
    ],
)
def test_value_refused_with_one_line(args: list[str], message: str, tmp_path: Path) -> None:
    result = runner.invoke(app, ["simulate", "--no-progress", "--out", str(tmp_path), *args])
    one_line_exit_2(result, message)
    assert not any(tmp_path.iterdir()), "a refused run must leave nothing behind"


def test_islands_up_to_the_node_count_are_accepted_and_uneven_ones_explained() -> None:
    FedAvg(island_size=2).check_nodes(4)
    FedAvg(island_size=4).check_nodes(4)  # one island of everyone
    FedAvg(island_size=4).check_nodes(6)
    FedAvg().check_nodes(3)
    assert FedAvg(island_size=2).uneven_islands(4) is None
    assert FedAvg(island_size=4).uneven_islands(6) == ("island_size=4 does not divide the 6 nodes: "
                                                       "each round has 1 island(s) of 4 and one of 2")
    assert "that node averages with no one" in FedAvg(island_size=2).uneven_islands(3)


def test_uneven_islands_are_said_before_the_run(tmp_path: Path) -> None:
    result = runner.invoke(app, ["simulate", "--strategy", "fedavg", "--nodes", "3", "--steps", "2",
                                 "--set", "island_size=2", "--no-progress", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert result.output.startswith("note: island_size=2 does not divide the 3 nodes: each round has 1 "
                                    "island(s) of 2 and one of 1 (that node averages with no one")


def test_demo_topk_up_to_a_whole_chunk_is_accepted() -> None:
    DeMo(compression_topk=16, compression_chunk=4, compression_decay=0.0)
    DeMo(compression_decay=1.0)
    with pytest.raises(ValueError, match="compression_topk"):
        DeMo(compression_topk=17, compression_chunk=4)


def test_meshtrain_threads_variable_is_named(tmp_path: Path) -> None:
    for value in ("0", "100000", "four"):
        result = runner.invoke(app, ["simulate", "--no-progress", "--out", str(tmp_path)],
                               env={"MESHTRAIN_THREADS": value})
        one_line_exit_2(result, f"MESHTRAIN_THREADS must be a whole number from 1 to 1024, got '{value}'")


def test_empty_binary_and_folder_profiles_name_the_file(tmp_path: Path) -> None:
    empty = tmp_path / "empty.yaml"
    empty.write_text("# nothing yet\n")
    one_line_exit_2(runner.invoke(app, ["simulate", "--profile", str(empty)]),
                    f"profile {empty}: the file is empty")
    binary = tmp_path / "model.yaml"
    binary.write_bytes(bytes(range(256)) * 4)
    one_line_exit_2(runner.invoke(app, ["simulate", "--profile", str(binary)]),
                    f"profile {binary}: not UTF-8 text (a binary file?)")
    folder = tmp_path / "profiles"
    folder.mkdir()
    one_line_exit_2(runner.invoke(app, ["simulate", "--profile", str(folder)]),
                    f"profile {folder} is a folder, not a profile file")
