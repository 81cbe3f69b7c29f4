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


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Files marked slow run first (a stable sort: each file's tests keep their order).

    Under xdist's ``--dist loadfile`` the workers take whole files in this order. Taken
    alphabetically, a long launch file came last and one worker finished it alone while the
    other core idled (about 70 s of a 678 s run on 2 cores); started first, the long files
    overlap and the many short ones fill the end."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


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
