"""``meshtrain hosts bench``: the alpha-beta fit, cluster files, and a real measurement.

* The fit recovers a known latency and bandwidth exactly from timings the model made.
* A cluster file round-trips through ``get_cluster``; bad ones are one line, exit 2.
* On two network-namespace hosts (real sshd, real gloo through meshtrain's ring) whose
  links are rate-limited with ``tc tbf``, the fitted bandwidth is close to the configured
  rate, and ``simulate --cluster FILE`` projects its wall-clock on the written cluster.

The namespace test is skipped (with the reason) where namespaces, sshd or tc cannot be had.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from in_process import meshtrain_here
from ssh_fixtures import Namespaces, SshWorld, meshtrain, rate_limited
from typer.testing import CliRunner

from meshtrain.cli.main import app
from meshtrain.cluster import CLUSTERS, Cluster, cluster_file_text, get_cluster, probe_label
from meshtrain.hosts.bench import (
    BenchError,
    ProbeSpec,
    Sample,
    bench_sizes,
    fit_alpha_beta,
    fitted_cluster,
    model_seconds,
    parse_size,
    probe_from_json,
    probe_to_json,
    result_text,
    samples_from_json,
    samples_to_json,
    step_spread,
)

# --------------------------------------------------------------------------- the fit


def synthetic(latency: float, bandwidth: float, group_size: int, sizes: list[int]) -> list[Sample]:
    """Timings exactly as the model says: 2(g-1) latency + moved bytes / bandwidth."""
    samples = [Sample(size, group_size, 1.0) for size in sizes]
    return [Sample(s.payload_bytes, group_size, s.hops * latency + s.moved_bytes / bandwidth)
            for s in samples]


@pytest.mark.parametrize("group_size", [2, 3, 5])
def test_fit_recovers_known_latency_and_bandwidth(group_size: int) -> None:
    samples = synthetic(3e-4, 2.5e7, group_size, bench_sizes(4096, 16 * 2**20, 8))
    fit = fit_alpha_beta(samples)
    assert fit.latency == pytest.approx(3e-4, rel=1e-9)
    assert fit.bandwidth == pytest.approx(2.5e7, rel=1e-9)
    assert fit.group_size == group_size
    cluster = fitted_cluster(fit, "x", "synthetic")
    for s in samples:  # the written cluster predicts the timings it came from
        assert model_seconds(s, cluster) == pytest.approx(s.seconds, rel=1e-9)


def test_shared_medium_cluster_predicts_the_same_times() -> None:
    """On a shared medium the model divides B by g, so the cluster records g times the fit."""
    samples = synthetic(1e-3, 1e7, 4, [2**12, 2**16, 2**20])
    fit = fit_alpha_beta(samples)
    shared = fitted_cluster(fit, "w", "wifi-like", shared_medium=True)
    assert shared.bandwidth == pytest.approx(4e7) and shared.shared_medium
    for s in samples:
        assert model_seconds(s, shared) == pytest.approx(s.seconds, rel=1e-9)


def test_fit_clamps_a_negative_latency_to_zero() -> None:
    # Small sizes faster than any line through the large ones: no negative latency is written.
    samples = [Sample(2**12, 2, 1e-5), Sample(2**20, 2, 0.2), Sample(2**22, 2, 0.8)]
    fit = fit_alpha_beta(samples)
    assert fit.latency == 0.0 and fit.bandwidth > 0


def token_bucket(latency: float, rate: float, burst: float, line_rate: float,
                 sizes: list[int]) -> list[Sample]:
    """Timings of a link shaped by a token bucket (``tc tbf``): the first ``burst`` bytes of a
    message go at ``line_rate``, the rest at ``rate``."""
    def seconds(s: Sample) -> float:
        bursting = min(s.moved_bytes, burst)
        return s.hops * latency + bursting / line_rate + (s.moved_bytes - bursting) / rate
    return [Sample(size, 2, seconds(Sample(size, 2, 1.0))) for size in sizes]


def test_the_bandwidth_is_the_sustained_rate_of_a_link_that_bursts() -> None:
    """A link that moves short messages faster than its rate (a token bucket, Wi-Fi): the fit
    keeps the rate the large sizes meet, which a training step's megabytes meet too. One line
    through every size said 1.6 GB/s for the 1 Gbit/s link measured below (its 16 MB
    all-reduce modelled at 10 ms against 134 ms), and projected DDP's communication at 0.03 s
    where a launch measured 0.78 s."""
    sizes = bench_sizes(4096, 16 * 2**20, 8)
    fit = fit_alpha_beta(token_bucket(6e-5, 1.25e8, 512 * 2**10, 2e9, sizes))
    assert fit.bandwidth == pytest.approx(1.25e8, rel=1e-9)
    # hosts bench on two namespace hosts behind `tc tbf rate 1gbit burst 512kb` (2026-11-29).
    measured = [(4000, 0.000247), (13080, 0.000241), (42776, 0.002677), (139896, 0.000429),
                (457488, 0.000391), (1496096, 0.012276), (4892604, 0.040552), (16000000, 0.133586)]
    samples = [Sample(size, 2, seconds) for size, seconds in measured]
    fit = fit_alpha_beta(samples)
    assert 1.0e8 <= fit.bandwidth <= 1.3e8, fit  # 1 Gbit/s is 1.25e8 bytes/s
    big = samples[-1]
    assert model_seconds(big, fitted_cluster(fit, "x", "tbf")) == pytest.approx(big.seconds, rel=0.05)
    # The latency is the small sizes' median, so one slow sample (43 KB, 2.7 ms) moves it little.
    assert 5e-5 <= fit.latency <= 2e-4, fit


def test_large_sizes_out_of_order_fall_back_to_a_line_through_every_size() -> None:
    """On a fast link the large sizes take milliseconds, and a busy host can time the 1.6 MB
    all-reduce slower than the 8 MB one (these sizes are test_launch_auto's). Their slope
    alone is negative: the fit once refused ("do not grow with size"), though every size
    together grows."""
    samples = [Sample(65536, 2, 3.0e-4), Sample(327680, 2, 6.0e-4), Sample(1638400, 2, 6.2e-3),
               Sample(8192000, 2, 5.0e-3)]
    fit = fit_alpha_beta(samples)
    assert 1e9 < fit.bandwidth < 1e10 and fit.latency >= 0, fit  # 8 MB in 5 ms: 1.6 GB/s


def test_fit_refuses_what_cannot_give_a_cluster() -> None:
    with pytest.raises(BenchError, match="at least 2 different sizes"):
        fit_alpha_beta([Sample(4096, 2, 1e-3), Sample(4096, 2, 2e-3)])
    with pytest.raises(BenchError, match="do not grow with size"):
        fit_alpha_beta([Sample(4096, 2, 2e-3), Sample(2**20, 2, 1e-3)])
    with pytest.raises(BenchError, match="one group"):
        fit_alpha_beta([Sample(4096, 2, 1e-3), Sample(2**20, 3, 1e-2)])


def test_sizes_and_timings_json(tmp_path: Path) -> None:
    assert [parse_size(t) for t in ("4096", "64KB", "16MiB", "1.5mb")] == [4096, 64_000, 2**24, 1_500_000]
    with pytest.raises(BenchError, match="'lots' is not a size"):
        parse_size("lots")
    sizes = bench_sizes(4000, 4_000_000, 4)
    assert sizes == [4000, 40_000, 400_000, 4_000_000]
    samples = synthetic(1e-4, 1e8, 2, sizes)
    assert samples_from_json(samples_to_json(samples), "x") == samples
    with pytest.raises(BenchError, match="^box0:bench.json: not a benchmark result"):
        samples_from_json("{}", "box0:bench.json")
    # The file comes from rank 0's host: parsed strictly.
    row = '{"payload_bytes": 4096, "group_size": 2, "seconds": %s}'
    for bad in [row % "NaN", row % "Infinity", row % "-1", row % "true",
                row.replace("4096", "4096.5") % "0.1", row.replace("4096", "1e400") % "0.1",
                ",".join([row % "0.1"] * 1001)]:
        with pytest.raises(BenchError, match="not a benchmark result"):
            samples_from_json('{"samples": [' + bad + "]}", "box0:bench.json")
    with pytest.raises(BenchError, match="larger than 1048576 bytes"):
        samples_from_json(" " * (2 << 20), "box0:bench.json")
    # The copied-back file itself: its size is checked before it is read, and bytes that are
    # not UTF-8 are one line (read_text raised UnicodeDecodeError: a traceback from hosts bench).
    copied = tmp_path / "bench.json"
    copied.write_bytes(b'{"samples": []}')
    assert result_text(copied, "box0:bench.json") == '{"samples": []}'
    copied.write_bytes(b'{"samples": ["\xff"]}')
    with pytest.raises(BenchError, match=r"^box0:bench.json: not a benchmark result \(not UTF-8 text at "
                                         r"byte 14\)$"):
        result_text(copied, "box0:bench.json")
    copied.write_bytes(b" " * (2 << 20))
    with pytest.raises(BenchError, match="larger than 1048576 bytes"):
        result_text(copied, "box0:bench.json")


# --------------------------------------------------------------------------- cluster files


def test_cluster_file_round_trips_and_named_clusters_stay(tmp_path: Path) -> None:
    cluster = Cluster("lab", "two boxes", 1.25e8, 2.5e-4, shared_medium=False, speed=0.5)
    path = tmp_path / "lab.yaml"
    path.write_text(cluster_file_text(cluster, "measured"))
    assert get_cluster(str(path)) == cluster
    assert path.read_text().startswith("# measured\n")
    assert get_cluster("wifi") is CLUSTERS["wifi"]
    (tmp_path / "min.yml").write_text("bandwidth: 1.0e+6\nlatency: 0\n")
    assert get_cluster(str(tmp_path / "min.yml")) == Cluster("min", "measured cluster from min.yml", 1e6, 0.0)


def test_cluster_file_keeps_the_compute_probe(tmp_path: Path) -> None:
    probed = Cluster("lab", "two boxes", 1.25e8, 2.5e-4, step_seconds=0.125,
                     probe=probe_label("gpt", 32, 1), step_jitter=0.004)
    path = tmp_path / "lab.yaml"
    path.write_text(cluster_file_text(probed))
    assert get_cluster(str(path)) == probed
    assert probed.probe == "task gpt, batch 32, threads 1"
    assert probe_label("gpt", 32, None) == "task gpt, batch 32, threads all"
    plain = tmp_path / "plain.yaml"  # no probe: no keys for it in the file
    plain.write_text(cluster_file_text(Cluster("plain", "x", 1e6, 0.0)))
    assert not {"step_seconds", "probe", "step_jitter"} & set(yaml.safe_load(plain.read_text()))


def test_step_spread_is_the_standard_deviation_of_normal_times_and_halves_the_pair_gap() -> None:
    import random
    import statistics

    rng = random.Random(0)
    normal = [rng.gauss(0.1, 0.01) for _ in range(20_000)]
    assert step_spread(normal) == pytest.approx(statistics.stdev(normal), rel=0.02)
    # Two hosts' sync waits half the mean gap between two steps: 0.564 x spread, exactly.
    times = [0.10, 0.12, 0.11, 0.30]
    gaps = [abs(a - b) for i, a in enumerate(times) for b in times[i + 1:]]
    assert step_spread(times) / math.sqrt(math.pi) == pytest.approx(statistics.mean(gaps) / 2)
    assert step_spread(times) < statistics.stdev(times)  # one slow step sways it less
    assert step_spread([0.1]) == 0.0


def test_probe_times_from_rank_0_are_parsed_strictly() -> None:
    spec = ProbeSpec("gpt", 32, 1, "/data/text.txt")
    assert spec.argv() == ["--probe-task", "gpt", "--probe-batch", "32", "--probe-threads", "1",
                           "--probe-data", "/data/text.txt"]
    # GPU hosts time their GPU: the inventory's device when every host has the same one.
    assert ProbeSpec("gpt", 32, None, None, "cuda").argv()[-2:] == ["--probe-device", "cuda"]
    good = {"samples": [], "probe": probe_to_json(spec, [0.12, 0.13], [0.004, 0.0])}
    assert probe_from_json(json.dumps(good), "box0:bench.json", 2) == good["probe"]
    assert probe_from_json('{"samples": []}', "box0:bench.json", 2) is None
    for bad in ({"step_seconds": [0.1]}, {"step_seconds": [0.1, -1]}, {"step_seconds": [0.1, True]},
                {"task": "gpt; rm -rf /"}, {"batch_size": 0}, {"threads": 1.5}, {"step_jitter": [0.1]},
                {"step_jitter": [0.1, -0.1]}):
        text = json.dumps({"samples": [], "probe": {**good["probe"], **bad}})
        with pytest.raises(BenchError, match="^box0:bench.json: not a benchmark result"):
            probe_from_json(text, "box0:bench.json", 2)
    with pytest.raises(BenchError, match="not a benchmark result"):
        probe_from_json(json.dumps(good).replace("0.12", "NaN"), "box0:bench.json", 2)


@pytest.mark.parametrize(("text", "message"), [
    ("name: lab\nlatency: 0.001\n", "missing key 'bandwidth'"),
    ("bandwidth: 1.0e+6\nlatency: 0.001\nstep_seconds: 0\n",
     "step_seconds: expected seconds > 0 and at most 3600, got 0"),
    ("bandwidth: -5\nlatency: 0.001\n", "bandwidth: expected bytes per second from 1000 to 1e+13, got -5"),
    # What no network is (a cluster file from a lying host, or downloaded): `plan` printed
    # 300-digit numbers from these.
    ("bandwidth: 1.0e+6\nlatency: 425\n", "latency: expected seconds from 0 to 10, got 425"),
    ("bandwidth: 1.0e+300\nlatency: 0.001\n", "bandwidth: expected bytes per second from 1000 to 1e+13"),
    ("bandwidth: 1.0e+6\nlatency: 0.001\nstep_seconds: 1.0e+300\n", "step_seconds: expected seconds > 0 "
                                                                    "and at most 3600, got 1e+300"),
    ("bandwidth: [1, 2\nlatency: 1\n", "not valid YAML (line 2)"),
    ("bandwith: 1e6\nlatency: 0.001\n", "unknown key 'bandwith'"),
    ("bandwidth: 1.0e+6\nlatency: 0.001\nshared_medium: maybe\n", "shared_medium: expected true or false"),
])
def test_bad_cluster_file_is_one_line_and_exit_2(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    result = CliRunner().invoke(app, ["simulate", "--task", "digits", "--steps", "1", "--no-progress",
                                      "--cluster", str(path), "--out", str(tmp_path / "runs")])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"error: {path}: {message}"), lines
    assert not (tmp_path / "runs").exists()  # nothing was started


def test_plan_refuses_a_cluster_file_with_numbers_no_network_has(tmp_path: Path) -> None:
    """`plan` on a cluster file that says 425 s a message printed 300-digit numbers."""
    path = tmp_path / "lied.yaml"
    path.write_text("bandwidth: 1.0e-300\nlatency: 1.0e+300\n")
    done = meshtrain_here("plan", "--hosts", "2", "--cluster", str(path), "--step-seconds", "0.1",
                          cwd=tmp_path)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.strip() == (f"error: {path}: bandwidth: expected bytes per second from 1000 to "
                                   "1e+13, got 1e-300"), done.stderr
    assert done.stdout == ""


# --------------------------------------------------------------------------- what a host reports
def bench_json(group_size: int = 2, times: tuple[float, ...] = (1e-3, 2e-3, 1.2e-2),
               sizes: tuple[int, ...] = (4096, 65536, 1048576)) -> str:
    return json.dumps({"samples": [{"payload_bytes": b, "group_size": group_size, "seconds": t}
                                   for b, t in zip(sizes, times, strict=False)]})


@pytest.mark.parametrize(("text", "refusal"), [
    # A list 2**52 long was built from this (MemoryError, or the kernel killed the launcher).
    (bench_json(group_size=2**52), "group_size 4503599627370496 is not the number of hosts (2)"),
    (bench_json(group_size=1000), "group_size 1000 is not the number of hosts (2)"),
    (bench_json(group_size=1), "group_size 1 is not the number of hosts (2)"),
    # 1e-200 s once ended hosts bench in a ZeroDivisionError traceback.
    (bench_json(times=(1e-200, 2e-200, 3e-200)), "seconds 1e-200 is not a time from 1e-06 to 3600 s"),
    (bench_json(times=(1e-3, 2e-3, 1e5)), "seconds 100000.0 is not a time from 1e-06 to 3600 s"),
    (bench_json(sizes=(4096, 65536, 2**50)),
     "payload_bytes 1125899906842624 is not a size that was measured"),
])
def test_a_host_that_reports_what_was_not_measured_is_refused_naming_the_field(text: str,
                                                                                 refusal: str) -> None:
    with pytest.raises(BenchError) as refused:
        samples_from_json(text, "box0:bench.json", 2, [4096, 65536, 1048576])
    assert str(refused.value) == f"box0:bench.json: not a benchmark result (ValueError: {refusal})"
    assert samples_from_json(bench_json(), "box0:bench.json", 2, [4096, 65536, 1048576])  # honest: read


def test_a_fit_to_times_no_network_gives_is_refused() -> None:
    """425 s a message, or more bytes a second than any link, was written into the cluster file."""
    slow = [Sample(b, 2, 850.0 + b * 1e-9) for b in (4096, 65536, 1048576)]
    with pytest.raises(BenchError, match=r"^latency: the times give 425 s per message, more than any "
                                         r"network to train over \(10 s\)$"):
        fit_alpha_beta(slow)
    fast = [Sample(b, 2, 1e-6 + b * 1e-15) for b in (4096, 65536, 1048576)]
    with pytest.raises(BenchError, match=r"^bandwidth: the times give 1e\+15 bytes/s, outside what a link "
                                         r"carries \(1000 to 1e\+13\)$"):
        fit_alpha_beta(fast)


def test_probe_step_times_beyond_an_hour_are_refused() -> None:
    text = json.dumps({"samples": [], "probe": probe_to_json(ProbeSpec("gpt", 32), [0.1, 1e300], [0.0, 0.0])})
    with pytest.raises(BenchError, match=r"step_seconds must hold one time > 0 and <= 3600 s per host"):
        probe_from_json(text, "box0:bench.json", 2)


@pytest.mark.parametrize("out", ["/proc/x.yaml", "/dev/null", "."])
def test_bench_refuses_an_output_it_cannot_write_before_measuring(tmp_path: Path, out: str) -> None:
    """`hosts bench --out /proc/x.yaml` measured every host, then lost the result in a traceback.
    The hosts here do not exist: the refusal must come before any is contacted."""
    inv = tmp_path / "inv.yaml"
    inv.write_text(yaml.safe_dump({"defaults": {"user": "nobody", "python": "/usr/bin/python3"},
                                   "hosts": [{"name": "box0", "host": "192.0.2.1"},
                                             {"name": "box1", "host": "192.0.2.2"}]}))
    done = meshtrain_here("hosts", "bench", str(inv), "--out", out, cwd=tmp_path, timeout=60)
    assert done.returncode == 2, done.stdout + done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: --out {out}: "), done.stderr
    assert "192.0.2" not in done.stdout + done.stderr


def test_missing_cluster_file_names_it(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"nowhere\.yaml: cannot read the cluster file"):
        get_cluster(str(tmp_path / "nowhere.yaml"))


# --------------------------------------------------------------------------- real hosts
RATE_MBIT = 80  # tbf rate on every host's eth0: 10 MB/s leaves each host


@pytest.fixture(scope="module")
def limited_world(netns_hosts: tuple[SshWorld, Namespaces]) -> Iterator[tuple[SshWorld, Namespaces]]:
    """The session's two namespace hosts (conftest.py), each sending at most RATE_MBIT
    through its eth0 while this module runs (the limit is removed afterwards)."""
    with rate_limited(netns_hosts[1], f"{RATE_MBIT}mbit"):
        yield netns_hosts


@pytest.fixture(scope="module")
def benched(limited_world, tmp_path_factory: pytest.TempPathFactory
            ) -> tuple[subprocess.CompletedProcess[str], Path, SshWorld]:
    """One ``hosts bench`` run on the rate-limited hosts (shared by the tests below)."""
    world, _ = limited_world
    folder = tmp_path_factory.mktemp("bench")
    hosts = [{"name": f"box{i}", "host": s.address, "workdir": str(folder / f"box{i}")}
             for i, s in enumerate(world.servers)]
    inv = world.inventory(folder / "lab.yaml", hosts, iface="eth0", rendezvous={"port": 29510, "timeout": 60})
    result = meshtrain(world, "hosts", "bench", str(inv), "--min-size", "64KB", "--max-size", "2MB",
                       "--points", "5", "--repeats", "3", "--task", "digits", "--batch-size", "16",
                       "--threads", "1", cwd=folder, timeout=180)
    return result, folder, world


def test_bench_fits_the_configured_rate(benched) -> None:
    result, folder, _ = benched
    assert result.returncode == 0, result.stdout + result.stderr
    assert "measured vs fitted model" in result.stdout and "2.00 MB" in result.stdout, result.stdout
    cluster = get_cluster(str(folder / "clusters" / "lab.yaml"))  # default --out: clusters/<inventory>
    configured = RATE_MBIT * 1e6 / 8
    # tbf holds each host to the rate; its 32 kB burst and the ring's gaps can only make a
    # link look a little faster, Python and gloo overheads a little slower.
    assert 0.5 * configured <= cluster.bandwidth <= 1.2 * configured, cluster
    assert 0 <= cluster.latency < 0.05, cluster
    assert cluster.name == "lab" and not cluster.shared_medium and cluster.speed == 1.0
    assert f"wrote clusters{'/'}lab.yaml" in result.stdout
    # The compute probe: every host timed digits steps; the slowest host's step is written.
    assert cluster.probe == "task digits, batch 16, threads 1"
    assert "compute probe: digits, batch 16, on cpu: " in result.stdout  # the inventory's device
    assert cluster.step_seconds is not None and 0 < cluster.step_seconds < 1.0, cluster
    probed = re.search(r"compute probe, seconds per step: box0 ([\d.]+), box1 ([\d.]+)", result.stdout)
    assert probed, result.stdout
    assert cluster.step_seconds == pytest.approx(max(map(float, probed.groups())), abs=1e-4)
    spread = re.search(r"spread: box0 ([\d.]+), box1 ([\d.]+)", result.stdout)
    assert spread and cluster.step_jitter == pytest.approx(max(map(float, spread.groups())), abs=1e-4)


def test_simulate_projects_onto_the_benched_cluster(benched) -> None:
    result, folder, _ = benched
    assert result.returncode == 0, result.stdout + result.stderr
    path = folder / "clusters" / "lab.yaml"
    cluster = yaml.safe_load(path.read_text())
    sim = meshtrain_here("simulate", "--task", "digits", "--strategy", "ddp", "--nodes", "2", "--steps", "3",
                         "--no-progress", "--cluster", str(path), "--step-seconds", "0.5",
                         "--out", str(folder / "runs"), "--run-id", "sim", cwd=folder)
    assert sim.returncode == 0, sim.stderr
    summary = json.loads((folder / "runs" / "sim" / "summary.json").read_text())
    projected = summary["projected"]
    assert projected["cluster"] == "lab"
    assert projected["compute_seconds"] == pytest.approx(3 * 0.5)
    # DDP: one all-reduce per step over 2 nodes (2 messages each), bytes over the measured B.
    expected = 3 * 2 * cluster["latency"] + summary["bytes_sent_per_node"] / cluster["bandwidth"]
    assert projected["communication_seconds"] == pytest.approx(expected, rel=1e-9)


def test_a_fit_that_misses_a_measurement_is_flagged() -> None:
    from meshtrain.hosts.bench import fit_warning

    good = synthetic(3e-4, 2.5e7, 2, bench_sizes(4096, 16 * 2**20, 6))
    assert fit_warning(good, fitted_cluster(fit_alpha_beta(good), "x", "synthetic")) is None
    # One size ten times slower than the line through the others (a busy link): flagged, named.
    bad = [*good[:-1], Sample(good[-1].payload_bytes, 2, good[-1].seconds * 10)]
    line = fit_warning(bad, fitted_cluster(fit_alpha_beta(bad), "x", "busy"))
    assert line is not None and "misses the" in line and "measure again" in line


def test_the_probe_on_device_auto_times_what_this_host_has() -> None:
    """``device: auto`` in the inventory (the default): each host resolves it, a GPU box to its
    GPU; here, a CPU."""
    from meshtrain.hosts.bench import probe_step_seconds

    median, spread = probe_step_seconds(ProbeSpec("digits", 16, 1, None, "auto"))
    assert 0 < median < 1.0 and spread >= 0


LYING_PYTHON = """#!/bin/sh
# A host that controls its account: its interpreter runs the real benchmark rank, then
# rank 0 replaces what it measured (the last word of the command line is --out's path).
{python} "$@"
status=$?
for word in "$@"; do out=$word; done
if [ "$2" = meshtrain.hosts.bench ] && [ -f "$out" ]; then cat {lie} > "$out"; fi
exit $status
"""


@pytest.mark.slow
def test_bench_on_real_hosts_refuses_a_group_size_rank_0_made_up(netns_hosts, tmp_path: Path) -> None:
    """Rank 0's host says 1000 hosts took part where 2 did: hosts bench wrote it into the
    cluster file and exited 0 (and 2**52 made the launcher build a list that long)."""
    world, _ = netns_hosts
    lie = tmp_path / "lie.json"
    lie.write_text(bench_json(group_size=1000, sizes=(4000, 64000)))  # the sizes asked for
    python = tmp_path / "python"
    python.write_text(LYING_PYTHON.format(python=sys.executable, lie=lie))
    python.chmod(0o755)
    hosts = [{"name": f"box{i}", "host": s.address, "workdir": str(tmp_path / f"box{i}")}
             for i, s in enumerate(world.servers)]
    inv = world.inventory(tmp_path / "lab.yaml", hosts, iface="eth0", python=str(python))
    done = meshtrain(world, "hosts", "bench", str(inv), "--min-size", "4KB", "--max-size", "64KB",
                     "--points", "2", "--repeats", "1", "--out", str(tmp_path / "lab-cluster.yaml"),
                     cwd=tmp_path, timeout=120)
    assert done.returncode == 1, done.stdout + done.stderr
    assert ("error: box0:bench.json: not a benchmark result (ValueError: group_size 1000 is not the "
            "number of hosts (2))") in done.stderr, done.stderr
    assert not (tmp_path / "lab-cluster.yaml").exists()


def test_bench_speed_is_held_to_what_a_cluster_file_may_say(tmp_path: Path) -> None:
    """--speed 1e6 was written into a cluster file that every reader then refused."""
    done = meshtrain_here("hosts", "bench", str(tmp_path / "inv.yaml"), "--speed", "1e6", cwd=tmp_path)
    assert done.returncode == 2 and done.stderr.strip() == "error: --speed must be <= 10000, got 1000000.0", \
        done.stderr
