"""The strategy planner: its costs against the alpha-beta formula written out by hand, and
the choices the rule makes on fast and slow links."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import pytest
import torch

from meshtrain.cluster import CLUSTERS, Cluster, get_cluster
from meshtrain.planning import (
    CODEC_SECONDS,
    COMM_BUDGET,
    NOISY_SPREAD,
    PROBE_ROUNDS,
    Workload,
    all_reduce_seconds,
    candidates,
    recommend,
)

GPT_PARAMETERS = 420_000  # the gpt task's model, about 1.68 MB of fp32
SLOW = Cluster("slow", "~50 Mbit/s", bandwidth=50e6 / 8, latency=1e-3)


def ring_seconds(payload: float, n: int, bandwidth: float, latency: float) -> float:
    """Ring all-reduce by the textbook: 2(n-1) latencies, 2(n-1)/n of the payload per link."""
    return 2 * (n - 1) * latency + 2 * (n - 1) / n * payload / bandwidth


def test_costs_follow_the_alpha_beta_model() -> None:
    work = Workload(GPT_PARAMETERS, step_seconds=0.05, hosts=4)
    gbe = CLUSTERS["gbe"]
    by_label = {c.label: c for c in candidates(work, gbe)}
    full = ring_seconds(GPT_PARAMETERS * 4, 4, gbe.bandwidth, gbe.latency)
    assert by_label["ddp"].comm_seconds == pytest.approx(ddp_seconds(GPT_PARAMETERS * 4, 4, gbe, 0.05),
                                                         rel=1e-6)
    assert by_label["diloco (H=50)"].comm_seconds == pytest.approx(full / 50, rel=1e-6)
    assert by_label["sparta (p=0.005)"].comm_seconds == pytest.approx(
        ring_seconds(GPT_PARAMETERS * 4 * 0.005, 4, gbe.bandwidth, gbe.latency), rel=1e-3)
    demo_per_host = GPT_PARAMETERS * 32 / 64**2 * 6  # fp32 value + int16 index per coefficient
    assert by_label["demo (topk=32, chunk=64)"].comm_seconds == pytest.approx(
        3 * gbe.latency + 3 * demo_per_host / gbe.bandwidth, rel=1e-3)
    ddp = by_label["ddp"]
    assert ddp.speedup == pytest.approx(4 * 0.05 / (0.05 + ddp.comm_seconds))
    # Compressed candidates: an all-gather of the exact wire bytes (3 peers' payloads in, ours
    # out to 3) plus encoding ours and decoding all 4, every H steps.
    scales = 4 * -(-GPT_PARAMETERS // 128)
    int8 = 3 * gbe.latency + 3 * (GPT_PARAMETERS + scales) / gbe.bandwidth \
        + GPT_PARAMETERS * (CODEC_SECONDS["int8"][0] + 4 * CODEC_SECONDS["int8"][1])
    assert by_label["diloco (H=50, compression=int8)"].comm_seconds == pytest.approx(int8 / 50, rel=1e-3)
    sparse = 3 * gbe.latency + 3 * -(-GPT_PARAMETERS // 4096) * 116 / gbe.bandwidth \
        + GPT_PARAMETERS * (CODEC_SECONDS["sparseloco"][0] + 4 * CODEC_SECONDS["sparseloco"][1])
    assert by_label["sparseloco (H=30)"].comm_seconds == pytest.approx(sparse / 30, rel=1e-3)


def ddp_seconds(payload: float, n: int, cluster: Cluster, step: float) -> float:
    """DDP's buckets by hand: 256 KiB each (the last holds the rest), the i-th ready once the
    backward pass (2/3 of the step) has produced the bytes up to its end, sent one at a time;
    the last leaves after the backward pass. What runs past the backward pass adds."""
    backward, cap = 2 / 3 * step, 256 * 1024
    sizes = [cap] * int(payload // cap) + ([payload % cap] if payload % cap else [])
    link_free, produced = 0.0, 0.0
    for size in sizes[:-1]:
        produced += size
        link_free = max(link_free, backward * produced / payload) + ring_seconds(
            size, n, cluster.bandwidth, cluster.latency)
    return max(0.0, link_free - backward) + ring_seconds(sizes[-1], n, cluster.bandwidth, cluster.latency)


def test_ddp_hides_its_buckets_behind_a_long_backward_pass_and_not_a_short_one() -> None:
    gbe, payload = CLUSTERS["gbe"], GPT_PARAMETERS * 4
    last = payload % (256 * 1024)
    buckets = [256 * 1024] * (payload // (256 * 1024)) + [last]
    sent_alone = sum(ring_seconds(b, 2, gbe.bandwidth, gbe.latency) for b in buckets)
    # A 10 s step: every bucket but the last is through long before the backward pass ends.
    slow = next(c for c in candidates(Workload(GPT_PARAMETERS, 10.0, 2), gbe) if c.strategy == "ddp")
    assert slow.comm_seconds == pytest.approx(ring_seconds(last, 2, gbe.bandwidth, gbe.latency), rel=1e-6)
    # A 1 us step hides almost nothing: the buckets cost what they cost one after the other,
    # each paying its own latency (more than one all-reduce of the whole payload).
    fast = next(c for c in candidates(Workload(GPT_PARAMETERS, 1e-6, 2), gbe) if c.strategy == "ddp")
    assert fast.comm_seconds == pytest.approx(sent_alone, abs=1e-6)
    assert fast.comm_seconds > all_reduce_seconds(payload, 2, gbe)


def test_small_model_on_a_fast_link_gets_ddp() -> None:
    plan = recommend(Workload(GPT_PARAMETERS, 0.05, 2), CLUSTERS["10gbe"])
    assert plan.choice.strategy == "ddp"
    assert plan.choice.comm_share <= COMM_BUDGET
    assert "exact" in plan.reasons[0]


def test_same_model_on_a_slow_link_gets_diloco_within_the_budget() -> None:
    plan = recommend(Workload(GPT_PARAMETERS, 0.05, 2), SLOW)
    assert plan.choice.strategy == "diloco"
    full = ring_seconds(GPT_PARAMETERS * 4, 2, SLOW.bandwidth, SLOW.latency)
    # the smallest H with full/H <= budget/(1-budget) * step
    smallest = min(h for h in (5, 10, 20, 50, 100, 200, 500) if full / h / (0.05 + full / h) <= COMM_BUDGET)
    assert plan.choice.options == {"H": smallest} == {"H": 50}
    assert plan.choice.comm_share <= COMM_BUDGET
    config = plan.as_config()
    assert config["strategy"] == "diloco" and config["strategy_options"] == {"H": 50}
    assert "DDP would spend" in config["reasons"][0]


def test_large_model_on_gigabit_gets_diloco() -> None:
    plan = recommend(Workload(242_000_000, 2.0, 4), CLUSTERS["gbe"])
    assert plan.choice.strategy == "diloco"
    assert plan.choice.comm_share <= COMM_BUDGET


def test_hopeless_link_takes_what_communicates_least_and_says_so() -> None:
    plan = recommend(Workload(242_000_000, 0.01, 2), CLUSTERS["internet"])
    weighed = [c for c in plan.candidates if c.strategy in ("diloco", "sparseloco")]
    assert plan.choice == min(weighed, key=lambda c: c.comm_seconds)
    assert plan.choice.options == {"H": 500, "compression": "int8"}
    assert "even DiLoCo H=500" in plan.reasons[1] and "communicates least" in plan.reasons[2]


def test_int8_diloco_when_fp32_diloco_does_not_fit() -> None:
    plan = recommend(Workload(242_000_000, 2.0, 4), CLUSTERS["internet"])
    assert plan.choice.options == {"H": 500, "compression": "int8"}
    assert plan.choice.comm_share <= COMM_BUDGET
    assert "even DiLoCo H=500" in plan.reasons[1] and "compute of encoding" in plan.reasons[2]
    assert plan.as_config()["strategy_options"] == {"H": 500, "compression": "int8"}


def test_one_host_needs_no_communication() -> None:
    plan = recommend(Workload(GPT_PARAMETERS, 0.05, 1), SLOW)
    assert plan.choice.strategy == "ddp" and plan.choice.comm_seconds == 0


@pytest.mark.parametrize("work", [Workload(0, 0.1, 2), Workload(10, 0.0, 2), Workload(10, 0.1, 0)])
def test_nonsense_workloads_are_refused(work: Workload) -> None:
    with pytest.raises(ValueError, match="a plan needs"):
        recommend(work, SLOW)


def test_compute_probe_times_real_steps_of_the_task_model() -> None:
    from meshtrain.planning import measure_step_seconds, trainable_parameters
    from meshtrain.tasks import TaskOptions, check_options, get_task

    task = get_task("digits")
    bundle = task.build(TaskOptions(options=check_options(task, {})))
    before = [p.detach().clone() for p in bundle.model.parameters()]
    seconds = measure_step_seconds(bundle.model, bundle.train_data, 32, bundle.collate_fn,
                                   min_steps=3, max_steps=3)
    assert 0 < seconds < 5
    assert trainable_parameters(bundle.model) == sum(p.numel() for p in before)
    # it really stepped the optimizer (the probe trains a throwaway copy of the model)
    assert any(not p.equal(b) for p, b in zip(bundle.model.parameters(), before, strict=True))


def test_compute_probe_runs_on_the_device_it_is_given() -> None:
    """On a GPU host the probe must time the GPU's steps, not the CPU's (``--strategy auto``
    passes the run's device): the model and every batch move there. "meta" stands in for a
    GPU here; tests/test_cuda.py times a real one."""
    import torch
    from helpers import Windows, tiny_gpt

    from meshtrain.planning import measure_step_times

    model = tiny_gpt()
    times = measure_step_times(model, Windows(), 4, device=torch.device("meta"), min_steps=2, max_steps=2)
    assert len(times) == 2 and {p.device.type for p in model.parameters()} == {"meta"}


def test_plan_command_prints_the_winner_first_and_why() -> None:
    from typer.testing import CliRunner

    from meshtrain.cli.main import app

    result = CliRunner().invoke(app, ["plan", "--hosts", "2", "--cluster", "wifi", "--step-seconds", "0.01"],
                                env={"COLUMNS": "160"})
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    # The winner's label may wrap under its name where the console is narrower than COLUMNS
    # says (rich reads the width once, when the CLI's console is made).
    first_row = next(i for i, line in enumerate(lines) if line.strip().startswith(("ddp", "diloco")))
    cells, below = lines[first_row].split(), lines[first_row + 1].split()
    h = cells[1] if cells[1].startswith("(H=") else below[0]
    assert cells[0] == "diloco" and h.startswith("(H="), lines[first_row:first_row + 2]  # DDP costs too much
    assert "DDP would spend" in result.output and "[1] DiLoCo" in result.output


@pytest.mark.parametrize(("args", "message"), [
    (["--hosts", "0"], "--hosts must be >= 1, got 0"),
    (["--cluster", "nosuch"], "unknown cluster 'nosuch'"),
    (["--budget", "1.5"], "--budget must be <= 1, got 1.5"),
    (["--budget", "0"], "--budget must be > 0, got 0.0"),
    (["--step-seconds", "-1"], "--step-seconds must be > 0, got -1.0"),
    # Accepted before the options were the settings' one definition: a batch of 0 samples,
    # an infinite step, an empty data path.
    (["--batch-size", "0"], "--batch-size must be >= 1, got 0"),
    (["--step-seconds", "inf"], "--step-seconds must be a finite number, got inf"),
    (["--data", ""], "--data must not be empty"),
])
def test_plan_command_refuses_bad_input_in_one_line(args: list[str], message: str) -> None:
    from typer.testing import CliRunner

    from meshtrain.cli.main import app

    result = CliRunner().invoke(app, ["plan", *args])
    assert result.exit_code == 2
    assert result.output.strip() == f"error: {message}" or message in result.output, result.output
    assert len(result.output.strip().splitlines()) == 1, result.output


def _auto_run(tmp_path: Path, *args: str) -> tuple[str, dict]:
    import yaml
    from typer.testing import CliRunner

    from meshtrain.cli.main import app

    result = CliRunner().invoke(app, ["simulate", "--strategy", "auto", "--nodes", "2", "--steps", "20",
                                      "--no-progress", "--out", str(tmp_path / "runs"), *args])
    assert result.exit_code == 0, result.output
    (run,) = (tmp_path / "runs").iterdir()
    return result.output, yaml.safe_load((run / "config.yaml").read_text())


def test_strategy_auto_takes_ddp_on_a_fast_link_and_records_why(tmp_path: Path) -> None:
    output, config = _auto_run(tmp_path, "--cluster", "10gbe", "--step-seconds", "0.05")
    assert "strategy auto: ddp on 10gbe" in output
    assert config["spec"]["strategy"] == "ddp"  # a replay of config.yaml repeats the choice
    assert config["plan"]["strategy"] == "ddp" and config["plan"]["communication_share"] <= COMM_BUDGET
    assert "exact" in config["plan"]["reasons"][0]


def test_strategy_auto_takes_diloco_within_budget_on_a_slow_link(tmp_path: Path) -> None:
    slow = tmp_path / "slow.yaml"
    slow.write_text("bandwidth: 6.25e6\nlatency: 1e-3\n")  # ~50 Mbit/s, written as researchers do
    output, config = _auto_run(tmp_path, "--cluster", str(slow), "--step-seconds", "0.001")
    plan = config["plan"]
    assert config["spec"]["strategy"] == plan["strategy"] == "diloco"
    assert config["spec"]["strategy_options"]["H"] == plan["strategy_options"]["H"]
    assert plan["communication_share"] <= COMM_BUDGET
    assert plan["trainable_parameters"] == 9610  # the digits MLP the run trained
    assert f"strategy auto: diloco (H={plan['strategy_options']['H']})" in output


def test_strategy_auto_refuses_strategy_parameters(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from meshtrain.cli.main import app

    result = CliRunner().invoke(app, ["simulate", "--strategy", "auto", "--set", "H=5",
                                      "--out", str(tmp_path)])
    assert result.exit_code == 2
    assert "--strategy auto chooses the strategy and its parameters itself" in result.output


def test_a_noisy_host_tips_a_fast_link_from_ddp_to_diloco() -> None:
    """The probe's spread (step_jitter) costs DDP a wait at every step and DiLoCo one per H
    steps: on a link where DDP fits the budget, hosts whose step varies by a third of itself
    (a busy machine) make DiLoCo the choice."""
    from meshtrain.cluster import sync_wait_seconds

    work = Workload(GPT_PARAMETERS, step_seconds=0.125, hosts=2)
    quiet = get_cluster("10gbe")
    assert recommend(work, quiet).choice.strategy == "ddp"
    busy = dataclasses.replace(quiet, step_jitter=0.04)
    plan = recommend(work, busy)
    ddp = plan.candidates[0]
    assert ddp.comm_seconds == pytest.approx(ddp_seconds(GPT_PARAMETERS * 4, 2, quiet, 0.125)
                                             + sync_wait_seconds(1, 2, busy))
    assert plan.choice.strategy == "diloco" and plan.choice.comm_share <= 0.10
    h = plan.choice.options["H"]
    assert plan.choice.comm_seconds == pytest.approx(
        (all_reduce_seconds(GPT_PARAMETERS * 4, 2, quiet) + sync_wait_seconds(h, 2, busy)) / h)


def test_streaming_and_delayed_diloco_hide_their_syncs_behind_compute() -> None:
    gbe = CLUSTERS["gbe"]
    work = Workload(GPT_PARAMETERS, 0.05, 4)
    by_label = {c.label: c for c in candidates(work, gbe)}
    full = all_reduce_seconds(GPT_PARAMETERS * 4, 4, gbe)
    fragment = all_reduce_seconds(GPT_PARAMETERS * 4 / 4, 4, gbe)
    # Four fragment syncs per H=50 steps, each hidden behind 5 steps of 50 ms.
    streaming = by_label["streaming-diloco (H=50, fragments=4, tau=5)"]
    assert streaming.comm_seconds == pytest.approx(4 * max(0.0, fragment - 5 * 0.05) / 50)
    assert streaming.peak_bytes == pytest.approx(by_label["diloco (H=50)"].peak_bytes / 4)
    # The delayed outer step hides behind the whole next round of 50 steps.
    delayed = by_label["diloco (H=50, delay=1)"]
    assert delayed.comm_seconds == pytest.approx(max(0.0, full - 50 * 0.05) / 50)
    assert delayed.comm_seconds < by_label["diloco (H=50)"].comm_seconds


def test_delayed_diloco_when_nothing_without_staleness_fits() -> None:
    # 24.2M parameters on a 0.5 MB/s link at 1 s a step: a full sync takes 290 s, more than
    # 50% of even H=500's steps; int8 and SparseLoCo still spend over 10%; but H=500 steps
    # of compute hide the whole sync of delay=1.
    link = Cluster("slow", "a slow link", bandwidth=0.5e6, latency=0.0)
    plan = recommend(Workload(24_200_000, 1.0, 4), link)
    assert plan.choice.options == {"H": 500, "delay": 1}
    assert plan.choice.comm_share <= COMM_BUDGET
    assert "hiding its syncs behind compute" in plan.reasons[-1]


# ------------------------------------------------- the compute probe runs as the run will
class _ThreadsSeen(torch.nn.Module):
    """A tiny regression model that notes torch's intra-op thread count at every forward,
    and can sleep ``delays(call)`` seconds there (a busy machine, seen by the probe)."""

    def __init__(self, delays=lambda call: 0.0) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(6, 2)
        self.threads: list[int] = []
        self.delays = delays

    def forward(self, batch):
        self.threads.append(torch.get_num_threads())
        delay = self.delays(len(self.threads))
        if delay:
            time.sleep(delay)  # stands in for a step slowed by other work on the machine
        x, y = batch
        return ((self.fc(x) - y) ** 2).mean()


@pytest.mark.parametrize(("threads", "seen"), [(None, 1), (2, 2)])
def test_strategy_auto_times_the_model_with_the_runs_threads_per_node(threads, seen) -> None:
    """``--strategy auto`` timed the model with every core while each simulated node trains
    on one thread (under load the estimate was 252x the run's step); it times it now with
    the thread count a node of the run will use, and records it with the probe's spread."""
    from types import SimpleNamespace

    from helpers import regression_data

    from meshtrain.build import choose_strategy
    from meshtrain.config.spec import RunSpec
    from meshtrain.tasks import get_task

    model = _ThreadsSeen()
    bundle = SimpleNamespace(model=model, train_data=regression_data(64), collate_fn=None)
    spec = RunSpec(nodes=2, cluster="gbe", batch_size=8, threads=threads)
    before = torch.get_num_threads()
    torch.set_num_threads(3)  # what torch would take here, were it not told (every core)
    try:
        plan = choose_strategy(spec, get_task("digits"), bundle)
    finally:
        torch.set_num_threads(before)
    assert model.threads == []  # a throwaway copy was timed: the run starts untouched
    probe = spec.extra_config["plan"]["probe"]
    assert probe["threads"] == seen and len(probe["round_seconds"]) == PROBE_ROUNDS
    assert probe["spread"] >= 0 and plan.workload.step_seconds == pytest.approx(probe["seconds"])


def test_the_probe_repeats_and_says_when_it_is_noisy() -> None:
    """Three rounds; a machine that slows down between them (a step of 5 ms, then 40 ms)
    makes a noisy probe, and the probe says so; steady steps do not."""
    from helpers import regression_data

    from meshtrain.planning import probe_compute

    # Steady steps of 100 ms: a sleep overshoots by a few ms on a loaded machine (steps of
    # 20 ms once measured 21.5/21.5/27.9 ms in a full suite: a 29% spread from the scheduler
    # alone), a small share of 100 ms.
    steady = _ThreadsSeen(lambda call: 0.1)
    calm = probe_compute(steady, regression_data(64), 8, threads=1, seconds=0.1)
    assert set(steady.threads) == {1} and len(calm.round_seconds) == PROBE_ROUNDS
    assert not calm.noisy and calm.warning() is None, calm
    assert calm.seconds == pytest.approx(0.1, rel=0.5)
    busy = probe_compute(_ThreadsSeen(lambda call: 0.005 if call <= 8 else 0.04), regression_data(64), 8,
                         threads=1, seconds=0.1)
    assert busy.noisy and busy.spread > NOISY_SPREAD, busy
    warning = busy.warning()
    assert warning is not None and "\n" not in warning
    assert f"spread {busy.spread:.0%}" in warning and "--step-seconds" in warning


def test_a_probe_is_noisy_exactly_when_its_shown_spread_is_over_the_limit() -> None:
    """The warning is decided on the whole percent it prints: a spread of 25.2% reads "25%"
    and is not noisy (a full suite once printed "spread 25%, more than 25%"); 25.6% reads
    "26%" and is."""
    from meshtrain.planning import ComputeProbe

    at_limit = ComputeProbe(seconds=1.0, round_seconds=(0.9, 1.0, 1.152), threads=1)
    over = ComputeProbe(seconds=1.0, round_seconds=(0.9, 1.0, 1.156), threads=1)
    assert f"{at_limit.spread:.0%}" == "25%" and at_limit.spread > NOISY_SPREAD
    assert not at_limit.noisy and at_limit.warning() is None
    assert over.noisy and "spread 26%, more than 25%" in (over.warning() or "")


def test_plan_says_how_it_timed_the_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """``plan`` times the model as a host's rank will train (its threads: MESHTRAIN_THREADS
    here) and prints the probe's rounds and spread (a warning line when noisy)."""
    from typer.testing import CliRunner

    from meshtrain.cli.main import app

    monkeypatch.setenv("MESHTRAIN_THREADS", "1")
    result = CliRunner().invoke(app, ["plan", "--hosts", "2", "--cluster", "wifi"], env={"COLUMNS": "300"})
    assert result.exit_code == 0, result.output
    probe = next(line for line in result.output.splitlines() if line.startswith("compute probe: "))
    assert f"a step with 1 torch thread, {PROBE_ROUNDS} rounds, spread " in probe
    noisy = [line for line in result.output.splitlines()
             if line.startswith("warning: the compute probe is noisy")]
    spread = float(probe.rsplit("spread ", 1)[1].rstrip("%")) / 100
    assert bool(noisy) == (spread > NOISY_SPREAD)  # a busy machine is said to be busy
