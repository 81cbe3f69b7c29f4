"""Settings shared by the whole suite."""

from __future__ import annotations

import os

import pytest

# Quiet and deterministic: no progress bars, no hub access attempts.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def pytest_configure(config) -> None:  # noqa: ANN001 - pytest's hook signature
    """Whisper features are cached on disk (~/.cache/meshtrain by default): the suite's go
    to a folder of its own, removed at the end, so tests leave nothing in the user's home."""
    import atexit
    import shutil
    import tempfile

    if "MESHTRAIN_CACHE" not in os.environ:
        cache = tempfile.mkdtemp(prefix="meshtrain-test-cache-")
        os.environ["MESHTRAIN_CACHE"] = cache
        atexit.register(shutil.rmtree, cache, ignore_errors=True)


#: The fast subset, ``pytest -m fast`` (CONTRIBUTING.md: the development loop): the in-process
#: core (strategies' math and bytes, settings, checkpoints, planning, layering, the docs' code),
#: under 2 minutes on 2 cores. A test of these files that starts processes (the processes
#: runtime, gloo groups: their names say so) or is marked slow stays out.
FAST_FILES = {
    "test_reference_math.py", "test_identities.py", "test_strategies.py", "test_bytes.py",
    "test_comm.py", "test_checkpoint.py", "test_resume_rules.py", "test_resume_refusals.py",
    "test_settings_flags.py", "test_bad_values.py", "test_numbers.py", "test_build.py",
    "test_architecture.py", "test_custom_strategy.py", "test_examples.py", "test_docs.py",
    "test_data.py", "test_random_streams.py", "test_run_dir.py", "test_planning.py",
    "test_cluster.py", "test_inventory.py", "test_errors.py", "test_safe_copy.py",
    "test_node_replica.py", "test_rank.py", "test_engine_shape.py", "test_untrusted_files.py",
    "test_nonfinite_guard.py", "test_environment.py", "test_launch_output.py", "test_quoting.py",
}
_NOT_FAST = ("processes", "gloo", "across_runtimes", "every_runtime", "both_runtimes")


def _is_fast(item: pytest.Item) -> bool:
    return (item.path.name in FAST_FILES and item.get_closest_marker("slow") is None
            and not any(word in item.nodeid.lower() for word in _NOT_FAST))


@pytest.hookimpl(tryfirst=True)  # before -m reads the markers
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Marks the fast subset, and orders the files for xdist's ``--dist loadfile``: files with a
    test marked slow first (most slow tests first), then the others, most tests first. A stable
    sort of whole files: each file's tests stay together and in their order (so ``-n 0`` sets a
    module's fixtures up once).

    The workers take whole files in this order (pyproject's addopts give
    ``--no-loadscope-reorder``: by default xdist re-sorts the files by their number of tests
    alone, which put the long launch files, few tests each, at the end of the run, where one
    worker finished them while the others idled). Started first, the long files overlap and
    the many short ones fill the end."""
    slow: dict[str, int] = {}
    count: dict[str, int] = {}
    first: dict[str, int] = {}
    for index, item in enumerate(items):
        if _is_fast(item):
            item.add_marker(pytest.mark.fast)
        file = str(item.path)
        first.setdefault(file, index)
        count[file] = count.get(file, 0) + 1
        slow[file] = slow.get(file, 0) + (item.get_closest_marker("slow") is not None)

    def order(item: pytest.Item) -> tuple[bool, int, int, int]:
        file = str(item.path)
        return slow[file] == 0, -slow[file], -count[file], first[file]

    items.sort(key=order)


# --------------------------------------------------------------------------- shared worlds
# One loopback sshd and one two-host namespace world per test session (per xdist worker):
# the launch tests of several modules log in to the same servers. A test that unplugs a
# host's cable plugs it back in before it ends; one that adds a qdisc removes it again.
@pytest.fixture(scope="session")
def loopback_ssh(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201 - Iterator[SshWorld]
    """One sshd on 127.0.0.1 (see ssh_fixtures.loopback_world)."""
    from ssh_fixtures import loopback_world

    yield from loopback_world(tmp_path_factory)


@pytest.fixture(scope="session")
def netns_hosts(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201 - Iterator[(SshWorld, Namespaces)]
    """Two namespace hosts with their own sshd, and the launcher's namespace (see
    ssh_fixtures.netns_world)."""
    from ssh_fixtures import netns_world

    yield from netns_world(tmp_path_factory)


@pytest.fixture(scope="session")
def netns_three_hosts(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201 - Iterator[(SshWorld, Namespaces)]
    """Three namespace hosts (the elastic launch tests: a host lost, a host added)."""
    from ssh_fixtures import netns_world

    yield from netns_world(tmp_path_factory, n_hosts=3)
