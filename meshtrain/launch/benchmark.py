"""``meshtrain hosts bench`` as a library call: launch the all-reduce benchmark (and the
compute probe) on every host of an inventory, fit the network model, write the cluster file.

:func:`benchmark_hosts` is what the ``hosts bench`` command and ``meshtrain up`` both
run; they print its :class:`Benchmark`. The rank side is :mod:`meshtrain.hosts.bench`.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path

from meshtrain.cluster import Cluster, cluster_file_text, probe_label
from meshtrain.config.hosts import HostsBenchSettings
from meshtrain.errors import InputError, RunFailure
from meshtrain.hosts.bench import (
    BENCH_FILE,
    BenchError,
    ProbeSpec,
    Sample,
    bench_sizes,
    fit_alpha_beta,
    fit_warning,
    fitted_cluster,
    parse_size,
    probe_from_json,
    result_text,
    samples_from_json,
)
from meshtrain.hosts.inventory import Inventory, load_inventory
from meshtrain.hosts.inventory_edit import set_links
from meshtrain.hosts.links import LinkChoice, choose_links
from meshtrain.hosts.ssh import SSHError
from meshtrain.launch.launcher import REMOTE_RUNS, LaunchOptions, RankFailure, launch, new_launch_id
from meshtrain.run_dir import atomic_write_text
from meshtrain.tasks import get_task


class BenchmarkFailed(RunFailure):
    """The benchmark did not finish on every host: no cluster file was written."""

    def __init__(self, message: str, failures: list[RankFailure], exit_code: int = 1) -> None:
        super().__init__(message)
        self.failures = failures
        self.exit_code = exit_code


@dataclass
class Benchmark:
    """A finished benchmark: what was measured, the fitted cluster and the file written."""

    samples: list[Sample]
    cluster: Cluster
    out: Path
    repeats: int
    #: The compute probe's seconds per step and spread, by host name (empty without --task).
    probe_seconds: dict[str, float]
    probe_spread: dict[str, float]
    #: A warning when the model misses a measured size badly (None when it fits).
    doubt: str | None
    #: The fastest link chosen for each host that had more than one (recorded in the inventory).
    links: list[LinkChoice] = dataclasses.field(default_factory=list)
    inventory_updated: bool = False


def benchmark_hosts(inventory: Path, inv: Inventory, how: HostsBenchSettings) -> Benchmark:
    """Measure, fit and write ``how.out`` (default ``clusters/NAME.yaml``).

    Raises :class:`~meshtrain.errors.InputError` before any host is contacted for bad
    options, :class:`~meshtrain.launch.launcher.PreflightError` when a host is not ready,
    and :class:`BenchmarkFailed` when a rank failed or sent back nothing usable.
    """
    if inv.world_size < 2:
        raise InputError(f"{inventory}: a benchmark needs at least 2 hosts, the inventory has "
                         f"{inv.world_size}")
    sizes = bench_sizes(parse_size(how.min_size), parse_size(how.max_size), how.points)
    # Without --threads the probe times what a launch on these hosts runs: the inventory's
    # threads, and its device when every host has the same one (auto: each host's own).
    inventory_threads = inv.hosts[0].threads if len({h.threads for h in inv.hosts}) == 1 else None
    inventory_device = inv.hosts[0].device if len({h.device for h in inv.hosts}) == 1 else "cpu"
    probe = probe_spec(how, inventory_threads, inventory_device)
    name = how.name or inventory.stem
    out = Path(how.out) if how.out else Path("clusters") / f"{name}.yaml"
    check_output_path(out)  # before minutes of measuring, not after
    # The fastest link first: the all-reduces below then run over it, as training will.
    try:
        links = choose_links(inv, accept_new_host_keys=how.accept_new_host_keys)
    except SSHError as exc:
        raise BenchmarkFailed(str(exc), []) from None
    updated = set_links(inventory, {c.host: (c.address.ip, c.address.iface, c.bandwidth)
                                    for c in links}) if links else False
    if updated:
        inv = load_inventory(inventory)
    argv = ["python", "-m", "meshtrain.hosts.bench", "--sizes", ",".join(map(str, sizes)),
            "--repeats", str(how.repeats), *(probe.argv() if probe else [])]
    with tempfile.TemporaryDirectory(prefix="meshtrain-bench-") as tmp:
        run_id = new_launch_id("bench", inv.world_size, Path(tmp))
        argv += ["--out", f"{REMOTE_RUNS}/{run_id}/{BENCH_FILE}"]  # copied back like a run directory
        options = LaunchOptions(run_id=run_id, out_dir=Path(tmp),
                                accept_new_host_keys=how.accept_new_host_keys)
        result = launch(inv, argv, options, training=False)
        timings = Path(tmp) / run_id / BENCH_FILE
        if result.exit_code != 0 or not timings.is_file():
            raise BenchmarkFailed("the benchmark did not finish; no cluster file was written",
                                  result.failures, result.exit_code or 1)
        try:
            source = f"{inv.hosts[0].name}:{BENCH_FILE}"
            text = result_text(timings, source)
            samples = samples_from_json(text, source, inv.world_size, sizes)
            probed = probe_from_json(text, source, inv.world_size) if probe else None
        except BenchError as exc:
            raise BenchmarkFailed(str(exc), result.failures) from None
        try:
            fit = fit_alpha_beta(samples)
        except BenchError as exc:
            raise BenchmarkFailed(f"{source}: {exc}", result.failures) from None
    labels = ", ".join(h.name for h in inv.hosts)
    cluster = fitted_cluster(fit, name, how.description or f"measured by meshtrain hosts bench on {labels}",
                             shared_medium=how.shared_medium, speed=how.speed)
    seconds: dict[str, float] = {}
    spread: dict[str, float] = {}
    if probe is not None:
        if probed is None:
            raise BenchmarkFailed(f"{inv.hosts[0].name}:{BENCH_FILE}: the compute probe's times are missing",
                                  result.failures)
        seconds = dict(zip((h.name for h in inv.hosts), probed["step_seconds"], strict=True))
        spread = dict(zip((h.name for h in inv.hosts), probed["step_jitter"], strict=True))
        cluster = dataclasses.replace(cluster, step_seconds=max(seconds.values()),
                                      step_jitter=max(spread.values()),
                                      probe=probe_label(probe.task, probe.batch_size, probe.threads))
    bench = Benchmark(samples, cluster, out, how.repeats, seconds, spread, fit_warning(samples, cluster),
                      links, updated)
    try:
        atomic_write_text(out, cluster_file_text(
            cluster, f"meshtrain hosts bench {inventory}: {len(samples)} sizes x {how.repeats} repeats"
                     + (f"\n{probe_note(bench)}" if probe is not None else "")
                     + (f"\nWARNING: {bench.doubt}" if bench.doubt else "")))
    except OSError as exc:  # the disk filled while measuring: say what was measured
        raise BenchmarkFailed(f"--out {out}: cannot write the cluster file ({exc.strerror or exc}); "
                              f"measured bandwidth {cluster.bandwidth:.4g} bytes/s, latency "
                              f"{cluster.latency:.4g} s", []) from None
    return bench


def check_output_path(out: Path) -> None:
    """Refuse (:class:`InputError`) an ``--out`` the cluster file could not be written to: a
    special file (``/proc/...``, a FIFO, a device), a folder, or a place where no file can be
    made. It creates the folder and makes and removes one empty file there, as the final
    write would."""
    try:
        mode = out.stat().st_mode
    except FileNotFoundError:
        mode = None
    except OSError as exc:
        raise InputError(f"--out {out}: cannot use it ({exc.strerror or exc})") from None
    if mode is not None and not stat.S_ISREG(mode):
        raise InputError(f"--out {out}: not a regular file (a folder or a special file); give a "
                         "path for a new .yaml file")
    probe = out.parent / f".{out.name}.{secrets.token_hex(4)}.probe"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        probe.unlink()
    except OSError as exc:
        raise InputError(f"--out {out}: cannot write a file in {out.parent} "
                         f"({exc.strerror or exc})") from None


def probe_note(bench: Benchmark) -> str:
    """The compute probe's times per host, as the terminal and the cluster file show them."""
    return ("compute probe, seconds per step: "
            + ", ".join(f"{host} {t:.4f}" for host, t in bench.probe_seconds.items())
            + "; spread: " + ", ".join(f"{host} {t:.4f}" for host, t in bench.probe_spread.items()))


def probe_spec(how: HostsBenchSettings, inventory_threads: int | None,
               inventory_device: str) -> ProbeSpec | None:
    """The compute probe from ``hosts bench``'s options, checked here (InputError) before any
    host runs it."""
    if how.task is None:
        if how.data is not None or how.batch_size is not None or how.threads is not None:
            raise InputError("--data, --batch-size and --threads set up the compute probe: give --task too")
        return None
    chosen = get_task(how.task)
    if how.data is not None and not chosen.takes_data:
        raise InputError(f"task {how.task!r} reads no data file: drop --data {how.data}")
    batch = how.batch_size or int(chosen.defaults.get("batch_size", 32))
    threads = how.threads if how.threads is not None else inventory_threads
    absolute = str(Path(how.data).expanduser().resolve()) if how.data is not None else None
    return ProbeSpec(how.task, batch, threads, absolute, inventory_device)
